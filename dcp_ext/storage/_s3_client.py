"""How dcp_ext talks to S3: botocore clients built from s3fs-style options.

The data path uses botocore's synchronous client from a pool of threads: a
ranged GET streams with ``recv_into`` straight into tensor memory and a part
upload sends a pooled buffer without copying it, both with the GIL released
while bytes move. (An earlier version drove s3fs's aiobotocore client from
s3fs's single event-loop thread; on this project's 2-core benchmark that thread
was CPU-bound at 0.55-0.65x of plain boto3's GET throughput and copied each
uploaded part up to four times.)

``storage_options`` use s3fs's names, so the same dictionary works with
``s3fs.S3FileSystem``, torch's ``FsspecWriter`` and dcp_ext:
``key``/``secret``/``token`` (or ``username``/``password``), ``profile``,
``anon``, ``endpoint_url``, ``use_ssl``, ``client_kwargs`` (``endpoint_url``,
``region_name``, ``verify``, ...), ``config_kwargs`` (``botocore.config.Config``
fields), ``s3_additional_kwargs`` (extra request parameters such as
``ServerSideEncryption``) and ``requester_pays``. Unknown options are an error.

Every client has bounded waits: ``IOConfig.s3_connect_timeout`` and
``s3_read_timeout`` are its ``connect_timeout`` and ``read_timeout`` (unless
``config_kwargs`` sets them), and :class:`~dcp_ext.storage.S3Store` ends a
request's retries at ``IOConfig.s3_request_deadline``. A request the
endpoint never answered raises :class:`~dcp_ext.errors.StorageTimeoutError`
(:func:`timeout_error`), which names the endpoint, the object and the
settings. The connection then remembers the silence (:class:`Silence`) for
as long as one more attempt would have waited: requests in that window fail
at once with the same error instead of waiting again, so the clean-up
requests of a failed save (aborting uploads, removing its directory)
do not each add a deadline to it.

Clients are cached per (options, concurrency, timeouts), because building one
loads botocore's service model (80-450 ms here); :func:`clear_client_cache`
drops them.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ..config import IOConfig
from ..errors import (
    BucketNotFoundError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CredentialsError,
    DcpExtError,
    StorageError,
    StoragePermissionError,
    StorageTimeoutError,
    TransientStorageError,
)

__all__ = [
    "S3Connection",
    "get_connection",
    "clear_client_cache",
    "is_transient_s3_error",
    "is_throttling_s3_error",
    "is_timeout_s3_error",
    "timeout_error",
    "silent_endpoint_error",
    "Silence",
    "translate_s3_error",
]

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
# botocore's list of throttling codes (retries/standard.py), the ones S3 and
# S3-compatible servers send. They feed the adaptive rate limiter
# (dcp_ext.storage._rate_limit), besides being retried.
_THROTTLING_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "PriorRequestNotComplete",
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
    import botocore.exceptions as bexc
    import botocore.parsers as bparsers
    import urllib3.exceptions as uexc

    if isinstance(err, TransientStorageError):
        return True
    if isinstance(err, DcpExtError):
        return False
    parts = _client_error_parts(err)
    if parts is not None:
        code, status = parts
        return code in _TRANSIENT_CODES or status in (429, 500, 502, 503, 504)
    if isinstance(err, bexc.EndpointConnectionError):
        # Nothing listens there: usually a wrong endpoint_url, sometimes a
        # restarting proxy. Retried, but the bound keeps the wait short.
        return True
    return isinstance(
        err,
        (
            bexc.ConnectionError,  # ConnectionClosedError, ...
            bexc.HTTPClientError,  # ReadTimeoutError, ConnectTimeoutError, ...
            bexc.IncompleteReadError,
            bexc.ResponseStreamingError,
            bparsers.ResponseParserError,  # a cut-off XML body
            uexc.HTTPError,  # ProtocolError, IncompleteRead, timeouts
            http.client.HTTPException,
            ConnectionError,
            TimeoutError,
        ),
    )


def is_throttling_s3_error(err: BaseException) -> bool:
    """Whether an S3 call failed because the server is refusing the request rate:
    a throttling code, or HTTP 503/429 (HEAD responses carry no code)."""
    parts = _client_error_parts(err)
    if parts is None:
        return False
    code, status = parts
    return code in _THROTTLING_CODES or status in (429, 503)


def is_timeout_s3_error(err: BaseException) -> bool:
    """Whether an S3 call failed because the endpoint did not answer in time
    (connect or read timeout, while sending the request or receiving the answer)."""
    import botocore.exceptions as bexc
    import urllib3.exceptions as uexc

    return isinstance(err, (bexc.ConnectTimeoutError, bexc.ReadTimeoutError, uexc.TimeoutError, TimeoutError))


def timeout_error(err: BaseException, connection: S3Connection, config: IOConfig, where: str, doing: str,
                  attempts: int, elapsed: float) -> StorageTimeoutError:
    """The error of a request that ended because the endpoint did not answer:
    it names the endpoint, what was being done to which object, how long it
    waited, and which settings bound the wait."""
    return StorageTimeoutError(
        f"the S3 endpoint {connection.endpoint} did not answer in time {doing} {where}: {attempts} "
        f"attempt(s) in {elapsed:.1f} s, the last failed with {type(err).__name__} ({err}); each attempt "
        f"waits at most connect_timeout={connection.connect_timeout:g} s and read_timeout="
        f"{connection.read_timeout:g} s, the request at most s3_request_deadline={config.s3_request_deadline:g} s. "
        f"Check endpoint_url in storage_options and the network; for an endpoint that is only slow, raise "
        f"IOConfig.s3_read_timeout and s3_request_deadline (DCP_EXT_S3_READ_TIMEOUT, DCP_EXT_S3_REQUEST_DEADLINE)",
        where,
    )


def silent_endpoint_error(connection: S3Connection, config: IOConfig, where: str, doing: str,
                          left: float, why: str) -> StorageTimeoutError:
    """The error of a request not sent because the endpoint has just left
    another unanswered (:class:`Silence`)."""
    return StorageTimeoutError(
        f"not sent ({doing} {where}): the S3 endpoint {connection.endpoint} has just left a request "
        f"unanswered, so dcp_ext sends it nothing for {left:.1f} s more (as long as one attempt waits: "
        f"connect_timeout={connection.connect_timeout:g} s + read_timeout={connection.read_timeout:g} s; "
        f"s3_request_deadline={config.s3_request_deadline:g} s). That request: {why}",
        where,
    )


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



_IGNORED_OPTIONS = frozenset(
    # s3fs options about its own caching and file objects; meaningless here.
    {"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths",
     "default_block_size", "default_fill_cache", "default_cache_type", "cache_regions",
     "asynchronous", "loop", "max_concurrency", "fixed_upload_size", "version_aware"}
)
_WRITE_PARAMETERS = frozenset(
    {"ACL", "ServerSideEncryption", "SSEKMSKeyId", "SSEKMSEncryptionContext", "BucketKeyEnabled",
     "SSECustomerAlgorithm", "SSECustomerKey", "SSECustomerKeyMD5", "StorageClass", "Tagging",
     "ObjectLockMode", "ObjectLockRetainUntilDate", "ObjectLockLegalHoldStatus", "Metadata",
     "ContentType", "ExpectedBucketOwner", "RequestPayer"}
)
_SSE_C = ("SSECustomerAlgorithm", "SSECustomerKey", "SSECustomerKeyMD5")


class Silence:
    """When an endpoint last left a request unanswered, shared by the threads
    and stores of one connection."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._until = 0.0
        self._why = ""

    def note(self, until: float, why: str) -> None:
        """The endpoint left a request unanswered: requests fail at once until
        ``until`` (``time.monotonic()``)."""
        with self._lock:
            if until > self._until:
                self._until, self._why = until, why

    def remaining(self) -> tuple[float, str] | None:
        """``(seconds left, why)`` while requests are to fail at once, else ``None``."""
        with self._lock:
            left = self._until - time.monotonic()
            return (left, self._why) if left > 0 else None


