"""Where a checkpoint's metadata comes from, chosen once: dcp_ext's JSON, torch's ``.metadata``, or an HF folder.

:func:`read_checkpoint_metadata` tries the sources in that order and the
first whose file is there describes the checkpoint
(:class:`MetadataSource`). A path with none of them gets the error that
says what it is instead (:func:`missing_metadata_error`). A load whose
metadata changes under it is told so (:func:`replaced_error`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint.metadata import Metadata

from ..errors import (
    CheckpointCorruptError,
    CheckpointIncompleteError,
    CheckpointNotFoundError,
    CheckpointReplacedError,
    DcpExtError,
    NotACheckpointError,
)
from ..layout import NEWEST_FILE, PARTIAL_SUFFIX
from ..metadata import (
    METADATA_FILE,
    TORCH_METADATA_FILE,
    IncrementalSection,
    decode_metadata,
    load_torch_metadata,
)
from ..metadata.document import FrameIndexRef
from ..storage import TMP_MARK, Store
from ._hf_folder import read_safetensors_folder, safetensors_files

__all__ = [
    "LoadedMetadata",
    "MetadataSource",
    "SOURCES",
    "read_checkpoint_metadata",
    "broadcast_metadata_bytes",
    "missing_metadata_error",
    "replaced_error",
]


@dataclass(frozen=True)
class LoadedMetadata:
    """A checkpoint's metadata as one source read it.

    Attributes:
        metadata: DCP's metadata.
        frame_indexes: Version 3 and later: where each data file's frame index lies.
        incremental: An incremental save's section (version 4), else ``None``.
        seen: The metadata file read and the xxh3-64 of its bytes (``None``
            for an HF folder): a read that fails later is checked against it.
        reads: Metadata documents read from storage for it (0 or 1).
    """

    metadata: Metadata
    frame_indexes: dict[str, FrameIndexRef] = field(default_factory=dict)
    incremental: IncrementalSection | None = None
    seen: tuple[str, int] | None = None
    reads: int = 0


class MetadataSource(Protocol):
    """One kind of checkpoint metadata."""

    def read(self, store: Store, shared: bytes | None, max_concurrency: int) -> LoadedMetadata | None:
        """The metadata of the checkpoint in ``store``, or ``None`` if it is
        not of this kind (its file is not there).

        Args:
            store: The checkpoint directory.
            shared: dcp_ext's document as the coordinator read it for every
                rank (``None``: not shared, or not found there).
            max_concurrency: Reads in flight, for sources that read several files.
        """
        ...


class OwnMetadata:
    """dcp_ext's ``dcp_ext.metadata.json`` (:mod:`dcp_ext.metadata`)."""

    def read(self, store: Store, shared: bytes | None, max_concurrency: int) -> LoadedMetadata | None:
        raw, reads = shared, 0
        if raw is None:
            try:
                raw, reads = store.read_file(METADATA_FILE), 1
            except CheckpointNotFoundError:
                return None
        decoded = decode_metadata(raw, store.describe(METADATA_FILE))
        return LoadedMetadata(decoded.metadata, decoded.frame_indexes, decoded.incremental,
                              (METADATA_FILE, xxhash.xxh3_64_intdigest(raw)), reads)


class TorchMetadata:
    """torch's pickled ``.metadata`` (a checkpoint written by torch's own
    writers), read with a restricted unpickler and every record checked
    (:func:`~dcp_ext.metadata.load_torch_metadata`)."""

    def read(self, store: Store, shared: bytes | None, max_concurrency: int) -> LoadedMetadata | None:
        try:
            raw = store.read_file(TORCH_METADATA_FILE)
        except CheckpointNotFoundError:
            return None
        metadata = load_torch_metadata(raw, store.describe(TORCH_METADATA_FILE))
        return LoadedMetadata(metadata, seen=(TORCH_METADATA_FILE, xxhash.xxh3_64_intdigest(raw)))


class SafetensorsFolder:
    """No DCP metadata: torch's ``HuggingFaceStorageWriter`` output, or any
    Hugging Face folder, described by its safetensors headers
    (:mod:`dcp_ext.dcp_io._hf_folder`)."""

    def read(self, store: Store, shared: bytes | None, max_concurrency: int) -> LoadedMetadata | None:
        names = store.list_names() if store.root_exists() else []
        if safetensors_files(names) is None:
            return None
        return LoadedMetadata(read_safetensors_folder(store, names, max_concurrency))


#: The sources, in the order they are tried.
SOURCES: tuple[MetadataSource, ...] = (OwnMetadata(), TorchMetadata(), SafetensorsFolder())


