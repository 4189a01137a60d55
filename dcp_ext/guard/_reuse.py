"""The root's one rule for a save that replaces a tag's files: :func:`check_reuse`."""

from __future__ import annotations

from ..errors import CheckpointInUseError
from ..layout import (
    PARTIAL_SUFFIX,
    RETIRED_FILE,
    is_valid_tag,
    partial_dir,
    strays_marker,
)
from ..storage import Location, Store
from ._scan import scan_root

__all__ = ["check_reuse"]


def check_reuse(location: Location, store: Store, committed: bool) -> tuple[Store, str] | None:
    """(the saving coordinator, holding the directory's save lock) Before a
    save replaces the files of ``ROOT/{tag}_partial`` (an overwrite, or a
    save to a retired tag's name): refuse if another checkpoint refers to
    them or a save in flight builds on the tag, and otherwise mark the
    directory in the root as holding strays until the replaced files are
    gone (:func:`~dcp_ext.layout.strays_marker`).

    Args:
        location: The directory being saved to.
        store: Its store.
        committed: Whether it holds a committed checkpoint.

    Returns:
        ``(root store, marker name)`` to delete once the replaced files are
        gone, or ``None`` when the path is no tag of a root, or a new (or
        never committed) directory whose files nothing can refer to.

    Raises:
        CheckpointInUseError: The files are in use; nothing was changed.
    """
    path, parent, directory = location.url, location.parent(), location.name
    if parent is None or not directory.endswith(PARTIAL_SUFFIX) or not is_valid_tag(directory[: -len(PARTIAL_SUFFIX)]):
        return None
    if not committed and not store.exists(RETIRED_FILE):
        return None  # a new directory, or an uncommitted one: nothing refers to its files
    tag = directory[: -len(PARTIAL_SUFFIX)]
    root = parent.open()
    scan = scan_root(root, lambda t: parent.child(partial_dir(t)).open())
    reason = scan.pinned_by(tag)
    if reason is not None:
        raise CheckpointInUseError(f"cannot save {path} again now: {reason}. Nothing was changed", path)
    referrers = scan.referrers(tag)
    if referrers:
        raise CheckpointInUseError(
            f"{path} holds data files that the incremental checkpoint(s) {', '.join(referrers)} refer to: "
            f"saving {tag!r} again would break them. Nothing was changed; save under a new tag, or delete "
            f"(or compact) {', '.join(referrers)} first",
            path,
        )
    marker = strays_marker(tag)
    root.write_file(marker, b"{}")
    return root, marker
