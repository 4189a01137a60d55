"""S3 and S3-compatible object stores.

* A data file is a multipart upload: ``part_size`` parts sent by up to
  ``max_concurrency`` threads. Parts are copied once, from tensor memory into
  one of ``max_concurrency + 1`` pooled buffers, and sent from there. The pool
  belongs to the store, so the files one rank writes at the same time (model
  and optimizer shards, ``files_per_rank``) share it: together they hold at
  most ``part_size * (max_concurrency + 1)`` bytes.
  A file smaller than one part is a single PUT. The object appears only when
  the upload completes; a failed upload is aborted.
* Reads are ranged GETs from up to ``max_concurrency`` threads, received
  straight into destination memory.
* Transient failures (throttling, 5xx, resets, timeouts, short bodies) are
  retried with bounded exponential backoff (:mod:`dcp_ext.storage._retry`), within
  the request's deadline: every request (listing, HEAD, GET, PUT, each part
  of a multipart upload, completing or aborting it, DELETE) waits at most
  ``IOConfig.s3_connect_timeout`` plus ``s3_read_timeout`` per attempt and
  starts no attempt that could end after ``s3_request_deadline``; an
  endpoint that does not answer raises
  :class:`~dcp_ext.errors.StorageTimeoutError` naming it.
* Every attempt goes through the adaptive rate limiter of its key prefix
  (:mod:`dcp_ext.storage._rate_limit`), shared by the store's threads: after
  a ``503 SlowDown`` the store paces its requests to that prefix to what S3
  accepts instead of retrying at full speed.

How clients are built from ``storage_options`` and how errors are classified:
:mod:`dcp_ext.storage._s3_client`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ..config import IOConfig
from ..errors import (
    BucketNotFoundError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CredentialsError,
    DcpExtError,
    StorageError,
    StoragePermissionError,
    TransientStorageError,
)
from ._base import IncompleteUpload, ObjectWriter, Store, request_views, scatter
from ._parallel import run_each
from ._part_upload import PartBuffers, PartUploadWriter
from ._ranges import ReadRequest
from ._rate_limit import LimiterStats, PrefixRateLimiters
from ._retry import retry_sync
from ._s3_client import (
    S3Connection,
    _client_error_parts,
    get_connection,
    is_throttling_s3_error,
    is_timeout_s3_error,
    is_transient_s3_error,
    silent_endpoint_error,
    timeout_error,
    translate_s3_error,
)
from ._s3_options import S3Options

__all__ = ["S3Store", "split_s3_url"]

log = logging.getLogger("dcp_ext.s3")

T = TypeVar("T")


_MAX_PARTS = 10_000
# Bytes per recv: large enough to amortize the call, small enough that the
# HTTP stack's temporary buffer stays small.
_RECV_CHUNK = 1 << 20


def split_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> (``bucket``, ``a/b``)."""
    rest = url.split("://", 1)[1] if "://" in url else url
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ValueError(f"S3 URL {url!r} names no bucket")
    return bucket, key.strip("/")


