"""A process group as dcp_ext uses it: rank, barrier, and "run on the coordinator, share the outcome".

Outside ``torch.distributed`` (one process, no process group) every call
works as for a group of one.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist

from ..errors import DcpExtError

__all__ = ["GroupView"]

T = TypeVar("T")


@dataclass(frozen=True)
class GroupView:
    """Ranks of one process group (``None``: the default group, or one process).

    Attributes:
        group: The ``torch.distributed`` process group.
    """

    group: Any = None

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if self.distributed else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if self.distributed else 1

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def global_ranks(self) -> list[int] | None:
        """Global rank of each rank of the group; ``None`` for the default group."""
        if not self.distributed or self.group is None:
            return None
        return [dist.get_global_rank(self.group, r) for r in range(self.world_size)]

    def barrier(self) -> None:
        """(all ranks) Wait for every rank."""
        if self.distributed:
            dist.barrier(group=self.group)

    def broadcast(self, value: T) -> T:
        """(all ranks) The coordinator's ``value`` on every rank."""
        if not self.distributed:
            return value
        holder = [value]
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast_object_list(holder, src=src, group=self.group)
        return holder[0]

    def all_gather(self, value: T) -> list[T]:
        """(all ranks) Every rank's ``value`` (picklable), by group rank."""
        if not self.distributed:
            return [value]
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, value, group=self.group)
        return every

    def run_on_coordinator(self, fn: Callable[[], T]) -> T:
        """(all ranks) Run ``fn`` on the coordinator; every rank returns its value
        or raises its error.

        The error travels by pickle (dcp_ext errors pickle by message); one
        that cannot is raised on the other ranks as a :class:`DcpExtError`
        with its type and message. ``fn`` must not call collectives.
        """
        outcome: tuple[bool, Any] | None = None
        shared: tuple[bool, Any] | None = None
        if self.is_coordinator:
            try:
                outcome = (True, fn())
            except Exception as err:  # noqa: BLE001 - shared, then raised on every rank
                outcome = (False, err)
            shared = outcome
            if self.distributed:
                try:
                    pickle.dumps(outcome)
                except Exception:  # noqa: BLE001 - send what can travel
                    ok, value = outcome
                    shared = (False, DcpExtError(f"{type(value).__name__}: {value}")) if not ok else outcome
        if self.distributed:
            shared = self.broadcast(shared)
        if self.is_coordinator:
            shared = outcome  # the original objects, with their tracebacks
        assert shared is not None
        ok, value = shared
        if ok:
            return value  # type: ignore[no-any-return]
        raise value
