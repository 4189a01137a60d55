"""Where the tensors of a Hugging Face export come from, on the rank that writes them.

* :class:`LiveState`: training state (tensors and DTensors) spread over the
  ranks. Every rank learns who holds which slice (one ``all_gather``); then
  in step ``k`` every writer assembles the ``k``-th batch of its files'
  tensors (:func:`step_bytes` at most) from the slices the others send it
  (point-to-point), a slice several ranks hold coming from one of them
  (none at all when the writer holds it).
* :class:`StoredState`: a partial checkpoint on storage; each writer reads
  its own tensors, a batch at a time (one parallel read each), with ranged
  reads; nothing is exchanged.

Each rank assembles or reads into reused buffers (:class:`Arena`), two by
turns: a thread of its own (:class:`_Writer`) writes one batch while the
next is exchanged or read, so a rank holds about two batches beyond its
own state; one batch when batches are larger than :data:`OVERLAP_BYTES`
(its largest tensor is), which are then written before the next is prepared.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from .._runtime import GroupView
from ..dcp_io import CheckpointReader, FrameStream
from ..full import IntoTensor, exported_keys, whole_tensor_items
from ..metadata import StoredItem
from ..storage import Location
from ._layout import Box, HFFile, HFTensor, Transfer, plan_transfers
from ._sink import Assembled, FileSink

__all__ = ["LiveState", "StoredState", "Arena", "check_cpu_backend", "stored_dtype"]


class Arena:
    """Reused memory for the tensors of one step (or one tensor), handed out in order.

    Fresh allocations per tensor would cost their page faults every time,
    and gloo keeps its last received tensor alive until its next operation,
    so the previous step's memory would still be held while the next one
    fills: the high-water mark would be two steps instead of one. Each step
    starts with :meth:`reset` to the bytes it needs.
    """

    #: Every tensor starts at a multiple of this (any dtype's alignment).
    ALIGN = 64

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._used = 0

    @classmethod
    def size_of(cls, dtype: torch.dtype, shape: Sequence[int]) -> int:
        """Bytes :meth:`take` uses for such a tensor."""
        return -(-_numel(shape) * dtype.itemsize // cls.ALIGN) * cls.ALIGN

    def reset(self, capacity: int) -> None:
        """Start handing out memory from the beginning, ``capacity`` bytes of it
        (the buffer grows if needed; earlier tensors must no longer be used)."""
        self._used = 0
        if capacity > self._buffer.numel():
            self._buffer = torch.empty(0, dtype=torch.uint8)  # the old one goes first
            self._buffer = torch.empty(capacity, dtype=torch.uint8)

    def take(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """An uninitialized tensor in the next free bytes."""
        size = self.size_of(dtype, shape)
        if self._used + size > self._buffer.numel():
            raise RuntimeError(f"arena of {self._buffer.numel()} bytes cannot hold {size} more (planning error)")
        nbytes = _numel(shape) * dtype.itemsize
        view = self._buffer[self._used : self._used + nbytes].view(dtype).reshape(tuple(shape))
        self._used += size
        return view


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def check_cpu_backend(group: GroupView) -> None:
    """Slices travel as CPU tensors: the group needs a backend that sends them."""
    if not group.distributed:
        return
    backend = str(dist.get_backend(group.group))
    if "gloo" not in backend and "mpi" not in backend:
        raise ValueError(
            f"save_hf exchanges CPU tensors, which the {backend!r} process group cannot send: pass "
            f"process_group=dist.new_group(backend='gloo'), or initialize with backend='cpu:gloo,cuda:nccl'"
        )




def stored_dtype(dtype: torch.dtype, cast_to: torch.dtype | None) -> torch.dtype:
    """``cast_to`` for floating dtypes, else ``dtype`` unchanged."""
    return cast_to if cast_to is not None and dtype.is_floating_point else dtype


class LiveState:
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
        # The tensors this rank assembles in a step, two by turns: the writer
        # thread writes one step's while the next step's are assembled.
        self.arenas = (Arena(), Arena())
        self.arena = self.arenas[0]
        self.send_arena = Arena()  # casts or copies of what it sends in a step
        self.recv_arena = Arena()  # slices it receives that are not contiguous in their tensor
        self.tensors = [
            HFTensor(k, stored_dtype(v.dtype, cast_to), tuple(int(s) for s in v.shape)) for k, v in items
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

    def _local(self, index: int) -> torch.Tensor:
        """This rank's slice of tensor ``index`` as held (any dtype, device, layout)."""
        value = self.values[index]
        return (value.to_local() if hasattr(value, "to_local") else value).detach()

    def _must_copy(self, index: int) -> bool:
        """Whether this rank's slice needs a copy to be sent or written (cast,
        non-contiguous, or not on the CPU)."""
        local = self._local(index)
        return local.dtype != self.tensors[index].dtype or local.device.type != "cpu" or not local.is_contiguous()

    def _whole_here(self, transfers: Sequence[Transfer], index: int) -> bool:
        """Whether the writer holds tensor ``index`` whole (it assembles nothing)."""
        return (len(transfers) == 1 and transfers[0].source == self.group.rank
                and transfers[0].box.sizes == self.tensors[index].shape)

    def run(self, sink: FileSink, files: Sequence[HFFile], owners: Sequence[int],
            transfers: Sequence[tuple[Transfer, ...]]) -> None:
        """(all ranks) Every writer assembles and writes its files' tensors, in lockstep.

        Each writer's tensors, in file order, are cut into batches of at most
        :func:`step_bytes` bytes; in step ``k`` every writer assembles its
        ``k``-th batch from the slices the others send it, then writes it.
        Batches of about equal bytes keep the writers in step (one writer's
        step is not a large matrix while another's is a bias) and cost one
        round of messages per batch, not per tensor. A rank whose writing
        failed keeps sending and receiving (its peers' steps need it) and
        the step's end tells every rank to stop.
        """
        group = self.group
        me, world = group.rank, group.world_size
        queues: list[list[tuple[int, int]]] = [[] for _ in range(world)]
        for f, owner in enumerate(owners):
            queues[owner] += [(f, i) for i in files[f].tensors]
            if owner == me and not files[f].tensors:
                sink.open(f)
                sink.close(f)
        budget = step_bytes(self.tensors)
        batches = [_batches(q, self.tensors, budget) for q in queues]
        with _Writer(sink) as writer:
            for step in range(max((len(b) for b in batches), default=0)):
                work = [(owner, b[step]) for owner, b in enumerate(batches) if step < len(b)]
                mine = batches[me][step] if step < len(batches[me]) else []
                self.arena = _next_arena(self.arenas, step, budget, writer)
                self._reserve(work, mine, transfers)
                works: list[Any] = []
                keep: list[torch.Tensor] = []  # send buffers, alive until their sends completed
                copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (received, destination view)
                assembled: list[torch.Tensor | Assembled] = []
                for owner, batch in work:
                    for f, i in batch:
                        if owner == me:
                            assembled.append(self._assemble(i, transfers[i], works, copies, sink, f))
                            continue
                        for transfer in transfers[i]:
                            if transfer.source == me:
                                keep.append(self._send_buffer(i, transfer.box, sink, f))
                                works.append(_isend(group, keep[-1], owner, i))
                for work_item in works:
                    work_item.wait()
                for received, view in copies:
                    view.copy_(received)
                del keep, copies, works
                writer.submit([(f, i, files[f]) for f, i in mine], assembled)
                del assembled
                # Failures seen so far (this step's writes may still be running:
                # the next step's check, or the outcome exchange, sees those).
                if _any_failed(group, sink.failure is not None):
                    return

    def _reserve(self, work: Sequence[tuple[int, Sequence[tuple[int, int]]]], mine: Sequence[tuple[int, int]],
                 transfers: Sequence[tuple[Transfer, ...]]) -> None:
        """Size this step's three arenas: what this rank assembles (or copies
        whole), what it casts or copies to send, and column blocks it receives."""
        me = self.group.rank
        assemble = send = receive = 0
        for _, i in mine:
            spec = self.tensors[i]
            if not self._whole_here(transfers[i], i):
                assemble += Arena.size_of(spec.dtype, spec.shape)
                receive += sum(Arena.size_of(spec.dtype, t.box.sizes) for t in transfers[i]
                               if t.source != me and not _contiguous_in(t.box, spec.shape))
            elif self._must_copy(i):
                assemble += Arena.size_of(spec.dtype, spec.shape)
        for owner, batch in work:
            if owner == me:
                continue
            for _, i in batch:
                if any(t.source == me for t in transfers[i]) and self._must_copy(i):
                    send += sum(Arena.size_of(self.tensors[i].dtype, t.box.sizes)
                                for t in transfers[i] if t.source == me)
        self.arena.reset(assemble)
        self.send_arena.reset(send)
        self.recv_arena.reset(receive)

    def _assemble(self, index: int, transfers: Sequence[Transfer], works: list[Any],
                  copies: list[tuple[torch.Tensor, torch.Tensor]], sink: FileSink,
                  file: int) -> torch.Tensor | Assembled:
        """(writer) Post the receives of tensor ``index``; return the tensor they
        fill (with this rank's row blocks beside it, written from its shard)."""
        spec = self.tensors[index]
        me = self.group.rank
        if self._whole_here(transfers, index):  # no copy unless cast
            local = self._own_slice(index, sink, file, spec.shape)
            return self.arena.take(spec.dtype, spec.shape).copy_(local) if self._must_copy(index) else local
        whole = self.arena.take(spec.dtype, spec.shape)
        own: list[tuple[int, torch.Tensor]] = []
        for transfer in transfers:
            view = _box_view(whole, transfer.box.offsets, transfer.box.sizes)
            if transfer.source == me:
                local = self._own_slice(index, sink, file, transfer.box.sizes)
                if _contiguous_in(transfer.box, spec.shape) and not self._must_copy(index):
                    # A row block as held: written from the shard, not copied.
                    start = sum(o * st for o, st in zip(transfer.box.offsets, whole.stride()))
                    own.append((start * whole.element_size(), local))
                else:
                    view.copy_(local)  # copy_ casts
            elif _contiguous_in(transfer.box, spec.shape):
                works.append(_irecv(self.group, view, transfer.source, index))
            else:  # a column block (Shard(1)): received whole, then copied into place
                received = self.recv_arena.take(spec.dtype, transfer.box.sizes)
                works.append(_irecv(self.group, received, transfer.source, index))
                copies.append((received, view))
        return Assembled(whole, tuple(sorted(own, key=lambda o: o[0]))) if own else whole

    def _own_slice(self, index: int, sink: FileSink, file: int, shape: tuple[int, ...]) -> torch.Tensor:
        """This rank's slice of tensor ``index`` (of ``shape``), as held. On
        error, zeros (the step goes on) and the error is this rank's failure."""
        try:
            local = self._local(index)
            if tuple(local.shape) != shape:
                raise ValueError(f"local slice has shape {list(local.shape)}, its DTensor says {list(shape)}")
            return local
        except Exception as err:  # noqa: BLE001 - shared with every rank
            sink.fail(file, index, err)
            return torch.zeros(shape, dtype=self.tensors[index].dtype)

    def _send_buffer(self, index: int, box: Box, sink: FileSink, file: int) -> torch.Tensor:
        """This rank's slice ``box`` of tensor ``index``, ready to send: the
        local tensor itself when it needs no cast or copy, else a copy in
        this step's send arena. On error, zeros of the same size go out (the
        writer's step must complete) and the error is this rank's failure."""
        dtype = self.tensors[index].dtype
        try:
            local = self._own_slice(index, sink, file, box.sizes)
            if not self._must_copy(index):
                return local
            return self.send_arena.take(dtype, box.sizes).copy_(local)
        except Exception as err:  # noqa: BLE001 - shared with every rank
            sink.fail(file, index, err)
            return torch.zeros(box.sizes, dtype=dtype)