@dataclass(frozen=True)
class S3Connection:
    """A botocore S3 client and the request parameters every call carries.

    Attributes:
        client: A thread-safe botocore S3 client.
        write_params: Extra parameters for PutObject / CreateMultipartUpload.
        read_params: Extra parameters for GetObject / HeadObject / UploadPart
            (SSE-C keys, requester pays).
        list_params: Extra parameters for listing and deleting.
        connect_timeout: The client's connect timeout, seconds.
        read_timeout: The client's read timeout, seconds.
        checked_buckets: Buckets a store of this connection found to exist
            (a store is opened per tag directory: one HEAD per bucket, not per store).
        silence: When the endpoint last left a request unanswered.
    """

    client: Any
    write_params: dict[str, Any] = field(default_factory=dict)
    read_params: dict[str, Any] = field(default_factory=dict)
    list_params: dict[str, Any] = field(default_factory=dict)
    connect_timeout: float = 60.0
    read_timeout: float = 60.0
    checked_buckets: set[str] = field(default_factory=set, compare=False)
    silence: Silence = field(default_factory=Silence, compare=False)

    @property
    def endpoint(self) -> str:
        """The endpoint the client sends requests to."""
        return str(getattr(getattr(self.client, "meta", None), "endpoint_url", "") or "(AWS S3)")

    @property
    def attempt_seconds(self) -> float:
        """The longest an attempt can wait on an endpoint that sends nothing."""
        return self.connect_timeout + self.read_timeout


