"""Load full (single-file) checkpoints into sharded models, each rank reading its slices.

A full checkpoint here is a ``.safetensors`` file, a Hugging Face style folder
(``model.safetensors``, or shards listed in ``model.safetensors.index.json``),
or a ``torch.save`` file of a dict of tensors (dcp_ext's ``partial=False``
checkpoints are either). The readers below present such a file to DCP as a
checkpoint with one chunk per tensor, so ``dcp.load`` plans the load as for
any resharding and :class:`~dcp_ext.CheckpointReader`'s ranged reads fetch
only the bytes each rank owns. This replaces loading the whole model on rank 0
and broadcasting it.

``torch.save`` files are read without unpickling anything but tensor layout
(:mod:`dcp_ext.full._torch_zip`).

Keys are renamed on the way in with ``key_map`` (:mod:`dcp_ext.full._key_map`),
or the state dict is translated whole by an SMP-style ``translate_function``, and block-scaled FP8 weights
are dequantized into the model's dtype with ``dequantize_fp8=True``
(:mod:`dcp_ext.full._fp8`).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..config import IOConfig
from ..dcp_io import CheckpointReader, LoadedMetadata, read_hf_index, run_load
from ..errors import (
    CheckpointCorruptError,
    CheckpointKeyError,
    CheckpointNotFoundError,
    NotACheckpointError,
    ReshardError,
)
from ..format import header_prefix, parse_header
from ..metadata import StoredItem
from ..planners import LayoutLoadPlanner
from ..storage import Location, normalize_path
from ._checksums import FileChecksums, check_file_size, read_checksums
from ._fp8 import (
    FP8_DTYPES,
    SCALE_SUFFIX,
    FP8Scale,
    block_shape,
    dequantize_all,
    fp8_like,
    paired_scales,
)
from ._key_map import KeyMap, TranslateFunction, rename_keys, translate_state
from ._torch_zip import StoredTensor, numel, torch_save_tensors

__all__ = ["FullCheckpointReader", "load_pretrained", "PretrainedLoadReport"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
#: The files that make a folder a Hugging Face checkpoint.
HF_MARKERS = (_INDEX, _SINGLE)


def _split(path: str) -> tuple[str, str]:
    text = normalize_path(path).rstrip("/")
    if "://" in text:
        head, _, tail = text.rpartition("/")
        return head, tail
    return os.path.dirname(os.path.abspath(text)), os.path.basename(text)


class FullCheckpointReader(CheckpointReader):
    """A DCP ``StorageReader`` over a full checkpoint file or a Hugging Face folder.

    Use with ``dcp.load`` (every rank) and a state dict whose tensors may be
    sharded (FSDP2, tensor parallel) or plain::

        dcp.load(model_state_dict, storage_reader=FullCheckpointReader("model.safetensors"),
                 planner=LayoutLoadPlanner())

    Args:
        path: A ``.safetensors`` or ``torch.save`` file, or a folder holding
            ``model.safetensors`` or ``model.safetensors.index.json``.
        key_map: Maps a key in the file to the state-dict key to load it
            into: a callable (``None`` skips the tensor), a dict (keys not in
            it keep their name; a value of ``None`` skips), or a
            :class:`~dcp_ext.KeyList` (all keys at once); identity by default.
            Two keys given one name raise :class:`~dcp_ext.errors.CheckpointKeyError`.
        dequantize_fp8: Pair each 2-D FP8 tensor ``K`` with its scale
            ``K_scale_inv``: the scales are then left out of the metadata and
            listed in :attr:`scales` (by state-dict key). ``dcp.load`` with
            this reader reads the FP8 values as stored; applying the scales
            is :func:`load_pretrained`'s job (``dequantize_fp8=True`` there).
        storage_options: fsspec/s3fs options, as for :class:`~dcp_ext.CheckpointReader`.
        config: I/O tunables, as for :class:`~dcp_ext.CheckpointReader`.
        **io_options: The other keyword arguments of :class:`~dcp_ext.CheckpointReader`.

    Attributes:
        scales: With ``dequantize_fp8``, once the metadata is read: the
            scale of each FP8 weight, by the weight's state-dict key.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        key_map: KeyMap | None = None,
        dequantize_fp8: bool = False,
        storage_options: dict[str, Any] | None = None,
        config: IOConfig | None = None,
        **io_options: Any,
    ) -> None:
        self.source = normalize_path(path)
        """The full checkpoint as given (normalized): a safetensors or ``torch.save`` file, or a
        Hugging Face folder."""
        self.key_map = key_map
        self.dequantize_fp8 = dequantize_fp8
        self.scales: dict[str, FP8Scale] = {}
        root, self._file = self._locate(Location.of(self.source, storage_options, config))
        super().__init__(root, storage_options=storage_options, config=config, **io_options)
        self._metadata: Metadata | None = None  # a full checkpoint does not change

    @staticmethod
    def _locate(source: Location) -> tuple[str, str | None]:
        """(root, file) when ``source`` is a file, (source, None) for a folder."""
        parent, name = _split(source.url)
        store = source.at(parent).open()
        if name and store.exists(name):
            return parent, name
        return source.url, None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """(all ranks) Start a new load, optionally of another full checkpoint
        (``dcp.load(checkpoint_id=...)``)."""
        if checkpoint_id and normalize_path(checkpoint_id) != self.source:
            self.source = normalize_path(checkpoint_id)
            root, self._file = self._locate(Location.of(self.source, self.storage_options, self.config))
            self._metadata = None
            super().reset(root)
            return
        super().reset(None)

    # -- metadata -----------------------------------------------------------
    def _load_metadata(self) -> LoadedMetadata:
        if self._metadata is None:
            self._metadata = self._build_metadata()
        return LoadedMetadata(self._metadata)

    def _build_metadata(self) -> Metadata:
        tensors = self._tensors()
        paired = (
            paired_scales({k: t.dtype for k, t in tensors.items()}, {k: t.shape for k, t in tensors.items()})
            if self.dequantize_fp8 else {}
        )
        names = rename_keys(list(tensors), key_map=self.key_map, where=self.source, exclude=set(paired.values()))
        recorded = read_checksums(self.store, self._file)
        sized: set[str] = set()
        self.scales = {
            names[weight]: FP8Scale(weight, scale, tensors[scale], self._stored_item(
                scale, tensors[scale], numel(tensors[scale].shape) * tensors[scale].dtype.itemsize,
                recorded.get(tensors[scale].file), sized))
            for weight, scale in paired.items() if weight in names
        }
        state: dict[str, Any] = {}
        storage: dict[MetadataIndex, StoredItem] = {}
        for key, target in names.items():
            info = tensors[key]
            zeros = (0,) * len(info.shape)
            nbytes = numel(info.shape) * info.dtype.itemsize
            state[target] = TensorStorageMetadata(
                properties=TensorProperties(dtype=info.dtype),
                size=torch.Size(info.shape),
                chunks=[ChunkStorageMetadata(torch.Size(zeros), torch.Size(info.shape))],
            )
            storage[MetadataIndex(target, zeros)] = self._stored_item(key, info, nbytes, recorded.get(info.file), sized)
        return Metadata(state_dict_metadata=state, storage_data=storage, storage_meta=StorageMeta())

    def _stored_item(
        self, key: str, info: StoredTensor, nbytes: int, recorded: FileChecksums | None, sized: set[str]
    ) -> StoredItem:
        """Where ``key`` lies, with its frame checksums when its file has them recorded."""
        entry = recorded.tensors.get(key) if recorded is not None else None
        if recorded is None or entry is None:
            return StoredItem(info.file, info.offset, nbytes, 0, nbytes)
        where = self.store.describe(info.file)
        if info.file not in sized:
            check_file_size(recorded, self.store.size(info.file), where)
            sized.add(info.file)
        if (entry.offset, entry.length) != (info.offset, nbytes):
            raise CheckpointCorruptError(
                f"{where}: tensor {key!r} lies at bytes [{info.offset}, {info.offset + nbytes}) but its checksums "
                f"were recorded for [{entry.offset}, {entry.offset + entry.length})",
                where,
            )
        return StoredItem(info.file, info.offset, nbytes, 0, nbytes, frame_size=entry.frame_size,
                          checksums=entry.checksums)

    def _tensors(self) -> dict[str, StoredTensor]:
        store = self.store
        if self._file is not None:
            return self._file_tensors(self._file)
        names = set(store.list_names())
        if _INDEX in names:
            tensors: dict[str, StoredTensor] = {}
            for name in sorted(set(read_hf_index(store, _INDEX).values())):
                tensors.update(self._file_tensors(name))
            return tensors
        if _SINGLE in names:
            return self._file_tensors(_SINGLE)
        if not store.root_exists():
            raise CheckpointNotFoundError(f"no full checkpoint at {self.source}: it does not exist", self.source)
        raise NotACheckpointError(
            f"{self.source} holds neither {_SINGLE} nor {_INDEX}; pass the checkpoint file itself",
            self.source,
        )

    def _file_tensors(self, name: str) -> dict[str, StoredTensor]:
        store = self.store
        head = header_prefix(lambda n: store.read_head(name, n), lambda: store.size(name))
        if head[:4] == b"PK\x03\x04":
            return torch_save_tensors(self.store, name)
        header = parse_header(head, self.store.describe(name))
        return {
            t.name: StoredTensor(name, t.dtype, t.shape, header.data_start + t.begin) for t in header.tensors
        }


