"""Rank functions of tests/test_plan_caching.py's two-rank world."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import dcp_ext
from dcp_ext import CheckpointWriter, LayoutSavePlanner
from dcp_ext.planning._plan_cache import PLAN_CACHE
from dcp_ext.whole_state import load_whole


def _save(state: dict[str, Any], path: str, name: str, stock: bool = False) -> LayoutSavePlanner:
    planner = LayoutSavePlanner(enable_plan_caching=True, plan_cache_name=name)
    if stock:
        dcp.save(state, storage_writer=CheckpointWriter(path), planner=planner)
    else:
        dcp_ext.save(state, path, planner=planner)
    return planner


def _sharded(rank: int, dtype: torch.dtype, own_dtype: torch.dtype) -> dict[str, Any]:
    """Rank-own keys, and one tensor sharded by rows over the two ranks (built as DTensor-free
    ShardedTensor-like state: each rank saves its own key for its rows)."""
    return {
        f"own{rank}": (torch.arange(8, dtype=torch.float32) + 10 * rank).to(own_dtype),
        "shared": torch.arange(6, dtype=torch.float32).to(dtype),  # replicated: written once
    }


def _exact(path: str, state: dict[str, Any]) -> bool:
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp_ext.load(back, path, planner=dcp_ext.LayoutLoadPlanner(strict=False))  # the other rank's key stays
    whole = load_whole(path)
    return all(torch.equal(back[k], v) and back[k].dtype == v.dtype and torch.equal(whole[k], v)
               and whole[k].dtype == v.dtype for k, v in state.items())


def plan_cache_world(rank: int, world_size: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {"bit_exact": True}
    # 1. One rank changes the dtype of its own key: planned again on that rank, reused on the other.
    exact = []
    for k, own in enumerate((torch.float32, torch.bfloat16 if rank == 1 else torch.float32, torch.float32)):
        state = _sharded(rank, torch.float32, own)
        path = f"{root}/own{k}"
        _save(state, path, "own")
        exact.append(_exact(path, state))
    out["one_rank_dtype"] = exact
    # 2. One rank changes the dtype of a replicated tensor the other also saves: the ranks
    # disagree, which global planning refuses (typed); the next consistent save commits.
    state = _sharded(rank, torch.float16 if rank == 1 else torch.float32, torch.float32)
    try:
        _save(state, f"{root}/mixed", "own")
        out["mixed_dtype_error"] = "none"
    except dcp_ext.DcpExtError as err:
        out["mixed_dtype_error"] = f"{type(err).__name__}: {err}"
    state = _sharded(rank, torch.float32, torch.float32)
    _save(state, f"{root}/after-mixed", "own")
    out["after_mixed"] = _exact(f"{root}/after-mixed", state)
    # 3. The coordinator loses its cache while rank 1 keeps its own: dcp_ext.save plans again.
    state = _sharded(rank, torch.float32, torch.float32)
    _save(state, f"{root}/lost0", "lost")
    if rank == 0:
        PLAN_CACHE.clear()
    dist.barrier()
    planner = _save(state, f"{root}/lost1", "lost")
    out["lost_cache_retried"] = _exact(f"{root}/lost1", state) and (rank != 0 or not planner.reused_global_plan)
    # ... stock dcp.save cannot plan again: typed, nothing written; the next save commits.
    if rank == 0:
        PLAN_CACHE.clear()
    dist.barrier()
    try:
        _save(state, f"{root}/lost2", "lost", stock=True)
        out["stock_lost_cache"] = "none"
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException
        out["stock_lost_cache"] = type(dcp_ext.unwrap_checkpoint_exception(exc)).__name__
    _save(state, f"{root}/lost3", "lost", stock=True)
    out["after_stock_lost_cache"] = _exact(f"{root}/lost3", state)
    # 4. A save refused by the writer (the checkpoint exists), with a new shape, then saves that commit.
    after = []
    bigger = {**state, "shared": torch.ones(9)}
    try:
        _save(bigger, f"{root}/own0", "own")
    except dcp_ext.CheckpointExistsError:
        pass
    for k, again in enumerate((state, bigger, {**state, "more": torch.ones(2)})):
        _save(again, f"{root}/refused{k}", "own")
        after.append(_exact(f"{root}/refused{k}", again))
    out["after_refusal"] = after
    out["bit_exact"] = all(exact) and out["after_mixed"] and all(after)
    dist.barrier()
    return out
