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
export does not replace are deleted once its index is committed (an old
``model.safetensors`` just before: transformers loads it in preference to
any index).
"""

from __future__ import annotations

import dataclasses
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

from ._failpoints import fail_point
from ._safetensors import build_header
from ._torch_format import tensor_bytes
from .config import IOConfig
from .errors import CheckpointExistsError, DcpExtError
from .export import _IntoTensor
from .full_checksums import FOLDER_SIDECAR, ChecksumRecorder, FileChecksums, encode_sidecar
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
    checksums: tuple[FileChecksums, ...]


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
        self.cause: BaseException | None = None  # the original error of :attr:`failure`
        self.written: list[str] = []
        self.bytes_written = 0
        self.checksums: list[FileChecksums] = []
        self._writer: ObjectWriter | None = None
        self._file = -1
        self._offsets: dict[int, int] = {}
        self._recorder: ChecksumRecorder | None = None
        self._size = 0

    def fail(self, file: int, tensor: int | None, err: BaseException) -> None:
        if self.failure is None:
            self.cause = err
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
            self._recorder = ChecksumRecorder(file=spec.name, frame_size=self.frame_size)
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
            assert self._writer is not None and self._recorder is not None
            self._recorder.add(spec.name, self._offsets[index], data)
            self._writer.write(data)
            fail_point("mid_hf_export")
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
            assert self._recorder is not None
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
class _Scratch:
    """One reused buffer that each tensor in turn is assembled or read into.

    A fresh allocation per tensor would cost its page faults every time,
    and gloo keeps its last received tensor alive until its next operation,
    so the previous tensor's memory would still be held while the next one
    fills: the high-water mark would be two tensors instead of one.
    """

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """An uninitialized tensor over the buffer (valid until the next call)."""
        nbytes = _numel(shape) * dtype.itemsize
        if nbytes > self._buffer.numel():
            self._buffer = torch.empty(0, dtype=torch.uint8)  # the old one goes first
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self._buffer[:nbytes].view(dtype).reshape(shape)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _check_cpu_backend(group: GroupView) -> None:
    """Slices travel as CPU tensors: the group needs a backend that sends them."""
    if not group.distributed:
        return
    backend = str(dist.get_backend(group.group))
    if "gloo" not in backend and "mpi" not in backend:
        raise ValueError(
            f"save_hf exchanges CPU tensors, which the {backend!r} process group cannot send: pass "
            f"process_group=dist.new_group(backend='gloo'), or initialize with backend='cpu:gloo,cuda:nccl'"
        )


def _check_dtype(dtype: torch.dtype | None) -> None:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype (it casts floating tensors), got {dtype!r}")


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
        mine: list[tuple[str, str, tuple[int, ...], tuple[Box, ...]]] | str = []
        try:
            mine = [(k, str(v.dtype), tuple(int(s) for s in v.shape), _held_slices(k, v)) for k, v in items]
        except ValueError as err:  # shared: every rank raises it
            mine = str(err)
        gathered = group.all_gather(mine)
        every: list[list[tuple[str, str, tuple[int, ...], tuple[Box, ...]]]] = []
        for rank, theirs in enumerate(gathered):
            if isinstance(theirs, str):
                raise ValueError(f"rank {rank}: {theirs}")
            every.append(theirs)
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
        self.scratch = _Scratch()  # the tensor this rank assembles
        self.send_scratch: list[_Scratch] = []  # casts or copies of what it sends, one per send of a step
        self.recv_scratch: list[_Scratch] = []  # slices it receives that are not contiguous in the tensor
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
        """This rank's slice of tensor ``index`` in its stored dtype, contiguous,
        on the CPU: the local tensor itself, or a copy in the scratch buffer
        (for a tensor the writer holds whole, so it assembles nothing)."""
        value = self.values[index]
        local = (value.to_local() if hasattr(value, "to_local") else value).detach()
        dtype = self.tensors[index].dtype
        if local.dtype == dtype and local.device.type == "cpu" and local.is_contiguous():
            return local
        return self.scratch.tensor(dtype, tuple(int(s) for s in local.shape)).copy_(local)

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
                        keep.append(self._send_buffer(i, transfer.box, sink, f, len(keep)))
                        works.append(_isend(group, keep[-1], owner, step))
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
        whole = self.scratch.tensor(spec.dtype, spec.shape)
        for transfer in transfers:
            view = _box_view(whole, transfer.box.offsets, transfer.box.sizes)
            if transfer.source == me:
                view.copy_(self._own_slice(index, sink, file, transfer.box.sizes, cast_here=False))
            elif view.is_contiguous():
                works.append(_irecv(self.group, view, transfer.source, step))
            else:  # a column block (Shard(1)): received whole, then copied into place
                while len(self.recv_scratch) <= len(copies):
                    self.recv_scratch.append(_Scratch())
                received = self.recv_scratch[len(copies)].tensor(spec.dtype, transfer.box.sizes)
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

    def _send_buffer(self, index: int, box: Box, sink: _FileSink, file: int, slot: int) -> torch.Tensor:
        """This rank's slice ``box`` of tensor ``index``, ready to send: the
        local tensor itself when it needs no cast or copy, else a copy in the
        reused send buffer ``slot`` (this step's ``slot``-th send). On error,
        zeros of the same size go out (the writer's step must complete) and
        the error is this rank's failure."""
        dtype = self.tensors[index].dtype
        try:
            value = self.values[index]
            local = (value.to_local() if hasattr(value, "to_local") else value).detach()
            if tuple(local.shape) != box.sizes:
                raise ValueError(f"local slice has shape {list(local.shape)}, its DTensor says {list(box.sizes)}")
            if local.dtype == dtype and local.device.type == "cpu" and local.is_contiguous():
                return local
            while len(self.send_scratch) <= slot:
                self.send_scratch.append(_Scratch())
            return self.send_scratch[slot].tensor(dtype, box.sizes).copy_(local)
        except Exception as err:  # noqa: BLE001 - shared with every rank
            sink.fail(file, index, err)
            return torch.zeros(box.sizes, dtype=dtype)


def _box_view(tensor: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """The slice ``offsets``/``sizes`` of ``tensor`` (a view)."""
    view = tensor
    for dim, (offset, size) in enumerate(zip(offsets, sizes)):
        view = view.narrow(dim, int(offset), int(size))
    return view


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
        self.scratch = _Scratch()
        self.block_scratch = _Scratch()  # column blocks, one at a time
        stored = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        self.chosen = _exported_keys(list(stored), include_optimizer)
        self.metadata = [stored[k] for _, k in self.chosen]
        self.tensors = [
            HFTensor(name, _stored_dtype(md.properties.dtype, cast_to), tuple(int(s) for s in md.size))
            for (name, _), md in zip(self.chosen, self.metadata)
        ]

    def read(self, index: int) -> torch.Tensor:
        """Tensor ``index`` in full, in its exported dtype (valid until the next call)."""
        key = self.chosen[index][1]
        md = self.metadata[index]
        dest = self.scratch.tensor(md.properties.dtype, tuple(int(s) for s in md.size))
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
        # Chunks whose place in the tensor is contiguous (row blocks) land
        # there directly, all in one parallel read; a column block would be
        # staged by the reader, all blocks at once, so each is read into a
        # reused block buffer in turn and copied into place.
        direct = [item for item in items if _box_view(dest, item.dest_offsets, item.lengths).is_contiguous()]
        if direct:
            self.reader.read_data(LoadPlan(direct), cast(LoadPlanner, _IntoTensor(dest)))
        for item in items:
            view = _box_view(dest, item.dest_offsets, item.lengths)
            if view.is_contiguous():
                continue
            block = self.block_scratch.tensor(dest.dtype, tuple(int(n) for n in item.lengths))
            at_zero = dataclasses.replace(item, dest_offsets=torch.Size((0,) * len(item.lengths)))
            self.reader.read_data(LoadPlan([at_zero]), cast(LoadPlanner, _IntoTensor(block)))
            view.copy_(block)
        return dest.to(self.tensors[index].dtype)  # a view of the scratch buffer unless cast

    def run(self, sink: _FileSink, files: Sequence[HFFile], owners: Sequence[int], rank: int,
            progress: Callable[[int, int], None] | None = None) -> None:
        """(each rank on its own) Read and write the files this rank writes."""
        mine = [f for f, owner in enumerate(owners) if owner == rank]
        total = sum(files[f].nbytes for f in mine)
        done = 0
        for f in mine:
            sink.open(f)
            for i in files[f].tensors:
                if sink.failure is not None:
                    return
                if progress is not None:
                    progress(done, total)
                try:
                    tensor = self.read(i)
                except Exception as err:  # noqa: BLE001 - shared with every rank
                    sink.fail(f, i, err)
                    return
                sink.put(f, i, tensor)
                done += self.tensors[i].nbytes
                del tensor
            sink.close(f)
        if progress is not None:
            progress(total, total)


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
        by_file = {c.file: c for o in outcomes for c in o.checksums}
        store.write_file(FOLDER_SIDECAR, encode_sidecar([by_file[f.name] for f in plan.files]))
        written.append((store, FOLDER_SIDECAR))
        if plan.config is not None:
            store.write_file(HF_CONFIG_FILE, plan.config)
        if extra is not None:
            extra[0].write_file(extra[1], extra[2])
            written.append((extra[0], extra[1]))
        new = [f.name for f in plan.files]
        if HF_SINGLE_FILE in existing and HF_SINGLE_FILE not in new:
            # Before the index: transformers loads model.safetensors in
            # preference to any index, so the old one must not outlive it.
            store.delete(HF_SINGLE_FILE)
        store.write_file(HF_INDEX_FILE, index_document(plan.tensors, plan.files))
    except BaseException:
        for target, name in written + [(store, f.name) for f in plan.files]:
            _delete_quietly(target, name)
        raise
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
    except BaseException:
        # Not a storage or data error (those are shared below): a collective
        # failed, or the process is being interrupted. The peers see it as a
        # failed collective; this rank's files go.
        sink.abort()
        for name in sink.written:
            _delete_quietly(store, name)
        raise
    sink.abort()  # a file left open when another rank's failure stopped the steps
    outcomes: list[_Outcome] = group.all_gather(sink.outcome())
    failures = [o.failure for o in outcomes if o.failure is not None]
    if failures:
        for name in sink.written:
            _delete_quietly(store, name)
        group.barrier()  # every rank's files are gone before any rank returns
        first = failures[0]
        raise first.error() from (sink.cause if first.rank == group.rank else None)
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
            group: one process writes everything). Slices travel between
            ranks as CPU tensors, so its backend must send those (gloo, or
            ``"cpu:gloo,cuda:nccl"``); CUDA tensors are copied to the CPU
            on the rank that holds them.
        storage_options: fsspec/s3fs options.
        config: I/O tunables (``frame_size`` sets the checksum frames).

    Returns:
        What this rank wrote.

    Raises:
        CheckpointExistsError: The folder holds an export and ``overwrite`` is off (every rank).
        DcpExtError: Writing failed on some rank (every rank, the same error;
            of the failure's own class when it is a dcp_ext error).
        TypeError: A dtype safetensors cannot store (every rank, before writing).
        ValueError: The ranks' states differ, ``config_json`` is not JSON,
            ``dtype`` is not floating, or the group cannot send CPU tensors.
    """
    return write_live_state(state, path, max_shard_size=max_shard_size, dtype=dtype, config_json=config_json,
                            overwrite=overwrite, process_group=process_group, storage_options=storage_options,
                            config=config)


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
    return write_partial(source, path, include_optimizer=include_optimizer, max_shard_size=max_shard_size,
                         dtype=dtype, config_json=config_json, overwrite=overwrite, process_group=process_group,
                         storage_options=storage_options, config=config)


# -- the same with a file of the caller's committed just before the index ---------------
def write_live_state(
    state: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    max_shard_size: int | str,
    dtype: torch.dtype | None,
    config_json: dict[str, Any] | str | None,
    overwrite: bool,
    process_group: Any,
    storage_options: dict[str, Any] | None,
    config: IOConfig | None,
    extra: tuple[Store, str, bytes] | None = None,
) -> HFExportReport:
    """(all ranks) :func:`save_hf`; ``extra`` = ``(store, name, bytes)`` is
    written by the coordinator just before the index (CheckpointManager's
    ``user_content_{tag}``) and deleted if the export fails."""
    started = time.perf_counter()
    _check_dtype(dtype)
    group = GroupView(process_group)
    io_config = config or IOConfig.from_env()
    store = open_store(path, io_config, storage_options)
    _check_cpu_backend(group)
    live = _LiveState(group, state, dtype)
    plan = _make_plan(live.tensors, group.world_size, max_shard_size, config_json, store.describe(), live.local_bytes)
    transfers = live.plan(plan.files, plan.owners)
    return _export(group, store, plan, overwrite,
                   lambda sink: live.run(sink, plan.files, plan.owners, transfers), started, extra)


def write_partial(
    source: str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    include_optimizer: bool,
    max_shard_size: int | str,
    dtype: torch.dtype | None,
    config_json: dict[str, Any] | str | None,
    overwrite: bool,
    process_group: Any,
    storage_options: dict[str, Any] | None,
    config: IOConfig | None,
    extra: tuple[Store, str, bytes] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> HFExportReport:
    """(all ranks, or one process) :func:`export_hf`, with ``extra`` as for
    :func:`write_live_state`; ``progress(done, total)`` after each tensor, in
    bytes of tensor data this rank writes."""
    started = time.perf_counter()
    _check_dtype(dtype)
    group = GroupView(process_group)
    io_config = config or IOConfig.from_env()
    store = open_store(path, io_config, storage_options)
    stored = _StoredState(group, os.fspath(source), include_optimizer, dtype, storage_options, io_config)
    plan = _make_plan(stored.tensors, group.world_size, max_shard_size, config_json, store.describe())
    return _export(group, store, plan, overwrite,
                   lambda sink: stored.run(sink, plan.files, plan.owners, group.rank, progress), started, extra)