# -- the user-facing function -----------------------------------------------------
@dataclass(frozen=True)
class PretrainedLoadReport:
    """What :func:`load_pretrained` did.

    Attributes:
        loaded: State-dict keys filled from the checkpoint.
        missing: Model keys the checkpoint lacked (only when ``strict=False``).
        unexpected: Checkpoint keys the model does not have (ignored).
        uninitialized_buffers: Non-persistent buffers that were on the meta
            device and are now allocated but not initialized: set them yourself.
        bytes_read: Bytes this rank read.
        dequantized: Keys of ``loaded`` that were FP8 in the checkpoint and
            were dequantized with their scales (``dequantize_fp8=True``).
    """

    loaded: tuple[str, ...]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    uninitialized_buffers: tuple[str, ...]
    bytes_read: int
    dequantized: tuple[str, ...] = ()


def load_pretrained(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    key_map: KeyMap | None = None,
    translate_function: TranslateFunction | None = None,
    dequantize_fp8: bool = False,
    fp8_block_size: int | tuple[int, int] = 128,
    device: str | torch.device | None = None,
    storage_options: dict[str, Any] | None = None,
    process_group: Any = None,
    config: IOConfig | None = None,
) -> PretrainedLoadReport:
    """(all ranks) Load a full checkpoint into ``model``, each rank reading only its slices.

    ``model`` may be plain, or sharded with FSDP2 / tensor parallelism, and
    may still be on the meta device: it is then materialized with
    ``model.to_empty(device=...)`` first (CPU by default). Non-persistent
    buffers are not in any checkpoint; those left uninitialized are listed in
    the report (and a warning) so the caller can set them.

    Args:
        model: The module to load into, in place.
        path: ``.safetensors`` / ``torch.save`` file, or a Hugging Face folder.
        strict: Refuse a checkpoint that lacks some of the model's keys.
        key_map: Maps checkpoint keys to model keys: a callable (``None``
            skips a key), a dict ``{checkpoint key: model key}`` (keys not
            in it keep their name; ``None`` skips), or a
            :class:`~dcp_ext.KeyList` given all keys at once (SageMaker's
            key-list form). Each rank still reads only its slices.
        translate_function: Instead of ``key_map``, the SageMaker library's
            state-dict translation: called with the whole checkpoint as
            ``{key: tensor}`` (every rank reads every tensor whole), returns
            the state dict to load (keys renamed, tensors fused, split or
            transposed as the model needs). Not with ``dequantize_fp8``.
        dequantize_fp8: Load block-scaled FP8 weights (``K`` in an FP8 dtype
            beside ``K_scale_inv``, as in DeepSeek-V3 checkpoints) into
            bf16/fp32 parameters: each rank reads its slice of the FP8 weight
            and the scale blocks that slice touches, and stores
            ``(fp8.to(float32) * scale).to(param dtype)``. The scale keys are
            then not ``unexpected``. Parameters that are FP8 themselves get
            the stored values unchanged.
        fp8_block_size: The scale block, ``128`` (128 x 128) or ``(rows, cols)``.
        device: Where to materialize a meta-device model.
        storage_options: fsspec/s3fs options for remote paths.
        process_group: The group to load with (default group if ``None``).
        config: I/O tunables.

    Raises:
        KeyError: With ``strict=True``, the model keys the checkpoint lacks;
            two checkpoint keys renamed to one model key (both named).
        TypeError: ``translate_function`` returned something other than a
            state dict of tensors.
        ValueError: A tensor whose shape differs between model and checkpoint;
            an FP8 weight with a scale loaded into a non-FP8 parameter without
            ``dequantize_fp8``; a scale of the wrong shape for ``fp8_block_size``.
    """
    uninitialized: list[str] = []
    if any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        persistent = set(model.state_dict().keys())
        uninitialized = [n for n, b in model.named_buffers() if b.is_meta and n not in persistent]
        model.to_empty(device=device or "cpu")
        if uninitialized:
            warnings.warn(
                f"non-persistent buffers {uninitialized} were on the meta device and are now "
                f"allocated but uninitialized; set them before use",
                stacklevel=2,
            )
    if translate_function is not None:
        if key_map is not None:
            raise ValueError("pass key_map or translate_function, not both")
        if dequantize_fp8:
            raise ValueError("translate_function loads whole tensors; dequantize_fp8 is not supported with it")
        reader = FullCheckpointReader(path, storage_options=storage_options, config=config)
        return _load_translated(model, reader, translate_function, strict, uninitialized, process_group)
    block = block_shape(fp8_block_size)
    reader = FullCheckpointReader(path, key_map=key_map, dequantize_fp8=dequantize_fp8,
                                  storage_options=storage_options, config=config)
    metadata = reader.read_metadata()
    state = get_model_state_dict(model, options=StateDictOptions())
    available = set(metadata.state_dict_metadata)
    missing, unexpected = _compare_keys(state, available, strict, f"checkpoint {reader.source} lacks",
                                        "; pass strict=False to keep their current values, "
                                        "or key_map= to rename checkpoint keys")
    wanted = {k: v for k, v in state.items() if k in available}
    quantized: dict[str, tuple[torch.Tensor, FP8Scale]] = {}  # the parameter, its scale
    for key, value in wanted.items():
        stored = metadata.state_dict_metadata[key]
        shape = tuple(getattr(value, "shape", ()))
        if isinstance(stored, TensorStorageMetadata) and tuple(stored.size) != shape:
            raise ReshardError(
                f"{key!r}: the checkpoint holds shape {tuple(stored.size)} but the model has {shape}"
            )
        wants_fp8 = getattr(value, "dtype", None) in FP8_DTYPES
        if key in reader.scales and isinstance(value, torch.Tensor) and not wants_fp8:
            quantized[key] = (value, reader.scales[key])
        elif key in reader.scales:
            unexpected.append(reader.scales[key].scale_key)  # stored FP8 values loaded as they are
        elif (isinstance(stored, TensorStorageMetadata) and stored.properties.dtype in FP8_DTYPES
              and not wants_fp8 and key + SCALE_SUFFIX in available):
            raise ReshardError(
                f"{key!r} is stored in {stored.properties.dtype} with a block scale {key + SCALE_SUFFIX!r} in "
                f"{reader.source}, but the model holds {getattr(value, 'dtype', None)}; pass dequantize_fp8=True"
            )
    # FP8 weights land in FP8 buffers laid out like their parameters (so each
    # rank reads its slice, as for any tensor), then are scaled into them.
    load_state: dict[str, Any] = dict(wanted)
    for key, (value, _) in quantized.items():
        fp8 = metadata.state_dict_metadata[key]
        assert isinstance(fp8, TensorStorageMetadata)  # paired_scales pairs tensors only
        load_state[key] = fp8_like(value, fp8.properties.dtype)
    planner = LayoutLoadPlanner(strict=True, keys=tuple(wanted))  # missing/unexpected handled above
    run_load(load_state, reader, planner, process_group)
    dequantize_all({key: (value, load_state[key], scale) for key, (value, scale) in quantized.items()},
                   reader.store, reader.config.read_request_size, block)
    set_model_state_dict(model, wanted, options=StateDictOptions(strict=False))
    return PretrainedLoadReport(
        loaded=tuple(sorted(wanted)),
        missing=tuple(missing),
        unexpected=tuple(sorted(unexpected)),
        uninitialized_buffers=tuple(uninitialized),
        bytes_read=reader.store.stats.snapshot().bytes_read,
        dequantized=tuple(sorted(quantized)),
    )


