"""Plan caching never loads wrong numbers and never poisons later saves (issue 40).

Every framework adapter plans with ``LayoutSavePlanner(enable_plan_caching=True)``.
DCP's own caching compares plans without dtypes and is left half updated by a
refused save; dcp_ext's (``dcp_ext.planning._plan_cache``) fingerprints the
whole plan, verifies every claim on the coordinator and drops what a failed
save planned. One process here; the two-rank checks are in one world at the end.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import dcp_ext
from dcp_ext import CheckpointReader, CheckpointWriter, IOConfig, LayoutSavePlanner
from dcp_ext.errors import CheckpointExistsError, DcpExtError, PlanCacheError, PlanMismatchError
from dcp_ext.integrations._planning import save_planner
from dcp_ext.metadata import METADATA_FILE
from dcp_ext.planning._plan_cache import PLAN_CACHE
from dcp_ext.root import verify
from dcp_ext.whole_state import load_whole

from .support import plan_cache_workers
from .support.dist import run_world

VALUES = [1.0, 4.0, 7.0, 10.0]


@pytest.fixture(autouse=True)
def _fresh_cache() -> Any:
    PLAN_CACHE.clear()
    yield
    PLAN_CACHE.clear()


def _state(dtype: torch.dtype, extra: bool = False) -> dict[str, Any]:
    state: dict[str, Any] = {
        "w": torch.tensor(VALUES).to(dtype),
        "m": torch.arange(16, dtype=torch.float32).reshape(4, 4).to(dtype),
        "step": 3,
    }
    if extra:
        state["extra"] = torch.full((3,), 2.5)
    return state


def _loads_exactly(path: Path, state: dict[str, Any]) -> None:
    """Every reader dcp_ext offers gives back ``state`` bit for bit."""
    back = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
    dcp_ext.load(back, str(path))
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in state.items() if isinstance(v, torch.Tensor))
    whole = load_whole(str(path))
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert whole[key].dtype == value.dtype and torch.equal(whole[key], value), key
    report = verify(str(path))
    assert report.ok, report
    recorded = json.loads((path / METADATA_FILE).read_text())
    assert recorded["storage_meta"]["checkpoint_id"] == str(path)  # not the first save's id
    if (path / ".metadata").stat().st_size > 200:  # torch's reader too, where it can read the checkpoint
        stock = {k: torch.zeros_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
        dcp.load(stock, storage_reader=CheckpointReader(str(path)))
        assert all(torch.equal(stock[k], state[k]) for k in stock)


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize(
    "first, second",
    [(torch.bfloat16, torch.float16), (torch.float32, torch.int32), (torch.float32, torch.float64)],
    ids=["bf16-fp16", "fp32-int32", "fp32-fp64"],
)
def test_a_dtype_change_under_a_cached_plan_saves_the_new_dtype(
    tmp_path: Path, first: torch.dtype, second: torch.dtype, compression: str | None
) -> None:
    """Same keys and shapes, a new dtype, one process: as the adapters call it
    (``dcp_ext.save(..., planner=save_planner(name, config))``) and as stock DCP with
    ``LayoutSavePlanner(enable_plan_caching=True)`` does; then back again."""
    for k, dtype in enumerate((first, second, first)):
        state = _state(dtype)
        path = tmp_path / f"adapter{k}"
        dcp_ext.save(state, str(path), planner=save_planner("test", IOConfig()), compression=compression)
        _loads_exactly(path, state)
        path = tmp_path / f"stock{k}"
        dcp.save(state, storage_writer=CheckpointWriter(str(path), compression=compression),
                 planner=LayoutSavePlanner(enable_plan_caching=True, plan_cache_name="stock"))
        _loads_exactly(path, state)


def test_cached_plans_are_reused_only_when_equal(tmp_path: Path) -> None:
    """The second save of an unchanged state reuses the global plan (caching
    still pays); a new dtype, shape or key set plans again."""
    planner = LayoutSavePlanner(enable_plan_caching=True, plan_cache_name="reuse")
    reused = []
    for k, state in enumerate([_state(torch.float32), _state(torch.float32), _state(torch.bfloat16),
                               _state(torch.bfloat16), _state(torch.bfloat16, extra=True),
                               {**_state(torch.bfloat16), "w": torch.ones(5, dtype=torch.bfloat16)}]):
        planner = LayoutSavePlanner(enable_plan_caching=True, plan_cache_name="reuse")
        dcp_ext.save(state, str(tmp_path / f"s{k}"), planner=planner)
        reused.append(planner.reused_global_plan)
        _loads_exactly(tmp_path / f"s{k}", state)
    assert reused == [False, True, False, True, False, False]


def test_a_refused_save_leaves_no_cache_behind(tmp_path: Path) -> None:
    """A save refused in the writer's global checks (the checkpoint exists)
    is followed by saves of the same state, a changed shape and a changed key
    set under the same cache name: all commit and load bit-exact, none fails
    untyped, no lock is left; through dcp_ext.save and through stock dcp.save."""
    taken = tmp_path / "taken"
    dcp_ext.save({"x": torch.ones(2)}, str(taken))
    for route in ("dcp_ext", "stock"):
        def save(state: dict[str, Any], path: Path, route: str = route) -> None:
            planner = LayoutSavePlanner(enable_plan_caching=True, plan_cache_name=route)
            if route == "dcp_ext":
                dcp_ext.save(state, str(path), planner=planner)
            else:
                dcp.save(state, storage_writer=CheckpointWriter(str(path)), planner=planner)

        first = _state(torch.float32)
        save(first, tmp_path / f"{route}-a")
        wide = {**first, "m": torch.ones(8, 4)}
        with pytest.raises(BaseException) as refused:  # stock DCP wraps it in a CheckpointException
            save(wide, taken)  # refused: planned (a new shape), never written
        assert isinstance(dcp_ext.unwrap_checkpoint_exception(refused.value), CheckpointExistsError)
        for k, state in enumerate([first, wide, _state(torch.float32, extra=True), first]):
            path = tmp_path / f"{route}-after{k}"
            save(state, path)
            _loads_exactly(path, state)
            assert not (path / ".dcp_ext.saving").exists()
        # Refused with an unchanged plan (all claims): the next one still commits.
        with pytest.raises(BaseException) as refused:
            save(first, taken)
        assert isinstance(dcp_ext.unwrap_checkpoint_exception(refused.value), CheckpointExistsError)
        save(first, tmp_path / f"{route}-last")
        _loads_exactly(tmp_path / f"{route}-last", first)
    assert torch.equal(load_whole(str(taken))["x"], torch.ones(2))  # the refused saves left it as it was


def test_torch_plan_caching_cannot_commit_a_stale_dtype(tmp_path: Path) -> None:
    """DCP's own ``DefaultSavePlanner(enable_plan_caching=True)`` reuses its
    final plan, whose items record the old dtype: the writer refuses the
    item (typed, naming it) and nothing commits."""
    planner_cls = DefaultSavePlanner
    for k, dtype in enumerate((torch.bfloat16, torch.float16, torch.float64)):
        path = tmp_path / f"t{k}"
        state = _state(dtype)
        try:
            dcp.save(state, storage_writer=CheckpointWriter(str(path)), planner=planner_cls(enable_plan_caching=True))
        except BaseException as exc:  # DCP wraps the writer's error
            error = dcp_ext.unwrap_checkpoint_exception(exc)
            assert k > 0 and isinstance(error, PlanMismatchError), error
            assert "'w'" in str(error) or "'m'" in str(error)
            assert not (path / METADATA_FILE).exists()
            continue
        assert k == 0
        _loads_exactly(path, state)


def test_commit_refuses_results_that_disagree_with_the_metadata(tmp_path: Path) -> None:
    """A rank that stores another byte size than the metadata records (here: a
    planner whose resolve_data returns another dtype than it planned) is
    refused at the latest at the commit."""

    class Lying(LayoutSavePlanner):
        def resolve_data(self, write_item: Any) -> Any:
            data = super().resolve_data(write_item)
            return data.to(torch.float64) if isinstance(data, torch.Tensor) else data

    with pytest.raises(PlanMismatchError, match="'w'|'m'"):
        dcp_ext.save(_state(torch.float32), str(tmp_path / "lying"), planner=Lying())
    assert not (tmp_path / "lying" / METADATA_FILE).exists()


def test_two_ranks_plan_caching_world(tmp_path: Path) -> None:
    """Two gloo ranks: a dtype change on one rank only (its own key: planned
    again, bit-exact; a shard of a shared tensor: refused typed, and the next
    consistent save commits), a coordinator that lost its cache (dcp_ext.save
    plans again; stock dcp.save fails typed, and the next save commits), and
    a save refused by the writer followed by saves that commit."""
    reports = run_world(2, plan_cache_workers.plan_cache_world, str(tmp_path))
    assert reports[0]["one_rank_dtype"] == [True, True, True]
    assert reports[0]["mixed_dtype_error"].startswith("GlobalPlanError") or "dtype" in reports[0]["mixed_dtype_error"]
    assert reports[0]["after_mixed"] is True
    assert reports[0]["lost_cache_retried"] is True
    assert reports[0]["stock_lost_cache"] == "PlanCacheError"
    assert reports[0]["after_stock_lost_cache"] is True
    assert reports[0]["after_refusal"] == [True, True, True]
    assert all(r["bit_exact"] for r in reports)


def test_plan_caching_torture_trials(tmp_path: Path) -> None:
    """Two trials of the plan-caching torture (``python -m bench.torture
    --plan-caching`` runs many): seed 56 changes dtype (fp16, fp64, int32),
    shape and key set, is refused once and has the ranks disagree once,
    through dcp_ext.save and stock dcp.save, raw and zstd; once to the end,
    once with rank 1 killed in the middle of save 3's data."""
    from .support.plan_cache_torture import run_trial

    done = run_trial(tmp_path / "whole", 56, "none")
    assert done.violations == [] and done.exit_code == 0, done
    assert (done.logged, done.committed, done.refused) == (5, 3, 1)
    killed = run_trial(tmp_path / "killed", 56, "3:1:mid_data")
    assert killed.violations == [] and killed.exit_code != 0 and killed.logged == 3, killed


def test_plan_cache_error_is_a_typed_dcp_ext_error() -> None:
    assert issubclass(PlanCacheError, PlanMismatchError) and issubclass(PlanMismatchError, DcpExtError)
    assert issubclass(PlanMismatchError, ValueError)
