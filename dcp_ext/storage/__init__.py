"""Storage backends: where checkpoint bytes live.

A :class:`Location` (URL, storage options, config, backend options) opens its
store through the factory registered for its scheme (:func:`register_store`,
or the entry point group ``dcp_ext.stores``): a plain path or ``file://`` URL
is :class:`LocalStore`, ``s3://`` is :class:`S3Store`, ``az://``/``abfs[s]://``
:class:`AzureStore`, ``gs://``/``gcs://`` :class:`GCSStore`, any other URL without
a store of its own the generic :class:`FsspecStore`. A new store is one
module with a :class:`Store` subclass and one registration.
"""

from __future__ import annotations

import os
from typing import Any

from ..config import IOConfig
from ._base import (
    TMP_MARK,
    IncompleteUpload,
    IOStats,
    IOStatsSnapshot,
    ObjectWriter,
    Store,
)
from ._ranges import Piece, ReadRequest, box_runs, plan_requests, run_starts
from ._location import Location, join_path, normalize_path
from ._registry import (
    ENTRY_POINT_GROUP,
    FALLBACK_SCHEME,
    LOCAL_SCHEME,
    StoreFactory,
    register_store,
    registered_schemes,
    store_factory,
)
from ._s3_client import clear_client_cache
from ._s3_options import S3Options
from ._azure_options import AzureOptions
from ._gcs_options import GCSOptions
from .azure import AzureStore
from .fsspec_store import FsspecStore
from .gcs import GCSStore
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
    "Location",
    "S3Options",
    "AzureStore",
    "AzureOptions",
    "GCSStore",
    "GCSOptions",
    "StoreFactory",
    "register_store",
    "registered_schemes",
    "store_factory",
    "ENTRY_POINT_GROUP",
    "normalize_path",
    "join_path",
    "clear_client_cache",
]

def _local(url: str, config: IOConfig, storage_options: dict[str, Any], options: Any) -> Store:
    return LocalStore(url, config)


def _s3(url: str, config: IOConfig, storage_options: dict[str, Any], options: Any) -> Store:
    return S3Store("s3://" + url.split("://", 1)[1], config, storage_options, options)


def _fsspec(url: str, config: IOConfig, storage_options: dict[str, Any], options: Any) -> Store:
    return FsspecStore(url, config, storage_options)


# The built-in schemes, registered as a third party's would be.
register_store(LOCAL_SCHEME, _local)
register_store(("s3", "s3a", "s3n"), _s3)
register_store(("az", "abfs", "abfss"), AzureStore)
register_store(("gs", "gcs"), GCSStore)
register_store(FALLBACK_SCHEME, _fsspec)


def open_store(
    path: str | os.PathLike[str],
    config: IOConfig,
    storage_options: dict[str, Any] | None = None,
    filesystem: Any = None,
) -> Store:
    """Open the store for ``path`` (what :meth:`Location.open` does, for callers
    that have no :class:`Location`).

    Args:
        path: Local path, ``file://``, ``s3://`` or any registered or fsspec URL.
        config: I/O tunables.
        storage_options: The backend's options (S3 endpoint, credentials, region ...).
            Not used for local paths.
        filesystem: For the fsspec store: a file system from an earlier store
            of the same URL kind, to reuse.
    """
    location = Location(os.fspath(path), dict(storage_options or {}), config)
    if filesystem is not None and store_factory(location.scheme) is _fsspec:
        return FsspecStore(location.url, config, storage_options, filesystem)
    return location.open()
