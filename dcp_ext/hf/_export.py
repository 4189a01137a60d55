"""Hugging Face export: a sharded safetensors folder written by every rank at once.

:func:`save_hf` writes live training state (tensors and DTensors: FSDP2,
tensor parallel, plain), :func:`export_hf` a partial checkpoint on storage.
Both write the folder ``transformers.AutoModel.from_pretrained`` loads:

* ``model-00001-of-0000N.safetensors`` ... (``model.safetensors`` when there
  is one file), split by :func:`dcp_ext.hf._layout.plan_files`;
* ``dcp_ext.checksums.json``: per-frame xxh3 of every file, computed while
  the bytes stream out (:mod:`dcp_ext.full._checksums`);
* ``config.json`` if the caller gives one;
* ``model.safetensors.index.json``, the commit marker.

Each file is written by one rank (:func:`~dcp_ext.hf._layout.assign_writers`
balances bytes and prefers the rank that holds them), all writers at once.
From live state the ranks move in steps: in step ``k`` every writer
assembles the ``k``-th batch of its files' tensors (consecutive tensors of
at most the largest tensor's bytes, or 32 MiB) from the slices the other
ranks send it (point-to-point; a slice held by several ranks is sent by
one, by none when the writer holds it), and a thread of its own writes it
while the next batch is assembled. No rank holds more than two batches
beyond its state (one when a batch is over 128 MiB), plus the casts of the
slices it sends. From storage each writer reads its own tensors a batch at
a time (one parallel ranged read each), writing one while it reads the next;
nothing is exchanged (both: :mod:`dcp_ext.hf._sources`; the files:
:mod:`dcp_ext.hf._sink`; the plan: :mod:`dcp_ext.hf._layout`).

Commit order: every file committed (each appears complete or not at all,
:meth:`~dcp_ext.storage.Store.open_writer`), then the sidecar, then
``config.json``, then the index. A failure on any rank makes every rank
raise the same error naming the rank, file and tensor; the files this
attempt wrote are deleted and no index is written. ``overwrite=True``
deletes the old index before anything else, so the folder is never a
committed export mixing old and new files; the old weights files the new
export does not replace are deleted once its index is committed (an old
``model.safetensors`` just before: transformers loads it in preference to
any index).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._runtime import GroupView, crash_point
from ..config import IOConfig
from ..errors import CheckpointExistsError
from ..format import build_header
from ..full import FOLDER_SIDECAR, encode_sidecar, refuse_output_in_source
from ..storage import Location, Store, TMP_MARK
from ._layout import (
    HF_CONFIG_FILE,
    HF_INDEX_FILE,
    HF_SINGLE_FILE,
    HFFile,
    HFTensor,
    assign_writers,
    config_document,
    index_document,
    parse_shard_size,
    plan_files,
    stale_shards,
)
from ._sink import FileSink, Outcome
from ._sources import LiveState, StoredState, check_cpu_backend

__all__ = ["HFExportReport", "save_hf", "export_hf"]

log = logging.getLogger("dcp_ext.hf_export")


@dataclass(frozen=True)
class HFExportReport:
    """What one rank did in an export.

    Attributes:
        files: The weights files this rank wrote.
        bytes_written: Bytes of those files (headers included).
        total_bytes: Bytes of tensor data in the whole export (the index's ``total_size``).
        seconds: Wall time of the call on this rank.
        streamed_bytes: Of this rank's tensor data, the bytes copied from a
            partial checkpoint's files frame by frame (uncompressed, on local
            or shared POSIX storage, not cast: :mod:`dcp_ext.dcp_io._frame_stream`);
            the rest went through memory a batch of tensors at a time.
    """

    files: tuple[str, ...]
    bytes_written: int
    total_bytes: int
    seconds: float
    streamed_bytes: int = 0


def _check_dtype(dtype: torch.dtype | None) -> None:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype (it casts floating tensors), got {dtype!r}")


# -- the export ----------------------------------------------------------------------
@dataclass(frozen=True)
class _Plan:
    tensors: tuple[HFTensor, ...]
    files: tuple[HFFile, ...]
    owners: tuple[int, ...]
    config: bytes | None


def _make_plan(tensors: Sequence[HFTensor], world_size: int, max_shard_size: int | str,
               config_json: dict[str, Any] | str | None, where: str,
               local_bytes: Callable[[Sequence[HFFile]], list[list[int]]] | None = None) -> _Plan:
    """(all ranks, same inputs) Files, their writers and the config bytes; raises
    before anything is written when a dtype cannot be stored or the config is not JSON."""
    files = plan_files(tensors, parse_shard_size(max_shard_size))
    for f in files:  # a dtype safetensors cannot hold fails here, on every rank
        build_header(((tensors[i].name, tensors[i].dtype, tensors[i].shape) for i in f.tensors))
    owners = assign_writers(files, world_size, local_bytes(files) if local_bytes is not None else None)
    document = None if config_json is None else config_document(config_json, where)
    return _Plan(tuple(tensors), files, owners, document)


def _prepare_folder(store: Store, overwrite: bool) -> list[str]:
    """(coordinator) Refuse or retire an existing export; create the folder.

    Returns:
        The names the folder held (to remove stale weights files later).
    """
    names = store.list_names() if store.root_exists() else []
    present = [n for n in (HF_INDEX_FILE, HF_SINGLE_FILE) if n in names]
    if present:
        if not overwrite:
            raise CheckpointExistsError(
                f"Checkpoint already exists: {store.describe()} holds {' and '.join(present)}; "
                f"pass overwrite=True to replace it",
                store.describe(),
            )
        # The index first: from here on the folder is no committed export.
        store.delete(HF_INDEX_FILE)
        store.delete(FOLDER_SIDECAR)
    store.ensure_root()
    return names


def _finish_folder(store: Store, plan: _Plan, outcomes: Sequence[Outcome], existing: Sequence[str],
                   extra: tuple[Store, str, bytes] | None) -> None:
    """(coordinator) Sidecar, config, extra file, index; then tidy the old export's files."""
    written: list[tuple[Store, str]] = []
    try:
        by_file = {c.file: c for o in outcomes for c in o.checksums}
        store.write_file(FOLDER_SIDECAR, encode_sidecar([by_file[f.name] for f in plan.files]))
        written.append((store, FOLDER_SIDECAR))
        if plan.config is not None:
            store.write_file(HF_CONFIG_FILE, plan.config)
        if extra is not None:
            extra[0].write_file(extra[1], extra[2])
            written.append((extra[0], extra[1]))
        new = [f.name for f in plan.files]
        if HF_SINGLE_FILE in existing and HF_SINGLE_FILE not in new:
            # Before the index: transformers loads model.safetensors in
            # preference to any index, so the old one must not outlive it.
            store.delete(HF_SINGLE_FILE)
        crash_point("before_hf_index")
        store.write_file(HF_INDEX_FILE, index_document(plan.tensors, plan.files))
    except BaseException:
        for target, name in written + [(store, f.name) for f in plan.files]:
            _delete_quietly(target, name)
        raise
    for name in stale_shards(existing, new) + [n for n in existing if TMP_MARK in n and n.startswith("model")]:
        _delete_quietly(store, name)


