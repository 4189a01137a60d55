"""Per-rank state: what each rank saves for itself (dataloader position, RNG states), and the
rule that loads it into another world size.

**Where it is stored.** One key per saving rank in the DCP state itself,
``rank_state.{rank}_of_{world}`` (e.g. ``rank_state.1_of_4``): a 1-D ``uint8``
tensor that rank alone holds, so DCP's deduplication leaves it to that rank,
and it lands in the rank's ``state_*.distcp`` file. The bytes are the value
encoded as ``user_content`` is (:mod:`dcp_ext.format._user_content`: a JSON
tree plus safetensors, never pickle), after an 8-byte little-endian length,
zero-padded to a power of two (at least 256 bytes) so that a state that grows
by a digit keeps its size and the plan cache its plan
(:mod:`dcp_ext.planning._plan_cache` fingerprints sizes).

A key rather than a file of its own (``rank_state_3.safetensors``): the
checkpoint's metadata names it, so the commit covers it; its frames carry
xxh3 checksums checked on read, compression, incremental hashes and async
staging like any tensor's; it lives in data files retention, deletion,
``compact`` and the tiers already own, so the layout gains no name and
deletion's own-files lists no entry. A file would have to be written by
every rank outside DCP's write phase, before the commit, with checksums,
retention and leftover cleanup each taught about it. The price: per-rank
state is as large as its padded encoding in every checkpoint (kilobytes).

**The rule on load**, with ``N`` ranks saved and ``M`` loading
(:class:`RankStateLoadPlanner`, decided on every rank from the metadata
alone, before a byte is read):

* ``M == N``: rank ``r`` gets back exactly what rank ``r`` saved (a rule, if
  given, is not called).
* ``M != N`` and no rule: :class:`~dcp_ext.errors.RankStateMismatchError`
  on every rank, naming ``N`` and ``M``. Never a silent drop.
* ``M != N`` and a rule: the coordinator reads the ``N`` states and calls
  ``rule(states, M)`` once (``states[r]`` is what rank ``r`` saved, ``None``
  for a rank that saved none); it returns ``M`` states, which are checked
  as ``user_content`` is and sent to the ranks, rank ``j`` getting the
  ``j``-th. :func:`redistribute_dataloader` is the built-in rule for
  torchdata's ``StatefulDataLoader`` over a ``DistributedSampler``.

A checkpoint without per-rank state loads at any world size, with
``rank_state`` ``None``.
"""

from __future__ import annotations

import dataclasses
import re
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .._runtime import GroupView
from ..errors import CheckpointCorruptError, RankStateMismatchError
from ..format import UnsafeUserContentError, decode_user_content, encode_user_content
from ._load_planner import LayoutLoadPlanner

__all__ = [
    "RANK_STATE_PREFIX",
    "RankStateRule",
    "RankStateLoadPlanner",
    "encode_rank_state",
    "with_rank_state",
    "rank_state_key",
    "redistribute_dataloader",
]

#: The top-level name of the per-rank keys in the DCP state.
RANK_STATE_PREFIX = "rank_state."
_KEY = re.compile(r"rank_state\.(\d+)_of_(\d+)")
_LENGTH = struct.Struct("<Q")
_MIN_BYTES = 256

#: ``rule(states, new_world_size) -> states``: the ``N`` saved states (by saved
#: rank) in, one state per new rank out.
RankStateRule = Callable[[list[Any], int], Sequence[Any]]


def rank_state_key(rank: int, world_size: int) -> str:
    """The DCP key of rank ``rank``'s state in a save by ``world_size`` ranks."""
    return f"{RANK_STATE_PREFIX}{rank}_of_{world_size}"


def encode_rank_state(value: Any) -> bytes:
    """``value`` encoded as ``user_content`` is (no pickle).

    Raises:
        UnsafeUserContentError: A value that cannot be stored without pickle, named by its path.
    """
    try:
        return encode_user_content(value)
    except UnsafeUserContentError as err:
        raise UnsafeUserContentError(str(err).replace("user_content", "rank_state", 1)) from None


def _pack(encoded: bytes) -> torch.Tensor:
    size = max(_MIN_BYTES, 1 << (_LENGTH.size + len(encoded) - 1).bit_length())
    buffer = bytearray(size)
    buffer[: _LENGTH.size] = _LENGTH.pack(len(encoded))
    buffer[_LENGTH.size: _LENGTH.size + len(encoded)] = encoded
    return torch.frombuffer(buffer, dtype=torch.uint8)


