"""Retention policies: pure selection, composition, and the manager applying them."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

import dcp_ext
from dcp_ext.layout import TagInfo
from dcp_ext.root._retention import KeepAny, KeepEvery, KeepLast, KeepMatching, select_for_deletion


def _tags(*names: str) -> list[TagInfo]:
    return [TagInfo(name, float(i)) for i, name in enumerate(names)]  # committed in this order


def test_policies_select_and_compose() -> None:
    committed = _tags("step100", "best-step150", "step200", "step300", "step400", "step500")
    assert select_for_deletion(committed, KeepLast(2)) == ["step100", "best-step150", "step200", "step300"]
    assert KeepEvery(200).keep(committed) == {"step200", "step400"}
    assert KeepMatching(r"best.*").keep(committed) == {"best-step150"}
    policy = KeepLast(2) | KeepEvery(200) | KeepMatching(r"best.*")
    assert isinstance(policy, KeepAny)
    assert select_for_deletion(committed, policy) == ["step100", "step300"]
    # protect (the newest target, the tag just saved) always wins.
    assert select_for_deletion(committed, KeepLast(1), protect={"step100"}) == [
        "best-step150", "step200", "step300", "step400"]
    for bad in (lambda: KeepLast(0), lambda: KeepEvery(0), lambda: KeepMatching("(")):
        with pytest.raises(ValueError):
            bad()


def test_manager_applies_its_policy_after_each_commit(tmp_path: Path) -> None:
    model = nn.Linear(4, 2)
    manager = dcp_ext.CheckpointManager(str(tmp_path), retention=dcp_ext.KeepLast(2) | dcp_ext.KeepEvery(20))
    for step in (10, 20, 30, 40, 50):
        manager.save(f"step{step}", model)
    assert manager.tags() == ["step20", "step40", "step50"]
    # A save's own setting replaces the manager's for that save.
    manager.save("step60", model, num_kept_partial_checkpoints=1)
    assert manager.tags() == ["step60"]
    with pytest.raises(ValueError, match="not both"):
        manager.save("step70", model, num_kept_partial_checkpoints=1, retention=dcp_ext.KeepLast(1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["newest", "step60_partial"]


def test_steady_state_saves_on_s3_cost_a_bounded_number_of_requests(make_backend) -> None:
    """A manager save with retention costs a fixed handful of requests: no bucket
    check per tag directory, one metadata head read per committed tag; and a
    deleted checkpoint leaves no directory behind (SeaweedFS keeps emptied
    directories listed until their own key is deleted)."""
    from collections import Counter

    backend = make_backend("seaweedfs")  # the server that keeps emptied directories
    manager = dcp_ext.CheckpointManager(backend.url("root"), storage_options=backend.storage_options,
                                        retention=dcp_ext.KeepLast(2))
    model = nn.Linear(64, 64)
    for step in range(4):
        manager.save(f"s{step}", model)
    calls: Counter[str] = Counter()

    def count(event_name: str, **_: object) -> None:
        calls[event_name.rsplit(".", 1)[-1]] += 1

    events = manager.checkpoints.store.connection.client.meta.events
    events.register("before-call.s3", count)
    try:
        manager.save("s4", model)
    finally:
        events.unregister("before-call.s3", count)
    assert manager.tags() == ["s3", "s4"]
    assert calls["HeadBucket"] == 0, calls
    # The lock, newest, the head of each of the 3 committed tags retention
    # chooses from, and the same 3 heads again once it holds the lock of the
    # tag it deletes (what another job may have committed meanwhile, and
    # whether the doomed tag was saved again: dcp_ext.root._root's one rule),
    # and the lock once more just before the commit (a save whose lock was
    # taken over never commits: issue 40's heartbeat rule).
    assert calls["GetObject"] <= 9, calls
    assert sum(calls.values()) <= 40, calls
    assert manager.checkpoints.store.list_dirs() == ["s3_partial", "s4_partial"]
    manager.close()
