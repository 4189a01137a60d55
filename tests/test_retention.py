"""Retention policies: pure selection, composition, and the manager applying them."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

import dcp_ext
from dcp_ext.layout import TagInfo
from dcp_ext.retention import KeepAny, KeepEvery, KeepLast, KeepMatching, select_for_deletion


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
