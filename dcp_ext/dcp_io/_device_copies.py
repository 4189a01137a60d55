"""Copies between an accelerator and host memory, for staging (saves) and loads.

Written against torch's device-agnostic pieces (``torch.get_device_module(device)``:
``Stream``, ``Event``, ``stream``, ``current_stream``), so the same lines serve
CUDA, XPU or any backend with streams; on CPU those are torch's no-op stubs,
which is how the test suite runs these paths on machines without a GPU.

* :class:`DeviceToHost` (saves): a stage's device-to-host copies go on one side
  stream per device, ``non_blocking`` into pinned host buffers that the
  :class:`~dcp_ext.Stager` reuses from save to save. The side stream first
  waits for an event recorded on the caller's current stream when the save was
  called (the state as of that moment, whatever thread copies it), and
  :meth:`DeviceToHost.wait` blocks on an event recorded after the last copy:
  the staging future resolves, and the upload reads the buffers, only after it.
* :class:`HostToDevice` (loads): bytes read into pinned host buffers taken from
  a bounded pool, then copied to their device tensors ``non_blocking`` on a side
  stream while the next reads proceed; a buffer goes back to the pool when the
  event recorded after its copy has completed, and :meth:`HostToDevice.finish`
  makes the caller's stream wait for the side stream, so later kernels see the
  loaded values.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import torch

__all__ = ["DeviceToHost", "HostToDevice", "device_module", "on_accelerator"]


def on_accelerator(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives on an accelerator (anything but CPU and meta)."""
    return tensor.device.type not in ("cpu", "meta")


def device_module(device: torch.device) -> Any:
    """torch's module for ``device``'s type (``torch.cuda``, ``torch.cpu``...)."""
    return torch.get_device_module(device)


def _stream(device: torch.device) -> Any:
    module = device_module(device)
    try:
        return module.Stream(device=device)
    except TypeError:  # torch.cpu.Stream takes no device
        return module.Stream()


def _current_stream(device: torch.device) -> Any:
    return device_module(device).current_stream(device)


class DeviceToHost:
    """One stage's device-to-host copies, on a side stream per device.

    Use: :meth:`fence` in the thread that asked for the save (before it
    returns to training), then in the copying thread :meth:`begin` with those
    fences, :meth:`copy` for every tensor, and :meth:`wait` before anyone
    reads the host buffers. Streams are kept from stage to stage.
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}
        self._fences: dict[torch.device, Any] = {}
        self._used: set[torch.device] = set()

    def _side(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = _stream(device)
        return stream

    @staticmethod
    def fence(devices: set[torch.device]) -> dict[torch.device, Any]:
        """(caller's thread) An event on each device's current stream: the
        copies of the stage begun with them start after everything queued so far."""
        fences = {}
        for device in devices:
            event = device_module(device).Event()
            event.record(_current_stream(device))
            fences[device] = event
        return fences

    def begin(self, fences: dict[torch.device, Any]) -> None:
        """Start a stage's copies, after ``fences`` (from :meth:`fence`)."""
        self._fences = dict(fences)
        self._used = set()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue ``dst.copy_(src)`` (``src`` on a device) on the device's side stream."""
        device = src.device
        module = device_module(device)
        side = self._side(device)
        if device not in self._used:
            fence = self._fences.get(device)
            if fence is not None:
                side.wait_event(fence)
            else:  # a device the caller's fence did not cover: after this thread's current stream
                side.wait_stream(_current_stream(device))
            self._used.add(device)
        with module.stream(side):
            dst.copy_(src, non_blocking=True)

    def wait(self) -> None:
        """Block until every queued copy is done (an event after the last one per device)."""
        for device in sorted(self._used, key=str):
            module = device_module(device)
            done = module.Event()
            done.record(self._side(device))
            done.synchronize()
        self._used = set()
        self._fences = {}


class HostToDevice:
    """Pipelined host-to-device copies of loaded bytes through reused pinned buffers.

    Use: ``box = feed.host_buffer(shape, dtype, device)``; read the bytes into
    ``box``; ``feed.to_device(target, box)``; after the last one,
    :meth:`finish`. At most ``max_bytes`` of host buffers exist at a time
    (a request for more waits for the oldest copy to complete); buffers are
    pinned when ``pin`` (default: an accelerator is available).

    Args:
        max_bytes: Cap on host buffer bytes (a single larger request still
            gets its buffer, once everything before it is done).
        pin: Pin host buffers (page-locked: DMA straight from them).
    """

    def __init__(self, max_bytes: int = 256 << 20, pin: bool | None = None) -> None:
        self.max_bytes = max_bytes
        self.pin = torch.accelerator.is_available() if pin is None else pin
        self._free: dict[int, list[torch.Tensor]] = collections.defaultdict(list)
        self._in_flight: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()
        self._streams: dict[torch.device, Any] = {}
        self._held = 0
        self._lock = threading.Lock()
        #: Host bytes copied to devices so far.
        self.copied_bytes = 0

    @staticmethod
    def _size_class(nbytes: int) -> int:
        # Powers of two from 64 KiB: a freed buffer serves the next tensor of a similar size.
        return max(1 << 16, 1 << (max(nbytes, 1) - 1).bit_length())

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor of ``shape`` and ``dtype`` to read into (pinned, reused)."""
        nbytes = dtype.itemsize
        for n in shape:
            nbytes *= n
        size = self._size_class(nbytes)
        with self._lock:
            self._reclaim(block=False)
            while self._held + size > self.max_bytes and self._in_flight and not self._free[size]:
                self._reclaim(block=True)
            pool = self._free[size]
            if pool:
                raw = pool.pop()
            else:
                raw = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
                self._held += size
        return raw[:nbytes].view(dtype).view(shape)

    def to_device(self, target: torch.Tensor, box: torch.Tensor) -> None:
        """Copy ``box`` (from :meth:`host_buffer`) into ``target`` without waiting for it."""
        device = target.device
        module = device_module(device)
        with self._lock:
            side = self._streams.get(device)
            if side is None:
                side = self._streams[device] = _stream(device)
                # After whatever the caller queued (the destinations' allocation, zeroing).
                side.wait_stream(_current_stream(device))
        with module.stream(side):
            target.copy_(box, non_blocking=True)
            done = module.Event()
            done.record(side)
        raw = box.untyped_storage()
        with self._lock:
            self._in_flight.append((done, torch.empty(0, dtype=torch.uint8).set_(raw)))
            self.copied_bytes += box.numel() * box.element_size()

    def _reclaim(self, block: bool) -> None:
        """Return buffers whose copies are done to the pool (the oldest one
        waited for when ``block``). The lock is held."""
        while self._in_flight:
            done, raw = self._in_flight[0]
            if not done.query():
                if not block:
                    return
                done.synchronize()
                block = False
            self._in_flight.popleft()
            self._free[raw.numel()].append(raw)

    def finish(self) -> None:
        """Make each device's current stream wait for the copies (later work
        sees the loaded values) and recycle the buffers."""
        for device, side in list(self._streams.items()):
            _current_stream(device).wait_stream(side)
        with self._lock:
            while self._in_flight:
                self._reclaim(block=True)

    def close(self) -> None:
        """Wait for the copies and free the host buffers."""
        self.finish()
        with self._lock:
            self._free.clear()
            self._held = 0
