"""Plan caching that is correct by construction: :class:`PlanCache`.

DCP's own plan caching (``DefaultSavePlanner(enable_plan_caching=True)``)
compares a rank's new plan with its previous one by keys, sizes and chunks
(``_compare_save_plans``), not by dtype, and keeps its caches in class-level
dictionaries that a refused save leaves half updated. A save of the same
shapes in a new dtype then reuses metadata that records the old dtype: torch's
own reader returns wrong numbers without an error (issue 40). dcp_ext's
:class:`~dcp_ext.planners.LayoutSavePlanner` therefore does not use DCP's
caching at all, but this one:

* A rank's plan is summarised by a **fingerprint**: the xxh3-128 digest of
  its :class:`~dcp_ext.planning._plan_columns.CompactSavePlan`, which holds
  everything the metadata records of it (keys, kinds, dtypes, global sizes,
  ``requires_grad``, state-dict paths, every chunk's offsets and sizes).
* A rank whose plan has the fingerprint of its last successfully planned
  save sends only that fingerprint (a **claim**), never an empty plan.
* The coordinator reuses a cached plan only for a rank whose claim matches,
  bit for bit, the fingerprint of the plan it holds for that rank; it
  reuses its cached global plan and metadata only when every rank's claim
  matches. A claim it cannot match (its cache was dropped, or belongs to
  another save) raises :class:`~dcp_ext.errors.PlanCacheError` before
  anything is locked or written; ``dcp_ext``'s saves then plan again.
* Every answer carries the rank's files and the items it leaves to others
  explicitly; a rank always writes the items of the plan it made now.
* Entries are promoted only after the global plan succeeded (the writer's
  checks included), in ``finish_plan``. A save whose planning failed is
  noticed at the next save under the same cache key, on every rank, which
  then drops the key's entries; dcp_ext's own save calls drop them on
  every rank as soon as any failure is seen.

Which ranks call what: every rank keeps its own fingerprints; the
coordinator also keeps every rank's compact plan, the answers and the
metadata. Entries live per process, per cache key
(:meth:`~dcp_ext.planners.LayoutSavePlanner` builds it from the planner's
class, world size, mesh, ranks, tier nodes, layout and ``plan_cache_name``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from typing import Any

import xxhash
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from ..layout import Partition
from ._plan_columns import CompactSavePlan

__all__ = ["PlanClaim", "CachedGlobalPlan", "PlanCache", "fingerprint", "PLAN_CACHE"]

log = logging.getLogger("dcp_ext.planners")


def fingerprint(plan: CompactSavePlan) -> bytes:
    """The 16-byte digest of everything ``plan`` holds."""
    digest = xxhash.xxh3_128()
    digest.update(f"{plan.count}/{plan.width}/{int(plan.wide)}/{len(plan.keys)}/".encode())
    digest.update(plan.keys)
    digest.update(plan.rows)
    return digest.digest()


@dataclasses.dataclass(frozen=True)
class PlanClaim:
    """What a rank sends instead of its plan when the plan is unchanged: its fingerprint."""

    fingerprint: bytes


@dataclasses.dataclass(frozen=True)
class CachedGlobalPlan:
    """The coordinator's record of one successfully planned save.

    Attributes:
        plans: Each rank's compact plan, by rank.
        fingerprints: Their fingerprints.
        answers: The answer each rank received (files and items left to others).
        metadata: The planned metadata, as planning made it (before the
            writer's ``finish`` filled in what it stored).
        partition: The partition decision.
        writers: Which rank writes each chunk (the metadata's
            ``storage_data`` until the commit replaces it).
    """

    plans: tuple[CompactSavePlan, ...]
    fingerprints: tuple[bytes, ...]
    answers: tuple[SavePlan, ...]
    metadata: Metadata
    partition: Partition | None
    writers: Any

    def fresh_metadata(self) -> Metadata:
        """A copy of the planned metadata for one more save (the writer's
        ``finish`` sets attributes of the copy, never of the cached one)."""
        return dataclasses.replace(self.metadata, storage_data=self.writers)


class PlanCache:
    """The cached plans of one process, by cache key (see the module docstring).

    Thread-safe: an asynchronous save plans in a background thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fingerprints: dict[str, bytes] = {}
        self._global: dict[str, CachedGlobalPlan] = {}
        self._in_flight: set[str] = set()

    def begin(self, key: str) -> None:
        """(every rank, set-up) A save under ``key`` starts planning; a save
        under it that never finished planning drops the key's entries first."""
        with self._lock:
            if key in self._in_flight:
                log.info("the last save under plan cache %r did not finish planning: planning afresh", key)
                self._drop(key)
            self._in_flight.add(key)

    def claim(self, key: str, print_: bytes) -> bool:
        """(every rank) Whether this rank's plan is the one cached under ``key``."""
        with self._lock:
            return self._fingerprints.get(key) == print_

    def cached_global(self, key: str) -> CachedGlobalPlan | None:
        """(coordinator) The record of the last save planned under ``key``."""
        with self._lock:
            return self._global.get(key)

    def promote(self, key: str, print_: bytes | None, planned: CachedGlobalPlan | None) -> None:
        """(every rank, ``finish_plan``) The global plan succeeded: keep this
        rank's fingerprint (and, on the coordinator, the global record)."""
        with self._lock:
            self._in_flight.discard(key)
            if print_ is not None:
                self._fingerprints[key] = print_
            if planned is not None:
                self._global[key] = planned

    def drop(self, key: str) -> None:
        """(every rank) Forget everything cached under ``key``."""
        with self._lock:
            self._drop(key)
            self._in_flight.discard(key)

    def clear(self) -> None:
        """Forget every cached plan of this process."""
        with self._lock:
            self._fingerprints.clear()
            self._global.clear()
            self._in_flight.clear()

    def keys(self) -> Sequence[str]:
        """The keys with a cached fingerprint (tests, diagnostics)."""
        with self._lock:
            return sorted(self._fingerprints)

    def _drop(self, key: str) -> None:
        self._fingerprints.pop(key, None)
        self._global.pop(key, None)


#: The plan cache of this process, shared by every :class:`~dcp_ext.planners.LayoutSavePlanner`.
PLAN_CACHE = PlanCache()
