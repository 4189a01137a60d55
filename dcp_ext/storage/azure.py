"""Azure Blob Storage: ``az://container/prefix``, ``abfs://`` and ``abfss://``.

* A data file is a block blob built from ``block_size`` blocks, staged in
  parallel (Put Block) by up to ``max_concurrency`` threads from the store's
  pooled buffers (:class:`~dcp_ext.storage._part_upload.PartBuffers`, as S3 and GCS:
  every file a rank writes at once shares at most
  ``block_size * (max_concurrency + 1)`` bytes), then committed in one Put
  Block List. Staged blocks are invisible: the blob appears, whole, when the
  block list commits. A file smaller than one block is a single Put Blob.
  An aborted file leaves only uncommitted blocks, which no read or listing
  sees; the store deletes them (Azurite frees them; real Azure drops them
  a week after the last Put Block), and :meth:`AzureStore.list_incomplete_uploads`
  lists the blobs that hold nothing else.
* Reads are ranged GETs from up to ``max_concurrency`` threads, received
  with ``recv_into`` straight into the caller's memory.
* ``create_exclusive`` (the save lock, the commit marker) is a Put Blob with
  ``If-None-Match: *``: of racing creators exactly one gets 201, the others
  409 ``BlobAlreadyExists``.
* Every request is retried on transient failures with bounded exponential
  backoff (:mod:`dcp_ext.storage._retry`) within
  :attr:`AzureOptions.request_deadline`; errors become dcp_ext's and name
  the blob (:mod:`dcp_ext.storage._azure_client`).

Credentials and the account: :mod:`dcp_ext.storage._azure_account`.
"""

from __future__ import annotations

import base64
import email.utils
import logging
import math
import secrets
import time
import urllib.parse
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from xml.sax.saxutils import escape

import urllib3

from ..config import IOConfig
from ..errors import (
    BucketNotFoundError,
    CheckpointNotFoundError,
    CredentialsError,
    DcpExtError,
    StorageError,
    StoragePermissionError,
    TransientStorageError,
)
from ._azure_client import (
    AzureConnection,
    AzureResponseError,
    get_connection,
    is_timeout_error,
    is_transient_error,
    is_unreachable_error,
    silent_endpoint_error,
    timeout_error,
    translate_error,
)
from ._azure_options import MAX_BLOCKS, AzureOptions
from ._base import IncompleteUpload, ObjectWriter, Store, request_views, scatter
from ._parallel import run_each
from ._part_upload import PartBuffers, PartUploadWriter
from ._ranges import ReadRequest
from ._retry import retry_sync

__all__ = ["AzureStore", "split_azure_url"]

log = logging.getLogger("dcp_ext.azure")

T = TypeVar("T")

# Bytes per recv: large enough to amortize the call, small enough to stay in
# the socket's pace.
_RECV_CHUNK = 1 << 20
_LIST_PAGE = 5000
#: The ``upload_id`` of an :class:`IncompleteUpload` of this store (Azure has
#: one set of uncommitted blocks per blob, no upload ids).
UNCOMMITTED = "uncommitted-blocks"


def split_azure_url(url: str) -> tuple[str, str | None, str]:
    """``az://container/a/b`` -> (``container``, ``None``, ``a/b``);
    ``abfs://container@account.dfs.core.windows.net/a`` -> (``container``,
    ``account.dfs.core.windows.net``, ``a``)."""
    rest = url.split("://", 1)[1] if "://" in url else url
    head, _, key = rest.partition("/")
    container, at, host = head.partition("@")
    if not container or (at and not host):
        raise ValueError(f"Azure URL {url!r} names no container: write az://CONTAINER/path or "
                         f"abfs://CONTAINER@ACCOUNT.dfs.core.windows.net/path")
    return container, host or None, key.strip("/")


def _block_id(token: str, number: int) -> str:
    # Every block id of a blob must have the same length; a random token per
    # writer keeps two writers of one name from committing each other's blocks.
    return base64.b64encode(f"{token}-{number:06d}".encode()).decode()