def _unpack(tensor: torch.Tensor, where: str) -> bytes:
    raw = tensor.numpy().tobytes()
    (length,) = _LENGTH.unpack_from(raw) if len(raw) >= _LENGTH.size else (-1,)
    if not 0 <= length <= len(raw) - _LENGTH.size:
        raise CheckpointCorruptError(f"{where}: per-rank state of {len(raw)} bytes claims {length}", where)
    return raw[_LENGTH.size: _LENGTH.size + length]


def with_rank_state(state: Mapping[str, Any], encoded: bytes, group: GroupView) -> dict[str, Any]:
    """(each rank) ``state`` with this rank's encoded state added under its key (a shallow copy).

    Raises:
        ValueError: ``state`` already has a top-level ``rank_state`` entry.
    """
    clash = [k for k in state if k == RANK_STATE_PREFIX[:-1] or k.startswith(RANK_STATE_PREFIX)]
    if clash:
        raise ValueError(f"the state dict has {clash[0]!r}, the name per-rank state is saved under; rename it")
    return {**state, rank_state_key(group.rank, group.world_size): _pack(encoded)}


def _saved_ranks(saved: Mapping[str, Any], where: str) -> tuple[int, dict[int, str]]:
    """The saving world size and each saving rank's key (``(0, {})``: no per-rank state)."""
    ranks: dict[int, str] = {}
    worlds = set()
    for key in saved:
        match = _KEY.fullmatch(key) if key.startswith(RANK_STATE_PREFIX) else None
        if match is None:
            continue  # not a name dcp_ext gives per-rank state: the caller's own key
        md = saved[key]
        if (not isinstance(md, TensorStorageMetadata) or md.properties.dtype != torch.uint8 or len(md.size) != 1
                or int(match.group(1)) >= int(match.group(2))):
            raise CheckpointCorruptError(f"{where}: {key!r} is not per-rank state as dcp_ext saves it", where)
        ranks[int(match.group(1))] = key
        worlds.add(int(match.group(2)))
    if len(worlds) > 1:
        raise CheckpointCorruptError(f"{where}: per-rank state of several world sizes {sorted(worlds)}", where)
    return (worlds.pop() if worlds else 0), ranks