def _load_translated(
    model: nn.Module,
    reader: FullCheckpointReader,
    translate_function: TranslateFunction,
    strict: bool,
    uninitialized: list[str],
    process_group: Any,
) -> PretrainedLoadReport:
    """(all ranks) :func:`load_pretrained` with SageMaker's state-dict
    ``translate_function``: every tensor of the checkpoint ``reader`` reads
    (opened on its path, storage options and config) read whole on every
    rank, translated, then set into the (possibly sharded) model, each rank
    keeping its shard (``set_model_state_dict(full_state_dict=True)``)."""
    metadata = reader.read_metadata()
    whole = {
        key: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)
    }
    run_load(whole, reader, LayoutLoadPlanner(strict=True, keys=tuple(whole)), process_group)
    state = translate_state(whole, translate_function, reader.source)
    del whole
    model_keys = get_model_state_dict(model, options=StateDictOptions())
    missing, unexpected = _compare_keys(model_keys, set(state), strict,
                                        f"translate_function of {reader.source} returns no tensor for",
                                        "; pass strict=False to keep their current values")
    wanted = {k: v for k, v in state.items() if k in model_keys}
    for key, value in wanted.items():
        target: Any = model_keys[key]
        shape = tuple(getattr(target, "shape", ()))
        if tuple(value.shape) != shape:
            raise ReshardError(f"{key!r}: translate_function returns shape {tuple(value.shape)} but the model has {shape}")
        wanted[key] = value.to(target.dtype)
    set_model_state_dict(model, wanted, options=StateDictOptions(full_state_dict=True, strict=False))
    return PretrainedLoadReport(
        loaded=tuple(sorted(wanted)),
        missing=tuple(missing),
        unexpected=tuple(unexpected),
        uninitialized_buffers=tuple(uninitialized),
        bytes_read=reader.store.stats.snapshot().bytes_read,
        dequantized=(),
    )


def _compare_keys(model_keys: Any, available: set[str], strict: bool, lacks: str,
                  advice: str) -> tuple[list[str], list[str]]:
    """The model's keys ``available`` lacks and the ``available`` keys the
    model lacks, both sorted; with ``strict``, the first list empty or
    :class:`CheckpointKeyError` (``"{lacks} N key(s) of the model: [...]{advice}"``)."""
    missing = sorted(k for k in model_keys if k not in available)
    unexpected = sorted(k for k in available if k not in model_keys)
    if missing and strict:
        raise CheckpointKeyError(
            f"{lacks} {len(missing)} key(s) of the model: {missing[:10]}{' ...' if len(missing) > 10 else ''}{advice}")
    return missing, unexpected