class _AzureWriter(PartUploadWriter):
    """Blocks staged from the store's pooled buffers, then one block list (:class:`PartUploadWriter`)."""

    def __init__(self, store: AzureStore, name: str, size_hint: int | None) -> None:
        block_size = store.options.block_size
        if size_hint:  # at most 50,000 blocks; keep a margin for an imprecise hint
            block_size = max(block_size, math.ceil(size_hint / (MAX_BLOCKS * 0.9)))
        super().__init__(name, store._buffers, block_size, store.options.max_concurrency, store.stats,
                         "dcp_ext-azput")
        self._store = store
        self._blob = store.blob(name)
        self._where = store.describe(name)
        self._token = secrets.token_hex(8)
        self._ids: list[str] = []

    def _before_part(self, index: int) -> None:
        if index >= MAX_BLOCKS:
            raise StorageError(f"{self._where} needs more than {MAX_BLOCKS} blocks; raise AzureOptions.block_size "
                               f"(or IOConfig.part_size), or give open_writer a size_hint", self._where)
        self._ids.append(_block_id(self._token, index))

    def _send_part(self, index: int, buffer: bytearray, length: int) -> None:
        store = self._store
        body = memoryview(buffer)[:length]
        store.request(
            lambda: store.connection.send("PUT", store.container, self._blob,
                                          query={"comp": "block", "blockid": self._ids[index]},
                                          body=body).release_conn(),
            self._where, f"staging block {index + 1} of")

    def _put_whole(self, body: memoryview) -> None:
        self._store.put_blob(self.name, body, "writing")

    def _complete(self) -> None:
        store = self._store
        xml = "<?xml version='1.0' encoding='utf-8'?><BlockList>" + "".join(
            f"<Latest>{escape(i)}</Latest>" for i in self._ids) + "</BlockList>"
        # Retrying after a lost answer is harmless: the ids are then committed,
        # and <Latest> finds committed blocks too.
        store.request(
            lambda: store.connection.send("PUT", store.container, self._blob, query={"comp": "blocklist"},
                                          headers={"x-ms-blob-content-type": "application/octet-stream"},
                                          body=xml.encode()).release_conn(),
            self._where, "committing the blocks of")

    def _discard(self) -> None:
        if not self._ids:
            return
        try:
            self._store.discard_uncommitted(self.name)
        except Exception as err:  # the blocks stay invisible either way
            log.warning("could not delete the staged blocks of %s (Azure drops them within a week): %s",
                        self._where, err)