#: Least bytes a step's batch may hold (more when a tensor is larger): lets
#: models of many small tensors move in few rounds for a little memory.
MIN_STEP_BYTES = 32 << 20


def step_bytes(tensors: Sequence[HFTensor]) -> int:
    """Most bytes of one writer's batch in a step: the largest tensor, at least :data:`MIN_STEP_BYTES`."""
    return max([MIN_STEP_BYTES] + [t.nbytes for t in tensors])


def _batches(queue: Sequence[tuple[int, int]], tensors: Sequence[HFTensor],
             budget: int) -> list[list[tuple[int, int]]]:
    """``queue`` cut, in order, into runs of at most ``budget`` bytes (each at least one tensor)."""
    out: list[list[tuple[int, int]]] = []
    size = budget + 1
    for entry in queue:
        nbytes = tensors[entry[1]].nbytes
        if size + nbytes > budget:
            out.append([])
            size = 0
        out[-1].append(entry)
        size += nbytes
    return out


def _contiguous_in(box: Box, shape: tuple[int, ...]) -> bool:
    """Whether slice ``box`` of a row-major tensor of ``shape`` is one contiguous run
    (leading dimensions of size 1, then any, then whole dimensions)."""
    k = 0
    while k < len(shape) and box.sizes[k] == 1:
        k += 1
    return all(box.sizes[d] == shape[d] for d in range(k + 1, len(shape)))


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
    """A contiguous tensor's memory as a flat ``uint8`` view (gloo sends bytes of any dtype)."""
    if not tensor.is_contiguous():  # reshape would copy: a receive would land in the copy
        raise RuntimeError(f"internal error: a {list(tensor.shape)} slice to exchange is not contiguous")
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


