"""Storage backends: where checkpoint bytes live.

:func:`open_store` picks the backend from the path: a plain path or
``file://`` URL is :class:`LocalStore`, ``s3://`` is :class:`S3Store`, any
other fsspec URL is :class:`FsspecStore`.
"""

from __future__ import annotations

import os
from typing import Any

from ..config import IOConfig
from ..errors import InvalidPathError
from ._base import (
    TMP_MARK,
    IncompleteUpload,
    IOStats,
    IOStatsSnapshot,
    ObjectWriter,
    Store,
)
from ._ranges import Piece, ReadRequest, box_runs, plan_requests, run_starts
from ._s3_client import clear_client_cache
from .fsspec_store import FsspecStore
from .local import LocalStore
from .s3 import S3Store

__all__ = [
    "Piece",
    "ReadRequest",
    "box_runs",
    "plan_requests",
    "run_starts",
    "Store",
    "ObjectWriter",
    "IOStats",
    "IOStatsSnapshot",
    "IncompleteUpload",
    "TMP_MARK",
    "LocalStore",
    "S3Store",
    "FsspecStore",
    "open_store",
    "normalize_path",
    "join_path",
    "clear_client_cache",
]

_S3_SCHEMES = ("s3://", "s3a://", "s3n://")


def normalize_path(path: str | os.PathLike[str]) -> str:
    """The checkpoint location as a string: a local path or an fsspec URL.

    Raises:
        InvalidPathError: ``path`` is empty (or ``file://`` alone). An empty
            string would name the current directory, where a save writes and
            leftover cleanup deletes (issue 32): pass ``"."`` to mean it.
    """
    text = os.fspath(path)
    if text.startswith("file://"):
        text = text[len("file://"):]
    if not text:
        raise InvalidPathError(
            f"empty checkpoint path {os.fspath(path)!r}: pass a directory or URL (\".\" for the current directory)",
            os.fspath(path),
        )
    return text


def join_path(root: str | os.PathLike[str], name: str) -> str:
    """``root`` + ``/`` + ``name`` for paths and URLs alike."""
    text = normalize_path(root)
    if "://" in text:
        return f"{text.rstrip('/')}/{name}"
    return os.path.join(text, name)


def open_store(
    path: str | os.PathLike[str],
    config: IOConfig,
    storage_options: dict[str, Any] | None = None,
    filesystem: Any = None,
) -> Store:
    """Open the store for ``path``.

    Args:
        path: Local path, ``file://``, ``s3://`` or any fsspec URL.
        config: I/O tunables.
        storage_options: Options for the fsspec/s3fs file system (S3 endpoint,
            credentials, region ...). Not used for local paths.
        filesystem: An fsspec file system from an earlier store of the same
            URL kind, to reuse (S3 clients are cached per options instead).
    """
    text = normalize_path(path)
    if text.startswith(_S3_SCHEMES):
        return S3Store("s3://" + text.split("://", 1)[1], config, storage_options)
    if "://" in text:
        return FsspecStore(text, config, storage_options, filesystem)
    return LocalStore(text, config)
