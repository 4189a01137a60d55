"""Load full (single-file) checkpoints into sharded models, each rank reading its slices.

A full checkpoint here is a ``.safetensors`` file, a Hugging Face style folder
(``model.safetensors``, or shards listed in ``model.safetensors.index.json``),
or a ``torch.save`` file of a dict of tensors (dcp_ext's ``partial=False``
checkpoints are either). The readers below present such a file to DCP as a
checkpoint with one chunk per tensor, so ``dcp.load`` plans the load as for
any resharding and :class:`~dcp_ext.CheckpointReader`'s ranged reads fetch
only the bytes each rank owns. This replaces loading the whole model on rank 0
and broadcasting it.

``torch.save`` files are read without unpickling anything but tensor layout:
the zip directory gives each storage record's position, and ``data.pkl`` is
interpreted by an unpickler that admits only tensor rebuilding, storages and
ordered dicts.

Keys are renamed on the way in with ``key_map`` or an SMP-style
``translate_function`` (:mod:`dcp_ext.key_map`), and block-scaled FP8 weights
are dequantized into the model's dtype with ``dequantize_fp8=True``
(:mod:`dcp_ext.fp8`).
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ._dcp_calls import run_load
from .hf_folder import read_hf_index
from .metadata import StoredItem
from ._ranges import Piece, plan_requests
from ._safetensors import header_prefix, parse_header
from ._torch_format import tensor_bytes
from .config import IOConfig
from .full_checksums import FileChecksums, check_file_size, read_checksums
from .errors import (
    CheckpointCorruptError,
    CheckpointKeyError,
    CheckpointNotFoundError,
    NotACheckpointError,
    ReshardError,
)
from .frames import FrameTable, checksum_fault
from .fp8 import FP8_DTYPES, SCALE_SUFFIX, ScaleBox, block_shape, dequantize_slice, paired_scales, scale_box, scale_shape
from .key_map import KeyMap, TranslateFunction, rename_keys
from .reader import CheckpointReader
from .storage import Store, normalize_path, open_store

__all__ = ["FullCheckpointReader", "load_pretrained", "PretrainedLoadReport"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
#: The files that make a folder a Hugging Face checkpoint.
HF_MARKERS = (_INDEX, _SINGLE)


@dataclass(frozen=True)
class _Tensor:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the raw data in ``file``


@dataclass(frozen=True)
class _Scale:
    """The scale of a block-scaled FP8 weight: checkpoint keys of both, where the scale is."""

    weight_key: str
    scale_key: str
    tensor: _Tensor
    stored: StoredItem  # with its frame checksums when the folder's sidecar has them


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
            into: a callable (``None`` skips the tensor) or a dict (keys not in
            it keep their name; a value of ``None`` skips); identity by default.
        translate_function: Instead of ``key_map``, SMP style: called once
            with the list of all keys in the file, returns ``{file key:
            state-dict key}`` (keys absent keep their name). Two keys given
            one name raise :class:`~dcp_ext.errors.CheckpointKeyError`.
        dequantize_fp8: Pair each 2-D FP8 tensor ``K`` with its scale
            ``K_scale_inv``: the scales are then left out of the metadata and
            listed in :attr:`scales` (by state-dict key). ``dcp.load`` with
            this reader reads the FP8 values as stored; applying the scales
            is :func:`load_pretrained`'s job (``dequantize_fp8=True`` there).
        storage_options, config, ...: As for :class:`CheckpointReader`.

    Attributes:
        scales: With ``dequantize_fp8``, once the metadata is read: the
            scale of each FP8 weight, by the weight's state-dict key.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        key_map: KeyMap | None = None,
        translate_function: TranslateFunction | None = None,
        dequantize_fp8: bool = False,
        storage_options: dict[str, Any] | None = None,
        config: IOConfig | None = None,
        **io_options: Any,
    ) -> None:
        if key_map is not None and translate_function is not None:
            raise ValueError("pass key_map or translate_function, not both")
        self.source = normalize_path(path)
        self.key_map = key_map
        self.translate_function = translate_function
        self.dequantize_fp8 = dequantize_fp8
        self.scales: dict[str, _Scale] = {}
        root, self._file = self._locate(self.source, storage_options, config)
        super().__init__(root, storage_options=storage_options, config=config, **io_options)
        self._metadata: Metadata | None = None  # a full checkpoint does not change

    @staticmethod
    def _locate(source: str, storage_options: dict[str, Any] | None, config: IOConfig | None) -> tuple[str, str | None]:
        """(root, file) when ``source`` is a file, (source, None) for a folder."""
        parent, name = _split(source)
        store = open_store(parent, config or IOConfig.from_env(), storage_options)
        if name and store.exists(name):
            return parent, name
        return source, None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """(all ranks) Start a new load, optionally of another full checkpoint
        (``dcp.load(checkpoint_id=...)``)."""
        if checkpoint_id and normalize_path(checkpoint_id) != self.source:
            self.source = normalize_path(checkpoint_id)
            root, self._file = self._locate(self.source, self.storage_options, self.config)
            self._metadata = None
            super().reset(root)
            return
        super().reset(None)

    # -- metadata -----------------------------------------------------------
    def _read_metadata(self) -> Metadata:
        if self._metadata is None:
            self._metadata = self._build_metadata()
        return self._metadata

    def _build_metadata(self) -> Metadata:
        tensors = self._tensors()
        paired = (
            paired_scales({k: t.dtype for k, t in tensors.items()}, {k: t.shape for k, t in tensors.items()})
            if self.dequantize_fp8 else {}
        )
        names = rename_keys(list(tensors), key_map=self.key_map, translate_function=self.translate_function,
                            where=self.source, exclude=set(paired.values()))
        recorded = read_checksums(self.store, self._file)
        sized: set[str] = set()
        self.scales = {
            names[weight]: _Scale(weight, scale, tensors[scale], self._stored_item(
                scale, tensors[scale], _numel(tensors[scale].shape) * tensors[scale].dtype.itemsize,
                recorded.get(tensors[scale].file), sized))
            for weight, scale in paired.items() if weight in names
        }
        state: dict[str, Any] = {}
        storage: dict[MetadataIndex, StoredItem] = {}
        for key, target in names.items():
            info = tensors[key]
            zeros = (0,) * len(info.shape)
            nbytes = _numel(info.shape) * info.dtype.itemsize
            state[target] = TensorStorageMetadata(
                properties=TensorProperties(dtype=info.dtype),
                size=torch.Size(info.shape),
                chunks=[ChunkStorageMetadata(torch.Size(zeros), torch.Size(info.shape))],
            )
            storage[MetadataIndex(target, zeros)] = self._stored_item(key, info, nbytes, recorded.get(info.file), sized)
        return Metadata(state_dict_metadata=state, storage_data=storage, storage_meta=StorageMeta())

    def _stored_item(
        self, key: str, info: _Tensor, nbytes: int, recorded: FileChecksums | None, sized: set[str]
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

    def _tensors(self) -> dict[str, _Tensor]:
        store = self.store
        if self._file is not None:
            return self._file_tensors(self._file)
        names = set(store.list_names())
        if _INDEX in names:
            tensors: dict[str, _Tensor] = {}
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

    def _file_tensors(self, name: str) -> dict[str, _Tensor]:
        store = self.store
        head = header_prefix(lambda n: store.read_head(name, n), lambda: store.size(name))
        if head[:4] == b"PK\x03\x04":
            return _torch_save_tensors(self.store, name)
        header = parse_header(head, self.store.describe(name))
        return {
            t.name: _Tensor(name, t.dtype, t.shape, header.data_start + t.begin) for t in header.tensors
        }


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# -- torch.save files without unpickling -------------------------------------------
@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: torch.dtype


@dataclass(frozen=True)
class _TensorRef:
    storage: _StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor(storage: _StorageRef, storage_offset: int, size: Any, stride: Any, *rest: Any) -> _TensorRef:
    if not isinstance(storage, _StorageRef):
        raise ValueError(f"a tensor is rebuilt from {type(storage).__name__}, not a storage record")
    return _TensorRef(storage, int(storage_offset), tuple(int(s) for s in size), tuple(int(s) for s in stride))


def _rebuild_parameter(data: _TensorRef, *rest: Any) -> _TensorRef:
    if not isinstance(data, _TensorRef):
        raise ValueError(f"a parameter is rebuilt from {type(data).__name__}, not a tensor")
    return data


# Legacy typed-storage class names in torch.save's data.pkl, and their dtypes.
_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool, "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}


class _PlainDict(dict):  # type: ignore[type-arg]
    """Stands in for OrderedDict; accepts the ``_metadata`` attribute state dicts carry."""


class _LayoutUnpickler(pickle.Unpickler):
    """Interprets ``data.pkl`` into tensor layouts; refuses everything else."""

    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor
        if module == "torch._utils" and name == "_rebuild_parameter":
            return _rebuild_parameter
        if module == "collections" and name == "OrderedDict":
            return _PlainDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                return value
        raise CheckpointCorruptError(
            f"{self.where} refers to {module}.{name}; only plain tensors in dicts can be "
            f"loaded from a torch.save file without unpickling code",
            self.where,
        )

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage"):
            raise CheckpointCorruptError(f"{self.where}: unexpected persistent id {pid!r}", self.where)
        dtype = pid[1]
        if not isinstance(dtype, torch.dtype):
            raise CheckpointCorruptError(f"{self.where}: storage of unknown type {dtype!r}", self.where)
        return _StorageRef(str(pid[2]), dtype)


#: Largest ``data.pkl`` read (the tensors' layout: a few hundred bytes per tensor).
MAX_PICKLE_BYTES = 1 << 30


def _zip_directory(store: Store, name: str) -> dict[str, tuple[int, int]]:
    """``{record name: (local header offset, size)}`` from the zip central directory.

    Every record is checked to lie inside the file before anything is read:
    the sizes in a zip directory are claims, and reading a claimed 3 GiB
    ``data.pkl`` from a 3.8 KB file would allocate 3 GiB before finding the
    file short (issue 32, finding 6).

    Raises:
        CheckpointCorruptError: Not a zip archive, or a record claims bytes
            beyond the end of the file (message: file, record, claim).
    """
    where = store.describe(name)
    size = store.size(name)
    tail_len = min(size, 65536 + 22)
    tail = store.read_range(name, size - tail_len, tail_len)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0:
        raise CheckpointCorruptError(f"{where} is not a zip archive (no end of central directory)", where)
    entries, cd_size, cd_offset = struct.unpack("<HII", tail[at + 10 : at + 20])
    if cd_offset == 0xFFFFFFFF or cd_size == 0xFFFFFFFF or entries == 0xFFFF:
        loc = tail.rfind(b"PK\x06\x07", 0, at)
        if loc < 0:
            raise CheckpointCorruptError(f"{where}: zip64 locator missing", where)
        (eocd64_offset,) = struct.unpack("<Q", tail[loc + 8 : loc + 16])
        if eocd64_offset + 56 > size:
            raise CheckpointCorruptError(f"{where}: its zip64 directory record lies outside the file", where)
        eocd64 = store.read_range(name, eocd64_offset, 56)
        cd_size, cd_offset = struct.unpack("<QQ", eocd64[40:56])
    if cd_offset + cd_size > size:
        raise CheckpointCorruptError(
            f"{where}: its zip directory ({cd_size} bytes at {cd_offset}) lies outside the file ({size} bytes)", where
        )
    directory = store.read_range(name, cd_offset, cd_size)
    records: dict[str, tuple[int, int]] = {}
    pos = 0
    while pos + 46 <= len(directory) and directory[pos : pos + 4] == b"PK\x01\x02":
        method, = struct.unpack("<H", directory[pos + 10 : pos + 12])
        csize, usize, n, e, c = struct.unpack("<IIHHH", directory[pos + 20 : pos + 34])
        (local,) = struct.unpack("<I", directory[pos + 42 : pos + 46])
        record = directory[pos + 46 : pos + 46 + n].decode(errors="replace")
        extra = directory[pos + 46 + n : pos + 46 + n + e]
        values = []
        x = 0
        while x + 4 <= len(extra):
            tag, length = struct.unpack("<HH", extra[x : x + 4])
            if tag == 1:
                values = [struct.unpack("<Q", extra[x + 4 + 8 * i : x + 12 + 8 * i])[0] for i in range(length // 8)]
            x += 4 + length
        it = iter(values)
        try:
            if usize == 0xFFFFFFFF:
                usize = next(it)
            if csize == 0xFFFFFFFF:
                csize = next(it)
            if local == 0xFFFFFFFF:
                local = next(it)
        except StopIteration:
            raise CheckpointCorruptError(f"{where}: record {record}'s zip64 sizes are missing", where) from None
        if method != 0:
            raise CheckpointCorruptError(f"{where}: record {record} is compressed; torch.save files are not", where)
        # 30 bytes of local header come first; the data cannot end past the file.
        if local + 30 + usize > size:
            raise CheckpointCorruptError(
                f"{where}: zip record {record} claims {usize} bytes at offset {local}, past the end of the file "
                f"({size} bytes); the file is truncated or damaged",
                where,
            )
        records[record] = (int(local), int(usize))
        pos += 46 + n + e + c
    return records


def _torch_save_tensors(store: Store, name: str) -> dict[str, _Tensor]:
    where = store.describe(name)
    try:
        records = _zip_directory(store, name)
    except struct.error as err:  # a record cut short
        raise CheckpointCorruptError(f"{where}: its zip directory is damaged ({err})", where) from err
    pkl = [r for r in records if r.endswith("/data.pkl")]
    if len(pkl) != 1:
        raise CheckpointCorruptError(f"{where} is not a torch.save archive (no data.pkl)", where)
    prefix = pkl[0][: -len("data.pkl")]
    # Local headers: 30 fixed bytes, then name and extra field of their own lengths.
    headers = {r: bytearray(30) for r in records}
    store.read(plan_requests(
        [Piece(name, records[r][0], memoryview(headers[r])) for r in records], gap=4096, max_request=1 << 24,
    ))

    def data_offset(record: str) -> int:
        head = headers[record]
        if head[:4] != b"PK\x03\x04":
            raise CheckpointCorruptError(f"{where}: bad local header for {record}", where)
        n, e = struct.unpack("<HH", head[26:30])
        return int(records[record][0] + 30 + n + e)

    # Its claimed size is at most the file's (checked in _zip_directory).
    length = records[pkl[0]][1]
    if length > MAX_PICKLE_BYTES:
        raise CheckpointCorruptError(
            f"{where}: its {pkl[0]} claims {length} bytes; dcp_ext reads tensor layouts of at most "
            f"{MAX_PICKLE_BYTES} bytes",
            where,
        )
    pickled = store.read_range(name, data_offset(pkl[0]), length)
    try:
        obj = _LayoutUnpickler(pickled, where).load()
    except CheckpointCorruptError:
        raise
    except Exception as err:
        raise CheckpointCorruptError(f"{where}: cannot read data.pkl ({err})", where) from err
    flat: dict[str, _TensorRef] = {}
    # Iterative, not recursive: a hostile data.pkl nests dicts as deep as it likes.
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, _TensorRef):
            flat[path] = node
        elif isinstance(node, dict):
            stack.extend((v, f"{path}.{k}" if path else str(k)) for k, v in reversed(list(node.items())))
        # other plain values (ints, strings) are not tensors: not loaded here
    tensors: dict[str, _Tensor] = {}
    for key, ref in flat.items():
        if len(ref.shape) != len(ref.stride) or min((*ref.shape, ref.offset, 0)) < 0 \
                or max((*ref.shape, ref.offset, 0)) >= 1 << 63:
            raise CheckpointCorruptError(
                f"{where}: tensor {key!r} has an impossible layout (size {ref.shape[:8]}, stride {ref.stride[:8]}, "
                f"storage offset {ref.offset})",
                where,
            )
        expected = 1
        for size, stride in zip(reversed(ref.shape), reversed(ref.stride)):
            if size != 1 and stride != expected:
                raise CheckpointCorruptError(
                    f"{where}: tensor {key!r} is stored non-contiguously (stride {ref.stride}); "
                    f"re-save it with .contiguous()",
                    where,
                )
            expected *= size
        record = f"{prefix}data/{ref.storage.key}"
        if record not in records:
            raise CheckpointCorruptError(f"{where}: tensor {key!r} refers to missing record {record}", where)
        nbytes = _numel(ref.shape) * ref.storage.dtype.itemsize
        start = ref.offset * ref.storage.dtype.itemsize
        if start + nbytes > records[record][1]:
            raise CheckpointCorruptError(f"{where}: tensor {key!r} lies outside its storage record", where)
        tensors[key] = _Tensor(name, ref.storage.dtype, ref.shape, data_offset(record) + start)
    return tensors


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
            skips a key) or a dict ``{checkpoint key: model key}`` (keys not
            in it keep their name; ``None`` skips).
        translate_function: Instead of ``key_map``, the SageMaker form: a
            callable given the list of all checkpoint keys at once, returning
            ``{checkpoint key: model key}`` (keys absent keep their name).
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
        ValueError: A tensor whose shape differs between model and checkpoint;
            an FP8 weight with a scale loaded into a non-FP8 parameter without
            ``dequantize_fp8``; a scale of the wrong shape for ``fp8_block_size``.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from .planners import LayoutLoadPlanner

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
    block = block_shape(fp8_block_size)
    reader = FullCheckpointReader(path, key_map=key_map, translate_function=translate_function,
                                  dequantize_fp8=dequantize_fp8, storage_options=storage_options, config=config)
    metadata = reader.read_metadata()
    state = get_model_state_dict(model, options=StateDictOptions())
    available = set(metadata.state_dict_metadata)
    missing = sorted(k for k in state if k not in available)
    unexpected = sorted(k for k in available if k not in state)
    if missing and strict:
        raise CheckpointKeyError(
            f"checkpoint {reader.source} lacks {len(missing)} key(s) of the model: {missing[:10]}"
            f"{' ...' if len(missing) > 10 else ''}; pass strict=False to keep their current values, "
            f"or key_map= to rename checkpoint keys"
        )
    wanted = {k: v for k, v in state.items() if k in available}
    quantized: dict[str, tuple[torch.Tensor, _Scale]] = {}  # the parameter, its scale
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
        load_state[key] = _fp8_like(value, fp8.properties.dtype)
    planner = LayoutLoadPlanner(strict=True, keys=tuple(wanted))  # missing/unexpected handled above
    run_load(load_state, reader, planner, process_group)
    _dequantize_all({key: (value, load_state[key], scale) for key, (value, scale) in quantized.items()}, reader, block)
    set_model_state_dict(model, wanted, options=StateDictOptions(strict=False))
    return PretrainedLoadReport(
        loaded=tuple(sorted(wanted)),
        missing=tuple(missing),
        unexpected=tuple(sorted(unexpected)),
        uninitialized_buffers=tuple(uninitialized),
        bytes_read=reader.store.stats.snapshot().bytes_read,
        dequantized=tuple(sorted(quantized)),
    )


def _local_part(value: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's part of a (possibly DTensor) tensor and its offset in the whole."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return value, (0,) * value.dim()
    local = value.to_local()
    create_chunks: Any = value.__create_chunk_list__  # what DCP plans this rank's reads from
    chunks: list[Any] = create_chunks()
    if not chunks:
        return local, (0,) * value.dim()
    if len(chunks) != 1 or tuple(chunks[0].sizes) != tuple(local.shape):
        raise ReshardError(
            f"cannot dequantize a DTensor placed as {value.placements}: its local part is not one box"
        )
    return local, tuple(int(o) for o in chunks[0].offsets)


def _fp8_like(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty ``dtype`` tensor with ``value``'s shape and, for a DTensor, its placement."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return torch.empty(value.shape, dtype=dtype, device=value.device)
    local = value.to_local()
    return DTensor.from_local(
        torch.empty(local.shape, dtype=dtype, device=local.device), value.device_mesh, value.placements,
        run_check=False, shape=value.shape, stride=value.stride(),
    )


def _dequantize_all(
    weights: dict[str, tuple[torch.Tensor, torch.Tensor, _Scale]],
    reader: FullCheckpointReader,
    block: tuple[int, int],
) -> None:
    """(all ranks) For each ``key: (target, fp8, scale)``, scale this rank's part
    of ``fp8`` into this rank's part of ``target``.

    The scale blocks of all weights are fetched in one parallel batch of
    ranged reads: a model with thousands of FP8 weights on S3 must not wait
    for one round trip per weight.
    """
    jobs = []
    pieces: list[Piece] = []
    checks: list[tuple[_Scale, torch.Tensor]] = []
    for target, fp8, scale in weights.values():
        where = reader.store.describe(scale.tensor.file)
        expected = scale_shape(tuple(target.shape), block)
        if scale.tensor.shape != expected:
            raise CheckpointCorruptError(
                f"{where}: scale {scale.scale_key!r} of {scale.weight_key!r} {tuple(target.shape)} has shape "
                f"{scale.tensor.shape}, but {block[0]}x{block[1]} blocks need {expected}; pass the checkpoint's "
                f"fp8_block_size",
                where,
            )
        if not scale.tensor.dtype.is_floating_point or scale.tensor.dtype in FP8_DTYPES:
            raise CheckpointCorruptError(f"{where}: scale {scale.scale_key!r} is {scale.tensor.dtype}", where)
        local, offsets = _local_part(target)
        values, _ = _local_part(fp8)
        if local.numel() == 0:
            continue
        box = scale_box((offsets[0], offsets[1]), (local.shape[0], local.shape[1]), block)
        if scale.stored.checksums:
            # Checksums cover whole frames: read the whole scale (1/16384 of
            # its weight's elements for 128 x 128 blocks), check it, then slice.
            whole = torch.empty(scale.tensor.shape, dtype=scale.tensor.dtype)
            pieces.append(Piece(scale.tensor.file, scale.tensor.offset, tensor_bytes(whole)))
            checks.append((scale, whole))
            scales = whole[box.row0 : box.row1, box.col0 : box.col1]
        else:
            scales = torch.empty(box.shape, dtype=scale.tensor.dtype)
            pieces += _scale_pieces(scale.tensor, box, scales)
        jobs.append((local, values, offsets, scales, box))
    store = reader.store
    store.read(plan_requests(pieces, gap=store.coalesce_gap, max_request=reader.config.read_request_size))
    for scale, whole in checks:
        _check_scale(scale, tensor_bytes(whole), store.describe(scale.tensor.file))
    with torch.no_grad():
        for local, values, offsets, scales, box in jobs:
            local.copy_(dequantize_slice(values, (offsets[0], offsets[1]), scales, box, block, local.dtype))


def _check_scale(scale: _Scale, raw: memoryview, where: str) -> None:
    """Check every frame of a scale read whole against its recorded checksums.

    Raises:
        ChecksumMismatchError: A frame's bytes differ from what was recorded.
    """
    table = FrameTable(scale.stored)
    for k in range(len(table)):
        frame = table.frame(k)
        fault = checksum_fault(frame, raw[frame.raw_start : frame.raw_end])
        if fault is not None:
            raise fault.error(where, MetadataIndex(scale.scale_key), frame)


def _scale_pieces(info: _Tensor, box: ScaleBox, out: torch.Tensor) -> list[Piece]:
    """Ranged reads of the scale blocks ``box`` of the scale tensor ``info`` into
    ``out``: one per row of blocks (rows next to each other merge into one request)."""
    view = tensor_bytes(out)
    esize = info.dtype.itemsize
    width = (box.col1 - box.col0) * esize
    cols = info.shape[1]
    return [
        Piece(info.file, info.offset + (row * cols + box.col0) * esize, view[i * width : (i + 1) * width])
        for i, row in enumerate(range(box.row0, box.row1))
    ]