_CACHE: OrderedDict[str, S3Connection] = OrderedDict()
_CACHE_LOCK = threading.Lock()
_CACHE_SIZE = 16


def clear_client_cache() -> None:
    """Forget every cached S3 client (e.g. after rotating credentials by hand)."""
    with _CACHE_LOCK:
        _CACHE.clear()


def _build(storage_options: dict[str, Any], config: IOConfig) -> S3Connection:
    import botocore.session
    from botocore import UNSIGNED
    from botocore.config import Config

    options = dict(storage_options)
    key = options.pop("key", None) or options.pop("username", None)
    secret = options.pop("secret", None) or options.pop("password", None)
    token = options.pop("token", None)
    profile = options.pop("profile", None)
    anon = bool(options.pop("anon", False))
    endpoint_url = options.pop("endpoint_url", None)
    use_ssl = options.pop("use_ssl", True)
    requester_pays = bool(options.pop("requester_pays", False))
    client_kwargs = dict(options.pop("client_kwargs", None) or {})
    config_kwargs = dict(options.pop("config_kwargs", None) or {})
    additional = dict(options.pop("s3_additional_kwargs", None) or {})
    unknown = sorted(k for k in options if k not in _IGNORED_OPTIONS)
    if unknown:
        raise ValueError(
            f"unsupported S3 storage_options {unknown}; dcp_ext understands key, secret, "
            f"token, profile, anon, endpoint_url, use_ssl, client_kwargs, config_kwargs, "
            f"s3_additional_kwargs and requester_pays"
        )
    bad = sorted(k for k in additional if k not in _WRITE_PARAMETERS)
    if bad:
        raise ValueError(f"unsupported s3_additional_kwargs {bad}")
    if endpoint_url is not None:
        client_kwargs.setdefault("endpoint_url", endpoint_url)
    client_kwargs.setdefault("use_ssl", use_ssl)
    if key is not None:
        client_kwargs.setdefault("aws_access_key_id", key)
    if secret is not None:
        client_kwargs.setdefault("aws_secret_access_key", secret)
    if token is not None:
        client_kwargs.setdefault("aws_session_token", token)
    config_kwargs.setdefault("max_pool_connections", max(16, 2 * config.max_concurrency))
    # botocore waits 60 s for a connection and 60 s for each answer by default:
    # with our retries, a silent endpoint held a save for over 700 s (issue 32).
    config_kwargs.setdefault("connect_timeout", config.s3_connect_timeout)
    config_kwargs.setdefault("read_timeout", config.s3_read_timeout)
    # One retry layer, ours: botocore's own would multiply the bound.
    config_kwargs.setdefault("retries", {"total_max_attempts": 1})
    # Integrity is dcp_ext's job end to end; per-request CRCs only cost CPU.
    config_kwargs.setdefault("request_checksum_calculation", "when_required")
    config_kwargs.setdefault("response_checksum_validation", "when_required")
    if anon:
        config_kwargs["signature_version"] = UNSIGNED
    session = botocore.session.Session(profile=profile)
    client = session.create_client("s3", config=Config(**config_kwargs), **client_kwargs)
    payer = {"RequestPayer": "requester"} if requester_pays else {}
    sse_c = {k: additional[k] for k in _SSE_C if k in additional}
    return S3Connection(
        client=client,
        write_params={**additional, **payer},
        read_params={**sse_c, **payer},
        list_params=dict(payer),
        connect_timeout=float(client.meta.config.connect_timeout),
        read_timeout=float(client.meta.config.read_timeout),
    )


def get_connection(storage_options: dict[str, Any] | None, config: IOConfig) -> S3Connection:
    """The (cached) connection for these options.

    Raises:
        ValueError: An option dcp_ext does not understand.
    """
    options = dict(storage_options or {})
    cache_key = json.dumps([options, config.max_concurrency, config.s3_connect_timeout, config.s3_read_timeout],
                           sort_keys=True, default=repr)
    with _CACHE_LOCK:
        connection = _CACHE.get(cache_key)
        if connection is not None:
            _CACHE.move_to_end(cache_key)
            return connection
    connection = _build(options, config)
    with _CACHE_LOCK:
        _CACHE[cache_key] = connection
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return connection
