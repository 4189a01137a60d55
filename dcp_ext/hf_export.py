"""Hugging Face export: a sharded safetensors folder written by every rank at once.

:func:`save_hf` writes live training state (tensors and DTensors: FSDP2,
tensor parallel, plain), :func:`export_hf` a partial checkpoint on storage.
Both write the folder ``transformers.AutoModel.from_pretrained`` loads:

* ``model-00001-of-0000N.safetensors`` ... (``model.safetensors`` when there
  is one file), split by :func:`dcp_ext.hf_layout.plan_files`;
* ``dcp_ext.checksums.json``: per-frame xxh3 of every file, computed while
  the bytes stream out (:mod:`dcp_ext.full_checksums`);
* ``config.json`` if the caller gives one;
* ``model.safetensors.index.json``, the commit marker.

Each file is written by one rank (:func:`~dcp_ext.hf_layout.assign_writers`
balances bytes and prefers the rank that holds them), all writers at once,
one tensor in memory at a time. From live state the ranks move in steps: in
step ``k`` every writer assembles the ``k``-th tensor of its files from the
slices the other ranks send it (point-to-point; a slice held by several
ranks is sent by one, by none when the writer holds it), then writes it.
No rank ever holds more than about its largest tensor plus the slices it
sends. From storage each writer reads its own tensors with ranged reads;
nothing is exchanged.

Commit order: every file committed (each appears complete or not at all,
:meth:`~dcp_ext.storage.Store.open_writer`), then the sidecar, then
``config.json``, then the index. A failure on any rank makes every rank
raise the same error naming the rank, file and tensor; the files this
attempt wrote are deleted and no index is written. ``overwrite=True``
deletes the old index before anything else, so the folder is never a
committed export mixing old and new files; the old weights files the new
export does not replace are deleted once its index is committed.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from ._safetensors import build_header
from ._torch_format import tensor_bytes
from .config import IOConfig
from .errors import CheckpointExistsError, DcpExtError
from .export import _IntoTensor
from .hf_layout import (
    HF_CONFIG_FILE,
    HF_INDEX_FILE,
    HF_SINGLE_FILE,
    Box,
    HFFile,
    HFTensor,
    Transfer,
    assign_writers,
    config_document,
    index_document,
    parse_shard_size,
    plan_files,
    plan_transfers,
    stale_shards,
)
from .process_group import GroupView
from .reader import CheckpointReader
from .storage import TMP_MARK, ObjectWriter, Store, open_store

# TEMPORARY until dcp_ext.full_checksums is on main (then imported directly).
try:
    _checksums: Any = importlib.import_module("dcp_ext.full_checksums")
except ImportError:  # pragma: no cover
    _checksums = None
FOLDER_SIDECAR = "dcp_ext.checksums.json"

__all__ = ["HFExportReport", "save_hf", "export_hf"]

log = logging.getLogger("dcp_ext.hf_export")

# Safetensors metadata transformers expects ("pt": PyTorch weights).
_HEADER_METADATA = {"format": "pt"}


@dataclass(frozen=True)
class HFExportReport:
    """What one rank did in an export.

    Attributes:
        files: The weights files this rank wrote.
        bytes_written: Bytes of those files (headers included).
        total_bytes: Bytes of tensor data in the whole export (the index's ``total_size``).
        seconds: Wall time of the call on this rank.
    """

    files: tuple[str, ...]
    bytes_written: int
    total_bytes: int
    seconds: float


@dataclass(frozen=True)
class _Failure:
    """A rank's first error, as every rank re-raises it."""

    rank: int
    file: str
    tensor: str | None
    kind: type[BaseException]
    message: str
    path: str

    def error(self) -> DcpExtError:
        what = f"{self.file}, tensor {self.tensor!r}" if self.tensor is not None else self.file
        text = f"Hugging Face export failed on rank {self.rank} writing {what}: {self.message}"
        kind = self.kind if issubclass(self.kind, DcpExtError) else DcpExtError
        try:
            return kind(text, self.path)
        except Exception:  # noqa: BLE001 - a subclass with another signature
            return DcpExtError(text, self.path)


@dataclass(frozen=True)
class _Outcome:
    """One rank's result, shared with every rank."""

    failure: _Failure | None
    files: tuple[str, ...]
    bytes_written: int
    checksums: tuple[Any, ...]


class _FileSink:
    """(writer ranks) Streams tensors into this rank's files, one file open at a time.

    The first error stops all writing on this rank (the open file is
    aborted); it is kept as :attr:`failure` for the outcome exchange.
    """

    def __init__(self, store: Store, rank: int, files: Sequence[HFFile], tensors: Sequence[HFTensor],
                 frame_size: int) -> None:
        self.store = store
        self.rank = rank
        self.files = files
        self.tensors = tensors
        self.frame_size = frame_size
        self.failure: _Failure | None = None
        self.written: list[str] = []
        self.bytes_written = 0
        self.checksums: list[Any] = []
        self._writer: ObjectWriter | None = None
        self._file = -1
        self._offsets: dict[int, int] = {}
        self._recorder: Any = None
        self._size = 0

    def fail(self, file: int, tensor: int | None, err: BaseException) -> None:
        if self.failure is None:
            name = self.files[file].name
            self.failure = _Failure(
                self.rank, name, None if tensor is None else self.tensors[tensor].name, type(err),
                f"{type(err).__name__}: {err}", self.store.describe(name),
            )
            log.debug("rank %d failed on %s", self.rank, name, exc_info=err)
        self.abort()

    def open(self, file: int) -> None:
        """Start file ``file``: write its header."""
        if self.failure is not None:
            return
        try:
            spec = self.files[file]
            header, entries = build_header(
                ((self.tensors[i].name, self.tensors[i].dtype, self.tensors[i].shape) for i in spec.tensors),
                metadata=_HEADER_METADATA,
            )
            self._file = file
            self._offsets = {i: len(header) + e.begin for i, e in zip(spec.tensors, entries)}
            self._size = len(header) + spec.nbytes
            self._recorder = (
                _checksums.ChecksumRecorder(file=spec.name, frame_size=self.frame_size)
                if _checksums is not None else None
            )
            self._writer = self.store.open_writer(spec.name, size_hint=self._size)
            self._writer.write(header)
        except Exception as err:  # noqa: BLE001 - shared with every rank
            self.fail(file, None, err)

    def put(self, file: int, index: int, tensor: torch.Tensor) -> None:
        """Write tensor ``index`` (contiguous, CPU, its stored dtype and shape) of file ``file``."""
        if self.failure is not None:
            return
        try:
            spec = self.tensors[index]
            if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
                raise ValueError(f"expected {spec.dtype} {list(spec.shape)}, got {tensor.dtype} {list(tensor.shape)}")
            data = tensor_bytes(tensor)
            if self._recorder is not None:
                self._recorder.add(spec.name, self._offsets[index], data)
            assert self._writer is not None
            self._writer.write(data)
        except Exception as err:  # noqa: BLE001 - shared with every rank
            self.fail(file, index, err)

    def close(self, file: int) -> None:
        """Commit file ``file``."""
        if self.failure is not None or self._writer is None:
            return
        name = self.files[file].name
        try:
            self._writer.commit()
            self._writer = None
            self.written.append(name)
            self.bytes_written += self._size
            if self._recorder is not None:
                self.checksums.append(self._recorder.finish(size=self._size))
        except Exception as err:  # noqa: BLE001 - shared with every rank
            self.fail(file, None, err)

    def abort(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            try:
                writer.abort()
            except Exception as err:  # noqa: BLE001 - a temporary name is never read
                log.warning("could not abort %s: %s", writer.name, err)

    def outcome(self) -> _Outcome:
        return _Outcome(self.failure, tuple(self.written), self.bytes_written, tuple(self.checksums))


# -- sources --------------------------------------------------------------------------
def _stored_dtype(dtype: torch.dtype, cast_to: torch.dtype | None) -> torch.dtype:
    """``cast_to`` for floating dtypes, else ``dtype`` unchanged."""
    return cast_to if cast_to is not None and dtype.is_floating_point else dtype


class _LiveState:
    """Tensors and DTensors of the ranks' state dicts, and who holds which slice.

    Built collectively (one ``all_gather`` of every rank's keys, shapes and
    slices), so every rank plans the same transfers.
    """

    def __init__(self, group: GroupView, state: dict[str, Any], cast_to: torch.dtype | None) -> None:
        self.group = group
        items = [(k, v) for k, v in state.items() if isinstance(v, torch.Tensor)]
        self.values = [v for _, v in items]
        mine: list[tuple[str, str, tuple[int, ...], tuple[Box, ...]]] = []
        for key, value in items:
            mine.append((key, str(value.dtype), tuple(int(s) for s in value.shape), _held_slices(key, value)))
        every = group.all_gather(mine)
        reference = every[0]
        for rank, theirs in enumerate(every):
            if [k for k, *_ in theirs] != [k for k, *_ in reference]:
                extra = sorted({k for k, *_ in theirs} ^ {k for k, *_ in reference})
                raise ValueError(
                    f"the ranks' states differ: rank {rank} and rank 0 have different tensor keys (or order)"
                    + (f"; differing keys: {extra[:10]}" if extra else "")
                    + "; every rank must pass the same state dict keys"
                )
            for (key, dtype, shape, _), (_, dtype0, shape0, _) in zip(theirs, reference):
                if (dtype, shape) != (dtype0, shape0):
                    raise ValueError(
                        f"tensor {key!r}: rank {rank} has {dtype} {list(shape)}, rank 0 has {dtype0} {list(shape0)}"
                    )
        self.held = [[theirs[i][3] for theirs in every] for i in range(len(items))]
        self.tensors = [
            HFTensor(k, _stored_dtype(v.dtype, cast_to), tuple(int(s) for s in v.shape)) for k, v in items
        ]

    def local_bytes(self, files: Sequence[HFFile]) -> list[list[int]]:
        world = self.group.world_size
        out = []
        for f in files:
            row = [0] * world
            for i in f.tensors:
                itemsize = self.tensors[i].dtype.itemsize
                for rank, boxes in enumerate(self.held[i]):
                    row[rank] += sum(b.numel for b in boxes) * itemsize
            out.append(row)
        return out

    def plan(self, files: Sequence[HFFile], owners: Sequence[int]) -> list[tuple[Transfer, ...]]:
        """(all ranks) The transfers of every tensor."""
        transfers: list[tuple[Transfer, ...]] = [()] * len(self.tensors)
        for f, owner in zip(files, owners):
            for i in f.tensors:
                transfers[i] = plan_transfers(self.tensors[i].name, self.tensors[i].shape, owner, self.held[i])
        return transfers

    def local_slice(self, index: int) -> torch.Tensor:
        """This rank's slice of tensor ``index`` in its stored dtype, contiguous, on the CPU."""
        value = self.values[index]
        local = value.to_local() if hasattr(value, "to_local") else value
        return local.detach().to(device="cpu", dtype=self.tensors[index].dtype).contiguous()

    def run(self, sink: _FileSink, files: Sequence[HFFile], owners: Sequence[int],
            transfers: Sequence[tuple[Transfer, ...]]) -> None:
        """(all ranks) Every writer assembles and writes its files' tensors, in lockstep.

        Step ``k``: each writer's ``k``-th tensor. A rank whose writing failed
        keeps sending and receiving (its peers' steps need it) and the step's
        end tells every rank to stop.
        """
        group = self.group
        me, world = group.rank, group.world_size
        queues: list[list[tuple[int, int]]] = [[] for _ in range(world)]
        for f, owner in enumerate(owners):
            queues[owner] += [(f, i) for i in files[f].tensors]
        for f, owner in enumerate(owners):
            if owner == me and not files[f].tensors:
                sink.open(f)
                sink.close(f)
        steps = max((len(q) for q in queues), default=0)
        for step in range(steps):
            works: list[Any] = []
            keep: list[torch.Tensor] = []  # send buffers, alive until their sends completed
            copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (received, destination view)
            assembled: torch.Tensor | None = None
            mine = queues[me][step] if step < len(queues[me]) else None
            for owner in range(world):
                if step >= len(queues[owner]):
                    continue
                f, i = queues[owner][step]
                if owner == me:
                    assembled = self._assemble(i, transfers[i], step, works, copies, sink, f)
                    continue
                for transfer in transfers[i]:
                    if transfer.source == me:
                        buffer = self._send_buffer(i, transfer.box, sink, f)
                        keep.append(buffer)
                        works.append(_isend(group, buffer, owner, step))
            for work in works:
                work.wait()
            for received, view in copies:
                view.copy_(received)
            del keep, copies
            if mine is not None:
                f, i = mine
                if i == files[f].tensors[0]:
                    sink.open(f)
                if assembled is not None:
                    sink.put(f, i, assembled)
                if i == files[f].tensors[-1]:
                    sink.close(f)
            del assembled
            if _any_failed(group, sink.failure is not None):
                return

    def _assemble(self, index: int, transfers: Sequence[Transfer], step: int, works: list[Any],
                  copies: list[tuple[torch.Tensor, torch.Tensor]], sink: _FileSink, file: int) -> torch.Tensor:
        """(writer) Post the receives of tensor ``index``; return the tensor they fill."""
        spec = self.tensors[index]
        me = self.group.rank
        if len(transfers) == 1 and transfers[0].source == me and transfers[0].box.sizes == spec.shape:
            return self._own_slice(index, sink, file, spec.shape)  # held whole here: no copy unless cast
        whole = torch.empty(spec.shape, dtype=spec.dtype)
        for transfer in transfers:
            view = whole
            for dim, (offset, size) in enumerate(zip(transfer.box.offsets, transfer.box.sizes)):
                view = view.narrow(dim, offset, size)
            if transfer.source == me:
                view.copy_(self._own_slice(index, sink, file, transfer.box.sizes, cast_here=False))
            elif view.is_contiguous():
                works.append(_irecv(self.group, view, transfer.source, step))
            else:
                received = torch.empty(transfer.box.sizes, dtype=spec.dtype)
                works.append(_irecv(self.group, received, transfer.source, step))
                copies.append((received, view))
        return whole

    def _own_slice(self, index: int, sink: _FileSink, file: int, shape: tuple[int, ...],
                   cast_here: bool = True) -> torch.Tensor:
        """This rank's slice of tensor ``index`` (of ``shape``): cast and
        contiguous with ``cast_here``, else as held (``copy_`` into the
        assembled tensor casts). On error, zeros (the step goes on) and the
        error is this rank's failure."""
        try:
            if not cast_here:
                value = self.values[index]
                local = (value.to_local() if hasattr(value, "to_local") else value).detach()
            else:
                local = self.local_slice(index)
            if tuple(local.shape) != shape:
                raise ValueError(f"local slice has shape {list(local.shape)}, its DTensor says {list(shape)}")
            return local
        except Exception as err:  # noqa: BLE001 - shared with every rank
            sink.fail(file, index, err)
            return torch.zeros(shape, dtype=self.tensors[index].dtype)

    def _send_buffer(self, index: int, box: Box, sink: _FileSink, file: int) -> torch.Tensor:
        """This rank's slice ``box`` of tensor ``index``, ready to send. On
        error, zeros of the same size go out (the writer's step must complete)
        and the error is this rank's failure."""
        try:
            local = self.local_slice(index)
            if tuple(local.shape) != box.sizes:
                raise ValueError(f"local slice has shape {list(local.shape)}, its DTensor says {list(box.sizes)}")
            return local
        except Exception as err:  # noqa: BLE001 - shared with every rank
            sink.fail(file, index, err)
            return torch.zeros(box.sizes, dtype=self.tensors[index].dtype)


def _held_slices(key: str, value: torch.Tensor) -> tuple[Box, ...]:
    """The global slice(s) of ``value`` this rank holds: a DTensor's local
    chunk, or the whole of a plain tensor."""
    chunk_list = getattr(value, "__create_chunk_list__", None)
    if chunk_list is None or not hasattr(value, "to_local"):
        return (Box((0,) * value.dim(), tuple(int(s) for s in value.shape)),)
    try:
        chunks = chunk_list()
    except Exception as err:
        raise ValueError(f"tensor {key!r}: cannot tell which slice this rank holds ({err}); "
                         f"redistribute it to Shard/Replicate placements first") from err
    boxes = tuple(Box(tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes)) for c in chunks)
    local_shape = tuple(int(s) for s in value.to_local().shape)
    if len(boxes) != 1 or boxes[0].sizes != local_shape:
        raise ValueError(f"tensor {key!r}: its local tensor {list(local_shape)} is not one slice of the global "
                         f"tensor ({[list(b.sizes) for b in boxes]}); redistribute it first")
    return boxes


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat ``uint8`` tensor (gloo sends bytes of any dtype)."""
    return tensor.reshape(-1).view(torch.uint8)


def _isend(group: GroupView, tensor: torch.Tensor, peer: int, tag: int) -> Any:
    return dist.isend(_as_bytes(tensor), group=group.group, tag=tag, group_dst=peer)


def _irecv(group: GroupView, tensor: torch.Tensor, peer: int, tag: int) -> Any:
    return dist.irecv(_as_bytes(tensor), group=group.group, tag=tag, group_src=peer)


def _any_failed(group: GroupView, failed: bool) -> bool:
    """(all ranks) Whether any rank failed."""
    if not group.distributed:
        return failed
    flag = torch.tensor([1 if failed else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group.group)
    return bool(flag.item())


class _StoredState:
    """The tensors of a partial checkpoint, read with ranged reads by the rank that writes them."""

    def __init__(self, group: GroupView, source: str, include_optimizer: bool, cast_to: torch.dtype | None,
                 storage_options: dict[str, Any] | None, config: IOConfig) -> None:
        self.reader = CheckpointReader(source, storage_options=storage_options, config=config)
        if group.distributed:
            self.reader.metadata_group = (group.group,)  # the coordinator reads it once for all
        metadata = self.reader.read_metadata()
        self.reader.set_up_storage_reader(metadata, True)
        stored = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        self.chosen = _exported_keys(list(stored), include_optimizer)
        self.metadata = [stored[k] for _, k in self.chosen]
        self.tensors = [
            HFTensor(name, _stored_dtype(md.properties.dtype, cast_to), tuple(int(s) for s in md.size))
            for (name, _), md in zip(self.chosen, self.metadata)
        ]

    def read(self, index: int) -> torch.Tensor:
        """Tensor ``index`` in full, in its stored dtype."""
        key = self.chosen[index][1]
        md = self.metadata[index]
        dest = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        # The row as the index hint: version-3 look-ups then index no key's rows.
        items = [
            ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex(key, chunk.offsets),
                dest_offsets=chunk.offsets,
                storage_index=MetadataIndex(key, chunk.offsets, row),
                storage_offsets=torch.Size((0,) * len(chunk.offsets)),
                lengths=chunk.sizes,
            )
            for row, chunk in enumerate(md.chunks)
        ]
        self.reader.read_data(LoadPlan(items), cast(LoadPlanner, _IntoTensor(dest)))
        return dest.to(self.tensors[index].dtype)

    def run(self, sink: _FileSink, files: Sequence[HFFile], owners: Sequence[int], rank: int) -> None:
        """(each rank on its own) Read and write the files this rank writes."""
        for f, owner in enumerate(owners):
            if owner != rank:
                continue
            sink.open(f)
            for i in files[f].tensors:
                if sink.failure is not None:
                    return
                try:
                    tensor = self.read(i)
                except Exception as err:  # noqa: BLE001 - shared with every rank
                    sink.fail(f, i, err)
                    return
                sink.put(f, i, tensor)
                del tensor
            sink.close(f)


def _exported_keys(keys: Sequence[str], include_optimizer: bool) -> list[tuple[str, str]]:
    """``(name in the export, key in the checkpoint)``: a CheckpointManager
    checkpoint's ``model.`` keys lose the prefix, its ``optimizer.`` keys stay
    (with ``include_optimizer``); other checkpoints keep every key."""
    if not any(k.startswith("model.") for k in keys):
        return [(k, k) for k in keys]
    chosen = []
    for key in keys:
        if key.startswith("model."):
            chosen.append((key[len("model."):], key))
        elif include_optimizer and key.startswith("optimizer."):
            chosen.append((key, key))
    return chosen


# -- the export ----------------------------------------------------------------------
@dataclass(frozen=True)
class _Plan:
    tensors: tuple[HFTensor, ...]
    files: tuple[HFFile, ...]
    owners: tuple[int, ...]
    config: bytes | None


def _make_plan(tensors: Sequence[HFTensor], world_size: int, max_shard_size: int | str,
               config_json: dict[str, Any] | str | None, where: str,
               local_bytes: Callable[[Sequence[HFFile]], list[list[int]]] | None = None) -> _Plan:
    """(all ranks, same inputs) Files, their writers and the config bytes; raises
    before anything is written when a dtype cannot be stored or the config is not JSON."""
    files = plan_files(tensors, parse_shard_size(max_shard_size))
    for f in files:  # a dtype safetensors cannot hold fails here, on every rank
        build_header(((tensors[i].name, tensors[i].dtype, tensors[i].shape) for i in f.tensors))
    owners = assign_writers(files, world_size, local_bytes(files) if local_bytes is not None else None)
    document = None if config_json is None else config_document(config_json, where)
    return _Plan(tuple(tensors), files, owners, document)


def _prepare_folder(store: Store, overwrite: bool) -> list[str]:
    """(coordinator) Refuse or retire an existing export; create the folder.

    Returns:
        The names the folder held (to remove stale weights files later).
    """
    names = store.list_names() if store.root_exists() else []
    present = [n for n in (HF_INDEX_FILE, HF_SINGLE_FILE) if n in names]
    if present:
        if not overwrite:
            raise CheckpointExistsError(
                f"Checkpoint already exists: {store.describe()} holds {' and '.join(present)}; "
                f"pass overwrite=True to replace it",
                store.describe(),
            )
        # The index first: from here on the folder is no committed export.
        store.delete(HF_INDEX_FILE)
        store.delete(FOLDER_SIDECAR)
    store.ensure_root()
    return names


def _finish_folder(store: Store, plan: _Plan, outcomes: Sequence[_Outcome], existing: Sequence[str],
                   extra: tuple[Store, str, bytes] | None) -> None:
    """(coordinator) Sidecar, config, extra file, index; then tidy the old export's files."""
    written: list[tuple[Store, str]] = []
    try:
        if _checksums is not None:
            by_file = {c.file: c for o in outcomes for c in o.checksums}
            store.write_file(FOLDER_SIDECAR, _checksums.encode_sidecar([by_file[f.name] for f in plan.files]))
            written.append((store, FOLDER_SIDECAR))
        if plan.config is not None:
            store.write_file(HF_CONFIG_FILE, plan.config)
        if extra is not None:
            extra[0].write_file(extra[1], extra[2])
            written.append((extra[0], extra[1]))
        store.write_file(HF_INDEX_FILE, index_document(plan.tensors, plan.files))
    except BaseException:
        for target, name in written + [(store, f.name) for f in plan.files]:
            _delete_quietly(target, name)
        raise
    new = [f.name for f in plan.files]
    for name in stale_shards(existing, new) + [n for n in existing if TMP_MARK in n and n.startswith("model")]:
        _delete_quietly(store, name)


def _delete_quietly(store: Store, name: str) -> None:
    try:
        store.delete(name)
    except Exception as err:  # noqa: BLE001 - tidying after the outcome is known
        log.warning("could not delete %s: %s", store.describe(name), err)


def _export(
    group: GroupView,
    store: Store,
    plan: _Plan,
    overwrite: bool,
    write: Callable[[_FileSink], None],
    started: float,
    extra: tuple[Store, str, bytes] | None = None,
) -> HFExportReport:
    """(all ranks) Prepare the folder, write the files (``write``), share the
    outcomes, then commit (coordinator) or clean up (every rank)."""
    existing = group.run_on_coordinator(lambda: _prepare_folder(store, overwrite))
    sink = _FileSink(store, group.rank, plan.files, plan.tensors, store.config.frame_size)
    try:
        write(sink)
    finally:
        sink.abort()
    outcomes: list[_Outcome] = group.all_gather(sink.outcome())
    failures = [o.failure for o in outcomes if o.failure is not None]
    if failures:
        for name in sink.written:
            _delete_quietly(store, name)
        group.barrier()  # every rank's files are gone before any rank returns
        raise failures[0].error()
    group.run_on_coordinator(lambda: _finish_folder(store, plan, outcomes, existing, extra))
    mine = outcomes[group.rank]
    return HFExportReport(mine.files, mine.bytes_written, sum(f.nbytes for f in plan.files),
                          time.perf_counter() - started)


def save_hf(
    state: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    config_json: dict[str, Any] | str | None = None,
    overwrite: bool = False,
    process_group: Any = None,
    storage_options: dict[str, Any] | None = None,
    config: IOConfig | None = None,
    _extra: tuple[Store, str, bytes] | None = None,
) -> HFExportReport:
    """(all ranks) Write live state as a Hugging Face folder at ``path``.

    Args:
        state: Flat ``{key: tensor or DTensor}`` (e.g. ``get_model_state_dict(model)``),
            the same keys in the same order on every rank; other values are
            skipped. DTensors may be sharded (FSDP2 ``Shard(0)``, tensor
            parallel ``Shard(0)``/``Shard(1)``, uneven) or replicated; a plain
            tensor is taken as the same on every rank.
        path: The folder: local path, ``s3://`` or fsspec URL.
        max_shard_size: Most bytes of tensor data per file (``"5GB"``,
            ``"500MB"``, ``"2GiB"`` or an int); a larger tensor gets a file
            of its own.
        dtype: Cast floating tensors to this dtype (on the rank that holds
            them, before they move); other tensors keep theirs.
        config_json: ``config.json`` to write: a dict, or a JSON string
            written as given.
        overwrite: Replace an existing export in the folder.
        process_group: The ranks that hold ``state`` (default group; no
            group: one process writes everything).
        storage_options: fsspec/s3fs options.
        config: I/O tunables (``frame_size`` sets the checksum frames).

    Returns:
        What this rank wrote.

    Raises:
        CheckpointExistsError: The folder holds an export and ``overwrite`` is off (every rank).
        DcpExtError: Writing failed on some rank (every rank, the same error;
            of the failure's own class when it is a dcp_ext error).
        TypeError: A dtype safetensors cannot store (every rank, before writing).
        ValueError: The ranks' states differ, or ``config_json`` is not JSON.
    """
    started = time.perf_counter()
    group = GroupView(process_group)
    io_config = config or IOConfig.from_env()
    store = open_store(path, io_config, storage_options)
    live = _LiveState(group, state, dtype)
    plan = _make_plan(live.tensors, group.world_size, max_shard_size, config_json, store.describe(), live.local_bytes)
    transfers = live.plan(plan.files, plan.owners)
    return _export(group, store, plan, overwrite,
                   lambda sink: live.run(sink, plan.files, plan.owners, transfers), started, _extra)


def export_hf(
    source: str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    include_optimizer: bool = False,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    config_json: dict[str, Any] | str | None = None,
    overwrite: bool = False,
    process_group: Any = None,
    storage_options: dict[str, Any] | None = None,
    config: IOConfig | None = None,
    _extra: tuple[Store, str, bytes] | None = None,
) -> HFExportReport:
    """(all ranks, or one process) Write a partial checkpoint as a Hugging Face folder at ``path``.

    Each rank reads the tensors of the files it writes with ranged reads;
    nothing is exchanged, so N ranks write N files at once. Keys of a
    :class:`~dcp_ext.CheckpointManager` checkpoint (``{tag}_partial``) lose
    their ``model.`` prefix; optimizer tensors keep their flattened
    ``optimizer.`` keys (``include_optimizer``).

    Args:
        source: The partial checkpoint directory (or any checkpoint
            :class:`~dcp_ext.CheckpointReader` reads).
        path, max_shard_size, dtype, config_json, overwrite, process_group,
            storage_options, config: As for :func:`save_hf`.

    Returns:
        What this rank wrote.

    Raises:
        As :func:`save_hf`; and the reader's errors for a missing or damaged source.
    """
    started = time.perf_counter()
    group = GroupView(process_group)
    io_config = config or IOConfig.from_env()
    store = open_store(path, io_config, storage_options)
    stored = _StoredState(group, os.fspath(source), include_optimizer, dtype, storage_options, io_config)
    plan = _make_plan(stored.tensors, group.world_size, max_shard_size, config_json, store.describe())
    return _export(group, store, plan, overwrite,
                   lambda sink: stored.run(sink, plan.files, plan.owners, group.rank), started, _extra)