def _delete_quietly(store: Store, name: str) -> None:
    try:
        store.delete(name)
    except Exception as err:  # noqa: BLE001 - tidying after the outcome is known
        log.warning("could not delete %s: %s", store.describe(name), err)


def _export(
    group: GroupView,
    store: Store,
    plan: _Plan,
    overwrite: bool,
    write: Callable[[FileSink], None],
    started: float,
    extra: tuple[Store, str, bytes] | None = None,
) -> HFExportReport:
    """(all ranks) Prepare the folder, write the files (``write``), share the
    outcomes, then commit (coordinator) or clean up (every rank)."""
    existing = group.run_on_coordinator(lambda: _prepare_folder(store, overwrite))
    sink = FileSink(store, group.rank, plan.files, plan.tensors, store.config.frame_size)
    try:
        write(sink)
    except BaseException:
        # Not a storage or data error (those are shared below): a collective
        # failed, or the process is being interrupted. The peers see it as a
        # failed collective; this rank's files go.
        sink.abort()
        for name in sink.written:
            _delete_quietly(store, name)
        raise
    sink.abort()  # a file left open when another rank's failure stopped the steps
    outcomes: list[Outcome] = group.all_gather(sink.outcome())
    failures = [o.failure for o in outcomes if o.failure is not None]
    if failures:
        for name in sink.written:
            _delete_quietly(store, name)
        group.barrier()  # every rank's files are gone before any rank returns
        first = failures[0]
        raise first.error() from (sink.cause if first.rank == group.rank else None)
    group.run_on_coordinator(lambda: _finish_folder(store, plan, outcomes, existing, extra))
    mine = outcomes[group.rank]
    return HFExportReport(mine.files, mine.bytes_written, sum(f.nbytes for f in plan.files),
                          time.perf_counter() - started, sink.streamed_bytes)


