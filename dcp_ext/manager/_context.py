"""What every part of a manager shares: where it saves, how, and with which process groups."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .._runtime import GroupView
from ..config import IOConfig
from ..format import Codec
from ..layout import MeshInfo
from ..root import CheckpointRoot
from ..storage import Location

__all__ = ["Groups", "ManagerContext"]


class Groups:
    """The process groups of a manager.

    Args:
        process_group: The group that saves and loads (``None``: the default group).
        collective_timeout: The bound of the collectives of the groups made
            here (``IOConfig.collective_timeout``).
    """

    def __init__(self, process_group: Any, collective_timeout: float = 600.0) -> None:
        self.process_group = process_group
        self.view = GroupView(process_group)
        self.collective_timeout = collective_timeout
        self._own: Any = None

    def background(self) -> Any:
        """(all ranks; collective the first time) The group for collectives
        that run on background threads (DCP's upload, tier steps): the
        caller's ``process_group``, else a gloo group of the manager's own,
        made on first use. Training runs its own collectives meanwhile; on
        the default group the two could interleave differently per rank."""
        if self.process_group is not None or not self.view.distributed:
            return self.process_group
        if self._own is None:
            self._own = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.collective_timeout))
        return self._own

    def for_tiers(self) -> Groups:
        """(all ranks; collective) The groups of a tiered manager: the local
        commit, replication and drains run collectives on background threads
        too, so without a ``process_group`` every collective goes to a group
        of the manager's own."""
        if self.process_group is None and self.view.distributed:
            return Groups(self.background(), self.collective_timeout)
        return self


@dataclass(frozen=True)
class ManagerContext:
    """Where and how a manager's parts save and load (the same on every rank).

    Attributes:
        location: The root (URL, storage options, I/O config): every store
            and checkpoint of the manager is opened from it.
        groups: The manager's process groups.
        mesh: The device mesh as plain data (``None``: none given).
        compression: Codec of partial checkpoints (``None``: raw).
        checkpoints: The root's tags, ``newest``, deletion.
    """

    location: Location
    groups: Groups
    mesh: MeshInfo | None
    compression: Codec | None
    checkpoints: CheckpointRoot

    @property
    def root(self) -> str:
        """The root URL, normalized."""
        return self.location.url

    @property
    def config(self) -> IOConfig:
        """I/O tunables."""
        return self.location.config

    @property
    def process_group(self) -> Any:
        return self.groups.process_group

    @property
    def group(self) -> GroupView:
        return self.groups.view
