"""``dcp_ext.save`` / ``dcp_ext.load``: stock DCP with dcp_ext storage and errors.

These call ``torch.distributed.checkpoint.save``/``load`` with a
:class:`CheckpointWriter`/:class:`CheckpointReader` through
:mod:`dcp_ext.dcp_io._calls`, and differ in two ways:

* a failure raises the underlying error (a :class:`~dcp_ext.errors.DcpExtError`
  where storage is at fault) instead of DCP's ``CheckpointException``, which
  derives from ``BaseException`` and escapes ``except Exception``;
* a failed save deletes the data files every rank committed, so nothing
  orphaned stays behind (the metadata, the commit marker, was never written);
* each rank may save state of its own (``rank_state=``: dataloader
  position, RNG states), which ``load`` returns by the rule of
  :mod:`dcp_ext.planning._rank_state` (at another world size: an error, or
  ``rank_state_rule=``).

Call them on every rank of the process group, like ``dcp.save``/``dcp.load``.
"""

from __future__ import annotations

import os
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner

from ._runtime import GroupView
from .config import IOConfig
from .dcp_io import CheckpointReader, CheckpointWriter, run_load, run_save
from .format import Codec
from .planning import RankStateLoadPlanner, RankStateRule, encode_rank_state, with_rank_state

__all__ = ["save", "load"]


def save(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    overwrite: bool = False,
    planner: SavePlanner | None = None,
    process_group: Any = None,
    config: IOConfig | None = None,
    compression: str | Codec | None = None,
    rank_state: Any = None,
    **io_options: Any,
) -> Metadata:
    """(all ranks) Save ``state_dict`` to ``path`` with :class:`CheckpointWriter`.

    Args:
        state_dict: What to save, as for ``dcp.save``.
        path: Local path, ``s3://`` or fsspec URL of the checkpoint directory.
        storage_options: fsspec/s3fs options.
        overwrite: Replace a committed checkpoint at ``path``.
        planner: A DCP ``SavePlanner``; DCP's default one if ``None``.
        process_group: Group to save with; the default group if ``None``.
        config: I/O tunables; ``io_options`` (``part_size=``, ...) override it.
        compression: ``None`` (raw), ``"zstd"``, a :class:`~dcp_ext.ZstdCodec`
            or any :class:`~dcp_ext.Codec`; loads need no setting.
        rank_state: This rank's own state (``None``: none), of the types
            ``user_content`` takes (no pickle); stored under the key
            ``rank_state.{rank}_of_{world}`` (so ``state_dict`` must have no
            top-level ``rank_state``). :func:`load` returns it.

    Returns:
        The checkpoint's DCP metadata.
    """
    if rank_state is not None:
        state_dict = with_rank_state(state_dict, encode_rank_state(rank_state), GroupView(process_group))
    writer = CheckpointWriter(
        path, storage_options=storage_options, overwrite=overwrite, config=config, compression=compression,
        **io_options
    )
    return run_save(state_dict, writer, planner, process_group)


def load(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    planner: LoadPlanner | None = None,
    process_group: Any = None,
    config: IOConfig | None = None,
    strict: bool = True,
    rank_state_rule: RankStateRule | None = None,
    **io_options: Any,
) -> Any:
    """(all ranks) Load ``path`` into ``state_dict`` in place with :class:`CheckpointReader`.

    The other arguments are as for :func:`save`.

    Args:
        state_dict: The state to fill, as for ``dcp.load`` (its tensors are
            loaded in place, resharded to their layout).
        path: Local path, ``s3://`` or fsspec URL of the checkpoint directory.
        planner: A DCP ``LoadPlanner``; by default
            :class:`~dcp_ext.planners.LayoutLoadPlanner` (DCP's default with
            clear key/shape/dtype errors, and non-tensor values unpickled
            with ``weights_only=True``).
        strict: Passed to the default planner: refuse keys the checkpoint lacks.
        rank_state_rule: With the default planner, at a world size other than
            the save's: ``rule(saved_states, world_size) -> states``, or
            :func:`~dcp_ext.redistribute_dataloader` (see
            :meth:`CheckpointManager.resume <dcp_ext.CheckpointManager.resume>`).

    Returns:
        This rank's ``rank_state`` (``None`` if the checkpoint has none, or
        with a ``planner`` of your own).

    Raises:
        RankStateMismatchError: The checkpoint holds per-rank state of another
            world size and no ``rank_state_rule`` is given (before anything is read).
    """
    reader = CheckpointReader(path, storage_options=storage_options, config=config, **io_options)
    if planner is not None:
        if rank_state_rule is not None:
            raise ValueError("rank_state_rule needs the default planner (planner=None)")
        run_load(state_dict, reader, planner, process_group)
        return None
    # LayoutLoadPlanner (non-tensor values unpickled with weights_only=True) that also reads rank_state.
    ours = RankStateLoadPlanner(strict, group=GroupView(process_group), rule=rank_state_rule)
    run_load(state_dict, reader, ours, process_group)
    return ours.rank_state()
