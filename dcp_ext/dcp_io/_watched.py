"""dcp_ext's saves and loads on a watched group: bounded collectives, the failed rank named.

:func:`watch` puts a save or load on the group :func:`~dcp_ext._runtime.rank_watch.watched_group`
gives (collectives bounded by ``IOConfig.collective_timeout``) with a
:class:`~dcp_ext._runtime.RankWatch` reporting its phases; :func:`rank_failure`
turns what a failed one raised into the error to raise: a
:class:`~dcp_ext.errors.RankFailedError` naming the ranks and hosts that did
not arrive when a collective failed, or another rank's dcp_ext error with
that rank and host named. Every rank calls both.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from .._runtime import RankWatch, watched_group
from ..config import IOConfig
from ..errors import DcpExtError, RankFailedError, unwrap_checkpoint_exception

__all__ = ["watch", "rank_failure"]

log = logging.getLogger("dcp_ext.rank_watch")


def watch(process_group: Any, config: IOConfig, phases: tuple[str, ...]) -> tuple[Any, RankWatch | None]:
    """(every rank; collective the first time for a group) The group to run on, and its watch."""
    watched = watched_group(process_group, config.collective_timeout)
    if watched is None:
        return process_group, None
    return watched.group, RankWatch(watched, phases)


def rank_failure(
    watcher: RankWatch | None, exc: BaseException, error: BaseException, what: str, path: str,
    outcome: Callable[[], str] | None = None,
) -> BaseException:
    """(every rank, after a failed save or load) The error to raise instead of ``error``.

    Args:
        watcher: The operation's watch (``None``: not watched; ``error`` is returned).
        exc: What DCP raised (a ``CheckpointException`` holds every rank's failure).
        error: The error dcp_ext would raise for it.
        what: ``"save"`` or ``"load"``, for the message.
        path: The checkpoint.
        outcome: For saves: says what became of the checkpoint.
    """
    if watcher is None or isinstance(error, (KeyboardInterrupt, SystemExit, RankFailedError)):
        return error
    if isinstance(error, DcpExtError):
        return _with_its_rank(watcher, exc, error)
    if _a_rank_raised_its_own(exc):
        return error  # every rank arrived: DCP gathered that rank's error for all
    culprits, step = watcher.culprits()
    if not culprits:
        return error
    timeout = watcher.watched.timeout
    bound = f"within collective_timeout ({timeout:g} s)" if timeout is not None else "(the process group's timeout)"
    told = outcome() if outcome is not None else ""
    failed = RankFailedError(
        f"{what} of {path} failed at step {step!r}: {'; '.join(c.describe() for c in culprits)} did not arrive "
        f"{bound}{'. ' + told if told else ''} ({type(error).__name__}: {str(error).splitlines()[0][:200]})",
        path, tuple(c.member.rank for c in culprits), tuple(c.member.host for c in culprits), step,
    )
    failed.__cause__ = error
    return failed


def _a_rank_raised_its_own(exc: BaseException) -> bool:
    """Whether DCP gathered a rank's own failure (not a failed collective):
    then every rank arrived, and nobody is missing."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return False
    for entry in failures.values():
        raised = entry[0] if isinstance(entry, tuple) else entry
        if isinstance(raised, BaseException) and not _is_transport_error(raised):
            return True
    return False


def _is_transport_error(err: BaseException) -> bool:
    """A failed collective or rendezvous (gloo, NCCL, the store, a timeout)."""
    if isinstance(err, dist.DistError):
        return True
    text = str(err).lower()
    return isinstance(err, (RuntimeError, TimeoutError, ConnectionError)) and any(
        word in text for word in ("gloo", "nccl", "timed out", "connection", "socket", "store")
    )


def _with_its_rank(watcher: RankWatch, exc: BaseException, error: DcpExtError) -> BaseException:
    """The rank's dcp_ext error that failed the operation, its message starting with
    that rank and host (on every rank, the failing one too: one message everywhere)."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return error
    for rank, entry in failures.items():
        raised = entry[0] if isinstance(entry, tuple) else entry
        if isinstance(raised, BaseException) and unwrap_checkpoint_exception(raised) is error:
            if not 0 <= rank < len(watcher.watched.members):
                return error
            try:
                named = type(error)(f"{watcher.watched.members[rank].describe()}: {error}", error.path)
            except TypeError:
                return error
            named.__cause__ = error.__cause__
            return named
    return error