class StoredState:
    """The tensors of the partial checkpoint at ``source``, read with ranged reads by the rank that writes them."""

    def __init__(self, group: GroupView, source: Location, include_optimizer: bool,
                 cast_to: torch.dtype | None) -> None:
        self.reader = CheckpointReader(source)
        if group.distributed:
            self.reader.metadata_group = (group.group,)  # the coordinator reads it once for all
        metadata = self.reader.read_metadata()
        self.reader.set_up_storage_reader(metadata, True)
        # The tensor being read, two by turns: one is read while the other is written.
        self.arenas = (Arena(), Arena())
        self.arena = self.arenas[0]
        self.block_arena = Arena()  # column blocks, one at a time
        stored = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        self.chosen = exported_keys(list(stored), include_optimizer)
        self.metadata = [stored[k] for _, k in self.chosen]
        self.tensors = [
            HFTensor(name, stored_dtype(md.properties.dtype, cast_to), tuple(int(s) for s in md.size))
            for (name, _), md in zip(self.chosen, self.metadata)
        ]
        self.stream = FrameStream(self.reader)

    def read(self, indices: Sequence[int]) -> list[torch.Tensor]:
        """Tensors ``indices`` in full, in their exported dtypes (views of the
        current arena unless cast: valid until it is reset)."""
        keys = [self.chosen[i][1] for i in indices]
        mds = [self.metadata[i] for i in indices]
        shapes = [tuple(int(s) for s in md.size) for md in mds]
        self.arena.reset(sum(Arena.size_of(md.properties.dtype, shape) for md, shape in zip(mds, shapes)))
        dests: dict[str, torch.Tensor] = {}
        direct: list[ReadItem] = []
        blocks: list[tuple[torch.Tensor, ReadItem]] = []
        for key, md, shape in zip(keys, mds, shapes):
            dest = dests[key] = self.arena.take(md.properties.dtype, shape)
            # Chunks whose place in the tensor is contiguous (row blocks) land
            # there directly, every tensor's in one parallel read; a column
            # block would be staged by the reader, all blocks at once, so each
            # is read into a reused block buffer in turn and copied into place.
            for item in whole_tensor_items(key, md):
                if _box_view(dest, item.dest_offsets, item.lengths).is_contiguous():
                    direct.append(item)
                else:
                    blocks.append((dest, item))
        if direct:
            self.reader.read_data(LoadPlan(direct), cast(LoadPlanner, IntoTensor(dests)))
        for dest, item in blocks:
            lengths = tuple(int(n) for n in item.lengths)
            self.block_arena.reset(Arena.size_of(dest.dtype, lengths))
            block = self.block_arena.take(dest.dtype, lengths)
            at_zero = dataclasses.replace(item, dest_offsets=torch.Size((0,) * len(item.lengths)))
            self.reader.read_data(LoadPlan([at_zero]), cast(LoadPlanner, IntoTensor(block)))
            _box_view(dest, item.dest_offsets, item.lengths).copy_(block)
        return [dests[key].to(self.tensors[i].dtype) for key, i in zip(keys, indices)]

    def run(self, sink: FileSink, files: Sequence[HFFile], owners: Sequence[int], rank: int,
            progress: Callable[[int, int], None] | None = None) -> None:
        """(each rank on its own) Read and write the files this rank writes, in order.

        A tensor whose stored chunks :class:`~dcp_ext.dcp_io.FrameStream`
        can stream (uncompressed, on local files, row blocks, not cast) goes
        from the source file to its output a frame at a time, on this thread.
        The others go a batch of consecutive tensors (:func:`step_bytes` of
        stored bytes at most, in one parallel read) at a time, each batch read
        while the one before it is written by the writer thread.
        """
        mine = [(f, i) for f, owner in enumerate(owners) if owner == rank for i in files[f].tensors]
        for f, owner in enumerate(owners):
            if owner == rank and not files[f].tensors:
                sink.open(f)
                sink.close(f)
        total = sum(files[f].nbytes for f, owner in enumerate(owners) if owner == rank)
        stored = [HFTensor(t.name, md.properties.dtype, t.shape) for t, md in zip(self.tensors, self.metadata)]
        done = 0
        budget = step_bytes(stored)
        steps: list[tuple[list[tuple[ReadItem, StoredItem]] | None, list[tuple[int, int]]]] = []
        batched: list[tuple[int, int]] = []
        for f, i in mine:
            chunks = self._stream_plan(i)
            if chunks is None:
                batched.append((f, i))
                continue
            steps.extend((None, batch) for batch in _batches(batched, stored, budget))
            batched = []
            steps.append((chunks, [(f, i)]))
        steps.extend((None, batch) for batch in _batches(batched, stored, budget))
        with _Writer(sink) as writer, self.stream:
            n = 0
            for chunks, batch in steps:
                if sink.failure is not None:
                    break
                if progress is not None:
                    progress(done, total)
                if chunks is not None:
                    writer.wait()  # tensors before it are written first
                    (f, i), = batch
                    self._stream_one(sink, f, i, files[f], chunks)
                    done += self.tensors[i].nbytes
                    continue
                self.arena = _next_arena(self.arenas, n, budget, writer)
                n += 1
                try:
                    tensors = self.read([i for _, i in batch])
                except Exception as err:  # noqa: BLE001 - shared with every rank
                    sink.fail(*self._culprit(batch, err))
                    break
                writer.submit([(f, i, files[f]) for f, i in batch], tensors)
                done += sum(self.tensors[i].nbytes for _, i in batch)
                del tensors
        if progress is not None and sink.failure is None:
            progress(total, total)

    def _stream_plan(self, index: int) -> list[tuple[ReadItem, StoredItem]] | None:
        """The stored chunks of tensor ``index`` in the order of its bytes, if
        every one can be streamed straight into the output: exported in its
        stored dtype, each a run of whole rows (contiguous in the full tensor),
        together covering it exactly; else ``None``."""
        md = self.metadata[index]
        if self.tensors[index].dtype != md.properties.dtype:
            return None
        shape = tuple(int(n) for n in md.size)
        strides = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        itemsize = md.properties.dtype.itemsize
        placed: list[tuple[int, int, ReadItem, StoredItem]] = []
        for item in whole_tensor_items(self.chosen[index][1], md):
            box = Box(tuple(int(o) for o in item.dest_offsets), tuple(int(n) for n in item.lengths))
            if not _contiguous_in(box, shape):
                return None
            try:
                info = self.stream.streamable(item)
            except Exception:  # noqa: BLE001 - the batch path reads it again and shares the error
                return None
            if info is None:
                return None
            start = sum(o * st for o, st in zip(box.offsets, strides)) * itemsize
            placed.append((start, box.numel * itemsize, item, info))
        placed.sort(key=lambda entry: entry[0])
        at = 0
        for start, nbytes, _, _ in placed:
            if start != at:
                return None  # a gap or an overlap: let the batch path assemble it
            at += nbytes
        if at != self.tensors[index].nbytes:
            return None
        return [(item, info) for _, _, item, info in placed]

    def _stream_one(self, sink: FileSink, f: int, i: int, spec: HFFile,
                    chunks: Sequence[tuple[ReadItem, StoredItem]]) -> None:
        """Write tensor ``i`` of file ``f`` from its stored chunks, a frame at a time."""
        if i == spec.tensors[0]:
            sink.open(f)
        sink.put_stream(f, i, (view for item, info in chunks for view in self.stream.read(item, info)))
        if i == spec.tensors[-1]:
            sink.close(f)

    def _culprit(self, batch: Sequence[tuple[int, int]], err: Exception) -> tuple[int, int, Exception]:
        """The file, tensor and error of the first tensor of ``batch`` that
        fails to read alone (the batch's first, with ``err``, if none does)."""
        for f, i in batch:
            try:
                self.read([i])
            except Exception as alone:  # noqa: BLE001 - the error to share
                return f, i, alone
        return batch[0][0], batch[0][1], err