class AzureStore(Store):
    """A checkpoint under an Azure Blob prefix: ``az://container/path``,
    ``abfs[s]://container/path`` or ``abfs[s]://container@account.dfs.core.windows.net/path``.

    Args:
        url: The location (the account in the URL, or in ``storage_options``).
        config: I/O tunables.
        storage_options: adlfs-style account and credentials
            (:mod:`dcp_ext.storage._azure_account`).
        options: Endpoint, timeouts, block size and concurrency (default:
            :meth:`AzureOptions.from_config`).
    """

    kind = "azure"

    def __init__(self, url: str, config: IOConfig, storage_options: dict[str, Any] | None = None,
                 options: AzureOptions | None = None) -> None:
        super().__init__(url, config)
        self.options = options if options is not None else AzureOptions.from_config(config)
        self.container, account_host, self.prefix = split_azure_url(self.url)
        self.connection: AzureConnection = get_connection(self.url, account_host, storage_options or {},
                                                          self.options)
        """The account's endpoint, credentials and pooled HTTP connections, shared by the stores
        of the process that use the same ones."""
        self._container_checked = False
        self._buffers = PartBuffers(self.options.max_concurrency + 1)

    def blob(self, name: str) -> str:
        """The blob name of file ``name``."""
        return f"{self.prefix}/{name}" if self.prefix else name

    # -- requests -----------------------------------------------------------
    def request(self, attempt: Callable[[], T], where: str, doing: str, what: str = "") -> T:
        """Run ``attempt`` (one request), retried while it fails transiently
        within :attr:`AzureOptions.request_deadline`; errors become dcp_ext errors.

        Raises:
            StorageTimeoutError: The endpoint did not answer within the
                timeouts and the deadline, or has just left another request
                unanswered (then nothing is sent).
            DcpExtError: Any other failure (:func:`~dcp_ext.storage._azure_client.translate_error`).
        """
        connection = self.connection
        silent = connection.silence.remaining()
        if silent is not None:
            raise silent_endpoint_error(connection, where, doing, *silent)
        attempts = 0

        def counted() -> T:
            nonlocal attempts
            attempts += 1
            return attempt()

        start = time.monotonic()
        try:
            return retry_sync(counted, self.config.retry, is_transient_error, what or f"{doing} {where}",
                              deadline=self.options.request_deadline, attempt_seconds=self.options.attempt_seconds)
        except DcpExtError:
            raise
        except Exception as err:
            if is_timeout_error(err):
                error: DcpExtError = timeout_error(err, connection, where, doing, attempts, time.monotonic() - start)
            else:
                error = translate_error(err, connection, self.container, where, doing)
            if is_unreachable_error(err):
                # The requests that clean up after this one (aborting the other
                # blocks, releasing the save lock) fail at once instead of each
                # spending its own deadline on a dead endpoint.
                connection.silence.note(time.monotonic() + self.options.attempt_seconds, str(error))
            raise error from err

    def _call(self, method: str, name: str | None, doing: str, **kwargs: Any) -> urllib3.BaseHTTPResponse:
        """One request about file ``name`` (``None``: the container), body read."""
        blob = self.blob(name) if name is not None else ""
        where = self.describe(name) if name is not None else self.url
        return self.request(lambda: self.connection.send(method, self.container, blob, **kwargs), where, doing)

    def put_blob(self, name: str, data: bytes | bytearray | memoryview, doing: str,
                 headers: dict[str, str] | None = None) -> None:
        """One Put Blob: atomic, readers see the old blob or the new one."""
        sent = {"x-ms-blob-type": "BlockBlob", "Content-Type": "application/octet-stream", **(headers or {})}
        self._call("PUT", name, doing, headers=sent, body=data)

    # -- small files --------------------------------------------------------
    def read_file(self, name: str) -> bytes:
        return bytes(self._call("GET", name, "reading").data)

    def write_file(self, name: str, data: bytes) -> None:
        self.put_blob(name, bytes(data), "writing")

    def create_exclusive(self, name: str, data: bytes) -> bool:
        body = bytes(data)
        attempts = 0

        def attempt() -> None:
            nonlocal attempts
            attempts += 1
            self.connection.send("PUT", self.container, self.blob(name), body=body, headers={
                "x-ms-blob-type": "BlockBlob", "Content-Type": "application/octet-stream", "If-None-Match": "*"})

        try:
            self.request(attempt, self.describe(name), "creating")
        except DcpExtError as err:
            cause = err.__cause__
            if isinstance(cause, AzureResponseError) and (cause.code == "BlobAlreadyExists" or cause.status in (409, 412)):
                # After a retry the blob may be our own first attempt, whose answer was lost.
                return attempts > 1 and self._holds(name, body)
            raise
        return True

    def _holds(self, name: str, data: bytes) -> bool:
        try:
            return self.read_file(name) == data
        except CheckpointNotFoundError:
            return False

    def _head(self, name: str, doing: str = "checking") -> urllib3.BaseHTTPResponse:
        return self._call("HEAD", name, doing)

    def modified(self, name: str) -> float | None:
        stamp = self._head(name).headers.get("Last-Modified")
        return email.utils.parsedate_to_datetime(stamp).timestamp() if stamp else None

    def size(self, name: str) -> int:
        return int(self._head(name).headers["Content-Length"])

    def exists(self, name: str) -> bool:
        try:
            self._head(name)
        except CheckpointNotFoundError:  # a missing container too (BucketNotFoundError)
            return False
        return True

    def delete(self, name: str) -> None:
        try:
            self._call("DELETE", name, "deleting", headers={"x-ms-delete-snapshots": "include"})
        except BucketNotFoundError:
            raise
        except CheckpointNotFoundError:
            pass

    # -- data files -----------------------------------------------------------
    def open_writer(self, name: str, size_hint: int | None = None) -> ObjectWriter:
        return _AzureWriter(self, name, size_hint)

    def _fetch(self, request: ReadRequest) -> None:
        where = self.describe(request.name)
        last = request.offset + request.length - 1
        views = request_views(request)
        buffer = None
        if views is None:  # overlapping targets: read once, then copy
            buffer = memoryview(bytearray(request.length))
            views = [buffer]
        blob = self.blob(request.name)

        def attempt() -> None:
            response = self.connection.send("GET", self.container, blob,
                                            headers={"x-ms-range": f"bytes={request.offset}-{last}"}, stream=True)
            finished = False
            try:
                length = int(response.headers.get("Content-Length", -1))
                whole = response.status == 200  # the range ignored: the whole blob
                if length != request.length or (whole and request.offset):
                    # The blob ends inside the range (Azurite: 206 with the bytes
                    # that exist, or none at the end; real Azure: 416).
                    got = max(length - request.offset, 0) if whole else max(length, 0)
                    raise self._short_read(request.name, request.offset, request.length, min(got, request.length))
                _receive(response, views, where, request.length)
                finished = True
            finally:
                if finished:
                    response.release_conn()
                else:
                    response.close()  # unknown connection state: discard it

        try:
            self.request(attempt, where, "reading", f"reading {where} [{request.offset}, {last + 1})")
        except DcpExtError as err:
            if isinstance(err.__cause__, AzureResponseError) and err.__cause__.status == 416:
                raise self._short_read(request.name, request.offset, request.length, 0) from err
            raise
        if buffer is not None:
            scatter(request, buffer)
        self._finished(request)

    def _run_reads(self, requests: Sequence[ReadRequest]) -> None:
        run_each(self._fetch, requests, self.options.max_concurrency, "dcp_ext-azget")

    def _read_range_short(self, name: str, offset: int, length: int) -> bytes:
        try:
            response = self._call("GET", name, "reading", headers={"x-ms-range": f"bytes={offset}-{offset + length - 1}"})
        except DcpExtError as err:
            if isinstance(err.__cause__, AzureResponseError) and err.__cause__.status == 416:
                return b""  # real Azure: the range starts at or past the end
            raise
        data = bytes(response.data)
        return data[offset:offset + length] if response.status == 200 else data[:length]

    # -- namespace ------------------------------------------------------------
    def _list(self, recursive: bool = False, uncommitted: bool = False) -> tuple[list[tuple[str, float]], list[str]]:
        """((file, created), directories) directly under the prefix (every file
        below it if ``recursive``; blobs with only uncommitted blocks too if ``uncommitted``)."""
        self._check_container()
        prefix = f"{self.prefix}/" if self.prefix else ""
        files: list[tuple[str, float]] = []
        dirs: list[str] = []
        marker = ""
        while True:
            query = {"restype": "container", "comp": "list", "prefix": prefix, "maxresults": str(_LIST_PAGE)}
            if not recursive:
                query["delimiter"] = "/"
            if uncommitted:
                query["include"] = "uncommittedblobs"
            if marker:
                query["marker"] = marker
            response = self._call("GET", None, "listing", query=query)
            root = ElementTree.fromstring(response.data)
            for blob in root.iter("Blob"):
                name = _xml_name(blob)
                stamp = blob.findtext("Properties/Creation-Time") or blob.findtext("Properties/Last-Modified")
                created = email.utils.parsedate_to_datetime(stamp).timestamp() if stamp else time.time()
                files.append((name[len(prefix):], created))
            for found in root.iter("BlobPrefix"):
                dirs.append(_xml_name(found)[len(prefix):].rstrip("/"))
            marker = root.findtext("NextMarker") or ""
            if not marker:
                break
        return sorted(f for f in files if f[0]), sorted(d for d in dirs if d)

    def list_names(self) -> list[str]:
        return [n for n, _ in self._list()[0]]

    def list_dirs(self) -> list[str]:
        return self._list()[1]

    def list_entries(self) -> tuple[list[str], list[str]]:
        files, dirs = self._list()
        return [n for n, _ in files], dirs

    def list_tree(self) -> list[str]:
        return [n for n, _ in self._list(recursive=True)[0]]

    def list_incomplete_uploads(self) -> list[IncompleteUpload]:
        """Blobs under the root that hold only uncommitted blocks (a write that
        was never committed nor cleaned up), with when they were created."""
        committed = {n for n, _ in self._list(recursive=True)[0]}
        return [IncompleteUpload(name, UNCOMMITTED, created)
                for name, created in self._list(recursive=True, uncommitted=True)[0] if name not in committed]

    def abort_upload(self, upload: IncompleteUpload) -> None:
        self.discard_uncommitted(upload.name)

    def discard_uncommitted(self, name: str) -> None:
        """Delete the uncommitted blocks of file ``name`` if it has no committed
        content (a committed blob of that name is left alone: its pending
        blocks go with its next commit, or within a week)."""
        if self.exists(name):
            return
        try:
            self._call("DELETE", name, "deleting the staged blocks of")
        except CheckpointNotFoundError:
            pass  # real Azure keeps blocks-only blobs out of reach until they expire

    def remove_root_if_empty(self) -> None:
        """Nothing to do: a prefix vanishes with its last blob."""

    def _check_container(self) -> None:
        if self._container_checked or self.container in self.connection.checked_containers:
            self._container_checked = True
            return
        try:
            self._call("HEAD", None, "checking the container of", query={"restype": "container"})
        except CredentialsError:
            raise
        except StoragePermissionError:
            # A SAS for a container or an identity with data roles only may not read
            # the container's properties; the real operation will say what it may do.
            pass
        except CheckpointNotFoundError as err:  # HEAD answers carry the code in a header: ContainerNotFound
            raise BucketNotFoundError(
                f"container {self.container!r} does not exist in the Azure storage account "
                f"{self.connection.account.name!r} (for {self.url}; endpoint {self.connection.endpoint}): create it, "
                f"or check the URL and the account", self.url) from err
        self._container_checked = True
        self.connection.checked_containers.add(self.container)

    def root_exists(self) -> bool:
        self._check_container()
        prefix = f"{self.prefix}/" if self.prefix else ""
        response = self._call("GET", None, "listing",
                              query={"restype": "container", "comp": "list", "prefix": prefix, "maxresults": "1"})
        return ElementTree.fromstring(response.data).find("Blobs/Blob") is not None

    def ensure_root(self) -> None:
        self._check_container()


def _xml_name(element: ElementTree.Element) -> str:
    """A ``<Name>`` of a listing (percent-encoded by Azure when it holds characters XML cannot carry)."""
    node = element.find("Name")
    if node is None:
        return ""
    text = node.text or ""
    return urllib.parse.unquote(text) if node.get("Encoded") == "true" else text


def _receive(response: urllib3.BaseHTTPResponse, views: list[memoryview], where: str, total: int) -> None:
    """Fill ``views`` in order from ``response``'s body (``total`` bytes).

    urllib3's own ``readinto`` reads into a new ``bytes`` and copies it; the
    ``http.client`` response under it receives into the target itself, which
    halves the client CPU of a read. Its end of stream is checked, so the
    connection can go back to the pool."""
    raw = getattr(response, "_fp", None)
    readinto: Callable[[memoryview], int | None] = (
        raw.readinto if raw is not None and hasattr(raw, "readinto") and not response.headers.get("Content-Encoding")
        else response.readinto)
    done = 0
    for view in views:
        pos = 0
        while pos < view.nbytes:
            n = readinto(view[pos : pos + _RECV_CHUNK])
            if not n:
                raise TransientStorageError(f"connection closed after {done + pos} of {total} bytes of {where}", where)
            pos += n
        done += pos
