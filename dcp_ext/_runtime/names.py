"""The one check for file names read from storage: plain relative names only.

Every name dcp_ext reads from a file and then opens, copies or deletes (data
files in metadata and frame indexes, Hugging Face indexes, tier partition and
inventory files, peer replicas' file lists) goes through
:func:`validate_relative_name` first, so a hostile or damaged file can never
make dcp_ext read, write or delete outside the directory it belongs to.
"""

from __future__ import annotations

import re

from ..errors import UnsafeNameError

__all__ = ["UnsafeNameError", "validate_relative_name", "validate_name_part", "MAX_NAME_LENGTH"]

#: Longest relative name accepted (all parts and separators).
MAX_NAME_LENGTH = 1024
# One path component: starts with a letter, digit or underscore (never ".",
# so no hidden files and no ".."), then letters, digits and . _ - .
_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._\-]{0,254}")


def validate_name_part(part: object, where: str, what: str = "name") -> str:
    """Return ``part`` if it is one plain path component.

    Args:
        part: The value read from storage.
        where: The file it was read from (for the message).
        what: What the name is (``"data file name"``, ``"tier file"``...).

    Raises:
        UnsafeNameError: Otherwise, naming ``where`` and the value.
    """
    if not isinstance(part, str) or not _plain(part):
        raise UnsafeNameError(
            f"{where}: {what} {part!r} is not a plain name (letters, digits and . _ - only, "
            f"not starting with '.'); refusing to use it",
            where,
        )
    return part


def validate_relative_name(name: object, where: str, what: str = "file name") -> str:
    """Return ``name`` if it is a plain relative path (``a/b.distcp``) that
    stays inside the directory it is relative to.

    Args:
        name: The value read from storage.
        where: The file it was read from (for the message).
        what: What the name is, for the message.

    Raises:
        UnsafeNameError: ``name`` is not a string, is empty or too long, is
            absolute, or has a part that :func:`validate_name_part` refuses.
    """
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LENGTH:
        raise UnsafeNameError(f"{where}: invalid {what} {name!r}", where)
    if not all(_plain(part) for part in name.split("/")):
        raise UnsafeNameError(
            f"{where}: {what} {name!r} is not a plain relative name; refusing to use it "
            f"(it could name something outside its directory)",
            where,
        )
    return name


def _plain(part: object) -> bool:
    return isinstance(part, str) and _PART.fullmatch(part) is not None and part not in (".", "..")
