"""Load a whole checkpoint without a template: :func:`load_whole`.

``dcp.load`` fills a state dict that the caller built (a model's and an
optimizer's ``state_dict()``), so every tensor has a home of the right shape
before a byte is read. Converting a checkpoint, inspecting one, or restoring a
framework checkpoint whose contents are not known in advance (a Lightning
``CheckpointIO``, ``dcp_to_torch_save``) has no such template. This module
builds one from the checkpoint's metadata, one empty tensor per stored key,
and lets DCP's load machinery and :class:`~dcp_ext.CheckpointReader` read into
it, each stored chunk with ranged reads straight into its destination.

DCP flattens a nested state dict on save and records each flattened key's
original path in ``Metadata.planner_data``, so the nesting comes back. What
DCP does not keep is the type of mapping keys: it records ``str(key)``, so an
optimizer's ``state`` (``{0: {...}, 1: {...}}`` from ``optimizer.state_dict()``)
comes back keyed ``'0'``, ``'1'`` and ``optimizer.load_state_dict`` silently
orphans it. :func:`load_whole` restores those keys (see
:func:`restore_optimizer_keys` for the exact rule). Empty containers are not
stored by DCP at all; an optimizer's empty ``state`` is restored, any other
empty dict or list is absent from the result.

Works for every checkpoint :class:`~dcp_ext.CheckpointReader` reads: dcp_ext's
own (uncompressed, compressed, incremental), torch's ``FileSystemWriter`` /
``FsspecWriter`` ones (``extension_registry=`` for their stream extensions),
and safetensors folders (flat keys).
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from .dcp_io import CheckpointReader
from .errors import (
    CheckpointCorruptError,
    CheckpointKeyError,
    DcpExtError,
    unwrap_checkpoint_exception,
)

__all__ = ["load_whole", "restore_optimizer_keys", "WholeStatePlanner"]


class WholeStatePlanner(DefaultLoadPlanner):
    """A DCP ``LoadPlanner`` that builds the state it loads from the metadata.

    Pass it to ``dcp.load`` with an empty dict, then call
    :meth:`finish_load` for the nested state (optimizer keys not yet
    restored: :func:`load_whole` does that). Every rank that calls ``dcp.load`` with it
    (all ranks of the group, or one process with ``no_dist=True``) allocates
    and reads the whole selected state.

    Args:
        keys: Load only these: top-level names (``"model"``), flattened keys
            (``"optimizer.state.0.exp_avg"``) or flattened prefixes ending in
            ``"."`` (``"model.layers.0."``). ``None`` loads everything.
        weights_only: Decode non-tensor values with ``torch.load(...,
            weights_only=True)`` (plain data only: the default, safe for
            checkpoints of unknown origin). ``False`` unpickles anything:
            only for checkpoints you trust.
    """

    def __init__(self, keys: Collection[str] | None = None, *, weights_only: bool = True) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.keys = None if keys is None else frozenset(keys)
        self.weights_only = weights_only
        #: The nested state being filled (``{}`` until ``set_up_planner``).
        self.result: dict[str, Any] = {}
        self._paths: dict[str, tuple[Any, ...]] = {}

    def _wanted(self, fqn: str, path: tuple[Any, ...]) -> bool:
        if self.keys is None or fqn in self.keys or (path and str(path[0]) in self.keys):
            return True
        return any(key.endswith(".") and fqn.startswith(key) for key in self.keys)

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        """(every loading rank) Allocate one tensor per stored tensor key and
        a placeholder per non-tensor value."""
        if state_dict:
            raise ValueError("WholeStatePlanner fills an empty dict: pass {} to dcp.load")
        if metadata is None:
            raise CheckpointCorruptError("the checkpoint reader returned no metadata")
        mappings = metadata.planner_data if isinstance(metadata.planner_data, Mapping) else {}
        flat: dict[str, Any] = {}
        for fqn, meta in metadata.state_dict_metadata.items():
            path = mappings.get(fqn)
            path = tuple(path) if isinstance(path, (tuple, list)) and path else (fqn,)
            if not self._wanted(fqn, path):
                continue
            if isinstance(meta, TensorStorageMetadata):
                flat[fqn] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
            else:
                flat[fqn] = None  # filled by load_bytes
            self._paths[fqn] = path
        if self.keys is not None and not flat:
            raise CheckpointKeyError(
                f"none of the keys {sorted(self.keys)} is in the checkpoint (it holds "
                f"{sorted({k.split('.', 1)[0] for k in metadata.state_dict_metadata})[:20]})"
            )
        self.original_state_dict = state_dict
        self.state_dict = flat
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        """(every loading rank) Read every selected item whole."""
        assert self.metadata is not None
        return create_default_local_load_plan(self.state_dict, self.metadata, True)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Decode one non-tensor value (``weights_only`` as configured)."""
        fqn = read_item.dest_index.fqn
        try:
            self.state_dict[fqn] = torch.load(value, weights_only=self.weights_only)
        except Exception as err:
            hint = (" (loading it would need arbitrary unpickling; pass weights_only=False "
                    "for a checkpoint you trust)") if self.weights_only else ""
            raise CheckpointCorruptError(f"checkpoint value {fqn!r} could not be decoded{hint}: {err}",
                                         fqn) from err

    def finish_load(self) -> dict[str, Any]:
        """(after ``dcp.load`` returns) Nest the flat values along their
        recorded paths into :attr:`result` and return it. DCP has no hook at
        the end of a load, so the caller calls this."""
        result: dict[str, Any] = {}
        for fqn, value in self.state_dict.items():
            _set_path(result, self._paths[fqn], value)
        self.result = result
        return result


