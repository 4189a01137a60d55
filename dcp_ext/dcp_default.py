"""One line to make stock DCP calls that pass only ``checkpoint_id`` use dcp_ext.

Frameworks call ``dcp.save(state, checkpoint_id=path)``, ``dcp.async_save(...,
checkpoint_id=path)`` and ``dcp.load(state, checkpoint_id=path)`` without a
storage writer or reader (torchtitan, Lightning's ``ModelParallelStrategy``),
and torch then picks its own ``FileSystemWriter``/``FsspecWriter``. With::

    import dcp_ext
    dcp_ext.use_for_dcp(storage_options={"endpoint_url": ...}, compression="zstd")

(or ``with dcp_ext.use_for_dcp(...):`` around the calls) such calls use
:class:`~dcp_ext.CheckpointWriter` / :class:`~dcp_ext.CheckpointReader` for
local paths, ``file://``, ``s3://`` and every URL scheme fsspec knows. Calls
that pass a writer or reader, and ids of any other kind, are left to torch.

What is patched (torch 2.6 to 2.14; checked before anything changes):

1. ``torch.distributed.checkpoint._storage_utils._storage_setup``, the one
   function that turns a ``checkpoint_id`` into a writer or reader, in every
   module that bound it by name: ``state_dict_saver`` (``save``) and
   ``state_dict_loader`` (``load``, ``_load_state_dict_from_keys``) import it
   with ``from ... import _storage_setup``, so the replacement goes into each
   of those module namespaces as well as ``_storage_utils`` itself. It calls
   torch's own function for everything it does not take over.
2. ``execute_save`` of ``_ThreadBasedAsyncCheckpointExecutor`` and, where
   torch has it, ``_ProcessBasedAsyncCheckpointExecutor``: ``async_save``
   hands ``checkpoint_id`` to these and the writer is chosen later, in a
   background thread (after a ``with`` block may have ended) or in a spawned
   daemon process (where no patch exists). The replacement builds the
   writer when ``async_save`` is called, in the caller's thread, and passes
   it on; :class:`~dcp_ext.CheckpointWriter` pickles, so the daemon process
   gets it too.

Before patching, the torch in use must look exactly like that: the three
bindings are one and the same function with the parameters ``(storage,
checkpoint_id, reader)``, ``save`` and ``load`` look that name up at call
time, and each executor's ``execute_save`` takes ``checkpoint_id`` and
``storage_writer``. Anything else (a torch that chooses storage elsewhere,
another library's patch already in place) raises
:class:`UnsupportedTorchError` and changes nothing.

Undoing it (leaving the ``with`` block, :meth:`DcpDefault.off`,
:func:`stop_using_for_dcp`) puts back the very objects that were there. The
settings stack: the innermost active call wins, and torch is restored when
the last one is undone.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping
from types import ModuleType, TracebackType
from typing import Any

from .dcp_io import CheckpointReader, CheckpointWriter
from .errors import UnsupportedTorchError

__all__ = ["use_for_dcp", "stop_using_for_dcp", "active_dcp_default", "DcpDefault", "UnsupportedTorchError"]

log = logging.getLogger("dcp_ext.dcp_default")

_UTILS = "torch.distributed.checkpoint._storage_utils"
_SAVER = "torch.distributed.checkpoint.state_dict_saver"
_LOADER = "torch.distributed.checkpoint.state_dict_loader"
_EXECUTORS = (
    ("torch.distributed.checkpoint._async_thread_executor", "_ThreadBasedAsyncCheckpointExecutor", True),
    ("torch.distributed.checkpoint._async_process_executor", "_ProcessBasedAsyncCheckpointExecutor", False),
)


@dataclasses.dataclass(frozen=True)
class _Settings:
    storage_options: Mapping[str, Any] | None
    compression: Any
    overwrite: bool
    writer_options: Mapping[str, Any]
    reader_options: Mapping[str, Any]

    def writer(self, checkpoint_id: str | os.PathLike[str]) -> Any:
        return CheckpointWriter(checkpoint_id, storage_options=dict(self.storage_options or {}),
                                overwrite=self.overwrite, compression=self.compression, **self.writer_options)

    def reader(self, checkpoint_id: str | os.PathLike[str]) -> Any:
        return CheckpointReader(checkpoint_id, storage_options=dict(self.storage_options or {}),
                                **self.reader_options)


class DcpDefault:
    """One active :func:`use_for_dcp` call: a context manager, or undo it with :meth:`off`.

    Made by :func:`use_for_dcp` only (its ``settings`` are that call's).

    Args:
        settings: The settings of the :func:`use_for_dcp` call.

    Attributes:
        storage_options: As given to :func:`use_for_dcp`.
        compression: As given to :func:`use_for_dcp`.
        overwrite: As given to :func:`use_for_dcp`.
    """

    def __init__(self, settings: _Settings) -> None:
        self._settings = settings
        self.storage_options = settings.storage_options
        self.compression = settings.compression
        self.overwrite = settings.overwrite

    @property
    def active(self) -> bool:
        """Whether this call is still in force (not undone)."""
        with _LOCK:
            return self in _STACK

    def off(self) -> None:
        """Undo this call (idempotent). When no other call is active, torch's
        own objects are put back."""
        with _LOCK:
            if self in _STACK:
                _STACK.remove(self)
            if not _STACK:
                _PATCH.remove()

    def __enter__(self) -> DcpDefault:
        """The call itself: ``with dcp_ext.use_for_dcp(...):`` undoes it at the end of the block."""
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Undo this call (:meth:`off`), whether or not the block raised."""
        self.off()

    def __repr__(self) -> str:
        """The call's compression, overwrite setting and whether it is active."""
        state = "active" if self.active else "off"
        return f"<dcp_ext.use_for_dcp compression={self.compression!r} overwrite={self.overwrite} ({state})>"


def use_for_dcp(
    *,
    storage_options: Mapping[str, Any] | None = None,
    compression: Any = None,
    overwrite: bool = True,
    writer_options: Mapping[str, Any] | None = None,
    reader_options: Mapping[str, Any] | None = None,
) -> DcpDefault:
    """Make ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` called with
    ``checkpoint_id=`` and no writer/reader use dcp_ext (see the module doc
    for exactly what is patched).

    Takes effect at once, in this process, for every thread; call it on every
    rank (each rank's process chooses its own storage). Use the returned
    handle as a context manager to limit it to a block, or call its
    :meth:`~DcpDefault.off`.

    Args:
        storage_options: fsspec/s3fs options for every writer and reader
            (S3 ``endpoint_url``, credentials, ``client_kwargs``...).
        compression: ``None``, ``"zstd"`` or a :class:`~dcp_ext.Codec`, for
            saves; loads need no setting.
        overwrite: Replace a committed checkpoint at the same id. ``True`` by
            default, as torch's own writers do (frameworks save the same id
            again, e.g. a ``last`` checkpoint); ``False`` is dcp_ext's own
            default elsewhere and raises ``CheckpointExistsError``.
        writer_options: More :class:`~dcp_ext.CheckpointWriter` arguments
            (``config=``, ``part_size=``, ``frame_size=``...).
        reader_options: More :class:`~dcp_ext.CheckpointReader` arguments
            (``config=``, ``verify_checksums=``, ``extension_registry=``...).

    A load on a process group other than the default one
    (``dcp.load(..., process_group=pg)``) should pass
    ``reader_options={"process_group": pg}``, which read-once loads (S3,
    fsspec, shared file systems) exchange over; the patch cannot see the
    group ``dcp.load`` was given.

    Returns:
        The handle of this call.

    Raises:
        UnsupportedTorchError: The installed torch does not choose storage
            the way this patch expects; nothing was changed.
        TypeError: An option name the writer or reader does not take.
    """
    settings = _Settings(
        storage_options=dict(storage_options) if storage_options is not None else None,
        compression=compression,
        overwrite=bool(overwrite),
        writer_options=dict(writer_options or {}),
        reader_options=dict(reader_options or {}),
    )
    _check_options(CheckpointWriter, settings.writer_options, "writer_options")
    _check_options(CheckpointReader, settings.reader_options, "reader_options")
    handle = DcpDefault(settings)
    with _LOCK:
        if not _STACK:
            _PATCH.install()
        _STACK.append(handle)
    return handle


def stop_using_for_dcp() -> None:
    """Undo every active :func:`use_for_dcp` call and put torch's own objects back."""
    with _LOCK:
        _STACK.clear()
        _PATCH.remove()


def active_dcp_default() -> DcpDefault | None:
    """The :func:`use_for_dcp` call in force (the innermost), or ``None``."""
    with _LOCK:
        return _STACK[-1] if _STACK else None


def _check_options(cls: type, options: Mapping[str, Any], what: str) -> None:
    accepted = inspect.signature(cls).parameters
    unknown = sorted(set(options) - set(accepted))
    taken = sorted(set(options) & {"path", "storage_options", "overwrite", "compression"})
    if unknown or taken:
        raise TypeError(f"{what}: {cls.__name__} takes no option(s) {unknown or taken} here "
                        f"(storage_options, compression and overwrite are arguments of use_for_dcp)")


def _current() -> _Settings | None:
    stack = _STACK
    return stack[-1]._settings if stack else None


def _is_ours(checkpoint_id: Any) -> bool:
    """Local paths, ``file://``, ``s3://`` and every protocol fsspec knows."""
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        return False
    text = os.fspath(checkpoint_id)
    if not isinstance(text, str) or not text:
        return False
    if "://" not in text:
        return True
    protocol = text.split("://", 1)[0].lower()
    if protocol in ("file", "s3", "s3a", "s3n"):
        return True
    try:
        import fsspec

        return protocol in fsspec.available_protocols()
    except Exception:  # fsspec is a dependency; a broken registry means "not ours"
        return False


class _Patch:
    """The patched objects, and the originals to put back."""

    def __init__(self) -> None:
        self.original_setup: Callable[..., Any] | None = None
        self.bound: list[ModuleType] = []
        self.executors: list[tuple[type, Callable[..., Any]]] = []

    @property
    def installed(self) -> bool:
        return self.original_setup is not None

    def install(self) -> None:
        """(caller holds ``_LOCK``) Check the torch in use, then patch it."""
        if self.installed:
            return
        original, modules, executors = _recognise_torch()

        def _storage_setup(storage: Any, checkpoint_id: Any, reader: bool = False) -> Any:
            settings = _current()
            if storage or settings is None or not checkpoint_id or not _is_ours(checkpoint_id):
                return original(storage, checkpoint_id, reader)
            chosen = settings.reader(checkpoint_id) if reader else settings.writer(checkpoint_id)
            chosen.reset(checkpoint_id)
            return chosen

        _storage_setup.__dcp_ext_patch__ = True  # type: ignore[attr-defined]
        _storage_setup.__wrapped__ = original  # type: ignore[attr-defined]
        for module in modules:
            module._storage_setup = _storage_setup  # type: ignore[attr-defined]
        self.executors = []
        for cls, execute_save in executors:
            cls.execute_save = _resolving_execute_save(execute_save)  # type: ignore[attr-defined]
            self.executors.append((cls, execute_save))
        self.original_setup = original
        self.bound = modules
        log.info("dcp_ext.use_for_dcp: patched _storage_setup in %s and execute_save of %s",
                 [m.__name__ for m in modules], [cls.__name__ for cls, _ in executors])

    def remove(self) -> None:
        """(caller holds ``_LOCK``) Put back exactly what :meth:`install` replaced."""
        if not self.installed:
            return
        for module in self.bound:
            current = getattr(module, "_storage_setup", None)
            if getattr(current, "__dcp_ext_patch__", False):
                module._storage_setup = self.original_setup  # type: ignore[attr-defined]
            else:
                log.warning("dcp_ext.use_for_dcp: %s._storage_setup was replaced by someone else "
                            "since; left as it is", module.__name__)
        for cls, execute_save in self.executors:
            if getattr(cls.__dict__.get("execute_save"), "__dcp_ext_patch__", False):
                cls.execute_save = execute_save  # type: ignore[attr-defined]
            else:
                log.warning("dcp_ext.use_for_dcp: %s.execute_save was replaced by someone else "
                            "since; left as it is", cls.__name__)
        self.original_setup = None
        self.bound = []
        self.executors = []


def _resolving_execute_save(execute_save: Callable[..., Any]) -> Callable[..., Any]:
    def patched(self: Any, staging_future_or_state_dict: Any, *args: Any, checkpoint_id: Any = None,
                storage_writer: Any = None, **kwargs: Any) -> Any:
        settings = _current()
        if storage_writer is None and checkpoint_id and settings is not None and _is_ours(checkpoint_id):
            storage_writer = settings.writer(checkpoint_id)
        return execute_save(self, staging_future_or_state_dict, *args, checkpoint_id=checkpoint_id,
                            storage_writer=storage_writer, **kwargs)

    patched.__dcp_ext_patch__ = True  # type: ignore[attr-defined]
    patched.__wrapped__ = execute_save  # type: ignore[attr-defined]
    patched.__name__ = "execute_save"
    patched.__qualname__ = getattr(execute_save, "__qualname__", "execute_save")
    patched.__doc__ = execute_save.__doc__
    return patched


def _refuse(what: str) -> UnsupportedTorchError:
    import torch

    return UnsupportedTorchError(
        f"dcp_ext.use_for_dcp does not recognise how torch {torch.__version__} chooses DCP storage: "
        f"{what}. Nothing was patched; pass storage_writer=dcp_ext.CheckpointWriter(...) / "
        f"storage_reader=dcp_ext.CheckpointReader(...) explicitly."
    )


def _recognise_torch() -> tuple[Callable[..., Any], list[ModuleType], list[tuple[type, Callable[..., Any]]]]:
    """Check the torch in use has the patch points described in the module doc.

    Returns:
        torch's ``_storage_setup``, every loaded ``torch.*`` module that binds
        it by name (the saver and loader among them), and each executor class
        with its own ``execute_save``.

    Raises:
        UnsupportedTorchError: Any of it is not as expected.
    """
    try:
        utils = importlib.import_module(_UTILS)
        saver = importlib.import_module(_SAVER)
        loader = importlib.import_module(_LOADER)
    except ImportError as err:
        raise _refuse(f"cannot import {err.name}") from err
    original: Callable[..., Any] | None = getattr(utils, "_storage_setup", None)
    if original is None or not callable(original) or getattr(original, "__dcp_ext_patch__", False):
        raise _refuse(f"{_UTILS}._storage_setup is missing or already patched")
    setup: Callable[..., Any] = original
    try:
        params = list(inspect.signature(original).parameters)
    except (TypeError, ValueError) as err:
        raise _refuse(f"{_UTILS}._storage_setup has no signature") from err
    if params != ["storage", "checkpoint_id", "reader"]:
        raise _refuse(f"{_UTILS}._storage_setup takes {params}, not (storage, checkpoint_id, reader)")
    for module, func in ((saver, "save"), (loader, "load")):
        if getattr(module, "_storage_setup", None) is not original:
            raise _refuse(f"{module.__name__}._storage_setup is not {_UTILS}._storage_setup "
                          f"(another patch, or a torch that selects storage elsewhere)")
        code = getattr(inspect.unwrap(getattr(module, func)), "__code__", None)
        if code is None or "_storage_setup" not in code.co_names:
            raise _refuse(f"{module.__name__}.{func} does not look up _storage_setup")
    bound = [utils, saver, loader]
    for name, module in list(sys.modules.items()):
        if (name.startswith("torch.") and isinstance(module, ModuleType) and module not in bound
                and getattr(module, "_storage_setup", None) is original):
            bound.append(module)
    executors: list[tuple[type, Callable[..., Any]]] = []
    for module_name, class_name, required in _EXECUTORS:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as err:
            if required:
                raise _refuse(f"{module_name}.{class_name} is missing") from err
            continue
        execute_save = cls.__dict__.get("execute_save")
        if not callable(execute_save) or getattr(execute_save, "__dcp_ext_patch__", False):
            raise _refuse(f"{class_name}.execute_save is missing or already patched")
        accepted = inspect.signature(execute_save).parameters
        if not {"checkpoint_id", "storage_writer"} <= set(accepted):
            raise _refuse(f"{class_name}.execute_save takes no checkpoint_id/storage_writer")
        executors.append((cls, execute_save))
    return setup, bound, executors


_LOCK = threading.RLock()
_STACK: list[DcpDefault] = []
_PATCH = _Patch()
