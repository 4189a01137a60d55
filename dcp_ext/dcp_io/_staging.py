"""Staging: the copy of a state dict that an asynchronous save uploads.

An asynchronous save stops training only for as long as it takes to make a
copy of the state that later training steps cannot change. :class:`Stager`
makes that copy into buffers allocated on the first save and reused by every
later one (no fresh allocation and no page faults after the first), spreads
the copy over threads, and, with ``background=True``, returns before the copy
is done: the caller gets a future and must wait on it before changing the
state (before ``optimizer.step()``), exactly as DCP's
``AsyncSaveResponse.staging_completion``.

Use it with stock DCP::

    stager = dcp_ext.Stager()
    response = dcp.async_save(state, storage_writer=CheckpointWriter(path), async_stager=stager)
    response.staging_completion.result()   # before the next optimizer.step()
    ...
    response.upload_completion.result()    # before the next save with this stager
    stager.close()

:class:`~dcp_ext.CheckpointManager` does all of this itself (``async_save=True``).

Reused buffers mean that a staged copy is only valid until the next ``stage()``:
the stager waits for every future passed to :meth:`Stager.release_after` (the
manager passes each save's upload) before it overwrites them. With stock
``dcp.async_save``, wait for the previous upload before the next save, or pass
it to ``release_after``.

Yielding to training (issue 44): a background save's threads run at a lower
priority than training's. On Linux each thread has its own nice value: the
stager's threads are created with it, and DCP's upload thread takes it when
it first waits for the staged state (it is the first thread other than the
caller to wait on the staging future), so the threads it starts for the
upload (writers, encoders, S3 parts) inherit it. The nice value comes from
:attr:`~dcp_ext.config.IOConfig.background_cpu_share` (:func:`background_nice`):
the share of a core those threads get while training keeps it busy; idle CPU
they use in full. Host copies are single ``memcpy`` calls per piece
(``numpy.copyto``, which releases the GIL), not ATen's ``copy_``: from a
background thread that would start an OpenMP team per copy thread, whose
spinning cost as much CPU as the copy itself (measured: 0.16 s of 0.36 s).

Devices: CPU tensors are copied into plain (or, with ``share_memory``,
shared-memory) buffers. Accelerator (CUDA) tensors are copied into pinned
buffers, reused like the others, by ``non_blocking`` device-to-host copies on a
side stream per device that first waits for the caller's stream as of the
``stage()`` call; the staging future resolves only after an event recorded
behind the last copy (:class:`~dcp_ext.dcp_io._device_copies.DeviceToHost`).
The device-agnostic code runs on CPU in the test suite (torch's stream stubs);
these machines have no GPU, so ``python -m bench.gpu`` measures it where one is.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import functools
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.staging import AsyncStager

from ..config import IOConfig
from ._device_copies import DeviceToHost, on_accelerator

__all__ = ["Stager", "StagingStats", "copy_state", "background_nice", "lower_thread_priority"]

log = logging.getLogger("dcp_ext.staging")

# Contiguous copies are cut into pieces of this many bytes so that threads
# share big tensors; small enough to balance, large enough that the per-task
# overhead (~20 us) stays under 1% of the copy.
_PIECE_BYTES = 16 << 20


@dataclass(frozen=True)
class StagingStats:
    """What the last ``stage()`` did (rank-local).

    Attributes:
        tensors: Tensors copied.
        bytes: Bytes copied.
        allocated_bytes: Bytes of buffers allocated by this call (0 when every buffer was reused).
        seconds: Time of the copy itself (after any wait for a previous upload).
        waited_seconds: Time spent waiting for a previous upload to release the buffers.
    """

    tensors: int
    bytes: int
    allocated_bytes: int
    seconds: float
    waited_seconds: float


@dataclass
class _Copy:
    """One tensor to stage: where it comes from and the buffer it goes to."""

    source: torch.Tensor
    buffer: torch.Tensor


def _default_threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


# CFS's weight of nice 0..19 (kernel/sched/core.c, sched_prio_to_weight).
_NICE_WEIGHTS = (1024, 820, 655, 526, 423, 335, 272, 215, 172, 137, 110, 87, 70, 56, 45, 36, 29, 23, 18, 15)


def background_nice(share: float) -> int:
    """The nice increment that gives a thread ``share`` of a core against one
    busy thread at the caller's priority (CFS shares a core by weight: ``w / (w + 1024)``).

    ``1.0``: no change; ``0.25``: +5; ``0.1``: +10; ``0.015`` or less: +19.
    """
    if share >= 1.0:
        return 0
    want = 1024 * share / (1 - share)
    return min(range(len(_NICE_WEIGHTS)), key=lambda n: abs(math.log(_NICE_WEIGHTS[n] / want)))


def _thread_nice() -> int | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except OSError:  # pragma: no cover - a sandbox without getpriority
        return None


def lower_thread_priority(increment: int, base: int | None = None) -> bool:
    """Make the calling thread's nice value ``base + increment`` (at most 19)
    unless it is already that low; ``base``: its own current value.

    Linux only, where every thread has its own nice value (``setpriority`` on
    its thread id) and threads it starts inherit it. Raising a nice value
    needs no privilege; lowering it again would, so this never does.

    Returns:
        Whether the thread now runs at that priority (``False``: not Linux,
        ``increment`` 0, or the system refused).
    """
    if increment <= 0 or not sys.platform.startswith("linux"):
        return False
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        target = min(19, (current if base is None else base) + increment)
        if target > current:
            os.setpriority(os.PRIO_PROCESS, tid, target)
    except OSError as err:  # pragma: no cover - a sandbox without setpriority
        log.debug("could not lower the priority of thread %d: %s", tid, err)
        return False
    return True


class _StagedFuture(concurrent.futures.Future[dict[str, Any]]):
    """The future of a background ``stage()``.

    The first thread other than the caller to wait for the staged state is
    the one that uploads it (DCP's upload thread, in ``save_wrapper``): it
    takes the background priority here, before it starts the upload.
    (The future DCP hands the caller as ``staging_completion`` is another one.)
    """

    def __init__(self, caller: int, increment: int, base: int | None) -> None:
        super().__init__()
        self._caller, self._increment, self._base = caller, increment, base

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        if self._increment and threading.get_ident() != self._caller:
            lower_thread_priority(self._increment, self._base)
        return super().result(timeout)


class _Buffers:
    """Staging buffers by their place in the state dict, reused while shape and dtype match."""

    def __init__(self, pin_memory: bool, share_memory: bool) -> None:
        self.pin_memory = pin_memory
        self.share_memory = share_memory
        self._by_path: dict[tuple[Any, ...], torch.Tensor] = {}
        self.allocated = 0  # bytes allocated by the current stage()

    def get(self, path: tuple[Any, ...], like: torch.Tensor) -> torch.Tensor:
        buffer = self._by_path.get(path)
        if buffer is not None and buffer.shape == like.shape and buffer.dtype == like.dtype:
            return buffer
        buffer = torch.empty(like.shape, dtype=like.dtype, device="cpu",
                             pin_memory=self.pin_memory and on_accelerator(like))
        if self.share_memory:
            buffer.share_memory_()  # type: ignore[no-untyped-call]
        self._by_path[path] = buffer
        self.allocated += buffer.numel() * buffer.element_size()
        return buffer

    def keep_only(self, paths: set[tuple[Any, ...]]) -> None:
        for path in [p for p in self._by_path if p not in paths]:
            del self._by_path[path]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._by_path.values())

    def clear(self) -> None:
        self._by_path.clear()


@functools.cache
def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def _mirror(
    value: Any, path: tuple[Any, ...], buffers: _Buffers | None, copies: list[_Copy], seen: set[tuple[Any, ...]]
) -> Any:
    """The staged counterpart of ``value``: the same containers, every tensor
    replaced by its buffer (``buffers=None``: a fresh one), every other leaf
    deep-copied. Records the copies to make in ``copies``."""
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(value, dtensor):
        local = _mirror(value._local_tensor, path, buffers, copies, seen)  # type: ignore[attr-defined]
        return dtensor(local, value._spec, requires_grad=False)  # type: ignore[attr-defined]
    if isinstance(value, torch.Tensor):
        if type(value) not in (torch.Tensor, torch.nn.Parameter):
            # ShardedTensor, quantized or other subclasses: a private copy each time.
            return copy.deepcopy(value.detach()).cpu()
        source = value.detach()
        seen.add(path)
        if buffers is None:
            buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu")
        else:
            buffer = buffers.get(path, source)
        copies.append(_Copy(source, buffer))
        return buffer
    if isinstance(value, dict):
        out = type(value)() if type(value) is not dict else {}
        for key, item in value.items():
            out[key] = _mirror(item, (*path, key), buffers, copies, seen)
        return out
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        items = [_mirror(item, (*path, i), buffers, copies, seen) for i, item in enumerate(value)]
        return items if isinstance(value, list) else type(value)(items)
    return copy.deepcopy(value)


def _pieces(copies: list[_Copy]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) pairs of at most ~``_PIECE_BYTES`` each."""
    for item in copies:
        src, dst = item.source, item.buffer
        nbytes = src.numel() * src.element_size()
        if nbytes <= _PIECE_BYTES or not src.is_contiguous() or src.dim() == 0:
            yield dst, src
            continue
        flat_src, flat_dst = src.reshape(-1), dst.view(-1)
        step = max(1, _PIECE_BYTES // src.element_size())
        for start in range(0, flat_src.numel(), step):
            yield flat_dst[start:start + step], flat_src[start:start + step]


def _flat_bytes(tensor: torch.Tensor) -> np.ndarray[Any, Any]:
    return tensor.reshape(-1).view(torch.uint8).numpy()


def _memcpy_able(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return (src.device.type == "cpu" and dst.dtype == src.dtype and src.numel() > 0
            and src.is_contiguous() and dst.is_contiguous() and not src.is_conj() and not src.is_neg()
            and dst.dtype != torch.bool)


def host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for CPU tensors, as one ``memcpy`` when both are
    contiguous (``numpy.copyto`` releases the GIL and starts no OpenMP team)."""
    if _memcpy_able(dst, src):
        np.copyto(_flat_bytes(dst), _flat_bytes(src))
    else:
        with torch.no_grad():
            dst.copy_(src)


def _current_devices() -> set[torch.device]:
    """The calling thread's current accelerator device, if there is one (the
    device whose stream a stage's copies must come after)."""
    if not torch.accelerator.is_available():
        return set()
    accelerator = torch.accelerator.current_accelerator()  # pragma: no cover - no accelerator here
    if accelerator is None:  # pragma: no cover
        return set()
    return {torch.device(accelerator.type, torch.accelerator.current_device_index())}  # pragma: no cover


def _copy_pieces(pieces: list[tuple[torch.Tensor, torch.Tensor]], pool: concurrent.futures.Executor | None,
                 device: DeviceToHost | None = None) -> None:
    """Copy every ``(dst, src)``: accelerator sources queued on ``device``'s
    side streams by this thread (then waited for), host ones on ``pool``."""
    host = [(dst, src) for dst, src in pieces if not on_accelerator(src)]
    on_device = [(dst, src) for dst, src in pieces if on_accelerator(src)]
    if on_device:
        copier = device or DeviceToHost()
        with torch.no_grad():
            for dst, src in on_device:
                copier.copy(dst, src)
    if pool is None or len(host) < 2:
        for dst, src in host:
            host_copy(dst, src)
    else:
        list(pool.map(lambda piece: host_copy(*piece), host))
    if on_device:
        copier.wait()  # the event behind the last copy: the buffers hold the state


def copy_state(state_dict: dict[str, Any], threads: int | None = None) -> dict[str, Any]:
    """(any rank) A private CPU copy of ``state_dict`` in fresh buffers, copied by ``threads`` threads.

    What :class:`~dcp_ext.CheckpointWriter` stages when ``dcp.async_save`` is
    given no stager.
    """
    copies: list[_Copy] = []
    staged: dict[str, Any] = _mirror(state_dict, (), None, copies, set())
    threads = threads or _default_threads()
    if threads > 1:
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="dcp_ext-stage") as pool:
            _copy_pieces(list(_pieces(copies)), pool)
    else:
        _copy_pieces(list(_pieces(copies)), None)
    return staged


class Stager(AsyncStager):
    """An ``AsyncStager`` with reused buffers, parallel copies and optional background staging.

    Args:
        background: ``True`` (default): ``stage()`` returns a future at once
            and copies in a background thread; wait on it (DCP's
            ``staging_completion``) before changing the state. ``False``:
            ``stage()`` returns the staged state when the copy is done.
        threads: Host copy threads (default: 1 with ``background``, whose
            copy overlaps the forward and backward pass and needs no more
            than one ``memcpy`` stream; else up to 4, at most the CPU count).
        pin_memory: Pin buffers of accelerator tensors (default: when an
            accelerator is available).
        share_memory: Put buffers in shared memory, so that a process-based
            upload (``AsyncCheckpointerType.PROCESS``) receives them without a
            copy. Default off.
        cpu_share: With ``background``: the share of a core the stager's
            threads and the upload thread get while training keeps it busy
            (:func:`background_nice`; ``1.0``: training's own priority).
            Default: :attr:`IOConfig.background_cpu_share
            <dcp_ext.config.IOConfig.background_cpu_share>` (from the
            environment, ``DCP_EXT_BACKGROUND_CPU_SHARE``).

    Memory: one buffer per tensor of the state, i.e. one copy of the state
    per rank, kept until :meth:`close` (``buffer_bytes`` reports it). A state
    whose tensor shapes change reallocates only what changed.

    Which ranks: every rank stages its own state; nothing here is collective.
    """

    def __init__(
        self,
        *,
        background: bool = True,
        threads: int | None = None,
        pin_memory: bool | None = None,
        share_memory: bool = False,
        cpu_share: float | None = None,
    ) -> None:
        self.background = background
        self.threads = threads or (1 if background else _default_threads())
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.cpu_share = IOConfig.from_env().background_cpu_share if cpu_share is None else cpu_share
        if not 0 < self.cpu_share <= 1:
            raise ValueError(f"cpu_share must be in (0, 1], got {self.cpu_share!r}")
        #: Nice increment of the background threads (0: training's priority).
        self.nice = background_nice(self.cpu_share) if background else 0
        # Relative to the thread that creates the stager (training's).
        self._base_nice = _thread_nice()
        pin = torch.accelerator.is_available() if pin_memory is None else pin_memory
        self._buffers = _Buffers(pin_memory=pin, share_memory=share_memory)
        lower = (lower_thread_priority, (self.nice, self._base_nice))
        self._copy_pool = (
            concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="dcp_ext-stage",
                                                  initializer=lower[0], initargs=lower[1])
            if self.threads > 1 else None
        )
        # One stage at a time, in order: the single worker is also what makes
        # a second stage() wait for the first one's copy.
        self._stage_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dcp_ext-stager",
                                                                   initializer=lower[0], initargs=lower[1])
        self._device = DeviceToHost()
        self._holds: list[concurrent.futures.Future[Any]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._gate: threading.Event | None = None
        self.last_stats: StagingStats | None = None
        """What the last completed stage copied and how long it took (``None`` before the first)."""

    # AsyncStager: DCP must not call synchronize_staging() right after starting
    # the upload; the caller waits on the staging future instead.
    _synchronize_after_execute = False

    @property
    def buffer_bytes(self) -> int:
        """Bytes held in staging buffers (one copy of the last staged state)."""
        return self._buffers.nbytes

    def release_after(self, future: concurrent.futures.Future[Any]) -> None:
        """Do not overwrite the buffers before ``future`` is done (the upload of what they hold)."""
        with self._lock:
            self._holds = [f for f in self._holds if not f.done()]
            self._holds.append(future)

    def stage(self, state_dict: dict[str, Any]) -> concurrent.futures.Future[dict[str, Any]] | dict[str, Any]:
        """(every rank) Stage ``state_dict``.

        With ``background``, everything (the wait for uploads still reading
        the buffers, the walk over the state, the copies) runs on the
        stager's thread and this returns at once; the caller must leave the
        state, and the dict it passed, unchanged until the future resolves.

        Returns:
            With ``background``: a future of the staged state dict; else the staged state dict.
        """
        if self._closed:
            raise RuntimeError("this Stager is closed")
        # Taken here, not on the stager's thread: a hold added after this
        # call (this save's own upload) is for the next stage() to wait on.
        with self._lock:
            holds, self._holds = self._holds, []
        fences = DeviceToHost.fence(_current_devices())
        if not self.background:
            return self._stage_now(state_dict, holds, fences=fences)
        future = _StagedFuture(threading.get_ident(), self.nice, self._base_nice)
        gate = self._gate

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(self._stage_now(state_dict, holds, gate, fences))
            except BaseException as err:  # the caller's future reports it
                future.set_exception(err)

        self._stage_thread.submit(run)
        return future

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Background staging started inside this block waits for its end.

        The walk over the state is Python work: started at once, it takes
        the GIL from the caller for up to a switch interval (5 ms) while the
        caller is still inside ``dcp.async_save``. The manager wraps its
        ``dcp.async_save`` call in this, so the copy starts when the call returns.
        """
        gate = self._gate = threading.Event()
        try:
            yield
        finally:
            self._gate = None
            gate.set()

    def _stage_now(self, state_dict: dict[str, Any], holds: list[concurrent.futures.Future[Any]],
                   gate: threading.Event | None = None, fences: dict[torch.device, Any] | None = None,
                   ) -> dict[str, Any]:
        if gate is not None:
            gate.wait()
        started = time.perf_counter()
        # Waiting before the walk keeps a new save from touching buffers
        # that the previous upload still reads.
        concurrent.futures.wait(holds)
        waited = time.perf_counter() - started
        copies: list[_Copy] = []
        seen: set[tuple[Any, ...]] = set()
        self._buffers.allocated = 0
        staged: dict[str, Any] = _mirror(state_dict, (), self._buffers, copies, seen)
        self._buffers.keep_only(seen)
        self._copy(copies, self._buffers.allocated, waited, fences or {})
        return staged

    def _copy(self, copies: list[_Copy], allocated: int, waited: float, fences: dict[torch.device, Any]) -> None:
        started = time.perf_counter()
        self._device.begin(fences)
        _copy_pieces(list(_pieces(copies)), self._copy_pool, self._device)
        nbytes = sum(c.source.numel() * c.source.element_size() for c in copies)
        self.last_stats = StagingStats(len(copies), nbytes, allocated, time.perf_counter() - started, waited)
        log.debug("staged %d tensors, %d bytes in %.3f s", len(copies), nbytes, self.last_stats.seconds)

    def synchronize_staging(self) -> None:
        """Wait for the staging in flight (prefer the future ``stage()`` returned)."""
        self._stage_thread.submit(lambda: None).result()

    def close(self) -> None:
        """(every rank) Wait for staging in flight and uploads holding the buffers, then free them."""
        if self._closed:
            return
        self._closed = True
        self._stage_thread.shutdown(wait=True)
        with self._lock:
            holds, self._holds = self._holds, []
        concurrent.futures.wait(holds)
        if self._copy_pool is not None:
            self._copy_pool.shutdown(wait=True)
        self._buffers.clear()

    def __enter__(self) -> Stager:
        """The stager itself, for ``with Stager() as stager:``."""
        return self

    def __exit__(self, *exc: object) -> None:
        """(every rank) :meth:`close`: wait for staging and uploads in flight, then free the
        buffers."""
        self.close()
