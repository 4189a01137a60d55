"""Per-rank state (``rank_state``) across a world-size change (issue 43).

Each rank saves state of its own (a torchdata ``StatefulDataLoader``'s
``state_dict()``, RNG states) with ``CheckpointManager.save(rank_state=...)``
or ``dcp_ext.save(rank_state=...)``; a load at the same world size gives each
rank back what it saved; at another world size it is refused with
``RankStateMismatchError`` naming both sizes, unless ``rank_state_rule``
redistributes it: a user function, or ``dcp_ext.redistribute_dataloader``.

**Bit-exact sample order**, as asserted here: the ``N`` saving ranks each take
``TAKEN`` batches of ``BATCH`` samples from loaders over a shuffled
``DistributedSampler`` (``num_replicas=N``), so together they consumed the
first ``C = N * TAKEN * BATCH`` positions of the epoch's global order. After
the resume at ``M`` ranks, the samples rank ``j`` yields until the epoch ends
are, in order, exactly the samples rank ``j`` of an uninterrupted run at
``M`` ranks (same dataset, seed, epoch) yields at global positions ``>= C``:
its whole-epoch sequence without its first ``ceil((C - j) / M)`` samples. So
the samples taken before the save and after the resume are, as a multiset,
the dataset once. The uninterrupted runs are computed in the test process
with the same loaders (``tests/support/rank_state_workers.py``).

Worlds are spawned gloo groups (``run_world``): 2 -> 2, 2 -> 1 with torch's
``DistributedSampler``, and 1 -> 2 with torchdata's ``StatefulDistributedSampler``
(which records a position of its own). The rest runs in this process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import dcp_ext
from dcp_ext.planning import RankStateLoadPlanner
from tests.support import rank_state_workers as w
from tests.support.dist import run_world


def _skip(world_size: int, rank: int, consumed: int) -> int:
    return max(0, -(-(consumed - rank) // world_size))


def _after(world_size: int, sampler: str, consumed: int) -> list[list[int]]:
    """What each rank of an uninterrupted run at ``world_size`` yields from global position ``consumed`` on."""
    return [seq[_skip(world_size, j, consumed):] for j, seq in enumerate(w.uninterrupted(world_size, sampler))]


def test_two_ranks_to_two_and_to_one(tmp_path: Path) -> None:
    root, plain = str(tmp_path / "root"), str(tmp_path / "plain")
    saved = run_world(2, w.save_world, root, plain, "torch")
    consumed = 2 * w.TAKEN * w.BATCH
    before = saved[0]["taken"] + saved[1]["taken"]
    assert saved[0]["taken"] == w.uninterrupted(2, "torch")[0][: w.TAKEN * w.BATCH]

    # Same world size: each rank gets its own state back; the RNG states draw what they drew.
    same = run_world(2, w.resume_same_world, root, "torch")
    for rank in range(2):
        assert same[rank]["rank"] == rank
        assert torch.equal(same[rank]["draws"][0], saved[rank]["draws"][0])
        assert same[rank]["draws"][1] == saved[rank]["draws"][1]
        assert same[rank]["rest"] == _after(2, "torch", consumed)[rank]

    # 2 -> 1.
    (one,) = run_world(1, w.resume_other_world, root, plain, "torch")
    assert one["refused"] is not None and "saved by 2 rank(s)" in one["refused"] and "1 rank(s) load" in one["refused"]
    assert one["untouched"]  # refused while planning, before any byte was read
    expected = _after(1, "torch", consumed)[0]
    assert one["rest"] == expected and one["mixed_rest"] == expected and one["plain_rest"] == expected
    assert sorted(before + one["rest"]) == list(range(w.DATASET))
    assert one["calls"] == [(1, [0, 1])]  # once, every saved rank's state in rank order
    assert one["mixed"] == {"new_rank": 0, "saved_ranks": 2}
    assert one["wrong_count"] is not None and "returned 2 state(s)" in one["wrong_count"]
    assert one["plain_refused"] is not None and "saved by 2 rank(s)" in one["plain_refused"]


def test_one_rank_to_two(tmp_path: Path) -> None:
    root, plain = str(tmp_path / "root"), str(tmp_path / "plain")
    (saved,) = run_world(1, w.save_world, root, plain, "torchdata")
    consumed = w.TAKEN * w.BATCH  # 9: the two new ranks skip 5 and 4 samples of their own sequences
    two = run_world(2, w.resume_other_world, root, plain, "torchdata")
    expected = _after(2, "torchdata", consumed)
    assert [len(e) for e in expected] == [24 - 5, 24 - 4]
    for rank in range(2):
        result = two[rank]
        assert "saved by 1 rank(s)" in result["refused"] and "2 rank(s) load" in result["refused"]
        assert result["untouched"]
        assert result["rest"] == expected[rank] == result["mixed_rest"] == result["plain_rest"]
        assert result["mixed"] == {"new_rank": rank, "saved_ranks": 1}
        assert "returned 3 state(s)" in result["wrong_count"]
        assert "saved by 1 rank(s)" in result["plain_refused"]
    assert two[0]["calls"] == [(2, [0])] and two[1]["calls"] == []  # the rule runs on the coordinator only
    assert sorted(saved["taken"] + two[0]["rest"] + two[1]["rest"]) == list(range(w.DATASET))


# -- one process ------------------------------------------------------------------------------


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(4, 3)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_stored_as_keys_of_the_checkpoint_covered_by_its_commit_checksums_and_retention(tmp_path: Path) -> None:
    model, optimizer = _model()
    manager = dcp_ext.CheckpointManager(tmp_path)
    manager.save("a", model, optimizer, rank_state={"step": 1})
    manager.save("b", model, optimizer, rank_state={"step": 10_000, "rng": torch.get_rng_state()},
                 num_kept_partial_checkpoints=1)
    assert manager.tags() == ["b"] and not (tmp_path / "a_partial").exists()  # retention removed all of "a"
    directory = tmp_path / "b_partial"
    assert sorted(os.listdir(directory)) == [".metadata", "dcp_ext.metadata.json", "model_rank0.distcp",
                                             "optimizer_rank0.distcp", "partition.json", "state_rank0.distcp"]
    document = (directory / "dcp_ext.metadata.json").read_text()
    assert "rank_state.0_of_1" in document
    assert dcp_ext.verify(str(directory)).ok  # its frames' checksums, like every item's
    result = manager.resume(model, optimizer)
    assert result.rank_state["step"] == 10_000 and torch.equal(result.rank_state["rng"], torch.get_rng_state())
    # Padded to a power of two: a state that grows a little keeps its size (and the plan cache its plan).
    planner = RankStateLoadPlanner(strict=False)
    dcp_ext.load({}, str(directory), planner=planner)
    size = planner.metadata.state_dict_metadata["rank_state.0_of_1"].size  # type: ignore[union-attr]
    assert size[0] & (size[0] - 1) == 0
    manager.save("c", model, optimizer)
    manager.delete("b")
    assert not directory.exists()


def test_no_rank_state_loads_at_any_size_and_old_checkpoints_unchanged(tmp_path: Path) -> None:
    model, optimizer = _model()
    manager = dcp_ext.CheckpointManager(tmp_path)
    manager.save("a", model, optimizer, user_content={"step": 1})
    result = manager.resume(model, optimizer, rank_state_rule=dcp_ext.redistribute_dataloader)
    assert result.rank_state is None and result.user_content == {"step": 1}
    assert dcp_ext.load({"model": model.state_dict()}, str(tmp_path / "a_partial")) is None


def test_refusals(tmp_path: Path) -> None:
    model, optimizer = _model()
    manager = dcp_ext.CheckpointManager(tmp_path)
    with pytest.raises(dcp_ext.UnsafeUserContentError, match=r"rank_state\['it'\]"):
        manager.save("a", model, optimizer, rank_state={"it": object()})
    with pytest.raises(ValueError, match="partial checkpoints"):
        manager.save("a", model, optimizer, partial=False, rank_state={"step": 1})
    with pytest.raises(ValueError, match="partial checkpoints"):
        manager.resume(model, partial=False, rank_state_rule=dcp_ext.redistribute_dataloader)
    with pytest.raises(ValueError, match="default planner"):
        dcp_ext.load({}, str(tmp_path), planner=RankStateLoadPlanner(), rank_state_rule=dcp_ext.redistribute_dataloader)
    with pytest.raises(ValueError, match="rank_state"):
        dcp_ext.save({"rank_state": torch.ones(1)}, str(tmp_path / "x"), rank_state={"step": 1})
    assert manager.tags() == [] and not (tmp_path / "x").exists()  # nothing written
    assert issubclass(dcp_ext.RankStateMismatchError, (dcp_ext.DcpExtError, ValueError))


def _loader_state(samples: int, batches: int) -> dict[str, object]:
    state = w.loader(1, 0, "torch").state_dict()
    assert state["_sampler_iter_state"] == {"samples_yielded": 0}  # the shape the rule reads
    return {**state, "_sampler_iter_state": {"samples_yielded": samples}, "_num_yielded": batches,
            "_sampler_iter_yielded": batches}


def test_dataloader_rule_arithmetic_and_refusals() -> None:
    # 3 ranks took 4, 4, 3 samples: global positions 0..10. At 4 ranks: ceil((11 - j) / 4) each.
    states = [_loader_state(4, 2), _loader_state(4, 2), _loader_state(3, 2)]
    out = dcp_ext.redistribute_dataloader(states, 4)
    assert [s["_sampler_iter_state"]["samples_yielded"] for s in out] == [3, 3, 3, 2]
    assert [s["_num_yielded"] for s in out] == [2, 2, 2, 1]  # batches of 2 (inferred)
    with pytest.raises(dcp_ext.RankStateMismatchError, match="not the first 10 positions"):
        dcp_ext.redistribute_dataloader([_loader_state(3, 1), *states[1:]], 2)  # 3, 4, 3: not a prefix
    with pytest.raises(dcp_ext.RankStateMismatchError, match="num_workers"):
        dcp_ext.redistribute_dataloader([{"_snapshot": {}, "_steps_since_snapshot": 0}], 2)
    with pytest.raises(dcp_ext.RankStateMismatchError, match="state of its own"):
        dcp_ext.redistribute_dataloader([{**states[0], "dataset_state": {"pos": 1}}], 2)
    with pytest.raises(dcp_ext.RankStateMismatchError, match="rank 0 is a NoneType"):
        dcp_ext.redistribute_dataloader([None], 2)


def test_mismatch_error_pickles_by_message() -> None:
    import pickle

    err = dcp_ext.RankStateMismatchError("saved by 2 rank(s), 1 rank(s) load it", "ck")
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err) and again.path == "ck" and json.dumps(str(again))
