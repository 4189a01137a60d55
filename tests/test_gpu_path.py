"""The GPU path's device-agnostic pieces, run on CPU (issue 44), and background priority.

No GPU here: the accelerator code is written against torch's device-agnostic
stream and event API, whose ``torch.cpu`` stubs run the same lines. Tensors
are routed through the accelerator branch by treating CPU tensors as device
ones (``on_accelerator`` patched), which checks the ordering logic (fences,
side streams, events, buffer reuse), not DMA.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import threading

import pytest
import torch

from dcp_ext import Stager
from dcp_ext.config import IOConfig
from dcp_ext.dcp_io import _device_copies, _staging
from dcp_ext.dcp_io._device_copies import DeviceToHost, HostToDevice
from dcp_ext.dcp_io._staging import background_nice, host_copy, lower_thread_priority

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")


def _nice_of(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def test_cpu_share_maps_to_nice_values_by_cfs_weight() -> None:
    assert background_nice(1.0) == 0
    assert background_nice(0.5) == 0
    assert background_nice(0.25) == 5  # weight 335: 335 / (335 + 1024) = 0.25
    assert background_nice(0.1) == 10  # weight 110: 0.097
    assert background_nice(0.05) == 13
    assert background_nice(0.01) == 19
    assert IOConfig().background_cpu_share == 0.25
    with pytest.raises(ValueError, match="background_cpu_share"):
        IOConfig(background_cpu_share=0.0)
    with pytest.raises(ValueError, match="background_cpu_share"):
        IOConfig(background_cpu_share=float("nan"))


def test_the_environment_sets_the_share(monkeypatch) -> None:
    monkeypatch.setenv("DCP_EXT_BACKGROUND_CPU_SHARE", "0.1")
    assert IOConfig.from_env().background_cpu_share == 0.1
    with Stager() as stager:
        assert stager.cpu_share == 0.1 and stager.nice == 10
    monkeypatch.setenv("DCP_EXT_BACKGROUND_CPU_SHARE", "lots")
    with pytest.raises(ValueError, match="DCP_EXT_BACKGROUND_CPU_SHARE"):
        IOConfig.from_env()


@linux
def test_a_thread_lowers_its_own_priority_only() -> None:
    main = threading.get_native_id()
    before = _nice_of(main)
    seen: dict[str, int] = {}

    def worker() -> None:
        assert lower_thread_priority(5)
        seen["self"] = _nice_of(threading.get_native_id())
        child = threading.Thread(target=lambda: seen.setdefault("child", _nice_of(threading.get_native_id())))
        child.start()
        child.join()

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == {"self": min(19, before + 5), "child": min(19, before + 5)}  # threads it starts inherit it
    assert _nice_of(main) == before
    assert not lower_thread_priority(0)


@linux
def test_background_staging_runs_its_threads_and_the_uploader_at_low_priority() -> None:
    main = threading.get_native_id()
    before = _nice_of(main)
    state = {"w": torch.randn(3000, 1000), "b": torch.randn(10)}
    with Stager(cpu_share=0.1, threads=2) as stager:
        assert stager.nice == 10
        future = stager.stage(state)
        staged = future.result()  # the caller waits: its priority stays
        assert _nice_of(main) == before and torch.equal(staged["w"], state["w"])
        nices = {t.name.rsplit("_", 1)[0]: _nice_of(t.native_id) for t in threading.enumerate()
                 if t.name.startswith("dcp_ext-stage")}
        assert nices == {"dcp_ext-stager": min(19, before + 10), "dcp_ext-stage": min(19, before + 10)}
        # DCP's upload thread is the first other thread to wait for the staged state: it takes the priority.
        future = stager.stage(state)
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="AsyncCheckpointExecutor") as upload:
            assert upload.submit(lambda: (future.result(), _nice_of(threading.get_native_id()))[1]).result() == \
                min(19, before + 10)
    with Stager(cpu_share=1.0) as stager:  # training's priority: nothing lowered
        future = stager.stage(state)
        with concurrent.futures.ThreadPoolExecutor(1) as upload:
            assert upload.submit(lambda: (future.result(), _nice_of(threading.get_native_id()))[1]).result() == before


def test_host_copies_are_exact_for_every_layout() -> None:
    for src in (torch.randn(1000, 33), torch.randn(8, 6).t(), torch.tensor(3.5), torch.rand(99) > 0.5,
                torch.randn(5, dtype=torch.complex64).conj(), torch.zeros(0, 3), torch.arange(7, dtype=torch.int8)):
        dst = torch.empty(src.shape, dtype=src.dtype)
        host_copy(dst, src)
        assert torch.equal(dst, src.resolve_conj())


def test_device_to_host_copies_wait_for_their_fence_and_event() -> None:
    device = torch.device("cpu")
    copier = DeviceToHost()
    src = torch.randn(64, 64)
    dst = torch.empty_like(src)
    fences = DeviceToHost.fence({device})
    assert set(fences) == {device}
    copier.begin(fences)
    copier.copy(dst, src)
    copier.wait()
    assert torch.equal(dst, src)
    copier.begin({})  # no fence: the side stream follows the copying thread's current stream
    copier.copy(dst, src * 2)
    copier.wait()
    assert torch.equal(dst, src * 2)


def test_stager_routes_device_tensors_through_side_streams(monkeypatch) -> None:
    """The accelerator branch of a background stage, run with CPU tensors standing in."""
    calls: list[str] = []
    real_copy, real_wait = DeviceToHost.copy, DeviceToHost.wait
    monkeypatch.setattr(_staging, "on_accelerator", lambda tensor: tensor.dim() == 2)
    monkeypatch.setattr(DeviceToHost, "copy", lambda self, d, s: (calls.append("copy"), real_copy(self, d, s))[1])
    monkeypatch.setattr(DeviceToHost, "wait", lambda self: (calls.append("wait"), real_wait(self))[1])
    state = {"matrix": torch.randn(2000, 600), "vector": torch.randn(100)}
    with Stager() as stager:
        first = stager.stage(state).result()
        pointer = first["matrix"].data_ptr()
        state["matrix"].add_(1)
        again = stager.stage(state).result()
    assert torch.equal(again["matrix"], state["matrix"]) and torch.equal(again["vector"], state["vector"])
    assert again["matrix"].data_ptr() == pointer  # the host buffer is reused
    # 4.8 MB in 16 MiB pieces: one device copy per stage, each stage ends in one wait.
    assert calls == ["copy", "wait", "copy", "wait"]


def test_host_to_device_reuses_a_bounded_pool_of_buffers() -> None:
    feed = HostToDevice(max_bytes=1 << 20, pin=False)
    targets = [torch.empty(100, 1000) for _ in range(6)]  # 400 KB each, 512 KiB buffers
    sources = [torch.randn(100, 1000) for _ in targets]
    pointers = set()
    for target, source in zip(targets, sources, strict=True):
        box = feed.host_buffer((100, 1000), torch.float32)
        pointers.add(box.data_ptr())
        box.copy_(source)  # "read into" the host buffer
        feed.to_device(target, box)
    feed.finish()
    assert all(torch.equal(t, s) for t, s in zip(targets, sources, strict=True))
    assert len(pointers) <= 2 and feed.copied_bytes == 6 * 400_000  # two 512 KiB buffers at most
    one = feed.host_buffer((3,), torch.bfloat16)
    assert one.shape == (3,) and one.dtype == torch.bfloat16
    feed.close()


def test_host_to_device_waits_for_the_oldest_copy_when_full(monkeypatch) -> None:
    """A copy still in flight keeps its buffer: the next request waits for its event."""
    waited: list[int] = []

    class SlowEvent:
        def __init__(self) -> None:
            self.done = False

        def record(self, stream=None) -> None:
            pass

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            waited.append(1)
            self.done = True

    monkeypatch.setattr(torch.cpu, "Event", SlowEvent)
    feed = HostToDevice(max_bytes=1 << 16, pin=False)
    box = feed.host_buffer((1000,), torch.float32)
    feed.to_device(torch.empty(1000), box)
    again = feed.host_buffer((1000,), torch.float32)
    assert waited == [1] and again.data_ptr() == box.data_ptr()
    assert _device_copies.on_accelerator(torch.empty(1)) is False
