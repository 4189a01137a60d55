"""Tiered partial checkpoints: commit in node-local tiers, drain to the root, restore from the fastest copy.

Made by :class:`~dcp_ext.CheckpointManager` only when ``local_tier`` is given
(creating it is collective). See :mod:`dcp_ext.tiers` for the tiers
themselves; this part sequences them for each save and restore.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import itertools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._runtime import GroupView, NodeMap, RankWatch, watched_group
from ..dcp_io import (
    AsyncSaveHandle,
    CheckpointReader,
    CheckpointWriter,
    run_save,
    start_async_save,
)
from ..dcp_io._watched import rank_failure
from ..errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    DcpExtError,
    PostCommitError,
    StorageFullError,
)
from ..incremental import IncrementalSave
from ..layout import TagInfo, validate_tag
from ..metadata import METADATA_FILE
from ..planners import LayoutSavePlanner
from ..root import CheckpointRoot, RetentionPolicy
from ..storage import Store
from ..storage.tiered import TieredStore
from ..tiers import (
    DRAIN_PHASES,
    LocalTier,
    RestorePlan,
    drain,
    plan_restore,
    raise_if_any,
    refers_elsewhere,
)
from ._context import ManagerContext
from ._in_flight import InFlight
from ._options import IncrementalOptions, TierOptions
from ._partial import CommitFiles, PartialCheckpoints
from ._requests import ResumeResult, SaveRequest, app_state

__all__ = ["TieredCheckpoints"]

log = logging.getLogger("dcp_ext.manager")

#: Bytes a rank may write beside its tensors in one save (headers, metadata, partition).
_SMALL_FILES_ALLOWANCE = 1 << 20
#: The steps of a tiered save after its local ``dcp.save``, in order (each
#: ``*ed`` one: this rank's part is over, it waits for the others).
SAVE_STEPS = ("local_commit", "local_committed", "share", "shared", "replicate", "replicated", "local_newest",
              "local_newest_set", "done")
#: The steps of a tiered restore before its load (which has its own watch).
RESTORE_STEPS = ("inventory", "heal", "healed", "done")
_CHECK_STEPS = ("room", "done")
_Phase = Callable[[str], None]


class TieredCheckpoints:
    """Partial checkpoints that commit in every node's local tier first
    (all ranks call each method; creating one is collective).

    Args:
        ctx: Where and how the manager saves (its groups already those of a tiered manager).
        in_flight: The manager's save in flight and stager.
        partial: The manager's partial checkpoints in the root (saves that do
            not fit the tiers go there; restores load through it).
        options: The tier options (``options.local_tier`` is set).
        incremental: Whether saves are incremental.
        async_uploads: Must be ``"thread"`` for asynchronous tiered saves.
    """

    def __init__(self, ctx: ManagerContext, in_flight: InFlight, partial: PartialCheckpoints, options: TierOptions,
                 incremental: IncrementalOptions, async_uploads: str) -> None:
        assert options.local_tier is not None
        self.ctx = ctx
        self.in_flight = in_flight
        self.partial = partial
        self.options = options
        self.incremental = incremental
        self.async_uploads = async_uploads
        group = ctx.group
        self.local = LocalTier(options.local_tier, ctx.config, NodeMap.gather(group), group)
        # Drains run their collectives while later saves run theirs: a group of their own.
        self._drain_group = None
        if group.distributed:
            ranks = group.global_ranks() or list(range(dist.get_world_size()))
            self._drain_group = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True,
                                               timeout=datetime.timedelta(seconds=ctx.config.collective_timeout))
        self._drains = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dcp_ext-drain")
        self._tier_steps = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dcp_ext-tiers")
        self._saves = 0
        self._draining: set[str] = set()
        self._last_drain: concurrent.futures.Future[None] | None = None
        #: Where the last restore read each tag from.
        self.last_restore_plan: RestorePlan | None = None

    # -- save ------------------------------------------------------------------------
    def save(self, request: SaveRequest) -> AsyncSaveHandle | None:
        """(all ranks) Save ``request`` to every node's local tier (or, when
        some node lacks room, straight to the root, reported as
        :class:`~dcp_ext.errors.StorageFullError`), and drain it to the root
        if it is a ``persist_every``-th save or ``request.persist``."""
        ctx, options = self.ctx, self.options
        self._saves += 1
        persist = request.persist or (options.persist_every > 0 and self._saves % options.persist_every == 0)
        with self._watched(ctx.process_group, _CHECK_STEPS, "tiered save", self.local.partial_url(request.tag),
                           lambda step: f"Nothing was saved: {request.tag!r} is in no tier"):
            lacking = self.local.lacking_room(
                _state_nbytes(request.model, request.optimizer) + _SMALL_FILES_ALLOWANCE, options.local_tier_bytes,
                options.replicas)
        if lacking is not None:
            if self.incremental.enabled:
                # Its base is the root's newest: no drain may move it (or retire it) meanwhile.
                self.wait_for_drains()
            direct = self.partial.save(request)
            return self._report_full_tier(request.tag, lacking, direct)
        state = app_state(request.model, request.optimizer)
        nodes = self.local.nodes
        planner = LayoutSavePlanner(
            ctx.mesh, ctx.group.global_ranks(), nodes=[nodes.node_of(r) for r in range(nodes.world_size)],
            partners=[nodes.partner_of(n) for n in range(nodes.node_count)] if options.replicas else (),
            replicated_apart=True, key_prefixes=ctx.config.key_prefixes,
        )
        writer = CheckpointWriter(
            self.local.partial_url(request.tag), overwrite=request.overwrite, config=ctx.config,
            before_commit=CommitFiles(request.user_content, planner), compression=ctx.compression,
            # Incremental: a full local copy with each frame's hash, which the drain compares.
            incremental=IncrementalSave(max_chain=self.incremental.max_chain) if self.incremental.enabled else None,
        )
        if not request.async_save:
            run_save(state, writer, planner, ctx.process_group)
            self._after_local_save(request.tag, request.policy, persist, None)
            return None
        if self.async_uploads != "thread":
            raise ValueError("tiered saves upload in a thread (async_uploads='thread')")
        upload = start_async_save(state, writer, planner, ctx.process_group, stager=self.in_flight.stager_for())
        handle = AsyncSaveHandle(upload.staging_completion)
        persisted: concurrent.futures.Future[None] | None = concurrent.futures.Future() if persist else None
        handle.persist_completion = persisted

        def finish() -> None:
            try:
                upload.result()
                self._after_local_save(request.tag, request.policy, persist, persisted)
            except BaseException as err:  # noqa: BLE001 - the handle carries it
                handle.set_exception(err)
                if persisted is not None and not persisted.done():
                    persisted.set_exception(err)
                return
            handle.set_result(None)

        self._tier_steps.submit(finish)
        self.in_flight.track(handle)
        return handle

    def _report_full_tier(self, tag: str, lacking: str, direct: AsyncSaveHandle | None) -> AsyncSaveHandle:
        """(all ranks) ``tag`` did not fit some node's tier and was saved
        straight to the root (``direct``: its handle, ``None`` once done
        synchronously): raise, or have the returned handle raise, the same
        :class:`StorageFullError` on every rank; the root save's own outcome
        is the handle's ``persist_completion``."""
        full = StorageFullError(
            f"checkpoint {tag!r} was not saved to the local tiers: {lacking}; it is saved straight to "
            f"{self.ctx.root} instead (free space in the local tier, lower keep_local, or raise local_tier_bytes)",
            self.local.path,
        )
        log.warning("%s", full)
        if direct is None:
            raise full
        handle = AsyncSaveHandle(direct.staging_completion)
        handle.persist_completion = direct
        direct.add_done_callback(lambda _: handle.set_exception(full))
        self.in_flight.track(handle)
        return handle

    def _after_local_save(
        self,
        tag: str,
        policy: RetentionPolicy | None,
        persist: bool,
        persisted: concurrent.futures.Future[None] | None,
    ) -> None:
        """(all ranks, after the local-tier ``dcp.save`` returned on every rank)
        Commit ``tag`` on every node, move the nodes' ``newest``, apply local
        retention, and start the drain to the root if ``persist``.

        Watched (:data:`SAVE_STEPS`): a rank that dies, is cut off or stalls
        fails the save on every other rank with
        :class:`~dcp_ext.errors.RankFailedError` naming it and saying what
        became of the tag. A save whose replication fails this way is not
        committed again "with the replicas it has": the tag was committed on
        every node before any replica was sent, a replica file not completely
        received is never under its name, and across a partition no rank
        could learn which replicas the other side wrote.
        """
        local = self.local
        try:
            with self._watched(self.ctx.process_group, SAVE_STEPS, "tiered save", local.partial_url(tag),
                               lambda step: _save_outcome(tag, step)) as phase:
                local.spread_commit(tag, done=lambda: phase("local_committed"))
                phase("share")
                local.share_replicated(tag, sent=lambda: phase("shared"))
                if self.options.replicas:
                    phase("replicate")
                    local.replicate(tag, sent=lambda: phase("replicated"))
                phase("local_newest")
                with self.in_flight.lock:
                    protect = set(self._draining) | {tag}
                    if persist:
                        self._draining.add(tag)
                error = None
                try:
                    local.after_local_commit(tag, self.options.keep_local, protect)
                except DcpExtError as err:
                    error = str(err)
                phase("local_newest_set")
                try:
                    raise_if_any(self.ctx.group, error, f"moving the local tier's newest to {tag!r} / local retention")
                except DcpExtError as err:
                    raise PostCommitError(f"checkpoint {tag!r} committed in the local tier, but {err}") from err
        except BaseException:
            with self.in_flight.lock:
                self._draining.discard(tag)
            raise
        if not persist:
            return
        drained = self._drains.submit(self._drain, tag, policy)
        if persisted is not None:
            drained.add_done_callback(lambda f: _copy_outcome(f, persisted))
        with self.in_flight.lock:
            self._last_drain = drained

    def _drain(self, tag: str, policy: RetentionPolicy | None) -> None:
        try:
            with self._watched(self._drain_group, DRAIN_PHASES, "drain", self.ctx.checkpoints.partial_url(tag),
                               lambda step: _drain_outcome(tag, step, self.ctx.root)) as phase:
                drain(self.local, self.ctx.checkpoints, tag, GroupView(self._drain_group), policy,
                      max_chain=self.incremental.max_chain if self.incremental.enabled else None, phase=phase)
        except BaseException as err:
            log.warning("checkpoint %r stays in the local tier only: drain to %s failed: %s", tag, self.ctx.root, err)
            raise
        finally:
            with self.in_flight.lock:
                self._draining.discard(tag)

    def wait_for_drains(self, forget: bool = False) -> None:
        """(all ranks) Wait for the last drain to the root (its failure is its
        handle's); ``forget``: no longer track it afterwards."""
        with self.in_flight.lock:
            last = self._last_drain
            if forget:
                self._last_drain = None
        if last is not None:
            try:
                last.result()
            except BaseException as err:  # noqa: BLE001 - reported by that save's own handle
                log.warning("the last drain to %s failed: %s", self.ctx.root, err)

    def close(self) -> None:
        """(all ranks, after the drains were waited for) Stop the tier's threads."""
        self._drains.shutdown(wait=True)
        self._tier_steps.shutdown(wait=True)

    # -- restore ---------------------------------------------------------------------
    def resume(
        self,
        tag: str | None,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        strict: bool,
        allow_dtype_cast: bool,
    ) -> ResumeResult:
        """(all ranks) Restore the newest tag readable from the local tiers or the root (or ``tag``)."""
        if tag is not None:
            validate_tag(tag)
        ctx, local = self.ctx, self.local
        root = ctx.checkpoints
        where = local.partial_url(tag) if tag is not None else local.path
        with self._watched(ctx.process_group, RESTORE_STEPS, "tiered restore", where, _restore_outcome) as phase:
            inventories = local.gather_inventories()

            def root_tags() -> tuple[list[TagInfo], str | None]:
                # The persistent tier being down must not stop a restore that the local tiers can serve.
                try:
                    return (root.committed() if root.exists() else []), None
                except (DcpExtError, OSError) as err:
                    return [], f"{type(err).__name__}: {err}"

            persisted, unreachable = ctx.group.run_on_coordinator(root_tags)
            if unreachable is not None:
                log.warning("cannot list the persistent root %s (%s); restoring from the local tiers only",
                            root.url, unreachable)
            plan = plan_restore(inventories, persisted, local.nodes, tag)
            if plan is None:
                places = f"the local tiers or {root.url}" + (f" (unreachable: {unreachable})" if unreachable else "")
                what = f"checkpoint {tag!r}" if tag is not None else "committed checkpoint"
                raise CheckpointNotFoundError(f"no {what} readable from {places}", root.url)
            # A root copy written by an incremental drain refers to other tags'
            # files: its data files are not the local ones, so the two copies are
            # never mixed file by file (dcp_ext.tiers._incremental_drain).
            apart = plan.in_root and ctx.group.run_on_coordinator(lambda: _root_refers(root, plan.tag))
            if plan.fetches:
                phase("heal")
                local.heal(plan, inventories, sent=lambda: phase("healed"))
        sources: list[tuple[str, Store]] = []
        if local.node in plan.local_nodes | plan.healed_nodes and not (apart and not plan.local_complete):
            sources.append(("local", local.checkpoints.partial_store(plan.tag)))
        if plan.in_root and not (apart and sources):
            sources.append(("root", root.partial_store(plan.tag)))
        self.last_restore_plan = plan
        reader = self._reader(sources)
        if not apart:
            return self.partial.load(plan.tag, model, optimizer, strict, allow_dtype_cast, reader)
        failure: Exception | None = None
        try:
            result = self.partial.load(plan.tag, model, optimizer, strict, allow_dtype_cast, reader)
        except Exception as err:  # noqa: BLE001 - decided on every rank alike below
            failure = err
        with self._watched(ctx.process_group, _CHECK_STEPS, "tiered restore", local.partial_url(plan.tag),
                           lambda step: "The model may hold part of it"):
            damaged = ctx.group.all_gather(isinstance(failure, (CheckpointCorruptError, CheckpointNotFoundError))
                                           and sources[0][0] == "local")
        if not any(damaged):
            if failure is not None:
                raise failure
            return result
        # A damaged (or vanished) local copy: the whole tag again from the root.
        log.warning("the local copy of %s cannot be read (%s); loading it from %s", plan.tag,
                    failure or "on another node", root.url)
        reader = self._reader([("root", root.partial_store(plan.tag))])
        return self.partial.load(plan.tag, model, optimizer, strict, allow_dtype_cast, reader)

    def _reader(self, sources: list[tuple[str, Store]]) -> CheckpointReader:
        """A reader over the tiers in ``sources``. Each node reads the files
        in its own tier; read-once could make a rank owner of bytes only
        another node holds locally, so it is off."""
        store = TieredStore(sources)
        return CheckpointReader(self.ctx.location.at(store.describe()), store=store, read_once=False)

    @contextlib.contextmanager
    def _watched(self, group: Any, steps: tuple[str, ...], what: str, path: str,
                 outcome: Callable[[str], str]) -> Iterator[_Phase]:
        """(all ranks of ``group``; collective the first time for it) Run the
        block's collectives watched, as ``dcp.save`` and ``dcp.load`` are
        (:mod:`dcp_ext._runtime.rank_watch`): each rank reports the step it
        is in (the callable this yields, with one of ``steps``) and a
        heartbeat; when a collective fails (the group's bound is
        ``collective_timeout``), every surviving rank raises
        :class:`~dcp_ext.errors.RankFailedError` naming the ranks that did not
        arrive, their hosts, the step and ``outcome(step)``: what became of
        the checkpoint. Another rank's dcp_ext error passes unchanged (every
        rank raises it already)."""
        timeout = self.ctx.config.collective_timeout
        watched = watched_group(group, timeout)
        # The heartbeat of a group bounded by ``timeout`` (as rank_watch picks for
        # its own groups): the manager made these groups with it, and a survivor
        # reads the others' records 1.5 heartbeats apart before it raises.
        watcher = None if watched is None else RankWatch(
            watched, steps, interval=max(1.0, min(5.0, timeout / 10), len(watched.members) / 500))
        failed = True
        try:
            yield watcher.phase if watcher is not None else _no_phase
            failed = False
        except Exception as exc:
            step = watcher.phase_name if watcher is not None else ""
            error = rank_failure(watcher, exc, exc, what, path, lambda: outcome(step))
            if error is exc:
                raise
            raise error from error.__cause__
        finally:
            if watcher is not None:
                watcher.close(ok=not failed)


