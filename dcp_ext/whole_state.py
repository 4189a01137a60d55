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

from ._runtime import _StorageInfo
from .dcp_io import CheckpointReader
from .errors import (
    CheckpointCorruptError,
    CheckpointKeyError,
    DcpExtError,
    unwrap_checkpoint_exception,
)
from .metadata import METADATA_FILE, TORCH_METADATA_FILE, tiling_problem
from .metadata.chunk_columns import ChunkColumns
from .metadata.torch_checks import oversized_item

__all__ = ["load_whole", "restore_optimizer_keys", "WholeStatePlanner", "planner_paths"]


class WholeStatePlanner(DefaultLoadPlanner):
    """A DCP ``LoadPlanner`` that builds the state it loads from the metadata.

    Pass it to ``dcp.load`` with an empty dict, then call
    :meth:`finish_load` for the nested state (optimizer keys not yet
    restored: :func:`load_whole` does that). Every rank that calls ``dcp.load`` with it
    (all ranks of the group, or one process with ``no_dist=True``) allocates
    and reads the whole selected state.

    Nothing is allocated before the metadata is checked: every key's recorded
    path must nest consistently (:func:`planner_paths`), every tensor's chunks
    must tile it exactly (:func:`~dcp_ext.metadata.tiling_problem`: a gap would
    come back uninitialised), and (with ``reader``) every chunk stored by
    torch's writers must fit its stored item, inside its data file.

    Args:
        keys: Load only these: top-level names (``"model"``), flattened keys
            (``"optimizer.state.0.exp_avg"``) or flattened prefixes ending in
            ``"."`` (``"model.layers.0."``). ``None`` loads everything.
        weights_only: Decode non-tensor values with ``torch.load(...,
            weights_only=True)`` (plain data only: the default, safe for
            checkpoints of unknown origin). ``False`` unpickles anything:
            only for checkpoints you trust.
        reader: The reader the load uses: data files are looked up through
            it before allocation, and messages name its metadata file.
    """

    def __init__(self, keys: Collection[str] | None = None, *, weights_only: bool = True,
                 reader: CheckpointReader | None = None) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.keys = None if keys is None else frozenset(keys)
        self.weights_only = weights_only
        self.reader = reader
        #: The nested state being filled (``{}`` until ``set_up_planner``).
        self.result: dict[str, Any] = {}
        self._paths: dict[str, tuple[Any, ...]] = {}

    def _wanted(self, fqn: str, path: tuple[Any, ...]) -> bool:
        if self.keys is None or fqn in self.keys or (path and str(path[0]) in self.keys):
            return True
        return any(key.endswith(".") and fqn.startswith(key) for key in self.keys)

    def _where(self) -> str:
        """The metadata file the load read (looked up for messages only)."""
        if self.reader is None:
            return "the checkpoint's metadata"
        store = self.reader.store
        for name in (METADATA_FILE, TORCH_METADATA_FILE):
            try:
                if store.exists(name):
                    return store.describe(name)
            except DcpExtError:
                break
        return self.reader.path

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        """(every loading rank) Check the metadata, then allocate one tensor
        per stored tensor key and a placeholder per non-tensor value.

        Raises:
            CheckpointCorruptError: A path, chunk layout or stored extent the
                metadata records is impossible (naming the file and key).
            CheckpointKeyError: ``keys`` selects nothing.
        """
        if state_dict:
            raise ValueError("WholeStatePlanner fills an empty dict: pass {} to dcp.load")
        if metadata is None:
            raise CheckpointCorruptError("the checkpoint reader returned no metadata")
        try:
            paths = planner_paths(metadata)
        except _BadPath as bad:
            where = self._where()
            raise CheckpointCorruptError(f"{where}: {bad}", where) from bad
        wanted = {fqn: path for fqn, path in paths.items() if self._wanted(fqn, path)}
        if self.keys is not None and not wanted:
            raise CheckpointKeyError(
                f"none of the keys {sorted(self.keys)} is in the checkpoint (it holds "
                f"{sorted({k.split('.', 1)[0] for k in metadata.state_dict_metadata})[:20]})"
            )
        tensors: dict[str, TensorStorageMetadata] = {}
        for fqn in wanted:
            md = metadata.state_dict_metadata[fqn]
            if isinstance(md, TensorStorageMetadata):
                self._check_chunks(fqn, md)
                tensors[fqn] = md
        self._check_stored(metadata, tensors)
        flat: dict[str, Any] = {}
        for fqn in wanted:
            tensor = tensors.get(fqn)
            # Non-tensor values are filled by load_bytes.
            flat[fqn] = None if tensor is None else torch.empty(tuple(tensor.size), dtype=tensor.properties.dtype)
        self._paths = wanted
        self.original_state_dict = state_dict
        self.state_dict = flat
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def _check_chunks(self, fqn: str, md: TensorStorageMetadata) -> None:
        """Refuse a tensor its chunks do not tile (before it is allocated)."""
        try:
            shape = tuple(int(n) for n in md.size)
            chunks = md.chunks
            columns = chunks if isinstance(chunks, ChunkColumns) else ChunkColumns.of(chunks, len(shape))
            offsets, sizes = columns.offsets, columns.sizes
            dtype = md.properties.dtype
        except (AttributeError, TypeError, ValueError, OverflowError) as err:
            where = self._where()
            raise CheckpointCorruptError(f"{where}: key {fqn!r} has malformed chunks ({err})", where) from err
        problem = None if isinstance(dtype, torch.dtype) else f"key {fqn!r} has no dtype"
        problem = problem or tiling_problem(fqn, shape, offsets, sizes)
        if problem is not None:
            where = self._where()
            raise CheckpointCorruptError(f"{where}: {problem}", where)

    def _check_stored(self, metadata: Metadata, tensors: Mapping[str, TensorStorageMetadata]) -> None:
        """Refuse chunks written by torch's writers whose stored item cannot
        be theirs, before anything of their size is allocated (with
        ``reader``, whose records are checked): one past the end of its data
        file, or longer than a
        ``torch.save`` archive of the chunk can be (:func:`oversized_item`:
        its size or dtype was edited down, and would load truncated or cast).
        Their stored length bounds their size (:mod:`dcp_ext.metadata.torch_checks`)."""
        storage = metadata.storage_data
        if self.reader is None or not isinstance(storage, dict):
            # Records this planner cannot trust to be checked (another reader's), or dcp_ext's own
            # documents (checked when decoded; sizes against frames when read).
            return
        items = [(index, info) for index, info in storage.items()
                 if isinstance(info, _StorageInfo) and index.fqn in tensors]
        ends: dict[str, tuple[int, str, int, int]] = {}
        for index, info in items:
            end = info.offset + info.length
            if end > ends.get(info.relative_path, (-1,))[0]:
                ends[info.relative_path] = (end, index.fqn, info.offset, info.length)
        for name, (end, fqn, offset, length) in sorted(ends.items()):
            store, there = self.reader.file_store(name)
            size = store.size(there)
            if end > size:
                where = store.describe(there)
                raise CheckpointCorruptError(
                    f"{where}: {TORCH_METADATA_FILE} puts {fqn!r} at bytes [{offset}, {offset + length}), past "
                    f"the end of the file ({size} bytes); refusing to allocate it. The checkpoint is truncated "
                    f"or its metadata is damaged",
                    where,
                )
        extents: dict[str, dict[tuple[int, ...], tuple[int, ...]]] = {}
        for index, info in items:
            chunks = extents.get(index.fqn)
            if chunks is None:
                chunks = extents[index.fqn] = {tuple(c.offsets): tuple(c.sizes) for c in tensors[index.fqn].chunks}
            at = tuple(index.offset or ())
            extent = chunks.get(at)
            problem = None if extent is None else oversized_item(
                index.fqn, at, extent, tensors[index.fqn].properties.dtype, info)
            if problem is not None:
                where = self._where()
                raise CheckpointCorruptError(f"{where}: {problem}", where)

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


