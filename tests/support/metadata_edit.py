"""Editing a checkpoint's JSON metadata in tests, the way an attacker (or a
buggy tool) would: change the document, then recompute its ``integrity``
checksum (which guards against damage, not against deliberate edits), so the
reader's other checks are what the test exercises."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dcp_ext.metadata import seal as sign

__all__ = ["sign", "edit_metadata"]


def edit_metadata(path: Path, change: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    """Apply ``change`` to the document at ``path`` (in place) and re-sign it."""
    doc = json.loads(path.read_text())
    change(doc)
    path.write_bytes(sign(doc))
    return doc
