"""Partial checkpoints in the root: sharded saves (incremental ones included) and resumes.

Order of a partial save (each step only after the previous one succeeded):

1. every rank streams its shards into ``{tag}_partial/`` (``dcp.save`` with
   :class:`~dcp_ext.CheckpointWriter` and :class:`~dcp_ext.planners.LayoutSavePlanner`);
2. the coordinator writes ``user_content.safetensors`` and ``partition.json``
   (:class:`CommitFiles`), then the metadata, which commits the checkpoint;
3. the coordinator points ``newest`` at the tag (:class:`PostCommit`);
4. retention deletes what its policy does not keep by the root's one rule
   (:mod:`dcp_ext.root`), then what crashed saves left behind is removed.

Steps 3-4 run inside the writer's ``finish``, so a failure there reaches
every rank through DCP, for synchronous and asynchronous saves alike.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..dcp_io import (
    AsyncSaveHandle,
    CheckpointReader,
    CheckpointWriter,
    run_load,
    run_save,
    start_async_save,
)
from ..errors import (
    CheckpointNotFoundError,
    CheckpointReplacedError,
    DcpExtError,
    NotACheckpointError,
    PostCommitError,
)
from ..format import decode_user_content
from ..guard import Lease, lock_state
from ..incremental import IncrementalSave, restart_reason
from ..layout import (
    PARTITION_FILE,
    USER_CONTENT_FILE,
    Partition,
    is_valid_tag,
    partial_dir,
    validate_tag,
)
from ..metadata import METADATA_FILE, TORCH_METADATA_FILE, read_incremental_section
from ..planners import LayoutLoadPlanner, LayoutSavePlanner
from ..planning import RankStateLoadPlanner, RankStateRule, with_rank_state
from ..root import CheckpointRoot, RetentionPolicy
from ..storage import Store
from ._context import ManagerContext
from ._in_flight import InFlight
from ._options import IncrementalOptions
from ._requests import ResumeResult, SaveRequest, app_state, read_optional

__all__ = ["PartialCheckpoints", "CommitFiles"]

log = logging.getLogger("dcp_ext.manager")

# A resume that follows ``newest`` retries this often when retention of a
# concurrent save deletes the tag it is reading.
_RESUME_ATTEMPTS = 4


class PartialCheckpoints:
    """Sharded ``{tag}_partial`` checkpoints in the root (all ranks call each method).

    Args:
        ctx: Where and how the manager saves.
        in_flight: The manager's save in flight and stager.
        incremental: Whether saves are incremental.
        async_uploads: Where an asynchronous save's upload runs (``"thread"`` or ``"process"``).
    """

    def __init__(self, ctx: ManagerContext, in_flight: InFlight, incremental: IncrementalOptions,
                 async_uploads: str) -> None:
        self.ctx = ctx
        self.in_flight = in_flight
        self.incremental = incremental
        self.async_uploads = async_uploads
        #: The planner and reader of the last resume (fast-path and key reports, bytes read).
        self.last_load_planner: LayoutLoadPlanner | None = None
        self.last_reader: CheckpointReader | None = None

    # -- save ------------------------------------------------------------------------
    def save(self, request: SaveRequest) -> AsyncSaveHandle | None:
        """(all ranks) Save ``request`` to ``ROOT/{tag}_partial/``; its handle if asynchronous."""
        ctx = self.ctx
        state = app_state(request.model, request.optimizer)
        if request.rank_state is not None:
            state = with_rank_state(state, request.rank_state, ctx.group)
        planner = LayoutSavePlanner(ctx.mesh, ctx.group.global_ranks(), key_prefixes=ctx.config.key_prefixes)
        # Both steps are picklable objects, not closures: a process-based
        # upload runs them in DCP's checkpoint process.
        incremental = self._incremental_save(request.tag) if self.incremental.enabled else None
        writer = CheckpointWriter(
            ctx.checkpoints.partial_location(request.tag),
            overwrite=request.overwrite, before_commit=CommitFiles(request.user_content, planner),
            after_commit=PostCommit(ctx.checkpoints, request.tag, request.policy), compression=ctx.compression,
            incremental=incremental,
        )
        try:
            if not request.async_save:
                run_save(state, writer, planner, ctx.process_group)
                return None
            stager = self.in_flight.stager_for(share_memory=self.async_uploads == "process")
            handle = start_async_save(state, writer, planner, ctx.groups.background(), stager=stager,
                                      uploads=self.async_uploads)
        except BaseException:
            if incremental is not None:
                incremental.end_lease()  # the writer ends it on its own failures; this covers the rest
            raise
        self.in_flight.track(handle)
        return handle

    def _incremental_save(self, tag: str) -> IncrementalSave:
        """(all ranks) The base of an incremental save of ``tag``: the tag
        ``newest`` names and its metadata document, read by the coordinator
        and broadcast (every rank compares with the same checkpoint, and
        storage serves one GET of the document, not one per rank). The
        coordinator's copy holds the root lease that pins the base until the
        save ends (:mod:`dcp_ext.guard`)."""
        leases: list[Lease] = []
        base, document = self.ctx.group.run_on_coordinator(lambda: self._incremental_base(tag, leases))
        max_chain = self.incremental.max_chain
        if base is None or base == tag:  # never build on the checkpoint being replaced
            return IncrementalSave(max_chain=max_chain)
        return IncrementalSave(self.ctx.checkpoints.partial_url(base), partial_dir(base), base, max_chain, document,
                               lease=leases[0] if leases else None)

    def _incremental_base(self, tag: str, leases: list[Lease]) -> tuple[str | None, bytes | None]:
        """(coordinator) The base of the incremental save of ``tag`` and its
        metadata document, or ``(None, None)`` to write every frame.

        The base is the tag ``newest`` names; if that is not a valid,
        committed tag (an empty or damaged ``newest``), the newest committed
        one, with a warning, as a resume does. Its lease is written before its
        save lock is checked and its metadata read, so that no deleter can
        remove what this save will refer to (appended to ``leases``).
        """
        checkpoints = self.ctx.checkpoints
        base = checkpoints.newest_record()
        if base is not None and not is_valid_tag(base):
            base = checkpoints.newest()  # warns
        for attempt in range(2):
            if base is None or base == tag:
                return None, None
            lease = Lease(checkpoints.location, tag, base)
            lease.take()
            store = checkpoints.partial_store(base)
            try:
                state = lock_state(store)
                if state is not None and state.live:
                    log.info("incremental save of %s: writing every frame, since %s is being changed (%s)",
                             tag, base, state.reason)
                    lease.end()
                    return None, None
                document = store.read_file(METADATA_FILE)
                reason = restart_reason(read_incremental_section(document, store.describe(METADATA_FILE)))
            except CheckpointNotFoundError:
                lease.end()
                if attempt == 0:  # newest names a tag that is not committed: as resume does
                    base = checkpoints.newest()  # warns
                    continue
                return None, None
            except DcpExtError as err:
                # As read_base says it when a rank finds its base damaged.
                logging.getLogger("dcp_ext.incremental").warning(
                    "incremental save of %s: writing every frame, since its base %s is damaged or unreadable: %s",
                    tag, store.url, err)
                lease.end()
                return None, None
            except BaseException:
                lease.end()
                raise
            if reason is not None:
                log.info("incremental save: starting a new chain rather than building on %s: %s", base, reason)
                lease.end()
                return None, None
            leases.append(lease)
            return base, document
        return None, None

    # -- resume ----------------------------------------------------------------------
    def resume(self, tag: str | None, model: nn.Module, optimizer: torch.optim.Optimizer | None, strict: bool,
               allow_dtype_cast: bool, rank_state_rule: RankStateRule | None = None) -> ResumeResult:
        """(all ranks) Load ``tag`` (``None``: the newest committed one) into
        ``model`` / ``optimizer``. Following ``newest``, a tag that retention
        of a concurrent save deletes while it is read is given up for the
        one ``newest`` names then."""
        group = self.ctx.group
        follow_newest = tag is None
        if tag is None:
            tag = group.run_on_coordinator(self.newest_or_raise)
        validate_tag(tag)
        for attempt in range(_RESUME_ATTEMPTS):
            try:
                return self.load(tag, model, optimizer, strict, allow_dtype_cast, rank_state_rule=rank_state_rule)
            except (CheckpointNotFoundError, NotACheckpointError, CheckpointReplacedError) as err:
                # Retention of a concurrent save can delete the tag we are
                # reading (every rank sees the failure: DCP propagates it).
                # If newest has moved on, load that one instead.
                if not follow_newest or attempt == _RESUME_ATTEMPTS - 1:
                    raise
                newer = group.run_on_coordinator(self.ctx.checkpoints.newest)
                if newer is None or newer == tag:
                    raise
                log.warning("checkpoint %s disappeared while loading (%s); loading the newest, %s", tag, err, newer)
                tag = newer
        raise AssertionError("unreachable")

    def newest_or_raise(self) -> str:
        """(coordinator) The newest committed tag.

        Raises:
            CheckpointNotFoundError: Nothing is committed under the root.
        """
        newest = self.ctx.checkpoints.newest()
        if newest is None:
            url = self.ctx.checkpoints.store.url
            raise CheckpointNotFoundError(f"no committed checkpoint under {url}: nothing to resume from", url)
        return newest

    def load(
        self,
        tag: str,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        strict: bool,
        allow_dtype_cast: bool,
        reader: CheckpointReader | None = None,
        rank_state_rule: RankStateRule | None = None,
    ) -> ResumeResult:
        """(all ranks) Load the partial checkpoint ``tag`` (through ``reader``
        if given: a tiered restore's) into ``model`` / ``optimizer`` in place,
        and its per-rank state by ``rank_state_rule`` (:mod:`dcp_ext.planning._rank_state`)."""
        ctx = self.ctx
        if reader is None:
            reader = CheckpointReader(ctx.checkpoints.partial_location(tag), process_group=ctx.group.group)
        state = app_state(model, optimizer)

        def small_files() -> tuple[bytes | None, bytes | None]:
            # Read by the coordinator before the data and shared, so that a
            # tag deleted meanwhile fails on every rank alike. A checkpoint
            # written by torch's own writers has its .metadata only.
            if not reader.store.exists(METADATA_FILE) and not reader.store.exists(TORCH_METADATA_FILE):
                raise reader.missing_metadata_error()
            return read_optional(reader.store, PARTITION_FILE), read_optional(reader.store, USER_CONTENT_FILE)

        partition_raw, user_content_raw = ctx.group.run_on_coordinator(small_files)
        partition = (
            None if partition_raw is None
            else Partition.from_json(partition_raw, reader.store.describe(PARTITION_FILE))
        )
        # A parameter that had no gradient when the checkpoint was saved has
        # no optimizer state in it; get_state_dict has made some here.
        per_param = state.get("optimizer", {}).get("state", {})
        planner = RankStateLoadPlanner(
            strict, allow_dtype_cast=allow_dtype_cast, partition=partition, world_size=ctx.group.world_size,
            mesh=ctx.mesh, optional_prefixes=[f"optimizer.state.{fqn}." for fqn in per_param],
            group=ctx.group, rule=rank_state_rule,
        )
        self.last_load_planner = planner
        self.last_reader = reader
        run_load(state, reader, planner, ctx.process_group)
        for prefix in planner.absent_prefixes:
            # As when it was saved: no state until the parameter's first step.
            del per_param[prefix[len("optimizer.state."):-1]]
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=strict))
        if optimizer is not None:
            # Not strict where parameters were left without state: torch would refuse them.
            set_optimizer_state_dict(model, optimizer, state["optimizer"],
                                     options=StateDictOptions(strict=strict and not planner.absent_prefixes))
        user_content = (
            None if user_content_raw is None
            else decode_user_content(user_content_raw, reader.store.describe(USER_CONTENT_FILE))
        )
        return ResumeResult(tag, user_content, True, planner.rank_state())


@dataclass(frozen=True)
class CommitFiles:
    """(coordinator, the writer's ``before_commit``) Write ``user_content`` and ``partition.json``.

    Attributes:
        renamed: Data files an overwrite wrote beside the old checkpoint's
            under new names (planned -> written), recorded in the partition.
    """

    user_content: bytes | None
    planner: LayoutSavePlanner
    renamed: tuple[tuple[str, str], ...] = ()

    def with_renamed(self, renamed: dict[str, str]) -> CommitFiles:
        return dataclasses.replace(self, renamed=tuple(sorted(renamed.items())))

    def __call__(self, store: Store) -> None:
        if self.user_content is not None:
            store.write_file(USER_CONTENT_FILE, self.user_content)
        if self.planner.partition is not None:
            store.write_file(PARTITION_FILE, self.planner.partition.with_files_renamed(dict(self.renamed)).to_json())


@dataclass(frozen=True)
class PostCommit:
    """(coordinator, the writer's ``after_commit``) Move ``newest``, apply retention, tidy."""

    checkpoints: CheckpointRoot
    tag: str
    policy: RetentionPolicy | None

    def __call__(self) -> None:
        tag = self.tag
        try:
            self.checkpoints.set_newest(tag)
        except DcpExtError as err:
            raise PostCommitError(f"checkpoint {tag!r} committed, but updating newest failed: {err}") from err
        if self.policy is not None:
            try:
                report = self.checkpoints.retain(self.policy, protect={tag})
            except DcpExtError as err:
                raise PostCommitError(f"checkpoint {tag!r} committed, but retention failed: {err}") from err
            for kept, reason in report.held:
                log.warning("retention keeps %r for now: %s", kept, reason)
        try:
            self.checkpoints.remove_leftovers(current=tag)
        except DcpExtError as err:  # the checkpoint is committed; this is tidying
            log.warning("could not remove leftovers under %s: %s", self.checkpoints.url, err)