class _S3Writer(PartUploadWriter):
    """A multipart upload from the store's pooled buffers (:class:`PartUploadWriter`)."""

    def __init__(self, store: S3Store, name: str, size_hint: int | None) -> None:
        part_size = store.config.part_size
        if size_hint:
            # S3 allows 10,000 parts; keep a margin for an imprecise hint.
            part_size = max(part_size, math.ceil(size_hint / (_MAX_PARTS * 0.9)))
        super().__init__(name, store._part_buffers, part_size, store.config.max_concurrency, store.stats,
                         "dcp_ext-upload")
        self._store = store
        self._key = store.key(name)
        self._where = store.describe(name)
        self._upload_id: str | None = None
        self._etags: dict[int, str] = {}

    def _before_part(self, index: int) -> None:
        if index >= _MAX_PARTS:
            raise StorageError(f"{self._where} needs more than {_MAX_PARTS} parts; raise IOConfig.part_size",
                               self._where)
        if self._upload_id is None:
            store = self._store
            response = store.call("create_multipart_upload", "starting upload of", self._key,
                                  **store.connection.write_params)
            self._upload_id = response["UploadId"]

    def _send_part(self, index: int, buffer: bytearray, length: int) -> None:
        store = self._store
        number = index + 1
        # botocore takes bytes or bytearray, not a view: the short last part is sent as a copy.
        body = buffer if length == len(buffer) else bytes(memoryview(buffer)[:length])
        response = store.call("upload_part", f"uploading part {number} of", self._key,
                              UploadId=self._upload_id, PartNumber=number, Body=body,
                              **store.connection.read_params)
        with self._lock:
            self._etags[number] = response["ETag"]

    def _put_whole(self, body: memoryview) -> None:
        store = self._store
        store.call("put_object", "writing", self._key, Body=bytes(body), **store.connection.write_params)

    def _complete(self) -> None:
        store = self._store
        parts = [{"PartNumber": n, "ETag": self._etags[n]} for n in sorted(self._etags)]
        try:
            store.call(
                "complete_multipart_upload", "completing upload of", self._key,
                UploadId=self._upload_id, MultipartUpload={"Parts": parts},
                **store.connection.list_params,
            )
        except CheckpointNotFoundError:
            # NoSuchUpload on a retry: the first attempt completed but its
            # response was lost. Accept it if the object is ours.
            head = store.call("head_object", "checking", self._key, **store.connection.read_params)
            if int(head.get("ContentLength", -1)) != self.position:
                raise
        self._upload_id = None

    def _discard(self) -> None:
        if self._upload_id is None:
            return
        try:
            self._store.call(
                "abort_multipart_upload", "aborting upload of", self._key,
                UploadId=self._upload_id, **self._store.connection.list_params,
            )
        except Exception as err:  # the upload stays invisible either way
            log.warning("could not abort multipart upload of %s: %s", self._where, err)


