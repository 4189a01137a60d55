"""S3 and S3-compatible object stores, through s3fs's aiobotocore client.

s3fs supplies the session (credentials, endpoint, region) and its event loop;
the data path calls the aiobotocore client directly so that dcp_ext controls
parallelism, buffering and retries:

* a data file is a multipart upload of ``part_size`` parts with up to
  ``max_concurrency`` parts in flight; memory is bounded by
  ``part_size * (max_concurrency + 1)`` per file being written. A file smaller
  than one part is a single PUT. The object appears only when the upload
  completes; a failed upload is aborted.
* reads are ranged GETs streamed straight into destination memory, up to
  ``max_concurrency`` at once.
* transient failures (throttling, 5xx, resets, timeouts, short bodies) are
  retried with bounded exponential backoff by :mod:`dcp_ext._retry`; botocore's
  own retries are turned off so the bound is ours and testable.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from .._ranges import ReadRequest
from .._retry import retry_async
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
from ._base import ObjectWriter, Store, scatter

__all__ = ["S3Store", "make_s3_filesystem", "is_transient_s3_error", "translate_s3_error"]

log = logging.getLogger("dcp_ext.s3")

T = TypeVar("T")

_MAX_PARTS = 10_000

_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "RequestLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "ServiceUnavailableException",
        "PriorThrottlingError",
        "BadDigest",
        "XAmzContentSHA256Mismatch",
        "IncompleteBody",
    }
)
_CREDENTIAL_CODES = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AuthorizationHeaderMalformed",
        "InvalidSecurity",
        "MissingSecurityHeader",
    }
)
_DENIED_CODES = frozenset({"AccessDenied", "AllAccessDisabled", "Forbidden", "403"})
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404", "NoSuchUpload"})


def _client_error_parts(err: BaseException) -> tuple[str, int] | None:
    response = getattr(err, "response", None)
    if not isinstance(response, dict):
        return None
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def is_transient_s3_error(err: BaseException) -> bool:
    """Whether an error from an S3 call is worth retrying."""
    import aiohttp
    import botocore.exceptions as bexc

    if isinstance(err, TransientStorageError):
        return True
    if isinstance(err, DcpExtError):
        return False
    parts = _client_error_parts(err)
    if parts is not None:
        code, status = parts
        return code in _TRANSIENT_CODES or status in (429, 500, 502, 503, 504)
    transient_types: tuple[type[BaseException], ...] = (
        bexc.ConnectionError,  # includes EndpointConnectionError, ConnectionClosedError
        bexc.HTTPClientError,  # includes ReadTimeoutError, ConnectTimeoutError
        bexc.IncompleteReadError,
        bexc.ResponseStreamingError,
        aiohttp.ClientPayloadError,
        aiohttp.ClientConnectionError,
        asyncio.TimeoutError,
        ConnectionError,
        TimeoutError,
    )
    if isinstance(err, transient_types):
        return True
    # aiobotocore raises botocore's ResponseParserError on a cut-off XML body.
    return type(err).__name__ in ("ResponseParserError", "ServerDisconnectedError")


def translate_s3_error(err: BaseException, where: str, doing: str) -> DcpExtError:
    """Map a botocore/aiohttp error to the dcp_ext error a user can act on."""
    import botocore.exceptions as bexc

    if isinstance(err, DcpExtError):
        return err
    if isinstance(err, (bexc.NoCredentialsError, bexc.PartialCredentialsError)):
        return CredentialsError(
            f"no usable S3 credentials {doing} {where}: pass "
            f"storage_options={{'key': ..., 'secret': ...}} (or 'profile'), or set "
            f"AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE ({err})",
            where,
        )
    parts = _client_error_parts(err)
    if parts is not None:
        code, status = parts
        message = str(getattr(err, "response", {}).get("Error", {}).get("Message", "")) or str(err)
        if code == "NoSuchBucket":
            bucket = where.split("/")[2] if where.startswith("s3://") else where
            return BucketNotFoundError(
                f"bucket {bucket!r} does not exist ({doing} {where}): check the bucket "
                f"name, the region and the endpoint_url in storage_options",
                where,
            )
        if code in _CREDENTIAL_CODES:
            return CredentialsError(
                f"S3 rejected the credentials {doing} {where} ({code}: {message}): "
                f"check the access key, secret and session token",
                where,
            )
        if code in _DENIED_CODES or status == 403:
            return StoragePermissionError(
                f"access denied {doing} {where} ({code or status}: {message}): check "
                f"the bucket policy and the IAM permissions of these credentials",
                where,
            )
        if code in _NOT_FOUND_CODES or status == 404:
            return CheckpointNotFoundError(f"{where} does not exist ({doing})", where)
        if code == "InvalidRange" or status == 416:
            return CheckpointCorruptError(
                f"{where} is shorter than the checkpoint metadata says ({doing}); "
                f"the object is truncated or was replaced",
                where,
            )
        return StorageError(f"S3 error {doing} {where}: {code or status}: {message}", where)
    if isinstance(err, bexc.EndpointConnectionError):
        return StorageError(
            f"cannot connect to the S3 endpoint {doing} {where} ({err}): check "
            f"endpoint_url in storage_options and the network",
            where,
        )
    return StorageError(f"S3 failure {doing} {where}: {type(err).__name__}: {err}", where)


def make_s3_filesystem(storage_options: dict[str, Any] | None, config: IOConfig) -> Any:
    """Create a private ``s3fs.S3FileSystem`` tuned for checkpoint traffic.

    The instance bypasses fsspec's global cache (a cached instance would
    share a connection pool sized for someone else), opens enough connections
    for ``config.max_concurrency`` requests, and leaves retries to dcp_ext.
    """
    import s3fs

    options = dict(storage_options or {})
    options.setdefault("skip_instance_cache", True)
    config_kwargs = dict(options.pop("config_kwargs", None) or {})
    config_kwargs.setdefault("max_pool_connections", max(16, 2 * config.max_concurrency))
    # One retry layer, ours: botocore's would multiply the bound.
    config_kwargs.setdefault("retries", {"total_max_attempts": 1})
    # Integrity is checked end to end by dcp_ext; per-request CRCs only cost CPU.
    config_kwargs.setdefault("request_checksum_calculation", "when_required")
    config_kwargs.setdefault("response_checksum_validation", "when_required")
    options["config_kwargs"] = config_kwargs
    return s3fs.S3FileSystem(**options)


def split_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> (``bucket``, ``a/b``)."""
    rest = url.split("://", 1)[1] if "://" in url else url
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ValueError(f"S3 URL {url!r} names no bucket")
    return bucket, key.strip("/")