#: Largest batch that gets a second buffer, so that it is prepared while the
#: one before it is written: beyond it (a model with a tensor larger than
#: this) a rank holds one batch, and writes before it prepares the next. At
#: most two batches of this size stay within the issue-18 memory budget of
#: the largest tensor + 256 MiB above the state.
OVERLAP_BYTES = 128 << 20


def _next_arena(arenas: tuple[Arena, Arena], n: int, budget: int, writer: _Writer) -> Arena:
    """The arena batch ``n`` goes into: by turns when batches are small
    (the other one may still be written from; this one was, two batches
    ago, and :meth:`_Writer.submit` waited for that), else the first one,
    once the batch before is written."""
    if budget <= OVERLAP_BYTES:
        return arenas[n % 2]
    writer.wait()
    return arenas[0]


class _Writer:
    """One thread that writes a rank's tensors in order, while the caller
    prepares the next ones. At most one batch is queued: :meth:`submit`
    first waits for the batch before, so the caller may reuse the memory of
    the batch before that (two buffers, used by turns)."""

    def __init__(self, sink: FileSink) -> None:
        self.sink = sink
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="dcp_ext-hf-writer")
        self.pending: Future[None] | None = None

    def submit(self, batch: Sequence[tuple[int, int, HFFile]], tensors: Sequence[torch.Tensor | Assembled]) -> None:
        """Write ``tensors`` (tensor ``i`` of file ``f``, for each ``(f, i, file)``),
        opening a file at its first tensor and committing it after its last."""
        self.wait()
        if batch:
            self.pending = self.pool.submit(self._write, list(batch), list(tensors))

    def _write(self, batch: list[tuple[int, int, HFFile]], tensors: list[torch.Tensor | Assembled]) -> None:
        for (f, i, spec), tensor in zip(batch, tensors):
            if i == spec.tensors[0]:
                self.sink.open(f)
            self.sink.put(f, i, tensor)
            if i == spec.tensors[-1]:
                self.sink.close(f)

    def wait(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def __enter__(self) -> _Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.wait()
        finally:
            self.pool.shutdown(wait=True)