class RankStateLoadPlanner(LayoutLoadPlanner):
    """:class:`~dcp_ext.planners.LayoutLoadPlanner` that also reads the
    checkpoint's per-rank state by the rule of this module.

    Every rank constructs one and, after the load, calls :meth:`rank_state`.

    Args:
        strict: As for :class:`~dcp_ext.planners.LayoutLoadPlanner`.
        group: The group that loads (ranks and world size; the scatter of a rule's output).
        rule: How to carry ``N`` saved states to another world size (``None``: refuse).
        **options: The other :class:`~dcp_ext.planners.LayoutLoadPlanner` arguments.

    Attributes:
        saved_world_size: The world size that saved the per-rank state
            (``0``: none; set in ``set_up_planner``).
    """

    def __init__(self, strict: bool = True, *, group: GroupView | None = None, rule: RankStateRule | None = None,
                 **options: Any) -> None:
        super().__init__(strict, **options)
        self.group = group if group is not None else GroupView()
        self.rule = rule
        self.saved_world_size = 0
        self._buffers: dict[int, torch.Tensor] = {}
        self._where = "the checkpoint"

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        """(all ranks) DCP's set-up, then add the per-rank keys this rank reads.

        Raises:
            RankStateMismatchError: Per-rank state of another world size and no rule.
        """
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if metadata is None:
            return
        saved = metadata.state_dict_metadata
        self._where = where = getattr(metadata.storage_meta, "checkpoint_id", None) or "the checkpoint"
        self.saved_world_size, keys = _saved_ranks(saved, where)
        if not keys:
            return
        n, m, rank = self.saved_world_size, self.group.world_size, self.group.rank
        if n != m and self.rule is None:
            raise RankStateMismatchError(
                f"{where} holds per-rank state (rank_state) saved by {n} rank(s), but {m} rank(s) load it: "
                f"say how to carry it with rank_state_rule= (dcp_ext.redistribute_dataloader for a "
                f"StatefulDataLoader over a DistributedSampler, or a function from the {n} saved states and "
                f"{m} to {m} states; `lambda states, m: [None] * m` discards it)", where)
        wanted = ([rank] if rank in keys else []) if n == m else (sorted(keys) if rank == 0 else [])
        if not self.flatten_state_dict:
            self.state_dict = dict(self.state_dict)  # never add keys to the caller's dict
        for r in wanted:
            md = saved[keys[r]]
            assert isinstance(md, TensorStorageMetadata)
            self._buffers[r] = self.state_dict[keys[r]] = torch.empty(tuple(md.size), dtype=torch.uint8)
        if self.keys is not None:
            self._exact = self._exact | {keys[r] for r in wanted}
        # Other ranks' keys are not this rank's to load: hidden, so a flat
        # state dict does not see them as unexpected.
        others = {keys[r] for r in keys if r not in self._buffers}
        self.metadata = dataclasses.replace(
            metadata, state_dict_metadata={k: v for k, v in saved.items() if k not in others})

    def _decode(self, rank: int) -> Any:
        where = f"{self._where}: {rank_state_key(rank, self.saved_world_size)}"
        return decode_user_content(_unpack(self._buffers[rank], where), where)

    def rank_state(self) -> Any:
        """(all ranks, after the load; collective when a rule redistributes)
        This rank's per-rank state, ``None`` when the checkpoint has none.

        Raises:
            RankStateMismatchError: The rule returned a number of states other than the world size.
            UnsafeUserContentError: The rule returned a value that cannot be stored without pickle.
            Exception: What the rule raised (on every rank).
        """
        n, group = self.saved_world_size, self.group
        if n == 0:
            return None
        if n == group.world_size:
            return self._decode(group.rank) if group.rank in self._buffers else None
        rule = self.rule
        assert rule is not None  # set_up_planner refused the load otherwise
        outputs: list[bytes] = []

        def redistribute() -> None:
            states = [self._decode(r) if r in self._buffers else None for r in range(n)]
            new = list(rule(states, group.world_size))
            if len(new) != group.world_size:
                raise RankStateMismatchError(
                    f"rank_state_rule returned {len(new)} state(s) from the {n} saved; the {group.world_size} "
                    f"loading rank(s) need one each", self._where)
            outputs.extend(encode_rank_state(state) for state in new)

        group.run_on_coordinator(redistribute)  # the rule's error, if any, raised on every rank
        mine = outputs[0] if outputs else b""
        if group.distributed:
            received: list[Any] = [None]
            src = dist.get_global_rank(group.group, 0) if group.group is not None else 0
            dist.scatter_object_list(received, outputs if group.is_coordinator else None, src=src, group=group.group)
            mine = received[0]
        return decode_user_content(mine, f"{self._where}: per-rank state for rank {group.rank}")


# -- the built-in rule: torchdata's StatefulDataLoader over a DistributedSampler --------------

_ITER = "_sampler_iter_state"
_SAMPLES = "samples_yielded"
_SAMPLER = "sampler_state"
_NUM = "_num_yielded"


