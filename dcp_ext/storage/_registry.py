"""Which store serves which URL scheme: :func:`register_store`.

Every backend, dcp_ext's own included, is a **factory** registered for one
or more URL schemes: ``factory(url, config, storage_options, options) ->
Store``. ``url`` is the location as given (a plain path for local disk),
``config`` the :class:`~dcp_ext.IOConfig`, ``storage_options`` the caller's
mapping of backend options (credentials, endpoint...), and ``options`` the
backend's own frozen options object (:class:`~dcp_ext.storage.S3Options`...)
or ``None`` for its defaults.

A third-party package adds a scheme without touching dcp_ext, either by
calling :func:`register_store` when it is imported, or through the entry
point group ``dcp_ext.stores`` (name: the scheme; value: the factory), which
is read the first time an unknown scheme is opened::

    [project.entry-points."dcp_ext.stores"]
    myfs = "my_package.store:open_myfs_store"

Schemes not registered at all go to the generic fsspec store
(:class:`~dcp_ext.storage.FsspecStore`), whose save lock is only as safe as
the file system's exclusive create.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from importlib import metadata
from typing import Any, Protocol

from ..config import IOConfig
from ._base import Store

__all__ = ["StoreFactory", "register_store", "store_factory", "registered_schemes", "ENTRY_POINT_GROUP", "scheme_of"]

log = logging.getLogger("dcp_ext.storage")

#: The entry point group third-party stores register in.
ENTRY_POINT_GROUP = "dcp_ext.stores"
#: The scheme of plain local paths (and ``file://`` URLs).
LOCAL_SCHEME = "file"
#: Where a scheme nobody registered goes.
FALLBACK_SCHEME = "*"


class StoreFactory(Protocol):
    """Opens the store of one URL (see the module docstring)."""

    def __call__(self, url: str, config: IOConfig, storage_options: dict[str, Any],
                 options: Any | None) -> Store:
        """Open the store rooted at ``url``.

        Args:
            url: The location's normalized URL (a local path for the ``file`` scheme).
            config: I/O tunables.
            storage_options: The backend's options (endpoint, credentials...), a copy the store may keep.
            options: The backend's own options object, or ``None`` for its defaults.

        Returns:
            The :class:`Store` rooted at ``url``.
        """
        ...


_FACTORIES: dict[str, Callable[..., Store]] = {}
_LOCK = threading.Lock()
_ENTRY_POINTS_READ = False


def scheme_of(url: str) -> str:
    """The URL's scheme, lower case (``"file"`` for a plain path)."""
    head, sep, _ = url.partition("://")
    return head.lower() if sep and head and "/" not in head else LOCAL_SCHEME


def register_store(schemes: str | Iterable[str], factory: Callable[..., Store], *, replace: bool = False) -> None:
    """Make ``factory`` open the URLs of ``schemes`` (``"gs"`` or ``["az", "abfs"]``).

    Args:
        schemes: The URL scheme(s), without ``://``.
        factory: ``factory(url, config, storage_options, options) -> Store``.
        replace: Replace a factory already registered for a scheme (else
            that is an error: two packages claiming one scheme is a mistake).

    Raises:
        ValueError: A scheme is malformed, or taken and ``replace`` is False.
    """
    names = [schemes] if isinstance(schemes, str) else list(schemes)
    with _LOCK:
        for scheme in names:
            key = scheme.lower()
            if not key or not (key == FALLBACK_SCHEME or key.replace("+", "").replace("-", "").replace(".", "").isalnum()):
                raise ValueError(f"not a URL scheme: {scheme!r}")
            known = _FACTORIES.get(key)
            if known is not None and known is not factory and not replace:
                raise ValueError(f"the scheme {key!r} is already served by {_name(known)}; pass replace=True "
                                 f"to serve it with {_name(factory)}")
            _FACTORIES[key] = factory


def store_factory(scheme: str) -> Callable[..., Store]:
    """The factory that opens ``scheme`` (an entry point's, loaded on first
    use; the fsspec store for a scheme nobody registered)."""
    key = scheme.lower()
    with _LOCK:
        found = _FACTORIES.get(key)
    if found is None:
        _read_entry_points()
        with _LOCK:
            found = _FACTORIES.get(key) or _FACTORIES[FALLBACK_SCHEME]
    return found


def registered_schemes() -> list[str]:
    """Every scheme with a factory of its own (entry points included)."""
    _read_entry_points()
    with _LOCK:
        return sorted(k for k in _FACTORIES if k != FALLBACK_SCHEME)


def _read_entry_points() -> None:
    global _ENTRY_POINTS_READ
    if _ENTRY_POINTS_READ:
        return
    _ENTRY_POINTS_READ = True
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            factory = entry.load()
        except Exception as err:  # noqa: BLE001 - one broken plug-in must not break every other scheme
            log.warning("could not load the dcp_ext store %r (%s): %s", entry.name, entry.value, err)
            continue
        with _LOCK:
            _FACTORIES.setdefault(entry.name.lower(), factory)


def _name(factory: Callable[..., Store]) -> str:
    return f"{getattr(factory, '__module__', '?')}.{getattr(factory, '__qualname__', repr(factory))}"