def _no_phase(step: str) -> None:
    """The step reporter of an unwatched block (one process)."""


def _save_outcome(tag: str, step: str) -> str:
    """What became of ``tag`` when its tiered save failed at ``step`` (:data:`SAVE_STEPS`)."""
    if step in ("local_commit", "local_committed"):
        return (f"Checkpoint {tag!r} is committed in the local tier of rank 0's node and maybe of others (a restore "
                f"reads it only where every rank's files are); nothing was drained to the root")
    if step in ("share", "shared", "replicate", "replicated"):
        return (f"Checkpoint {tag!r} is committed in every node's local tier (a restore reads it from there); its "
                f"replicas on partner nodes may be incomplete (a replica not completely received is never read); "
                f"nothing was drained to the root")
    return (f"Checkpoint {tag!r} is committed and replicated in every node's local tier; some nodes' newest or "
            f"local retention may not be updated; nothing was drained to the root")


def _drain_outcome(tag: str, step: str, root: str) -> str:
    """What became of ``tag`` when its drain to ``root`` failed at ``step`` (:data:`~dcp_ext.tiers.DRAIN_PHASES`)."""
    if step == "drain_commit":
        return (f"Checkpoint {tag!r} is in the local tiers; rank 0 was committing it to {root}: it is there if "
                f"rank 0 finished (the root's newest moves only then)")
    return f"Checkpoint {tag!r} stays in the local tiers only: nothing was committed to {root}, its newest is unchanged"