def _share(total: int, rank: int, world_size: int) -> int:
    """How many of the global positions ``0 .. total-1`` a ``DistributedSampler``
    gives rank ``rank`` of ``world_size`` (position ``p`` goes to rank ``p % world_size``)."""
    return max(0, -(-(total - rank) // world_size))


def _consumed(state: Any, rank: int) -> int:
    """Samples rank ``rank``'s loader took from its sampler, from its ``state_dict()``."""
    def refuse(why: str) -> RankStateMismatchError:
        return RankStateMismatchError(f"redistribute_dataloader: the state saved by rank {rank} {why}")

    if not isinstance(state, dict):
        raise refuse(f"is a {type(state).__name__}, not a StatefulDataLoader.state_dict()")
    if "_snapshot" in state:
        raise refuse("is a multi-process loader's (num_workers > 0); this rule handles num_workers=0: "
                     "write a rank_state_rule for it")
    if not isinstance(state.get(_NUM), int):
        raise refuse("is not a StatefulDataLoader.state_dict() (it has no _num_yielded count)")
    inner = state.get(_ITER)
    if not isinstance(inner, dict) or not isinstance(inner.get(_SAMPLES), int) or inner[_SAMPLES] < 0:
        raise refuse("has no sampler position (StatefulDataLoader(batch_size=...) over a DistributedSampler "
                     "records one; a batch_sampler= of your own does not)")
    if set(inner) - {_SAMPLES, _SAMPLER} or any(state.get(k) is not None for k in
                                                 ("_index_sampler_state", "dataset_state", "fetcher_state")):
        raise refuse("holds sampler or dataset state of its own, which this rule cannot split")
    if _SAMPLER in inner and not (isinstance(inner[_SAMPLER], dict) and set(inner[_SAMPLER]) == {"yielded"}):
        raise refuse(f"has a sampler state {inner[_SAMPLER]!r} other than a StatefulDistributedSampler's")
    samples: int = inner[_SAMPLES]
    return samples


def redistribute_dataloader(states: Sequence[Any], world_size: int) -> list[Any]:
    """The built-in ``rank_state_rule`` for torchdata's ``StatefulDataLoader`` over a ``DistributedSampler``.

    ``states[r]`` is ``loader.state_dict()`` of saved rank ``r``, whose loader
    was ``StatefulDataLoader(dataset, batch_size=B, sampler=DistributedSampler(
    dataset, num_replicas=N, rank=r, ...))`` (map-style dataset,
    ``num_workers=0``; torch's ``DistributedSampler`` or torchdata's
    ``StatefulDistributedSampler``). The loaders at the new world size ``M``
    must use the same dataset, ``shuffle``, ``seed``, epoch and ``drop_last``.

    ``DistributedSampler`` arithmetic: with the epoch's global order ``G``
    (``randperm`` of ``seed + epoch``, or ``0..len-1``; padded or cut to a
    multiple of the world size), rank ``r`` of ``W`` yields ``G[r], G[r+W],
    G[r+2W], ...``. When the saved ranks took ``c_r`` samples each, they took
    the global positions ``0 .. C-1`` with ``C = sum(c_r)`` (checked: each
    ``c_r`` must be ``ceil((C - r) / N)``, else :class:`RankStateMismatchError`).
    The global count ``C`` carries over: new rank ``j`` skips
    ``s_j = ceil((C - j) / M)`` samples of its own sequence, so it yields
    ``G[p]`` for the positions ``p = j, j+M, ...`` with ``p >= C``, in order:
    exactly what rank ``j`` of a run at ``M`` ranks that never stopped yields
    from global position ``C`` on. The ranks together take every position from
    ``C`` on once (below the padding, which is the new world size's). When
    ``M`` does not divide ``C``, ranks ``j < C mod M`` start one sample later;
    batches then start at ``s_j`` (one batch may straddle the old boundary).
    Batch counters become ``ceil(s_j / B)``; the rest of the state (shared
    seed, ``_iterator_finished``) is saved rank 0's.

    Returns:
        One ``state_dict()`` per new rank, for ``loader.load_state_dict``.

    Raises:
        RankStateMismatchError: A state this rule cannot split (num_workers > 0,
            a sampler or dataset with state of its own, not a prefix of the global order).
    """
    n = len(states)
    consumed = [_consumed(state, r) for r, state in enumerate(states)]
    total = sum(consumed)
    if n == 0 or consumed != [_share(total, r, n) for r in range(n)]:
        raise RankStateMismatchError(
            f"redistribute_dataloader: the {n} saved loaders took {consumed} samples, which is not the first "
            f"{total} positions of one global order (that would be {[_share(total, r, n) for r in range(n)]}); "
            f"were they saved at the same step, with DistributedSampler(num_replicas={n}, rank=r)?")
    batch = max((-(-c // s[_NUM]) for c, s in zip(consumed, states) if s.get(_NUM)), default=0)
    finished = all(bool(s.get("_iterator_finished")) for s in states)
    out = []
    for j in range(world_size):
        skip = _share(total, j, world_size)
        inner = {**states[0][_ITER], _SAMPLES: skip}
        if _SAMPLER in inner:
            inner[_SAMPLER] = {"yielded": skip}
        batches = -(-skip // batch) if batch else 0
        out.append({**states[0], _ITER: inner, _NUM: batches, "_sampler_iter_yielded": batches,
                    "_iterator_finished": finished})
    return out