class _S3Writer(ObjectWriter):
    """Multipart upload with a bounded number of parts in flight."""

    def __init__(self, store: S3Store, name: str, size_hint: int | None) -> None:
        super().__init__(name)
        self._store = store
        self._key = store.key(name)
        part_size = store.config.part_size
        if size_hint:
            # S3 allows 10,000 parts; keep a margin for an imprecise hint.
            part_size = max(part_size, math.ceil(size_hint / (_MAX_PARTS * 0.9)))
        self._part_size = part_size
        self._buffer = bytearray(part_size)
        self._filled = 0
        self._upload_id: str | None = None
        self._parts: dict[int, str] = {}
        self._inflight: list[concurrent.futures.Future[None]] = []
        self._slots = threading.BoundedSemaphore(store.config.max_concurrency)
        self._error: BaseException | None = None
        self._done = False

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def write(self, data: memoryview | bytes | bytearray) -> None:
        view = memoryview(data).cast("B")
        self.position += view.nbytes
        while view.nbytes:
            take = min(view.nbytes, self._part_size - self._filled)
            self._buffer[self._filled : self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            if self._filled == self._part_size:
                self._send_part(self._take_buffer())

    def _take_buffer(self) -> bytearray:
        body = self._buffer if self._filled == len(self._buffer) else self._buffer[: self._filled]
        self._buffer = bytearray(self._part_size)
        self._filled = 0
        return body

    def _send_part(self, body: bytearray) -> None:
        self._raise_if_failed()
        store = self._store
        if self._upload_id is None:
            response = store.call(
                "create_multipart_upload", f"starting upload of {store.describe(self.name)}",
                Key=self._key,
            )
            self._upload_id = response["UploadId"]
        number = len(self._parts) + len(self._inflight) + 1
        if number > _MAX_PARTS:
            raise StorageError(
                f"{store.describe(self.name)} needs more than {_MAX_PARTS} parts; "
                f"raise IOConfig.part_size",
                store.describe(self.name),
            )
        self._slots.acquire()
        future = asyncio.run_coroutine_threadsafe(
            self._upload_part(number, body), store.loop
        )
        future.add_done_callback(self._part_done)
        self._inflight.append(future)

    async def _upload_part(self, number: int, body: bytearray) -> None:
        store = self._store

        async def attempt() -> None:
            client = await store.client()
            response = await client.upload_part(
                Bucket=store.bucket, Key=self._key, UploadId=self._upload_id,
                PartNumber=number, Body=body,
            )
            self._parts[number] = response["ETag"]

        await store.retrying(attempt, f"uploading part {number} of {store.describe(self.name)}")

    def _part_done(self, future: concurrent.futures.Future[None]) -> None:
        self._slots.release()
        if future.cancelled():
            return
        err = future.exception()
        if err is not None and self._error is None:
            self._error = translate_s3_error(
                err, self._store.describe(self.name), "uploading"
            )
            self._error.__cause__ = err

    def _wait_inflight(self) -> None:
        for future in self._inflight:
            try:
                future.result()
            except BaseException:
                pass  # recorded by _part_done
        self._inflight.clear()

    def commit(self) -> None:
        store = self._store
        where = store.describe(self.name)
        try:
            if self._upload_id is None:
                body = bytes(self._buffer[: self._filled])
                store.call("put_object", f"writing {where}", Key=self._key, Body=body)
            else:
                if self._filled:
                    self._send_part(self._take_buffer())
                self._wait_inflight()
                self._raise_if_failed()
                parts = [{"PartNumber": n, "ETag": self._parts[n]} for n in sorted(self._parts)]
                try:
                    store.call(
                        "complete_multipart_upload", f"completing upload of {where}",
                        Key=self._key, UploadId=self._upload_id,
                        MultipartUpload={"Parts": parts},
                    )
                except CheckpointNotFoundError:
                    # NoSuchUpload on a retry: the first attempt completed but
                    # its response was lost. Accept it if the object is ours.
                    head = store.call("head_object", f"checking {where}", Key=self._key)
                    if int(head.get("ContentLength", -1)) != self.position:
                        raise
                    self._upload_id = None
        except BaseException:
            self.abort()
            raise
        self._done = True
        self._buffer = bytearray()
        store.stats.add_written_file(self.position)

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        for future in self._inflight:
            future.cancel()
        self._wait_inflight()
        self._buffer = bytearray()
        if self._upload_id is not None:
            try:
                self._store.call(
                    "abort_multipart_upload", f"aborting upload of {self._store.describe(self.name)}",
                    Key=self._key, UploadId=self._upload_id,
                )
            except Exception as err:  # the upload stays invisible either way
                log.warning("could not abort multipart upload of %s: %s",
                            self._store.describe(self.name), err)


class S3Store(Store):
    """A checkpoint under an S3 prefix, ``s3://bucket/path/to/checkpoint``.

    Args:
        url: ``s3://bucket/prefix``.
        config: I/O tunables.
        storage_options: s3fs options (``key``, ``secret``, ``token``,
            ``profile``, ``endpoint_url``, ``client_kwargs={'region_name': ...}``,
            ``config_kwargs``...). Ignored when ``filesystem`` is given.
        filesystem: An ``s3fs.S3FileSystem`` to reuse (connections are kept).
    """

    kind = "s3"

    def __init__(
        self,
        url: str,
        config: IOConfig,
        storage_options: dict[str, Any] | None = None,
        filesystem: Any = None,
    ) -> None:
        super().__init__(url, config)
        self.bucket, self.prefix = split_s3_url(url)
        self.fs = filesystem if filesystem is not None else make_s3_filesystem(storage_options, config)
        self.loop: asyncio.AbstractEventLoop = self.fs.loop
        self._bucket_checked = False

    # -- plumbing -----------------------------------------------------------
    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    async def client(self) -> Any:
        await self.fs.set_session()
        return await self.fs.get_s3(self.bucket)

    async def retrying(self, fn: Callable[[], Awaitable[T]], what: str) -> T:
        return await retry_async(fn, self.config.retry, is_transient_s3_error, what)

    def _sync(self, coro_fn: Callable[[], Awaitable[T]]) -> T:
        import fsspec.asyn

        return fsspec.asyn.sync(self.loop, coro_fn)  # type: ignore[no-any-return]

    def call(self, method: str, what: str, **kwargs: Any) -> Any:
        """Call one S3 API method with retries; errors become dcp_ext errors."""

        async def attempt() -> Any:
            client = await self.client()
            return await getattr(client, method)(Bucket=self.bucket, **kwargs)

        try:
            return self._sync(lambda: self.retrying(attempt, what))
        except DcpExtError:
            raise
        except Exception as err:
            where = f"s3://{self.bucket}/{kwargs['Key']}" if "Key" in kwargs else self.url
            raise translate_s3_error(err, where, what.split(" ", 1)[0]) from err

    def describe(self, name: str = "") -> str:
        base = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        return f"{base}/{name}" if name else base

    # -- small files --------------------------------------------------------
    def read_file(self, name: str) -> bytes:
        where = self.describe(name)

        async def attempt() -> bytes:
            client = await self.client()
            response = await client.get_object(Bucket=self.bucket, Key=self.key(name))
            async with response["Body"] as body:
                return bytes(await body.read())

        try:
            return self._sync(lambda: self.retrying(attempt, f"reading {where}"))
        except DcpExtError:
            raise
        except Exception as err:
            raise translate_s3_error(err, where, "reading") from err

    def write_file(self, name: str, data: bytes) -> None:
        # A single PUT is atomic: readers see the old object or the new one.
        self.call("put_object", f"writing {self.describe(name)}", Key=self.key(name), Body=bytes(data))

    # -- data files -----------------------------------------------------------
    def open_writer(self, name: str, size_hint: int | None = None) -> ObjectWriter:
        return _S3Writer(self, name, size_hint)

    async def _fetch(self, request: ReadRequest) -> None:
        where = self.describe(request.name)
        last = request.offset + request.length - 1
        if request.is_direct:
            dest = request.targets[0][1]
        else:
            dest = memoryview(bytearray(request.length))

        async def attempt() -> None:
            client = await self.client()
            response = await client.get_object(
                Bucket=self.bucket, Key=self.key(request.name),
                Range=f"bytes={request.offset}-{last}",
            )
            length = int(response.get("ContentLength", -1))
            async with response["Body"] as body:
                if length != request.length:
                    # The object ends inside the range (a complete, short body):
                    # truncated file, not a network fault. A server that ignores
                    # Range would send more; refuse that too.
                    raise self._short_read(request.name, request.offset, request.length, max(length, 0))
                done = 0
                while done < request.length:
                    n = await body.readinto(dest[done:])
                    if n == 0:
                        raise TransientStorageError(
                            f"connection closed after {done} of {request.length} bytes of {where}",
                            where,
                        )
                    done += n

        try:
            await self.retrying(attempt, f"reading {where} [{request.offset}, {last + 1})")
        except DcpExtError:
            raise
        except Exception as err:
            raise translate_s3_error(err, where, "reading") from err
        if not request.is_direct:
            scatter(request, dest)
        self.stats.add_read(request.name, request.length)

    def _run_reads(self, requests: Sequence[ReadRequest]) -> None:
        async def run_all() -> None:
            slots = asyncio.Semaphore(self.config.max_concurrency)

            async def one(request: ReadRequest) -> None:
                async with slots:
                    await self._fetch(request)

            tasks = [asyncio.ensure_future(one(r)) for r in requests]
            try:
                done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            except BaseException:
                for task in tasks:
                    task.cancel()
                raise
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
            for task in tasks:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]

        self._sync(run_all)

    # -- namespace ------------------------------------------------------------
    def exists(self, name: str) -> bool:
        try:
            self.call("head_object", f"checking {self.describe(name)}", Key=self.key(name))
        except CheckpointNotFoundError:
            return False
        return True

    def delete(self, name: str) -> None:
        self.call("delete_object", f"deleting {self.describe(name)}", Key=self.key(name))

    def list_names(self) -> list[str]:
        self._check_bucket()
        prefix = f"{self.prefix}/" if self.prefix else ""
        names: list[str] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Prefix": prefix, "Delimiter": "/"}
            if token:
                kwargs["ContinuationToken"] = token
            response = self.call("list_objects_v2", f"listing {self.url}", **kwargs)
            names.extend(item["Key"][len(prefix):] for item in response.get("Contents", []))
            if not response.get("IsTruncated"):
                break
            token = response.get("NextContinuationToken")
        return sorted(n for n in names if n)

    def _check_bucket(self) -> None:
        if self._bucket_checked:
            return
        try:
            self.call("head_bucket", f"checking bucket of {self.url}")
        except StoragePermissionError:
            # HEAD responses carry no error code: 403 may mean bad credentials
            # or only a missing s3:ListBucket. A GET says which; credentials
            # errors are raised, a plain denial is left to the real operation.
            try:
                self.call("list_objects_v2", f"checking access to {self.url}", MaxKeys=1)
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

    def root_exists(self) -> bool:
        self._check_bucket()
        prefix = f"{self.prefix}/" if self.prefix else ""
        response = self.call("list_objects_v2", f"listing {self.url}", Prefix=prefix, MaxKeys=1)
        return bool(response.get("KeyCount", len(response.get("Contents", []))))

    def ensure_root(self) -> None:
        self._check_bucket()
