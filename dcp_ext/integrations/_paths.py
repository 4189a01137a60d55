"""Checkpoint locations that frameworks pass through ``pathlib.Path``.

Megatron-Core (``load_tensors_metadata``) and torch_checkpointing (every
``Storage`` call) hand the adapters ``Path(location)``, and
``Path("s3://bucket/x")`` is the local path ``s3:/bucket/x``: the second
slash is gone. :func:`location` gives the URL back, for the schemes fsspec
knows (``s3``, ``gs``, ``memory``...); any other text is a local path and
stays as it is.
"""

from __future__ import annotations

import os
import re

import fsspec

__all__ = ["location"]

# A scheme of two characters or more (``C:/x`` is a Windows drive), one slash.
_COLLAPSED = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/(?!/)")


def location(path: str | os.PathLike[str]) -> str:
    """``path`` as a string, with a URL that ``pathlib.Path`` collapsed
    (``s3:/bucket/x``) restored (``s3://bucket/x``)."""
    text = os.fspath(path)
    match = _COLLAPSED.match(text)
    if match is None:
        return text
    scheme = match.group(1).lower()
    if scheme == "file":  # Path("file:///tmp/x") is "file:/tmp/x": the local path /tmp/x
        return text[len("file:"):]
    if scheme in fsspec.available_protocols():
        return f"{match.group(1)}://{text[match.end():]}"
    return text