def read_checkpoint_metadata(store: Store, shared: bytes | None, max_concurrency: int) -> LoadedMetadata:
    """The metadata of the checkpoint in ``store`` from the first source that has it.

    Raises:
        CheckpointNotFoundError: Nothing exists at the path (or no bucket).
        CheckpointIncompleteError: Data files but no metadata.
        NotACheckpointError: The path holds something else.
        CheckpointCorruptError: The metadata is damaged or hostile.
    """
    for source in SOURCES:
        loaded = source.read(store, shared, max_concurrency)
        if loaded is not None:
            return loaded
    raise missing_metadata_error(store)


def broadcast_metadata_bytes(group: Any, store: Store) -> tuple[bytes | None, int]:
    """(every rank of ``group``) dcp_ext's metadata document, read once by
    the group's first rank and broadcast, so N ranks do not each GET it; and
    how many times this rank read it from storage.

    ``None`` when the group has one rank or ``torch.distributed`` is not
    initialized, or when the first rank found no document or could not read
    it (each rank then reads, and reports, itself).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
        return None, 0
    box: list[bytes | None] = [None]
    reads = 0
    if dist.get_rank(group) == 0:
        try:
            box[0] = store.read_file(METADATA_FILE)
            reads = 1
        except Exception:  # noqa: BLE001 - never skip the broadcast: every rank then reads (and reports) itself
            box[0] = None
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0], reads


def missing_metadata_error(store: Store) -> DcpExtError:
    """The error for a path without metadata: nothing there, a checkpoint
    root, an incomplete save, or something that is not a checkpoint."""
    if not store.root_exists():
        return CheckpointNotFoundError(
            f"no checkpoint at {store.url}: the path does not exist. Check the "
            f"path (for S3: bucket, prefix and endpoint).",
            store.url,
        )
    names = store.list_names()
    tags = [d[: -len(PARTIAL_SUFFIX)] for d in store.list_dirs() if d.endswith(PARTIAL_SUFFIX)]
    if tags or NEWEST_FILE in names:
        newest = store.read_file(NEWEST_FILE).decode(errors="replace").strip() if NEWEST_FILE in names else ""
        if newest in tags:
            tags.append(newest)  # the example below names it
        return NotACheckpointError(
            f"{store.url} is a checkpoint root (partial checkpoints: {', '.join(sorted(set(tags))) or 'none'}), "
            f"not one checkpoint: load {store.url.rstrip('/')}/{(tags or ['TAG'])[-1]}{PARTIAL_SUFFIX}, "
            f"or call resume_from_checkpoint on the root (dcp-ext ls lists what it holds).",
            store.url,
        )
    data = [n for n in names if n.endswith(".distcp") or TMP_MARK in n]
    if data:
        return CheckpointIncompleteError(
            f"checkpoint at {store.url} is incomplete: it has {len(data)} data "
            f"file(s) but no metadata ({METADATA_FILE} or {TORCH_METADATA_FILE}), "
            f"so the save that wrote it failed or has not finished. Do not load "
            f"it: use an earlier checkpoint, or save again.",
            store.url,
        )
    shown = ", ".join(names[:5]) + (" ..." if len(names) > 5 else "") if names else "nothing"
    return NotACheckpointError(
        f"{store.url} is not a DCP checkpoint: it has no {METADATA_FILE} or "
        f"{TORCH_METADATA_FILE} (it holds {shown}). Check the path.",
        store.url,
    )


def replaced_error(store: Store, path: str, seen: tuple[str, int] | None, err: DcpExtError) -> DcpExtError:
    """``err``, or a :class:`~dcp_ext.errors.CheckpointReplacedError` when
    the read failed because the checkpoint changed under it.

    A load that races a save with ``overwrite=True`` (or a deletion) of
    the same checkpoint reads frame indexes and data of files that are no
    longer the ones its metadata describes, and used to be told that they
    are damaged (issue 32, finding 12). On a failed read the metadata file
    is read again (one small read, on failures only): if it is gone or its
    bytes differ from those the load started from (``seen``), that is the
    error to report; the files are not damaged.

    Args:
        store: The checkpoint directory.
        path: Its URL, for the message.
        seen: The metadata file the load read and the xxh3-64 of its bytes.
        err: The error a read of the checkpoint raised.
    """
    if seen is None or not isinstance(err, (CheckpointCorruptError, CheckpointNotFoundError)):
        return err
    name, digest = seen
    try:
        now: bytes | None = store.read_file(name)
    except CheckpointNotFoundError:
        now = None
    except DcpExtError:
        return err  # cannot tell: the original error stands
    if now is not None and xxhash.xxh3_64_intdigest(now) == digest:
        return err
    what = "removed (its metadata is gone)" if now is None else "replaced (its metadata changed)"
    return CheckpointReplacedError(
        f"checkpoint {path} was {what} while this load was reading it (a save with overwrite=True, "
        f"or a deletion): its files no longer match the metadata the load started from, and the state "
        f"dict may be partly filled. The files are not damaged: load again (or another checkpoint). "
        f"The read failed with: {str(err).splitlines()[0] if str(err) else type(err).__name__}",
        path,
    )
