"""Errors raised by dcp_ext.

Every error derives from :class:`DcpExtError` and from the built-in exception it
resembles, so ``except FileNotFoundError`` or ``except PermissionError`` keeps
working for callers that do not know dcp_ext. Messages name the path (and key
or tensor where relevant) and say what to check.

Errors cross process boundaries: DCP gathers every rank's exception to the
coordinator with pickle, so each class pickles by message alone.

``dcp.save`` / ``dcp.load`` wrap storage errors in DCP's ``CheckpointException``
(a ``BaseException``). :func:`unwrap_checkpoint_exception` recovers ours.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DcpExtError",
    "CheckpointNotFoundError",
    "BucketNotFoundError",
    "NotACheckpointError",
    "CheckpointIncompleteError",
    "CheckpointExistsError",
    "CheckpointInProgressError",
    "CheckpointInUseError",
    "ForeignCheckpointError",
    "PostCommitError",
    "UnsupportedTorchError",
    "NeedsCheckpointReaderError",
    "CheckpointCorruptError",
    "ChecksumMismatchError",
    "UnsupportedCodecError",
    "UnsafeNameError",
    "StoragePermissionError",
    "CredentialsError",
    "StorageError",
    "StorageFullError",
    "TransientStorageError",
    "StorageTimeoutError",
    "CheckpointKeyError",
    "ReshardError",
    "PlanMismatchError",
    "PlanCacheError",
    "ReadOnceExchangeError",
    "RankFailedError",
    "InvalidPathError",
    "InvalidOptionError",
    "CheckpointReplacedError",
    "RankStateMismatchError",
    "unwrap_checkpoint_exception",
]


class DcpExtError(Exception):
    """Base class of every error raised by dcp_ext.

    Args:
        message: The full, user-facing message.
        path: The file, object or checkpoint the error is about, if any.
    """

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle with the message and ``path``, so the error crosses process boundaries intact
        (spawned workers, DCP's gathered exceptions)."""
        return (type(self), (str(self), self.path))

    def __str__(self) -> str:
        """The message alone (``path`` is an attribute, not appended to it)."""
        return str(self.args[0]) if self.args else ""


class CheckpointNotFoundError(DcpExtError, FileNotFoundError):
    """The checkpoint path (directory, prefix or bucket) does not exist."""


class BucketNotFoundError(CheckpointNotFoundError):
    """The S3 bucket named in the URL does not exist or is not visible."""


class NotACheckpointError(DcpExtError, FileNotFoundError):
    """The path exists but holds no DCP checkpoint (no metadata, no data files)."""


class CheckpointIncompleteError(NotACheckpointError):
    """Data files exist but the metadata (the commit marker) does not.

    The save that wrote them failed or is still running; the data must not be
    loaded.
    """


class CheckpointExistsError(DcpExtError, FileExistsError):
    """A committed checkpoint already exists at the path and ``overwrite=False``.

    Its message starts with torch's wording, ``Checkpoint already exists``
    (what PyTorch's own tests match for an overwrite refusal).
    """


class CheckpointInProgressError(DcpExtError, FileExistsError):
    """Another save to the same checkpoint path is in progress (its lock file
    exists and is not older than an hour)."""


class CheckpointInUseError(DcpExtError, FileExistsError):
    """A checkpoint cannot be deleted, rewritten or overwritten now: a save in
    progress builds on it, or another committed checkpoint refers to its
    data files (incremental saves). Nothing was changed."""


class ForeignCheckpointError(DcpExtError, PermissionError):
    """The files were not written by dcp_ext (a checkpoint saved by torch's
    own writer, say): dcp_ext deletes only what it wrote."""


class NeedsCheckpointReaderError(DcpExtError, RuntimeError):
    """A checkpoint torch's own readers cannot load (compressed, incremental,
    or too large for torch's pickled metadata): its ``.metadata`` says to
    load it with :class:`dcp_ext.CheckpointReader`."""


class UnsupportedTorchError(DcpExtError, RuntimeError):
    """The installed torch chooses DCP storage in a way
    :func:`dcp_ext.use_for_dcp` does not recognise (or another patch is in
    place); nothing was changed."""


class PostCommitError(DcpExtError, RuntimeError):
    """The checkpoint committed (it is complete and loadable), but a step after
    the commit failed: moving ``newest`` or applying retention. Every rank of
    the save raises it, for synchronous and asynchronous saves alike."""


class CheckpointCorruptError(DcpExtError, ValueError):
    """Metadata or data does not match what the checkpoint says it holds."""


class UnsafeNameError(CheckpointCorruptError):
    """A file name read from storage is not a plain relative name: it is
    absolute, contains ``..``, an empty or hidden part, a line break, a NUL
    or another odd character, and could name something outside its directory
    (checked by :func:`dcp_ext._runtime.validate_relative_name`)."""


class ChecksumMismatchError(CheckpointCorruptError):
    """Stored bytes do not match the checksum recorded when they were written:
    the file was damaged after the save. The message names the file, the byte
    range and the tensor keys stored there."""


class UnsupportedCodecError(DcpExtError, ValueError):
    """A codec the writer was asked for, or a checkpoint records, that this
    dcp_ext cannot use (unknown descriptor or missing package)."""