def _restore_outcome(step: str) -> str:
    """What became of a tiered restore that failed at ``step`` (:data:`RESTORE_STEPS`)."""
    if step in ("heal", "healed"):
        return "Nothing was loaded; files already fetched from partner nodes are complete copies in their tiers"
    return "Nothing was loaded"


def _copy_outcome(source: concurrent.futures.Future[None], target: concurrent.futures.Future[None]) -> None:
    """Give ``target`` the outcome of the finished ``source``."""
    error = source.exception()
    if error is None:
        target.set_result(None)
    else:
        target.set_exception(error)


def _state_nbytes(model: nn.Module | None, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of this rank's shards of the model's and optimizer's tensors:
    what a save writes at most (uncompressed)."""
    seen: set[int] = set()
    total = 0

    def add(value: Any) -> None:
        nonlocal total
        if isinstance(value, torch.Tensor) and id(value) not in seen:
            seen.add(id(value))
            local = value.to_local() if hasattr(value, "to_local") else value
            total += local.numel() * local.element_size()

    if model is not None:
        for value in itertools.chain(model.parameters(), model.buffers()):
            add(value)
    if optimizer is not None:
        for per_param in optimizer.state.values():
            for value in per_param.values():
                add(value)
    return total


def _root_refers(root: CheckpointRoot, tag: str) -> bool:
    """(coordinator) Whether the root's copy of ``tag`` refers to other
    checkpoints' files (an incremental drain's): ``False`` if unreadable."""
    store = root.partial_store(tag)
    try:
        return refers_elsewhere(store.read_file(METADATA_FILE), store.describe(METADATA_FILE))
    except (DcpExtError, OSError):
        return False
