"""What a save does to the checkpoint it replaces, and to its own files after a failure.

An ``overwrite=True`` save writes beside the checkpoint it replaces
(:func:`assign_beside`): the old one stays committed, and loadable, while the
new data is written, and is un-committed only when every byte of the new one
is durable. After the commit, :func:`remove_replaced` deletes the old
checkpoint's files the new one does not use. After a failure,
:func:`committed_with` tells a rank whether the checkpoint at its path is
its own save's after all (then its files stay). Which ranks call what: the
coordinator, except :func:`committed_with` (each rank).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from torch.distributed.checkpoint.planner import SavePlan

from ..config import IOConfig
from ..errors import CheckpointNotFoundError, DcpExtError
from ..layout import DATA_SUFFIX, RETIRED_FILE, FileAssignment, spread_name
from ..metadata import METADATA_FILE, decode_metadata
from ..storage import TMP_MARK, Store

__all__ = ["assign_beside", "uncommit", "remove_replaced", "committed_with", "save_outcome"]

log = logging.getLogger("dcp_ext.writer")


def assign_beside(plans: Sequence[SavePlan], taken: set[str], config: IOConfig) -> tuple[list[SavePlan], dict[str, str]]:
    """(coordinator, ``prepare_global_plan``) Every rank's plan with its data
    files named (a prefix for plans not made by dcp_ext's planner), each name
    the directory already holds (``taken``) replaced by a free generation of
    it (``model_rank0.distcp`` -> ``model_rank0.g1.distcp``).

    Returns:
        The plans, and the names replaced (planned -> written).
    """
    renamed: dict[str, str] = {}
    answers = []
    for rank, plan in enumerate(plans):
        assignment = plan.storage_data
        if not isinstance(assignment, FileAssignment):
            assignment = FileAssignment(prefix=spread_name(f"__{rank}_", rank, config.key_prefixes))
        if taken:
            assignment, moved = assignment.avoiding(taken, config.files_per_rank)
            renamed.update(moved)
        answers.append(plan if assignment is plan.storage_data else dataclasses.replace(plan, storage_data=assignment))
    return answers, renamed


def uncommit(store: Store, names: Sequence[str]) -> None:
    """(coordinator, ``finish``) Un-commit the checkpoint a save replaces (its
    metadata files, torch's first): until now it stayed loadable."""
    for name in names:
        store.delete(name)


def remove_replaced(store: Store, keep: set[str], strays: tuple[Store, str] | None) -> None:
    """(coordinator, holding the lock, after the commit) Delete the data files
    of the checkpoint this one replaced that it does not use, temporary
    files, a retired marker, then the root's strays marker."""
    try:
        for name in store.list_tree():  # data files under key prefixes too
            stale_data = name.endswith(DATA_SUFFIX) and name not in keep
            if stale_data or TMP_MARK in name or name == RETIRED_FILE:
                store.delete(name)
        if strays is not None:
            strays[0].delete(strays[1])
    except Exception as err:  # the checkpoint is committed; this is tidying
        log.warning("could not remove leftover files in %s: %s", store.url, err)


def committed_with(store: Store, names: Sequence[str]) -> bool:
    """(each rank, after a failed save) Whether the checkpoint at ``store`` is
    committed and names any of ``names``: this save committed after all. A
    committed checkpoint that names none of them is the one an overwrite
    failed to replace, and ``names`` are garbage.

    Raises:
        DcpExtError: The metadata cannot be read or decoded.
    """
    try:
        document = store.read_file(METADATA_FILE)
    except CheckpointNotFoundError:
        return False
    return not set(decode_metadata(document, store.describe(METADATA_FILE)).files).isdisjoint(names)


def save_outcome(store: Store, written: Sequence[str]) -> str:
    """(each rank, after a failed save) What became of the checkpoint at
    ``store``, given the files this rank wrote, for messages."""
    try:
        if committed_with(store, written):
            return "The checkpoint committed before the failure"
        if store.exists(METADATA_FILE):
            return "Nothing of this save was committed; the checkpoint it replaces is unchanged"
    except DcpExtError as err:
        return f"Whether it committed is unknown ({err})"
    return "Nothing was committed (a manager's newest is unchanged)"