class _BadPath(ValueError):
    """A recorded path :func:`planner_paths` refuses (its message names the key)."""


def planner_paths(metadata: Metadata) -> dict[str, tuple[Any, ...]]:
    """Where each stored key goes in the nested state: its path in
    ``Metadata.planner_data`` (DCP's flattening records one for every key it
    stores), or the key itself when there is no ``planner_data`` (a save
    with ``flatten_state_dict=False``, a safetensors folder).

    Refused, as a recording DCP's ``flatten_state_dict`` cannot make:
    ``planner_data`` that is not a mapping; no path for a stored key, or a
    path for a key the checkpoint does not store (a key was lost);
    a path that is not string parts for mapping keys (the first one too: the
    state is a dict) and integer parts for list indices, joined by ``"."``
    into its key; an index not below the number of stored keys (a list holds
    no more elements than the checkpoint stores, bar empty containers, which
    DCP does not store); paths that disagree on what a container is (a list,
    a mapping or a value). So no path makes a huge list, a negative index or
    a result shaped other than the saved state.

    Raises:
        _BadPath: Naming the key and path.
    """
    mappings = {} if metadata.planner_data is None else metadata.planner_data
    if not isinstance(mappings, Mapping):
        raise _BadPath(f"its planner_data is a {type(mappings).__name__}, not a map of keys to their paths")
    stored = metadata.state_dict_metadata
    recorded = metadata.planner_data is not None
    if recorded:
        unrecorded = next((k for k in stored if k not in mappings), None)
        lost = next((k for k in mappings if k not in stored), None) if len(mappings) > len(stored) else None
        if lost is not None or unrecorded is not None:
            what = (f"records a path for {_shown(lost)}, which the checkpoint does not store" if lost is not None
                    else f"records no path for key {unrecorded!r}")
            raise _BadPath(f"its planner_data {what}: the metadata lost keys or paths")
    count = len(stored)
    paths: dict[str, tuple[Any, ...]] = {}
    root: dict[Any, Any] = {}
    for fqn in stored:
        path = mappings[fqn] if recorded else (fqn,)
        shown = _shown(path)
        if not isinstance(path, (tuple, list)) or not path or type(path[0]) is not str or not all(
                type(p) is str or (type(p) is int and 0 <= p < count) for p in path):
            raise _BadPath(f"planner_data puts key {fqn!r} at {shown}: a path of mapping keys and list indices "
                           f"in [0, {count}) (the checkpoint's {count} stored keys) was expected")
        path = tuple(path)
        if ".".join(map(str, path)) != fqn:
            raise _BadPath(f"planner_data puts key {fqn!r} at {shown}, which does not name that key")
        _place(root, path, fqn, shown)
        paths[fqn] = path
    return paths


