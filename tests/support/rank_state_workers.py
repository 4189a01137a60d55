"""Ranks of tests/test_rank_state.py: per-rank state (``rank_state``) saved by N ranks, loaded by M.

Every loader is torchdata's ``StatefulDataLoader(list(range(DATASET)), batch_size=BATCH,
sampler=<a DistributedSampler of the world>)``, shuffled with ``SEED``, epoch 0.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch import nn
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

import dcp_ext

DATASET = 48
BATCH = 3
SEED = 7
TAKEN = 3  # batches each saving rank takes before its save


def loader(world_size: int, rank: int, sampler: str) -> StatefulDataLoader:
    """Rank ``rank``'s loader in a world of ``world_size`` (``sampler``: ``"torch"`` or ``"torchdata"``)."""
    data = list(range(DATASET))
    kind = DistributedSampler if sampler == "torch" else StatefulDistributedSampler
    return StatefulDataLoader(data, batch_size=BATCH, sampler=kind(data, num_replicas=world_size, rank=rank,
                                                                   shuffle=True, seed=SEED))


def _ids(batches: Any) -> list[int]:
    return [int(i) for batch in batches for i in batch]


def uninterrupted(world_size: int, sampler: str) -> list[list[int]]:
    """Each rank's samples over the whole epoch, in order, in a run that never stopped."""
    return [_ids(loader(world_size, rank, sampler)) for rank in range(world_size)]


def _model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def save_world(rank: int, world_size: int, root: str, plain: str, sampler: str) -> dict[str, Any]:
    """Take TAKEN batches, then save: tag ``loader`` (the loader's state alone), tag ``mixed``
    (loader, torch and Python RNG states, the rank), and ``plain`` with ``dcp_ext.save``.
    Returns the samples taken and the RNG draws that follow the saved RNG states."""
    model, optimizer = _model(0)
    data = loader(world_size, rank, sampler)
    batches = iter(data)
    taken = _ids(next(batches) for _ in range(TAKEN))
    torch.manual_seed(1000 + rank)
    random.seed(2000 + rank)
    torch_rng, python_rng = torch.get_rng_state(), random.getstate()
    draws = (torch.rand(8), [random.random() for _ in range(5)])
    manager = dcp_ext.CheckpointManager(root)
    manager.save("loader", model, optimizer, rank_state=data.state_dict())
    manager.save("mixed", model, optimizer, rank_state={
        "loader": data.state_dict(), "torch_rng": torch_rng, "python_rng": python_rng, "rank": rank})
    dcp_ext.save({"model": model.state_dict()}, plain, rank_state=data.state_dict())
    return {"taken": taken, "draws": draws}


def resume_same_world(rank: int, world_size: int, root: str, sampler: str) -> dict[str, Any]:
    """Resume ``mixed`` at the saving world size: RNG states back, the loader goes on."""
    model, optimizer = _model(1)

    def never(states: list[Any], m: int) -> list[Any]:
        raise AssertionError("the rule runs only when the world size changed")

    state = dcp_ext.CheckpointManager(root).resume(model, optimizer, tag="mixed", rank_state_rule=never).rank_state
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    draws = (torch.rand(8), [random.random() for _ in range(5)])
    data = loader(world_size, rank, sampler)
    data.load_state_dict(state["loader"])
    return {"draws": draws, "rest": _ids(data), "rank": state["rank"]}


def resume_other_world(rank: int, world_size: int, root: str, plain: str, sampler: str) -> dict[str, Any]:
    """Resume at another world size: the default refusal (model untouched), the built-in
    dataloader rule, a user function (and one returning too few states), and the same
    through ``dcp_ext.load``."""
    model, optimizer = _model(1)
    manager = dcp_ext.CheckpointManager(root)
    before = _weights(model)
    try:
        manager.resume(model, optimizer, tag="loader")
        refused = None
    except dcp_ext.RankStateMismatchError as err:
        refused = str(err)
    untouched = all(torch.equal(a, b) for a, b in zip(before, _weights(model)))

    data = loader(world_size, rank, sampler)
    result = manager.resume(model, optimizer, tag="loader", rank_state_rule=dcp_ext.redistribute_dataloader)
    data.load_state_dict(result.rank_state)
    rest = _ids(data)

    calls: list[tuple[int, list[int]]] = []

    def rule(states: list[Any], m: int) -> list[Any]:
        calls.append((m, [s["rank"] for s in states]))
        loaders = dcp_ext.redistribute_dataloader([s["loader"] for s in states], m)
        return [{"loader": state, "new_rank": j, "saved_ranks": len(states)} for j, state in enumerate(loaders)]

    mixed = manager.resume(model, optimizer, tag="mixed", rank_state_rule=rule).rank_state
    data = loader(world_size, rank, sampler)
    data.load_state_dict(mixed["loader"])
    mixed_rest = _ids(data)
    try:
        manager.resume(model, optimizer, tag="mixed", rank_state_rule=lambda states, m: states[:1] * (m + 1))
        wrong_count = None
    except dcp_ext.RankStateMismatchError as err:
        wrong_count = str(err)

    try:
        dcp_ext.load({"model": model.state_dict()}, plain)
        plain_refused = None
    except dcp_ext.RankStateMismatchError as err:
        plain_refused = str(err)
    flat = {f"model.{k}": v for k, v in model.state_dict().items()}  # a flat dict, strict
    data = loader(world_size, rank, sampler)
    data.load_state_dict(dcp_ext.load(flat, plain, rank_state_rule=dcp_ext.redistribute_dataloader))
    return {"refused": refused, "untouched": untouched, "rest": rest, "calls": calls,
            "mixed": {k: v for k, v in mixed.items() if k != "loader"}, "mixed_rest": mixed_rest,
            "wrong_count": wrong_count, "plain_refused": plain_refused, "plain_rest": _ids(data)}