def _set_path(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    """``root[p0][p1]... = value``, creating dicts for string parts and lists
    for integer parts (DCP's ``OBJ_PATH``: list indices stay ints)."""
    container: Any = root
    for here, after in zip(path, path[1:]):
        empty: Any = [] if type(after) is int else {}
        if isinstance(container, list):
            while len(container) <= here:
                container.append(None)
            if container[here] is None:
                container[here] = empty
            container = container[here]
        else:
            container = container.setdefault(here, empty)
    last = path[-1]
    if isinstance(container, list):
        while len(container) <= last:
            container.append(None)
    container[last] = value


def restore_optimizer_keys(state: Any) -> Any:
    """Give optimizer state dicts back their integer parameter keys, in place.

    The rule: a mapping with a ``"param_groups"`` list whose groups list their
    ``"params"`` is an optimizer state dict; a key of its ``"state"`` that is
    the decimal string of one of those params when they are integers
    (``'3'`` for ``params=[..., 3, ...]``) becomes that integer. Keys that are
    parameter names (``get_optimizer_state_dict``'s form) stay as they are, and
    an absent ``"state"`` (an optimizer that never stepped: DCP stores no empty
    mapping) becomes ``{}``. Applied at every depth (Lightning keeps a list of
    optimizer states).

    Args:
        state: A (nested) state dict loaded without a template, e.g. by
            ``dcp.load`` with :class:`WholeStatePlanner`; changed in place.

    Returns:
        ``state`` itself.
    """
    if isinstance(state, dict):
        for value in state.values():
            restore_optimizer_keys(value)
        groups = state.get("param_groups")
        if isinstance(groups, list) and groups and all(isinstance(g, dict) and "params" in g for g in groups):
            ids = {p for g in groups for p in g["params"] if type(p) is int}
            inner = state.get("state")
            if inner is None:
                state["state"] = {}
            elif isinstance(inner, dict) and ids:
                state["state"] = {_param_key(k, ids): v for k, v in inner.items()}
    elif isinstance(state, list):
        for value in state:
            restore_optimizer_keys(value)
    return state


def _param_key(key: Any, ids: set[int]) -> Any:
    if isinstance(key, str) and key.lstrip("-").isdigit() and str(int(key)) == key and int(key) in ids:
        return int(key)
    return key


def load_whole(
    path: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    keys: Collection[str] | None = None,
    weights_only: bool = True,
    restore_int_keys: bool = True,
    **io_options: Any,
) -> dict[str, Any]:
    """(any one process; no collective) The whole checkpoint at ``path`` as a
    nested dict, without a template.

    Called on one rank, on several ranks independently, or with no process
    group at all: it runs ``dcp.load(..., no_dist=True)`` and never talks to
    other ranks. Each call allocates the whole selected state on the CPU and
    streams every stored chunk into it with :class:`~dcp_ext.CheckpointReader`
    (ranged reads straight into the tensors, checksums verified).

    Args:
        path: Checkpoint directory: local path, ``file://``, ``s3://`` or an
            fsspec URL; written by dcp_ext (compressed or not) or by torch's
            own writers.
        storage_options: fsspec/s3fs options (S3 endpoint, credentials...).
        keys: Load only these top-level names, flattened keys or flattened
            prefixes ending in ``"."``; ``None`` loads everything.
        weights_only: Decode non-tensor values as plain data only (default).
            ``False`` unpickles any object: only for trusted checkpoints.
        restore_int_keys: Restore optimizer states' integer keys
            (:func:`restore_optimizer_keys`); on by default.
        **io_options: More :class:`~dcp_ext.CheckpointReader` arguments
            (``config=``, ``max_concurrency=``, ``extension_registry=``,
            ``verify_checksums=``...). ``read_once`` is always off: there is
            no group to share reads with.

    Returns:
        The nested state: tensors (contiguous, CPU), non-tensor values as
        saved, lists where the saved state had lists.

    Raises:
        CheckpointNotFoundError: Nothing at ``path``.
        CheckpointIncompleteError: Data files without metadata.
        CheckpointCorruptError: Damaged data or metadata, or (with
            ``weights_only``) a value that is not plain data, naming its key.
        CheckpointKeyError: ``keys`` selects nothing.
        DcpExtError: Any other failure, with DCP's error as the cause.
    """
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    # Through the package's public name, at call time: dcp_ext/__init__ may
    # import this module, and the reader's module is not a stable path.

    io_options["read_once"] = False
    reader = CheckpointReader(path, storage_options=storage_options, **io_options)
    planner = WholeStatePlanner(keys, weights_only=weights_only)
    try:
        with warnings.catch_warnings():
            # no_dist=True is the point here, not a fallback worth a warning.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load({}, storage_reader=reader, planner=planner, no_dist=True)
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        inner = reader.last_error or unwrap_checkpoint_exception(exc)
        if isinstance(inner, DcpExtError):
            raise inner from exc
        raise DcpExtError(f"loading the whole checkpoint {os.fspath(path)!r} failed: {inner}",
                          os.fspath(path)) from exc
    state = planner.finish_load()
    return restore_optimizer_keys(state) if restore_int_keys else state