class S3Store(Store):
    """A checkpoint under an S3 prefix, ``s3://bucket/path/to/checkpoint``.

    Args:
        url: ``s3://bucket/prefix``.
        config: I/O tunables.
        storage_options: s3fs-style options (see :mod:`dcp_ext.storage._s3_client`).
        options: Timeouts, part size and concurrency (default: from ``config``'s
            ``s3_*``, ``part_size`` and ``max_concurrency``).
    """

    kind = "s3"

    def __init__(
        self,
        url: str,
        config: IOConfig,
        storage_options: dict[str, Any] | None = None,
        options: S3Options | None = None,
    ) -> None:
        if options is not None:  # the store reads its settings from its config: one source of truth inside
            config = config.with_overrides(
                s3_connect_timeout=options.connect_timeout, s3_read_timeout=options.read_timeout,
                s3_request_deadline=options.request_deadline, part_size=options.part_size,
                max_concurrency=options.max_concurrency)
        self.options = S3Options.from_config(config)
        """Timeouts, part size and concurrency in effect (:class:`S3Options`)."""
        super().__init__(url, config)
        self.bucket, self.prefix = split_s3_url(url)
        self.connection: S3Connection = get_connection(storage_options, config)
        """The botocore client and per-request parameters of this endpoint and credentials,
        shared by the stores of the process that use the same ones."""
        self._bucket_checked = False
        self._part_buffers = PartBuffers(config.max_concurrency + 1)
        self.rate_limiters = PrefixRateLimiters(label=f"s3://{self.bucket}/")
        """The request pacing of each key prefix: slows down on ``503 SlowDown`` (see
        ``IOConfig.key_prefixes``)."""

    def key(self, name: str) -> str:
        """The S3 key of ``name`` (the store's prefix + ``/`` + ``name``)."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def describe(self, name: str = "") -> str:
        base = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        return f"{base}/{name}" if name else base

    def paced(self, key: str, attempt: Callable[[], T]) -> Callable[[], T]:
        """``attempt`` made to wait for, and report to, the rate limiter of ``key``'s prefix."""
        limiter = self.rate_limiters.for_key(key)

        def run() -> T:
            sent = limiter.acquire()
            try:
                result = attempt()
            except Exception as err:
                if is_throttling_s3_error(err):
                    limiter.throttled(sent)
                raise
            limiter.succeeded(sent)
            return result

        return run

    def rate_limit_stats(self) -> dict[str, LimiterStats]:
        """What the rate limiter of each key prefix this store used saw."""
        return self.rate_limiters.stats()

    def request(self, attempt: Callable[[], T], limited: str, where: str, doing: str, what: str = "") -> T:
        """Run ``attempt`` (one S3 request) paced by the rate limiter of key
        ``limited``, retried within the request's deadline; errors become
        dcp_ext errors.

        Args:
            attempt: Sends the request once and returns its result.
            limited: The key (or listed prefix) whose rate limiter paces it.
            where: The object, for messages.
            doing: What is being done, for messages ("writing", ...).
            what: What the log says is retried (default ``doing where``).

        Raises:
            StorageTimeoutError: The endpoint did not answer within the
                timeouts and ``IOConfig.s3_request_deadline``, or it has just
                left another request unanswered (then nothing is sent).
            DcpExtError: Any other failure, translated
                (:func:`~dcp_ext.storage._s3_client.translate_s3_error`).
        """
        silent = self.connection.silence.remaining()
        if silent is not None:
            raise silent_endpoint_error(self.connection, self.config, where, doing, *silent)
        attempts = 0

        def counted() -> T:
            nonlocal attempts
            attempts += 1
            return attempt()

        start = time.monotonic()
        try:
            return retry_sync(
                self.paced(limited, counted), self.config.retry, is_transient_s3_error, what or f"{doing} {where}",
                is_throttling_s3_error, deadline=self.config.s3_request_deadline,
                attempt_seconds=self.connection.attempt_seconds,
            )
        except DcpExtError:
            raise
        except Exception as err:
            if is_timeout_s3_error(err):
                error = timeout_error(err, self.connection, self.config, where, doing, attempts,
                                      time.monotonic() - start)
                self.connection.silence.note(time.monotonic() + self.connection.attempt_seconds, str(error))
                raise error from err
            raise translate_s3_error(err, where, doing) from err

    def call(self, method: str, doing: str, key: str | None = None, **kwargs: Any) -> Any:
        """One S3 API call with retries (:meth:`request`); errors become dcp_ext errors.

        Args:
            method: botocore client method name.
            doing: What is being done, for messages ("writing", ...).
            key: Object key, if the call has one.
        """
        where = f"s3://{self.bucket}/{key}" if key is not None else self.url
        if key is not None:
            kwargs["Key"] = key
        function: Callable[..., Any] = getattr(self.connection.client, method)
        # Calls without a key (listings) count against the prefix they list.
        limited = key if key is not None else str(kwargs.get("Prefix", f"{self.prefix}/"))
        return self.request(lambda: function(Bucket=self.bucket, **kwargs), limited, where, doing)

    # -- small files --------------------------------------------------------
    def read_file(self, name: str) -> bytes:
        key = self.key(name)

        def attempt() -> bytes:
            response = self.connection.client.get_object(
                Bucket=self.bucket, Key=key, **self.connection.read_params
            )
            with response["Body"] as body:
                return bytes(body.read())

        return self.request(attempt, key, self.describe(name), "reading")

    def write_file(self, name: str, data: bytes) -> None:
        # A single PUT is atomic: readers see the old object or the new one.
        self.call("put_object", "writing", self.key(name), Body=bytes(data), **self.connection.write_params)

    def create_exclusive(self, name: str, data: bytes) -> bool:
        # Conditional write (AWS S3 since 2024, moto; a store that ignores the
        # header makes this a plain PUT).
        try:
            self.call("put_object", "creating", self.key(name), Body=bytes(data), IfNoneMatch="*",
                      **self.connection.write_params)
        except DcpExtError as err:
            parts = _client_error_parts(err.__cause__) if err.__cause__ is not None else None
            if parts is not None and (parts[0] in ("PreconditionFailed", "ConditionalRequestConflict") or parts[1] in (409, 412)):
                return False
            raise
        return True

    # -- data files -----------------------------------------------------------
    def open_writer(self, name: str, size_hint: int | None = None) -> ObjectWriter:
        return _S3Writer(self, name, size_hint)

    def _fetch(self, request: ReadRequest) -> None:
        where = self.describe(request.name)
        last = request.offset + request.length - 1
        views = request_views(request)
        buffer = None
        if views is None:  # overlapping targets: read once, then copy
            buffer = memoryview(bytearray(request.length))
            views = [buffer]

        def attempt() -> None:
            response = self.connection.client.get_object(
                Bucket=self.bucket, Key=self.key(request.name),
                Range=f"bytes={request.offset}-{last}", **self.connection.read_params,
            )
            body = response["Body"]
            finished = False
            try:
                length = int(response.get("ContentLength", -1))
                if length != request.length:
                    # The object ends inside the range (a complete but short
                    # body): a truncated file, not a network fault.
                    raise self._short_read(request.name, request.offset, request.length, max(length, 0))
                done = 0
                for view in views:
                    pos = 0
                    while pos < view.nbytes:
                        n = body.readinto(view[pos : pos + _RECV_CHUNK])
                        if not n:
                            raise TransientStorageError(
                                f"connection closed after {done + pos} of {request.length} "
                                f"bytes of {where}",
                                where,
                            )
                        pos += n
                    done += pos
                # Reading the (empty) end lets urllib3 return the connection
                # to its pool instead of closing it.
                if body.read(1):
                    raise TransientStorageError(f"{where}: the server sent more than the range", where)
                finished = True
            finally:
                if not finished:
                    body.close()  # unknown connection state: discard it

        self.request(attempt, self.key(request.name), where, "reading",
                     f"reading {where} [{request.offset}, {last + 1})")
        if buffer is not None:
            scatter(request, buffer)
        self._finished(request)

    def _run_reads(self, requests: Sequence[ReadRequest]) -> None:
        run_each(self._fetch, requests, self.config.max_concurrency, "dcp_ext-get")

    # -- namespace ------------------------------------------------------------
    def exists(self, name: str) -> bool:
        try:
            self.call("head_object", "checking", self.key(name), **self.connection.read_params)
        except CheckpointNotFoundError:
            return False
        return True

    def delete(self, name: str) -> None:
        self.call("delete_object", "deleting", self.key(name), **self.connection.list_params)

    def _list(self, recursive: bool = False, below: str = "") -> tuple[list[str], list[str]]:
        """(files, directories) directly under the prefix (or its sub-directory
        ``below``, ending in ``/``); every file below it if ``recursive``."""
        self._check_bucket()
        prefix = (f"{self.prefix}/" if self.prefix else "") + below
        files: list[str] = []
        dirs: list[str] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Prefix": prefix, **self.connection.list_params}
            if not recursive:
                kwargs["Delimiter"] = "/"
            if token:
                kwargs["ContinuationToken"] = token
            response = self.call("list_objects_v2", "listing", **kwargs)
            files.extend(item["Key"][len(prefix):] for item in response.get("Contents", []))
            dirs.extend(p["Prefix"][len(prefix):].rstrip("/") for p in response.get("CommonPrefixes", []))
            if not response.get("IsTruncated"):
                break
            token = response.get("NextContinuationToken")
        return sorted(n for n in files if n), sorted(d for d in dirs if d)

    def list_names(self) -> list[str]:
        return self._list()[0]

    def list_dirs(self) -> list[str]:
        return self._list()[1]

    def list_entries(self) -> tuple[list[str], list[str]]:
        return self._list()

    def list_tree(self) -> list[str]:
        return self._list(recursive=True)[0]

    def _read_range_short(self, name: str, offset: int, length: int) -> bytes:
        key = self.key(name)

        def attempt() -> bytes:
            response = self.connection.client.get_object(
                Bucket=self.bucket, Key=key, Range=f"bytes={offset}-{offset + length - 1}",
                **self.connection.read_params,
            )
            with response["Body"] as body:
                return bytes(body.read())

        try:
            return self.request(attempt, key, self.describe(name), "reading")
        except CheckpointCorruptError:  # 416: the range starts past the end
            return b""

    def size(self, name: str) -> int:
        head = self.call("head_object", "checking", self.key(name), **self.connection.read_params)
        return int(head["ContentLength"])

    def modified(self, name: str) -> float | None:
        head = self.call("head_object", "checking", self.key(name), **self.connection.read_params)
        stamp = head.get("LastModified")
        return stamp.timestamp() if stamp is not None else None

    def list_incomplete_uploads(self) -> list[IncompleteUpload]:
        self._check_bucket()
        prefix = f"{self.prefix}/" if self.prefix else ""
        uploads: list[IncompleteUpload] = []
        markers: dict[str, Any] = {}
        while True:
            response = self.call("list_multipart_uploads", "listing uploads under", Prefix=prefix,
                                 **markers, **self.connection.list_params)
            for upload in response.get("Uploads", []):
                started = upload.get("Initiated")
                uploads.append(IncompleteUpload(
                    upload["Key"][len(prefix):], upload["UploadId"],
                    started.timestamp() if started is not None else 0.0,
                ))
            if not response.get("IsTruncated"):
                return uploads
            markers = {"KeyMarker": response.get("NextKeyMarker", ""),
                       "UploadIdMarker": response.get("NextUploadIdMarker", "")}

    def abort_upload(self, upload: IncompleteUpload) -> None:
        try:
            self.call("abort_multipart_upload", "aborting upload of", self.key(upload.name),
                      UploadId=upload.upload_id, **self.connection.list_params)
        except CheckpointNotFoundError:
            pass  # completed or aborted meanwhile

    def remove_root_if_empty(self) -> None:
        """On AWS S3 a prefix vanishes with its last object. Stores that keep
        real directories behind their S3 API (SeaweedFS) list an emptied one
        until its own key (``prefix/``) is deleted; so delete the keys of the
        directories found empty, deepest first (on AWS S3 they do not exist
        and the deletes do nothing)."""
        if self.prefix:
            self._delete_empty_directory_keys("")

    def _delete_empty_directory_keys(self, below: str) -> bool:
        """Delete the key of directory ``below`` (``""``: the root) if it holds
        no file and each of its sub-directories was emptied the same way."""
        files, dirs = self._list(below=below)
        emptied = [self._delete_empty_directory_keys(f"{below}{name}/") for name in dirs]
        if files or not all(emptied):
            return False
        self.call("delete_object", "deleting", f"{self.prefix}/{below}", **self.connection.list_params)
        return True

    def _check_bucket(self) -> None:
        if self._bucket_checked:
            return
        if self.bucket in self.connection.checked_buckets:  # by another store of this connection
            self._bucket_checked = True
            return
        try:
            self.call("head_bucket", "checking bucket of")
        except StoragePermissionError:
            # HEAD responses carry no error code: 403 may mean bad credentials
            # or only a missing s3:ListBucket. A GET says which; credentials
            # errors are raised, a plain denial is left to the real operation.
            try:
                self.call("list_objects_v2", "checking access to", MaxKeys=1, **self.connection.list_params)
            except CredentialsError:
                raise
            except StoragePermissionError:
                pass
        except CheckpointNotFoundError as err:
            raise BucketNotFoundError(
                f"bucket {self.bucket!r} does not exist (for {self.url}): check the "
                f"bucket name, the region and endpoint_url in storage_options",
                self.url,
            ) from err
        self._bucket_checked = True
        self.connection.checked_buckets.add(self.bucket)

    def root_exists(self) -> bool:
        self._check_bucket()
        prefix = f"{self.prefix}/" if self.prefix else ""
        response = self.call("list_objects_v2", "listing", Prefix=prefix, MaxKeys=1, **self.connection.list_params)
        return bool(response.get("KeyCount", len(response.get("Contents", []))))

    def ensure_root(self) -> None:
        self._check_bucket()
