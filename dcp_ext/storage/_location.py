"""Where a checkpoint lives, as one value: :class:`Location`.

A location is a URL (or a local path), the backend's ``storage_options``
(credentials, endpoint...), the :class:`~dcp_ext.IOConfig` and, optionally,
the backend's own options object (:class:`~dcp_ext.storage.S3Options`...).
It is built once from what a caller gave (:meth:`Location.of`) and handed
down whole: every part of dcp_ext that opens a store opens it from a
location (:meth:`Location.open`), so a path never travels without its options.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from ..config import IOConfig
from ..errors import InvalidPathError
from ._base import Store
from ._registry import scheme_of, store_factory

__all__ = ["Location", "normalize_path", "join_path"]


def normalize_path(path: str | os.PathLike[str]) -> str:
    """The checkpoint location as a string: a local path or a URL.

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


@dataclass(frozen=True)
class Location:
    """A checkpoint location: URL, storage options, I/O config, backend options.

    Attributes:
        url: A local path or a URL (``s3://``, ``gs://``, ``az://``, any
            registered or fsspec scheme), normalized.
        storage_options: The backend's options (S3 endpoint and
            credentials, a GCS token, an Azure account...).
        config: I/O tunables.
        options: The backend's own options object (:class:`~dcp_ext.storage.S3Options`,
            ...); ``None`` for its defaults, derived from ``config``.
    """

    url: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    config: IOConfig = field(default_factory=IOConfig.from_env)
    options: Any = None

    def __post_init__(self) -> None:
        """Normalize ``url`` (see :func:`normalize_path`) and copy ``storage_options``."""
        object.__setattr__(self, "url", normalize_path(self.url))
        object.__setattr__(self, "storage_options", dict(self.storage_options or {}))

    @classmethod
    def of(cls, where: str | os.PathLike[str] | Location, storage_options: dict[str, Any] | None = None,
           config: IOConfig | None = None, options: Any = None) -> Location:
        """The location of ``where``: a :class:`Location` as it is (then the
        other arguments must not be given), else a path or URL with them.

        Raises:
            ValueError: A :class:`Location` came with storage options or options of its own.
            InvalidPathError: An empty path.
        """
        if isinstance(where, Location):
            if storage_options or options is not None:
                raise ValueError("pass storage_options and options in the Location, not beside it")
            return where if config is None or config == where.config else dataclasses.replace(where, config=config)
        return cls(os.fspath(where), dict(storage_options or {}), config or IOConfig.from_env(), options)

    @property
    def scheme(self) -> str:
        """The URL scheme (``"file"`` for a local path)."""
        return scheme_of(self.url)

    @property
    def name(self) -> str:
        """The last part of the path (``step1_partial`` of ``s3://b/root/step1_partial``)."""
        return self.url.rstrip("/").rpartition("/")[2]

    def open(self) -> Store:
        """The store rooted here, from the backend registered for the scheme
        (:func:`~dcp_ext.storage.register_store`)."""
        return store_factory(self.scheme)(self.url, self.config, dict(self.storage_options), self.options)

    def child(self, name: str) -> Location:
        """The location ``name`` inside this one (``root.child("step1_partial")``)."""
        return dataclasses.replace(self, url=join_path(self.url, name))

    def parent(self) -> Location | None:
        """The location this one is inside (a bucket itself for ``s3://bucket/a``);
        ``None`` for a bucket, a file system's top, or a relative path's first part."""
        text = self.url.rstrip("/")
        if "://" in text:
            scheme, rest = text.split("://", 1)
            head, sep, _ = rest.rpartition("/")
            return dataclasses.replace(self, url=f"{scheme}://{head}") if sep and head else None
        head, sep, _ = text.rpartition("/")
        return dataclasses.replace(self, url=head or "/") if sep else None

    def at(self, url: str | os.PathLike[str]) -> Location:
        """Another URL with this location's options (a sibling checkpoint of the same root)."""
        return dataclasses.replace(self, url=os.fspath(url))

    def with_config(self, config: IOConfig) -> Location:
        """This location with other I/O tunables."""
        return dataclasses.replace(self, config=config)

    def __str__(self) -> str:
        """The URL, as messages show it."""
        return self.url
