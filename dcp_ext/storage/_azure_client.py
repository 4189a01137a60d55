"""How dcp_ext talks to Azure Blob Storage: REST over urllib3, errors classified.

No SDK on the data path. Measured on this project's 2-core machine against
Azurite (/tmp/notes/stores.md, issue 42), a ranged GET received with
``readinto`` through urllib3 used 0.64-0.8 s of client CPU per GiB where
azure-storage-blob used 1.6-1.85 s and adlfs 2.3-3.9 s, and its GET
throughput was 1.7x the SDK's; a conditional create is one header
(``If-None-Match: *`` -> 409 ``BlobAlreadyExists``) with the status in
hand. The SDK's default retry policy also waited 83-97 s on a dead endpoint
before failing.

:class:`AzureConnection` holds one ``urllib3.PoolManager`` (urllib3's own
retries off; ``connect_timeout`` and ``read_timeout`` per attempt) and the
account (:mod:`dcp_ext.storage._azure_account`), and sends one attempt of
one request (:meth:`AzureConnection.send`). Retries, the per-request deadline
and the translation of errors into dcp_ext's are the store's
(:class:`~dcp_ext.storage.AzureStore`), with the classifiers here:

* transient (retried): 408, 429, 500, 502, 503, 504 and Azure's
  ``ServerBusy``/``OperationTimedOut``/``InternalError``; resets,
  refused connections, cut-off bodies, timeouts;
* a timeout (:func:`is_timeout_error`): the endpoint did not answer within
  ``connect_timeout`` or ``read_timeout``; once the request's retries are
  spent it becomes :class:`~dcp_ext.errors.StorageTimeoutError`
  (:func:`timeout_error`), and the connection remembers the silence (or a
  refused connection: :func:`is_unreachable_error`;
  :class:`~dcp_ext.storage._s3_client.Silence`) so that the clean-up
  requests after it fail at once instead of each waiting again; other
  transient failures that outlast the retries become
  :class:`~dcp_ext.errors.TransientStorageError`;
* 404 ``ContainerNotFound`` -> :class:`~dcp_ext.errors.BucketNotFoundError`,
  other 404 -> :class:`~dcp_ext.errors.CheckpointNotFoundError`; 403 with a
  rejected signature or token -> :class:`~dcp_ext.errors.CredentialsError`,
  other 403 -> :class:`~dcp_ext.errors.StoragePermissionError`; 416 -> a
  short file (:class:`~dcp_ext.errors.CheckpointCorruptError`).

Connections are cached per (options, account settings), so the stores that
one save opens per directory share their pooled connections.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import os
import threading
import urllib.parse
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import urllib3
import urllib3.exceptions as uexc

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
from ._azure_account import API_VERSION, AzureAccount, resolve_account
from ._azure_options import AzureOptions
from ._s3_client import Silence

__all__ = [
    "AzureResponseError",
    "AzureConnection",
    "get_connection",
    "clear_azure_connections",
    "is_transient_error",
    "is_timeout_error",
    "is_unreachable_error",
    "timeout_error",
    "silent_endpoint_error",
    "translate_error",
]

_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_TRANSIENT_CODES = frozenset({"ServerBusy", "OperationTimedOut", "InternalError"})
# 403s that say the proof of identity was rejected (wrong key, bad or expired
# SAS or token), as opposed to an identity lacking a permission.
_CREDENTIAL_CODES = frozenset({"AuthenticationFailed", "InvalidAuthenticationInfo", "NoAuthenticationInformation"})
_ENV_KEYS = ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY",
             "AZURE_STORAGE_SAS_TOKEN")


class AzureResponseError(Exception):
    """The service answered a request with an error status (before it is
    translated into a dcp_ext error).

    Attributes:
        status: The HTTP status.
        code: Azure's error code (``x-ms-error-code``: ``BlobNotFound``, ...), or ``""``.
        message: The ``<Message>`` of the error body, or ``""`` (HEAD has none).
        request_id: ``x-ms-request-id``, for a support ticket.
    """

    def __init__(self, status: int, code: str, message: str, request_id: str) -> None:
        super().__init__(f"HTTP {status} {code}: {message} (x-ms-request-id {request_id or '?'})")
        self.status, self.code, self.message, self.request_id = status, code, message, request_id


def _error_message(body: bytes) -> str:
    text = body.decode("utf-8", "replace")
    start, end = text.find("<Message>"), text.find("</Message>")
    message = text[start + len("<Message>"):end] if 0 <= start < end else text[:300]
    return " ".join(message.split())


@dataclass(frozen=True)
class AzureConnection:
    """An account's endpoint, credentials and pooled HTTP connections.

    Attributes:
        account: Who the requests are for and how they are authorized.
        options: The timeouts and concurrency the pool was built for.
        pool: urllib3's pool manager (thread-safe; its retries are off).
        checked_containers: Containers a store of this connection found to
            exist (a store is opened per tag directory: one check per container).
        silence: When the endpoint last left a request unanswered.
    """

    account: AzureAccount
    options: AzureOptions
    pool: urllib3.PoolManager = field(repr=False, compare=False)
    checked_containers: set[str] = field(default_factory=set, compare=False)
    silence: Silence = field(default_factory=Silence, compare=False)

    @property
    def endpoint(self) -> str:
        return self.account.endpoint

    def url(self, container: str, blob: str = "", query: Mapping[str, str] | None = None) -> str:
        """The request URL (path percent-encoded, query in the order given)."""
        path = f"/{urllib.parse.quote(container, safe='')}"
        if blob:
            path += f"/{urllib.parse.quote(blob, safe='/~')}"
        text = self.account.endpoint + path
        if query:
            text += "?" + urllib.parse.urlencode(dict(query), quote_via=urllib.parse.quote)
        return text

    def send(
        self,
        method: str,
        container: str,
        blob: str = "",
        *,
        query: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        body: bytes | bytearray | memoryview | None = None,
        stream: bool = False,
    ) -> urllib3.BaseHTTPResponse:
        """One attempt of one request; a response with status below 300.

        With ``stream`` the body is left unread (the caller reads it and
        releases or closes the response); otherwise it is read.

        Raises:
            AzureResponseError: The service answered with an error status.
            urllib3.exceptions.HTTPError, OSError: The transport failed.
        """
        sent = {
            "x-ms-version": API_VERSION,
            "x-ms-date": email.utils.formatdate(usegmt=True),
            "x-ms-client-request-id": str(uuid.uuid4()),
            **(headers or {}),
        }
        if body is not None:
            sent["Content-Length"] = str(memoryview(body).nbytes)
        elif method in ("PUT", "POST"):
            sent["Content-Length"] = "0"
        url = self.account.auth.authorize(method, self.url(container, blob, query), sent)
        # urllib3 sends any buffer as it is (its annotations say bytes only):
        # block buffers and memoryviews of them go out without a copy.
        response = self.pool.request(method, url, body=cast(Any, body), headers=sent, preload_content=not stream,
                                     redirect=False)
        if response.status >= 300:
            data = response.data if method != "HEAD" else b""
            if stream:
                response.release_conn()
            code = response.headers.get("x-ms-error-code", "")
            raise AzureResponseError(response.status, code, _error_message(data) if data else "",
                                     response.headers.get("x-ms-request-id", ""))
        return response


_CACHE: OrderedDict[str, AzureConnection] = OrderedDict()
_CACHE_LOCK = threading.Lock()
_CACHE_SIZE = 16


def clear_azure_connections() -> None:
    """Forget every cached Azure connection (after rotating credentials by hand)."""
    with _CACHE_LOCK:
        _CACHE.clear()


def get_connection(url: str, url_account: str | None, storage_options: Mapping[str, Any],
                   options: AzureOptions) -> AzureConnection:
    """The (cached) connection for this account and these options.

    Raises:
        ValueError: An option dcp_ext does not understand.
        CredentialsError: No account or no credentials.
    """
    environ = {k: os.environ[k] for k in _ENV_KEYS if k in os.environ}
    key = json.dumps([url_account, dict(storage_options), environ, options.endpoint, options.connect_timeout,
                      options.read_timeout, options.max_concurrency], sort_keys=True, default=repr)
    with _CACHE_LOCK:
        found = _CACHE.get(key)
        if found is not None:
            _CACHE.move_to_end(key)
            return found
    account = resolve_account(url, url_account, storage_options, options.endpoint)
    pool = urllib3.PoolManager(
        num_pools=4,
        maxsize=max(16, 2 * options.max_concurrency),
        retries=False,  # one retry layer, ours: urllib3's would multiply the bound
        timeout=urllib3.Timeout(connect=options.connect_timeout, read=options.read_timeout),
    )
    connection = AzureConnection(account, options, pool)
    with _CACHE_LOCK:
        _CACHE[key] = connection
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return connection


def is_transient_error(err: BaseException) -> bool:
    """Whether a failed attempt is worth retrying."""
    if isinstance(err, TransientStorageError):
        return True
    if isinstance(err, DcpExtError):
        return False
    if isinstance(err, AzureResponseError):
        return err.status in _TRANSIENT_STATUS or err.code in _TRANSIENT_CODES
    if isinstance(err, uexc.SSLError):
        return False  # a certificate problem does not go away by itself
    return isinstance(err, (uexc.HTTPError, http.client.HTTPException, ConnectionError, TimeoutError))


def is_timeout_error(err: BaseException) -> bool:
    """Whether an attempt failed because the endpoint did not answer in time
    (a refused connection is not a timeout, though urllib3 files it as one)."""
    if isinstance(err, uexc.NewConnectionError):
        return False
    return isinstance(err, (uexc.TimeoutError, TimeoutError))


def is_unreachable_error(err: BaseException) -> bool:
    """Whether an attempt's failure says nothing answers at the endpoint: a
    timeout, or a refused (or unresolvable) connection."""
    return is_timeout_error(err) or isinstance(err, uexc.NewConnectionError)


def timeout_error(err: BaseException, connection: AzureConnection, where: str, doing: str, attempts: int,
                  elapsed: float) -> StorageTimeoutError:
    """The error of a request that ended because the endpoint did not answer:
    the endpoint, what was done to which blob, how long, and the settings."""
    o = connection.options
    return StorageTimeoutError(
        f"the Azure Blob endpoint {connection.endpoint} did not answer in time {doing} {where}: {attempts} "
        f"attempt(s) in {elapsed:.1f} s, the last failed with {type(err).__name__} ({err}); each attempt waits "
        f"at most AzureOptions.connect_timeout={o.connect_timeout:g} s and read_timeout={o.read_timeout:g} s, the "
        f"request at most request_deadline={o.request_deadline:g} s. Check the endpoint (account name, "
        f"AzureOptions.endpoint, the connection string's BlobEndpoint) and the network; for an endpoint that is "
        f"only slow, raise AzureOptions.read_timeout and request_deadline",
        where,
    )


def silent_endpoint_error(connection: AzureConnection, where: str, doing: str, left: float,
                          why: str) -> StorageTimeoutError:
    """The error of a request not sent because the endpoint has just left
    another unanswered, or refused it (:func:`is_unreachable_error`)."""
    o = connection.options
    return StorageTimeoutError(
        f"not sent ({doing} {where}): the Azure Blob endpoint {connection.endpoint} has just left a request "
        f"unanswered (or refused its connections), so dcp_ext sends it nothing for {left:.1f} s more (as long as "
        f"one attempt waits: "
        f"connect_timeout={o.connect_timeout:g} s + read_timeout={o.read_timeout:g} s). That request: {why}",
        where,
    )


def translate_error(err: BaseException, connection: AzureConnection, container: str, where: str,
                    doing: str) -> DcpExtError:
    """The dcp_ext error a user can act on, for a request's last failure."""
    if isinstance(err, DcpExtError):
        return err
    account = connection.account
    if isinstance(err, AzureResponseError):
        detail = f"HTTP {err.status} {err.code or ''}".rstrip() + (f": {err.message}" if err.message else "") + \
            f"; x-ms-request-id {err.request_id or '?'}"
        if err.status == 404 and err.code == "ContainerNotFound":
            return BucketNotFoundError(
                f"container {container!r} does not exist in the Azure storage account {account.name!r} "
                f"({doing} {where}; endpoint {account.endpoint}): create it, or check the URL and the account", where)
        if err.status == 404:
            return CheckpointNotFoundError(f"{where} does not exist ({doing}; {detail})", where)
        # Azurite answers a wrong key with 403 AuthorizationFailure "Server failed to
        # authenticate the request"; real Azure with AuthenticationFailed.
        if err.status == 403 and (err.code in _CREDENTIAL_CODES or "authenticate" in err.message.lower()):
            return CredentialsError(
                f"Azure rejected the credentials ({account.auth.how} of account {account.name!r}) {doing} {where} "
                f"({detail}): check the account key, SAS token (and its expiry) or Entra ID identity", where)
        if err.status == 403:
            return StoragePermissionError(
                f"access denied {doing} {where} ({detail}; {account.auth.how} of account {account.name!r}): check "
                f"the role assignments, the SAS permissions, and the account's network rules", where)
        if err.status == 416:
            return CheckpointCorruptError(
                f"{where} is shorter than the checkpoint metadata says ({doing}; {detail}); the blob is truncated "
                f"or was replaced", where)
        if is_transient_error(err):  # still failing when the retries ran out: worth trying again later
            return TransientStorageError(f"Azure Blob kept failing {doing} {where}: {detail}", where)
        return StorageError(f"Azure Blob error {doing} {where}: {detail}", where)
    if isinstance(err, uexc.NewConnectionError):
        return StorageError(
            f"cannot connect to the Azure Blob endpoint {account.endpoint} {doing} {where} ({err}): check the "
            f"account name, AzureOptions.endpoint (or the connection string's BlobEndpoint) and the network", where)
    kind = TransientStorageError if is_transient_error(err) else StorageError
    return kind(f"Azure Blob failure {doing} {where}: {type(err).__name__}: {err}", where)
