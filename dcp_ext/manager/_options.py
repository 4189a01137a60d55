"""The manager's option groups, checked when made: :class:`TierOptions`, :class:`IncrementalOptions`."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..incremental import DEFAULT_MAX_CHAIN
from ..storage import normalize_path

__all__ = ["TierOptions", "IncrementalOptions", "ASYNC_UPLOADS"]

#: Where an asynchronous save's upload may run.
ASYNC_UPLOADS = ("thread", "process")


@dataclass(frozen=True)
class TierOptions:
    """How partial saves use a node-local tier (see :class:`~dcp_ext.CheckpointManager`).

    Attributes:
        local_tier: This node's local-tier directory, normalized (``None``: no tiers).
        persist_every: Drain every N-th save to the root (``0``: only ``persist=True`` saves).
        keep_local: Newest tags kept in each local tier (``None``: all).
        replicas: ``1`` to keep each node's files in its partner node's tier too.
        local_tier_bytes: The most bytes this node's tier may hold (``None``: no cap).

    Raises:
        ValueError: A value out of range, or ``local_tier`` is a URL.
    """

    local_tier: str | None = None
    persist_every: int = 10
    keep_local: int | None = 2
    replicas: int = 0
    local_tier_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.persist_every < 0:
            raise ValueError(f"persist_every must be >= 0, got {self.persist_every}")
        if self.keep_local is not None and self.keep_local < 1:
            raise ValueError(f"keep_local must be >= 1 or None, got {self.keep_local}")
        if self.replicas not in (0, 1):
            raise ValueError(f"replicas must be 0 or 1, got {self.replicas}")
        if self.local_tier_bytes is not None and self.local_tier_bytes < 0:
            raise ValueError(f"local_tier_bytes must be >= 0 or None, got {self.local_tier_bytes}")
        if self.local_tier is not None and "://" in self.local_tier:
            raise ValueError(f"local_tier must be a directory on this node, got the URL {self.local_tier!r}")

    @classmethod
    def of(cls, local_tier: str | os.PathLike[str] | None, persist_every: int, keep_local: int | None,
           replicas: int, local_tier_bytes: int | None) -> TierOptions:
        """The options as the manager's keyword arguments give them."""
        url = None if local_tier is None else normalize_path(local_tier)
        return cls(url, persist_every, keep_local, replicas, local_tier_bytes)


@dataclass(frozen=True)
class IncrementalOptions:
    """Whether partial saves write only the frames that changed (:mod:`dcp_ext.incremental`).

    Attributes:
        enabled: Incremental saves on.
        max_chain: Incremental saves in a row before a self-contained one.

    Raises:
        ValueError: ``max_chain`` is negative.
    """

    enabled: bool = False
    max_chain: int = DEFAULT_MAX_CHAIN

    def __post_init__(self) -> None:
        if self.max_chain < 0:
            raise ValueError(f"max_chain must be >= 0, got {self.max_chain}")
