"""Asynchronous saves that barely stop training: dcp_ext's Stager, the
manager's AsyncSaveHandle, process-based uploads (real 2-rank gloo worlds)."""

from __future__ import annotations

import uuid

import pytest
import torch

from dcp_ext import Stager
from dcp_ext.dcp_io._staging import copy_state
from tests.support import async_workers
from tests.support.dist import run_world
from tests.support.fault_proxy import FaultPlan, FaultProxy
from tests.support.backends import BUCKET


def _state() -> dict:
    torch.manual_seed(0)
    return {
        "w": torch.randn(3000, 1000, dtype=torch.bfloat16),  # 6 MB: cut into pieces across threads
        "nested": {"b": torch.randn(17), "step": 7, "t": torch.tensor(3.0), "strided": torch.randn(8, 6).t()},
        "list": [torch.arange(5), "text", (torch.ones(2), 1.5)],
    }


def test_stager_reuses_its_buffers_and_copies_exactly() -> None:
    state = _state()
    with Stager(background=True, threads=3) as stager:
        staged = stager.stage(state).result()
        first = stager.last_stats
        assert first.allocated_bytes == first.bytes == stager.buffer_bytes > 6_000_000
        assert torch.equal(staged["w"], state["w"]) and staged["w"].data_ptr() != state["w"].data_ptr()
        assert staged["nested"]["step"] == 7 and staged["list"][1] == "text" and isinstance(staged["list"][2], tuple)
        assert torch.equal(staged["nested"]["strided"], state["nested"]["strided"])
        pointer = staged["w"].data_ptr()
        state["w"].add_(1)  # after staging: the staged copy must not change
        assert not torch.equal(staged["w"], state["w"])
        again = stager.stage(state).result()
        assert stager.last_stats.allocated_bytes == 0 and again["w"].data_ptr() == pointer
        assert torch.equal(again["w"], state["w"])
        # A changed shape reallocates that buffer only; a dropped key frees its buffer.
        state["nested"]["b"] = torch.randn(20)
        del state["list"]
        stager.stage(state).result()
        assert stager.last_stats.allocated_bytes == 20 * 4
        assert stager.buffer_bytes == sum(t.numel() * t.element_size() for t in
                                          (state["w"], state["nested"]["b"], state["nested"]["t"],
                                           state["nested"]["strided"]))
    assert stager.buffer_bytes == 0
    with pytest.raises(RuntimeError, match="closed"):
        stager.stage(state)


def test_stager_waits_for_the_upload_holding_its_buffers() -> None:
    import concurrent.futures
    import threading

    state = {"w": torch.zeros(1000)}
    stager = Stager(background=False)
    staged = stager.stage(state)
    upload: concurrent.futures.Future[None] = concurrent.futures.Future()
    stager.release_after(upload)
    state["w"].fill_(1)
    done = threading.Event()
    thread = threading.Thread(target=lambda: (stager.stage(state), done.set()))
    thread.start()
    assert not done.wait(0.3)  # the previous upload still reads the buffers
    assert torch.equal(staged["w"], torch.zeros(1000))
    upload.set_result(None)
    thread.join(5)
    assert done.is_set() and torch.equal(staged["w"], torch.ones(1000))
    assert stager.last_stats.waited_seconds >= 0.25
    stager.close()


def test_copy_state_is_a_private_copy() -> None:
    state = _state()
    copied = copy_state(state, threads=2)
    for key in ("w",):
        assert torch.equal(copied[key], state[key]) and copied[key].data_ptr() != state[key].data_ptr()
    state["w"].zero_()
    assert copied["w"].abs().sum() > 0


def test_async_saves_in_two_rank_worlds(tmp_path, moto_server) -> None:
    s3_root = f"s3://{BUCKET}/async-{uuid.uuid4().hex[:8]}"
    plan = FaultPlan(rate=1.0, faults=("slowdown",), match=lambda method, path: method in ("PUT", "POST"))
    with FaultProxy(moto_server.endpoint_url, plan) as proxy:
        options = [moto_server.storage_options(), moto_server.storage_options(endpoint_url=proxy.endpoint_url)]
        both = run_world(2, async_workers.thread_and_process_suites, str(tmp_path / "thread"), s3_root, options,
                         str(tmp_path / "process"), timeout=400)
    reports = [report["thread"] for report in both]
    print("thread worlds:", reports)
    for report in reports:
        assert report["first_allocated"] == report["buffer_bytes"] == report["buffer_bytes_after"] > 0
        assert report["rss_growth_5_to_20"] < 32 << 20, report["rss_growth_5_to_20"]
    # The same error on both ranks, though only rank 1's uploads failed.
    assert reports[0]["failure"] == reports[1]["failure"], [r["failure"] for r in reports]
    assert reports[0]["failure"][0] in ("TransientStorageError", "StorageError"), reports[0]["failure"]

    report = both[0]["process"]
    assert report["shared"] is True
    assert report["user_content"] == {"tag": "p2"}