def save_hf(
    state: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    config_json: dict[str, Any] | str | None = None,
    overwrite: bool = False,
    process_group: Any = None,
    storage_options: dict[str, Any] | None = None,
    config: IOConfig | None = None,
) -> HFExportReport:
    """(all ranks) Write live state as a Hugging Face folder at ``path``.

    Args:
        state: Flat ``{key: tensor or DTensor}`` (e.g. ``get_model_state_dict(model)``),
            the same keys in the same order on every rank; other values are
            skipped. DTensors may be sharded (FSDP2 ``Shard(0)``, tensor
            parallel ``Shard(0)``/``Shard(1)``, uneven) or replicated; a plain
            tensor is taken as the same on every rank.
        path: The folder: local path, ``s3://`` or fsspec URL.
        max_shard_size: Most bytes of tensor data per file (``"5GB"``,
            ``"500MB"``, ``"2GiB"`` or an int); a larger tensor gets a file
            of its own.
        dtype: Cast floating tensors to this dtype (on the rank that holds
            them, before they move); other tensors keep theirs.
        config_json: ``config.json`` to write: a dict, or a JSON string
            written as given.
        overwrite: Replace an existing export in the folder.
        process_group: The ranks that hold ``state`` (default group; no
            group: one process writes everything). Slices travel between
            ranks as CPU tensors, so its backend must send those (gloo, or
            ``"cpu:gloo,cuda:nccl"``); CUDA tensors are copied to the CPU
            on the rank that holds them.
        storage_options: fsspec/s3fs options.
        config: I/O tunables (``frame_size`` sets the checksum frames).

    Returns:
        What this rank wrote.

    Raises:
        CheckpointExistsError: The folder holds an export and ``overwrite`` is off (every rank).
        DcpExtError: Writing failed on some rank (every rank, the same error;
            of the failure's own class when it is a dcp_ext error).
        TypeError: A dtype safetensors cannot store (every rank, before writing).
        ValueError: The ranks' states differ, ``config_json`` is not JSON,
            ``dtype`` is not floating, or the group cannot send CPU tensors.
    """
    return write_live_state(state, Location.of(path, storage_options, config), max_shard_size=max_shard_size,
                            dtype=dtype, config_json=config_json, overwrite=overwrite, process_group=process_group)


def export_hf(
    source: str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    include_optimizer: bool = False,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    config_json: dict[str, Any] | str | None = None,
    overwrite: bool = False,
    process_group: Any = None,
    storage_options: dict[str, Any] | None = None,
    config: IOConfig | None = None,
) -> HFExportReport:
    """(all ranks, or one process) Write a partial checkpoint as a Hugging Face folder at ``path``.

    Each rank reads the tensors of the files it writes with ranged reads;
    nothing is exchanged, so N ranks write N files at once. Keys of a
    :class:`~dcp_ext.CheckpointManager` checkpoint (``{tag}_partial``) lose
    their ``model.`` prefix; optimizer tensors keep their flattened
    ``optimizer.`` keys (``include_optimizer``).

    Args:
        source: The partial checkpoint directory (or any checkpoint
            :class:`~dcp_ext.CheckpointReader` reads).
        path: The folder to write; the other arguments are as for :func:`save_hf`.

    Returns:
        What this rank wrote.

    Raises:
        DcpExtError: As :func:`save_hf`, and the reader's errors for a
            missing or damaged source.
        InvalidPathError: ``path`` is ``source`` or a folder inside it.
    """
    target = Location.of(path, storage_options, config)
    return write_partial(target.at(source), target, include_optimizer=include_optimizer,
                         max_shard_size=max_shard_size, dtype=dtype, config_json=config_json, overwrite=overwrite,
                         process_group=process_group)


# -- the same with a file of the caller's committed just before the index ---------------
def write_live_state(
    state: dict[str, Any],
    path: Location,
    *,
    max_shard_size: int | str,
    dtype: torch.dtype | None,
    config_json: dict[str, Any] | str | None,
    overwrite: bool,
    process_group: Any,
    extra: tuple[Store, str, bytes] | None = None,
) -> HFExportReport:
    """(all ranks) :func:`save_hf` into the folder ``path`` (its storage options
    and I/O config); ``extra`` = ``(store, name, bytes)`` is written by the
    coordinator just before the index (CheckpointManager's
    ``user_content_{tag}``) and deleted if the export fails."""
    started = time.perf_counter()
    _check_dtype(dtype)
    group = GroupView(process_group)
    store = path.open()
    check_cpu_backend(group)
    live = LiveState(group, state, dtype)
    plan = _make_plan(live.tensors, group.world_size, max_shard_size, config_json, store.describe(), live.local_bytes)
    transfers = live.plan(plan.files, plan.owners)
    return _export(group, store, plan, overwrite,
                   lambda sink: live.run(sink, plan.files, plan.owners, transfers), started, extra)


def write_partial(
    source: Location,
    path: Location,
    *,
    include_optimizer: bool,
    max_shard_size: int | str,
    dtype: torch.dtype | None,
    config_json: dict[str, Any] | str | None,
    overwrite: bool,
    process_group: Any,
    extra: tuple[Store, str, bytes] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> HFExportReport:
    """(all ranks, or one process) :func:`export_hf` of the checkpoint at
    ``source`` into the folder ``path``, with ``extra`` as for
    :func:`write_live_state`; ``progress(done, total)`` after each tensor, in
    bytes of tensor data this rank writes."""
    started = time.perf_counter()
    _check_dtype(dtype)
    refuse_output_in_source(source.url, path.url)
    group = GroupView(process_group)
    store = path.open()
    stored = StoredState(group, source, include_optimizer, dtype)
    plan = _make_plan(stored.tensors, group.world_size, max_shard_size, config_json, store.describe())
    return _export(group, store, plan, overwrite,
                   lambda sink: stored.run(sink, plan.files, plan.owners, group.rank, progress), started, extra)