def _shown(value: Any) -> str:
    """``repr(value)`` cut to a length a message can hold (any value: it came from a pickle)."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a half-built object from a hostile pickle
        text = f"<{type(value).__name__}>"
    return text if len(text) < 200 else text[:197] + "..."


_KIND = object()  # a node's key holding what it is: a list or a mapping
_VALUE = object()  # a leaf: a stored value


def _place(root: dict[Any, Any], path: tuple[Any, ...], fqn: str, shown: str) -> None:
    """Add ``path`` to the tree of paths seen, refusing one that disagrees with them."""
    node = root
    for depth, part in enumerate(path):
        kind = "list" if type(part) is int else "mapping"
        if node.setdefault(_KIND, kind) != kind:
            raise _BadPath(f"planner_data puts key {fqn!r} at {shown}, but other keys make {path[:depth]!r} a "
                           f"{node[_KIND]}, not a {kind}")
        child = node.get(part)
        if depth == len(path) - 1:
            if child is not None:
                raise _BadPath(f"planner_data puts key {fqn!r} at {shown}, where other keys are stored")
            node[part] = _VALUE
        elif child is _VALUE:
            raise _BadPath(f"planner_data puts key {fqn!r} at {shown}, inside the value stored at "
                           f"{path[:depth + 1]!r}")
        else:
            node = node.setdefault(part, {})


def _set_path(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    """``root[p0][p1]... = value``, creating dicts for string parts and lists
    for integer parts (DCP's ``OBJ_PATH``: list indices stay ints). Paths are
    those :func:`planner_paths` admitted: indices are small, kinds agree."""
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
    planner = WholeStatePlanner(keys, weights_only=weights_only, reader=reader)
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