class StoragePermissionError(DcpExtError, PermissionError):
    """The storage refused the operation (file mode, bucket policy, ACL)."""


class CredentialsError(StoragePermissionError):
    """No usable credentials, or the storage rejected them."""


class StorageError(DcpExtError, OSError):
    """Any other storage failure, after retries where they apply."""


class StorageFullError(StorageError):
    """The storage has no room for the checkpoint: the device is full
    (``ENOSPC``), a quota is reached, or a tiered save's local tier lacks
    room for it (``local_tier_bytes``, or its free space)."""


class TransientStorageError(StorageError):
    """A failure that is worth retrying (throttling, 5xx, reset, short read)."""


class StorageTimeoutError(StorageError, TimeoutError):
    """The storage endpoint did not answer a request within its timeouts and
    deadline (``IOConfig.s3_connect_timeout``, ``s3_read_timeout``,
    ``s3_request_deadline``). The message names the endpoint, the object and
    the settings to change. Not retried further: the deadline is spent."""


class PlanMismatchError(DcpExtError, ValueError):
    """Save plans that do not describe one consistent checkpoint: what a rank
    is about to store differs from the plan (and so the metadata) in an
    item's dtype, shape or byte size, or two ranks disagree on a key. The
    save stops before its commit; nothing of it is loadable. The message
    names the item."""


class PlanCacheError(PlanMismatchError):
    """A rank sent only the fingerprint of its cached save plan, but the
    coordinator does not hold that plan (a save under the same cache name
    failed on some ranks only, or a process took another's place). Raised
    during planning, before anything is locked or written; the cached plans
    are dropped, and dcp_ext's own saves plan again at once."""


class RankFailedError(DcpExtError, RuntimeError):
    """A rank of a save or load did not arrive at a collective step within
    ``IOConfig.collective_timeout``: it died, its host was cut off, or it is
    stalled. Raised on every surviving rank; the message names the missing
    ranks, their hosts, the step (``plan``, ``write_data``, ``commit``...)
    and what became of the checkpoint (for a save: nothing committed and
    ``newest`` unchanged, unless the commit was already written).

    Attributes:
        ranks: The missing ranks (group ranks).
        hosts: Their hosts, in the same order.
        step: The step this rank was waiting at.
    """

    def __init__(self, message: str, path: str | None = None, ranks: tuple[int, ...] = (),
                 hosts: tuple[str, ...] = (), step: str = "") -> None:
        super().__init__(message, path)
        self.ranks, self.hosts, self.step = ranks, hosts, step

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle with the message, ``path``, ``ranks``, ``hosts`` and ``step``."""
        return (type(self), (str(self), self.path, self.ranks, self.hosts, self.step))


class ReadOnceExchangeError(DcpExtError, RuntimeError):
    """A read-once load could not exchange data between ranks: a peer died,
    timed out, or failed with an error that could not be sent."""


class CheckpointKeyError(DcpExtError, KeyError):
    """The state dict asks for keys the checkpoint lacks, or (strict) the
    checkpoint holds keys the state dict does not take."""


class ReshardError(DcpExtError, ValueError):
    """A checkpoint tensor cannot be loaded into the requested one: a different
    global shape or dtype, or a layout the saved chunks cannot fill."""


class InvalidPathError(DcpExtError, ValueError):
    """A path given to dcp_ext cannot be used: it is empty (which would mean
    the current directory, and leftover cleanup there), or an export's
    output lies in the checkpoint it reads (writing it would destroy the
    source)."""


class InvalidOptionError(DcpExtError, ValueError):
    """An option is malformed, e.g. ``dcp-ext --storage-options`` that is not
    a JSON object. The message names the option."""


class CheckpointReplacedError(DcpExtError, RuntimeError):
    """The checkpoint was replaced (a save with ``overwrite=True``) or removed
    while it was being read: its metadata is no longer the document the load
    started from, so the bytes read do not belong to one checkpoint. Nothing
    is damaged; load it again."""


class RankStateMismatchError(DcpExtError, ValueError):
    """Per-rank state (``rank_state``) saved by N ranks cannot be given to the M
    ranks loading it as asked: M differs from N and no ``rank_state_rule``
    says how to carry it, or the rule cannot (the message names N and M)."""


def unwrap_checkpoint_exception(exc: BaseException) -> BaseException:
    """Return the most useful error inside DCP's ``CheckpointException``.

    ``dcp.save``/``dcp.load`` collect every rank's exception into a
    ``CheckpointException`` that derives from ``BaseException``. This returns the
    first :class:`DcpExtError` found among the ranks' failures (lowest rank
    first), else the first failure of any kind, else ``exc`` itself. The
    returned error's ``__cause__`` chain is intact.

    Args:
        exc: Any exception; non-``CheckpointException`` values are returned as is.
    """
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return exc
    inner: list[BaseException] = []
    for rank in sorted(failures):
        entry = failures[rank]
        err = entry[0] if isinstance(entry, tuple) else entry
        if isinstance(err, BaseException):
            inner.append(unwrap_checkpoint_exception(err))
    for err in inner:
        if isinstance(err, DcpExtError):
            return err
    return inner[0] if inner else exc
