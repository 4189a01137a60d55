"""Google Cloud Storage, ``gs://bucket/prefix`` (also ``gcs://``), through the JSON API.

* A data file smaller than one part is one multipart upload at commit. A
  larger one streams through the store's pooled part buffers (at most
  ``part_size * (max_concurrency + 1)`` bytes for all the files one store
  writes at once); each full buffer is uploaded, while the next fills, as a
  temporary object ``{name}{TMP_MARK}{upload}.p000000``, by up to
  ``max_concurrency`` threads. Every 32 uploaded parts are composed into one
  temporary (32 is GCS's limit of sources per compose) and deleted while the
  upload goes on; the commit composes what is left (composes of composes
  above 1,024 parts) into the final object, which appears at once and only
  then, and deletes the temporaries. An abort deletes them; a crash leaves
  them to :meth:`GCSStore.list_incomplete_uploads` (the cleanup of a root
  aborts those older than the stale-lock limit). See :mod:`dcp_ext.storage._gcs_writer`.
* Reads are ranged GETs from up to ``max_concurrency`` threads, received
  straight into the destination memory (no intermediate buffer).
* :meth:`GCSStore.create_exclusive` (the save lock, the commit marker) is one
  multipart upload with ``ifGenerationMatch=0``: GCS creates the object only
  if no live generation exists, so of racing creators exactly one gets 200
  and the others 412.
* Every request is retried on 408/429/5xx, resets, cut-off answers and
  timeouts with bounded exponential backoff (:mod:`dcp_ext.storage._retry`)
  within its deadline: each attempt waits at most ``connect_timeout +
  read_timeout`` and no attempt starts that could end after
  ``request_deadline`` (:class:`~dcp_ext.storage.GCSOptions`); an endpoint
  that does not answer raises :class:`~dcp_ext.errors.StorageTimeoutError`
  naming it, the object and the settings, and requests in the following
  window fail at once instead of waiting again.

How requests are sent and errors classified: :mod:`dcp_ext.storage._gcs_client`;
which ``storage_options`` it takes: :mod:`dcp_ext.storage._gcs_options`.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ..config import IOConfig
from ..errors import (
    BucketNotFoundError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    DcpExtError,
    StorageError,
    TransientStorageError,
)
from ._base import (
    TMP_MARK,
    IncompleteUpload,
    ObjectWriter,
    Store,
    request_views,
    scatter,
)
from ._gcs_client import (
    GCSConnection,
    GCSResponseError,
    get_connection,
    is_timeout_gcs_error,
    is_transient_gcs_error,
    quote,
    silent_endpoint_error,
    timeout_error,
    translate_gcs_error,
)
from ._gcs_options import GCSOptions
from ._gcs_writer import GCSWriter, temporary_pattern
from ._parallel import run_each
from ._part_upload import PartBuffers
from ._ranges import ReadRequest
from ._retry import retry_sync

__all__ = ["GCSStore", "split_gcs_url"]

log = logging.getLogger("dcp_ext.gcs")

T = TypeVar("T")

_LIST_PAGE = 1000


def split_gcs_url(url: str) -> tuple[str, str]:
    """``gs://bucket/a/b`` -> (``bucket``, ``a/b``)."""
    rest = url.split("://", 1)[1] if "://" in url else url
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ValueError(f"GCS URL {url!r} names no bucket")
    return bucket, key.strip("/")


def _timestamp(text: str) -> float:
    """Seconds since the epoch of an RFC 3339 time as GCS writes it
    (``2026-11-28T11:13:32.690335Z``; any number of fraction digits)."""
    match = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", text.strip())
    if match is None:
        raise ValueError(f"not an RFC 3339 time: {text!r}")
    zone = "+00:00" if match.group(3) == "Z" else match.group(3)
    moment = datetime.datetime.fromisoformat(match.group(1) + zone)
    return moment.timestamp() + float(f"0.{match.group(2) or 0}")


class GCSStore(Store):
    """A checkpoint under a GCS prefix, ``gs://bucket/path/to/checkpoint``.

    Args:
        url: ``gs://bucket/prefix`` (or ``gcs://``).
        config: I/O tunables.
        storage_options: gcsfs-style options: ``endpoint_url``, ``token``,
            ``access_token`` (:mod:`dcp_ext.storage._gcs_options`).
        options: Endpoint, timeouts, part size, concurrency and credentials
            (default: from ``config`` and ``storage_options``).
    """

    kind = "gcs"

    def __init__(self, url: str, config: IOConfig, storage_options: dict[str, Any] | None = None,
                 options: GCSOptions | None = None) -> None:
        super().__init__(url, config)
        self.options = GCSOptions.resolve(config, storage_options, options)
        self.scheme = url.split("://", 1)[0].lower() if "://" in url else "gs"
        """The URL's scheme as given (``gs`` or ``gcs``), kept in messages."""
        self.bucket, self.prefix = split_gcs_url(url)
        self.connection: GCSConnection = get_connection(self.options)
        """The HTTP connection pool of this endpoint and credentials, shared by the stores of the
        process that use the same ones."""
        self.part_buffers = PartBuffers(self.options.max_concurrency + 1)
        """The part buffers the store's writers share: at most ``max_concurrency + 1`` parts in
        memory, whatever the number of files."""

    # -- names --------------------------------------------------------------------------------
    def key(self, name: str) -> str:
        """The object name of ``name`` (the store's prefix + ``/`` + ``name``)."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def describe(self, name: str = "") -> str:
        base = f"{self.scheme}://{self.bucket}/{self.prefix}" if self.prefix else f"{self.scheme}://{self.bucket}"
        return f"{base}/{name}" if name else base

    def where(self, key: str) -> str:
        """The object ``key`` of this bucket, for messages."""
        return f"{self.scheme}://{self.bucket}/{key}"

    def object_path(self, key: str) -> str:
        """The JSON API path of object ``key`` of this bucket
        (``/storage/v1/b/{bucket}/o/{key}``)."""
        return f"/storage/v1/b/{quote(self.bucket)}/o/{quote(key)}"

    # -- requests -----------------------------------------------------------------------------
    def call(self, attempt: Callable[[], T], where: str, doing: str, what: str = "",
             check_bucket: bool = True) -> T:
        """Run ``attempt`` (one request) with retries within the request's
        deadline; errors become dcp_ext errors naming ``where``.

        Args:
            attempt: Sends the request once and returns its result.
            where: The object, for messages.
            doing: What is being done ("writing", ...).
            what: What the log says is retried (default ``doing where``).
            check_bucket: On a 404, find out whether the bucket is missing
                (:class:`~dcp_ext.errors.BucketNotFoundError`) or the object.

        Raises:
            StorageTimeoutError: The endpoint did not answer within the
                timeouts and the deadline, or it has just left another
                request unanswered (then nothing is sent).
            DcpExtError: Any other failure, translated
                (:func:`~dcp_ext.storage._gcs_client.translate_gcs_error`).
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
            return retry_sync(counted, self.config.retry, is_transient_gcs_error, what or f"{doing} {where}",
                              deadline=self.options.request_deadline, attempt_seconds=connection.attempt_seconds)
        except Exception as err:
            if is_timeout_gcs_error(err):
                error = timeout_error(err, connection, where, doing, attempts, time.monotonic() - start)
                connection.silence.note(time.monotonic() + connection.attempt_seconds, str(error))
                raise error from err
            translated = translate_gcs_error(err, where, doing, connection.endpoint)
            if isinstance(translated, CheckpointNotFoundError) and check_bucket:
                self._check_bucket()
            if translated is err:
                raise
            raise translated from err

    def multipart_attempt(self, key: str, data: bytes | bytearray | memoryview,
                          if_generation_match: int | None = None) -> Callable[[], dict[str, Any]]:
        """One attempt at storing ``data`` as object ``key`` in one multipart
        upload (the object's JSON resource, then its bytes, sent from ``data``
        without a copy); with ``if_generation_match=0`` only if no live object
        has that name (else :class:`GCSResponseError` 412)."""
        where = self.where(key)
        view = memoryview(data).cast("B")
        boundary = uuid.uuid4().hex
        resource = json.dumps({"name": key, "contentType": "application/octet-stream"})
        head = (f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n{resource}\r\n"
                f"--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n").encode()
        tail = f"\r\n--{boundary}--\r\n".encode()
        query = {"uploadType": "multipart"}
        if if_generation_match is not None:
            query["ifGenerationMatch"] = str(if_generation_match)
        headers = {"Content-Type": f"multipart/related; boundary={boundary}",
                   "Content-Length": str(len(head) + view.nbytes + len(tail))}
        path = f"/upload/storage/v1/b/{quote(self.bucket)}/o"
        return lambda: self.connection.json("POST", path, where, query=query, headers=headers,
                                            body=[head, view, tail])

    def upload(self, key: str, data: bytes | bytearray | memoryview, doing: str) -> dict[str, Any]:
        """Store ``data`` as object ``key`` in one multipart upload, retried."""
        return self.call(self.multipart_attempt(key, data), self.where(key), doing)

    def upload_media(self, key: str, data: memoryview, doing: str) -> dict[str, Any]:
        """Store ``data`` as object ``key`` in one media upload (a part: no metadata, no condition)."""
        where = self.where(key)
        path = f"/upload/storage/v1/b/{quote(self.bucket)}/o"
        query = {"uploadType": "media", "name": key}
        headers = {"Content-Type": "application/octet-stream"}
        return self.call(lambda: self.connection.json("POST", path, where, query=query, headers=headers, body=data),
                         where, doing)

    def compose(self, key: str, sources: Sequence[str], doing: str) -> dict[str, Any]:
        """Make object ``key`` the concatenation of ``sources`` (at most 32 objects of this bucket)."""
        where = self.where(key)
        body = json.dumps({"sourceObjects": [{"name": s} for s in sources],
                           "destination": {"contentType": "application/octet-stream"}}).encode()
        headers = {"Content-Type": "application/json"}
        return self.call(lambda: self.connection.json("POST", f"{self.object_path(key)}/compose", where,
                                                      headers=headers, body=body), where, doing)

    def delete_key(self, key: str) -> None:
        """Delete object ``key``; a missing one is not an error."""
        where = self.where(key)
        try:
            self.call(lambda: self.connection.send("DELETE", self.object_path(key), where, ok=(200, 204)),
                      where, "deleting")
        except BucketNotFoundError:
            raise
        except CheckpointNotFoundError:
            pass

    def metadata(self, name: str) -> dict[str, Any]:
        """The object resource of file ``name`` (size, updated, generation...)."""
        key = self.key(name)
        where = self.describe(name)
        return self.call(lambda: self.connection.json("GET", self.object_path(key), where), where, "checking")

    # -- small files --------------------------------------------------------------------------
    def read_file(self, name: str) -> bytes:
        key = self.key(name)
        where = self.describe(name)

        def attempt() -> bytes:
            return bytes(self.connection.send("GET", self.object_path(key), where, query={"alt": "media"}).data)

        return self.call(attempt, where, "reading")

    def write_file(self, name: str, data: bytes) -> None:
        # One upload is atomic: readers see the old object or the new one.
        self.upload(self.key(name), data, "writing")

    def create_exclusive(self, name: str, data: bytes) -> bool:
        key = self.key(name)
        send = self.multipart_attempt(key, data, if_generation_match=0)
        attempts = 0

        def attempt() -> bool:
            nonlocal attempts
            attempts += 1
            try:
                send()
            except GCSResponseError as err:
                if err.status == 412:  # a live object has the name
                    return False
                raise
            return True

        created = self.call(attempt, self.describe(name), "creating")
        if created or attempts == 1:
            return created
        # 412 after a failed attempt: that attempt may have created the object
        # and lost its answer. The callers' records are unique to them (host,
        # pid, save id), so equal bytes mean it was ours.
        try:
            return self.read_file(name) == bytes(data)
        except CheckpointNotFoundError:
            return False

    # -- data files ---------------------------------------------------------------------------
    def open_writer(self, name: str, size_hint: int | None = None) -> ObjectWriter:
        return GCSWriter(self, name)

    def _fetch(self, request: ReadRequest) -> None:
        key = self.key(request.name)
        where = self.describe(request.name)
        last = request.offset + request.length - 1
        views = request_views(request)
        buffer = None
        if views is None:  # overlapping targets: read once, then copy
            buffer = memoryview(bytearray(request.length))
            views = [buffer]

        def attempt() -> None:
            response = self.connection.send("GET", self.object_path(key), where, query={"alt": "media"},
                                            headers={"Range": f"bytes={request.offset}-{last}"}, stream=True,
                                            ok=(200, 206))
            finished = False
            try:
                length = int(response.headers.get("Content-Length", -1))
                if response.status == 200 and request.offset != 0:
                    raise StorageError(f"{where}: the endpoint ignored the byte range of a read", where)
                if length < request.length:
                    # The object ends inside the range: a truncated file, not a network fault.
                    raise self._short_read(request.name, request.offset, request.length, max(length, 0))
                receive = _receiver(response)
                done = 0
                for view in views:
                    pos = 0
                    while pos < view.nbytes:
                        n = receive(view[pos:])
                        if not n:
                            raise TransientStorageError(f"connection closed after {done + pos} of "
                                                        f"{request.length} bytes of {where}", where)
                        pos += n
                    done += pos
                if length != request.length:
                    raise StorageError(f"{where}: the endpoint sent {length} bytes for a range of "
                                       f"{request.length}", where)
                finished = True
            finally:
                if finished:
                    response.release_conn()
                else:
                    response.close()  # unknown connection state: discard it

        self.call(attempt, where, "reading", f"reading {where} [{request.offset}, {last + 1})")
        if buffer is not None:
            scatter(request, buffer)
        self._finished(request)

    def _run_reads(self, requests: Sequence[ReadRequest]) -> None:
        run_each(self._fetch, requests, self.options.max_concurrency, "dcp_ext-gcs-get")

    def _read_range_short(self, name: str, offset: int, length: int) -> bytes:
        key = self.key(name)
        where = self.describe(name)
        headers = {"Range": f"bytes={offset}-{offset + length - 1}"}

        def attempt() -> bytes:
            return bytes(self.connection.send("GET", self.object_path(key), where, query={"alt": "media"},
                                              headers=headers, ok=(200, 206)).data)[:length]

        try:
            return self.call(attempt, where, "reading")
        except CheckpointCorruptError:  # 416: the range starts at or past the end
            return b""

    # -- namespace ----------------------------------------------------------------------------
    def exists(self, name: str) -> bool:
        try:
            key = self.key(name)
            where = self.describe(name)
            self.call(lambda: self.connection.send("GET", self.object_path(key), where, query={"fields": "name"}),
                      where, "checking", check_bucket=False)
        except CheckpointNotFoundError:
            return False
        return True

    def delete(self, name: str) -> None:
        self.delete_key(self.key(name))

    def size(self, name: str) -> int:
        return int(self.metadata(name)["size"])

    def modified(self, name: str) -> float | None:
        stamp = self.metadata(name).get("updated")
        return _timestamp(stamp) if stamp else None

    def list_objects(self, prefix: str, delimiter: bool, glob: str | None = None) -> tuple[
            list[dict[str, Any]], list[str]]:
        """Every object resource under ``prefix`` (full keys) and, with
        ``delimiter``, the sub-prefixes directly under it; all pages. ``glob``:
        GCS's ``matchGlob``, a filter the server may apply (the emulator
        ignores it): callers filter the result themselves too.

        Raises:
            BucketNotFoundError: The bucket does not exist.
        """
        items: list[dict[str, Any]] = []
        prefixes: list[str] = []
        token: str | None = None
        path = f"/storage/v1/b/{quote(self.bucket)}/o"
        where = self.where(prefix)
        while True:
            query = {"prefix": prefix, "maxResults": str(_LIST_PAGE),
                     "fields": "items(name,size,timeCreated,updated),prefixes,nextPageToken"}
            if delimiter:
                query["delimiter"] = "/"
            if glob:
                query["matchGlob"] = glob
            if token:
                query["pageToken"] = token

            def attempt(query: dict[str, str] = query) -> dict[str, Any]:
                return self.connection.json("GET", path, where, query=query)

            try:
                page = self.call(attempt, where, "listing", check_bucket=False)
            except BucketNotFoundError:
                raise
            except CheckpointNotFoundError as err:  # a listing's 404 is its bucket's
                raise self._no_bucket() from err
            items.extend(page.get("items", []))
            prefixes.extend(page.get("prefixes", []))
            token = page.get("nextPageToken")
            if not token:
                return items, prefixes

    def _list(self, recursive: bool = False) -> tuple[list[str], list[str]]:
        prefix = f"{self.prefix}/" if self.prefix else ""
        items, prefixes = self.list_objects(prefix, not recursive)
        files = sorted(n for n in (item["name"][len(prefix):] for item in items) if n)
        dirs = sorted(d for d in (p[len(prefix):].rstrip("/") for p in prefixes) if d)
        return files, dirs

    def list_names(self) -> list[str]:
        return self._list()[0]

    def list_dirs(self) -> list[str]:
        return self._list()[1]

    def list_entries(self) -> tuple[list[str], list[str]]:
        return self._list()

    def list_tree(self) -> list[str]:
        return self._list(recursive=True)[0]

    def list_incomplete_uploads(self) -> list[IncompleteUpload]:
        """The uploads in parts that never committed nor aborted: their
        temporary part and group objects, one entry per upload (its oldest
        object's creation time as ``initiated``)."""
        prefix = f"{self.prefix}/" if self.prefix else ""
        # Only the temporaries, where the server filters (real GCS): not every file of every checkpoint.
        items, _ = self.list_objects(prefix, delimiter=False, glob=f"**{TMP_MARK}*")
        pattern = temporary_pattern()
        uploads: dict[tuple[str, str], float] = {}
        for item in items:
            match = pattern.fullmatch(item["name"][len(prefix):])
            if match is None:
                continue
            stamp = item.get("timeCreated") or item.get("updated")
            created = _timestamp(stamp) if stamp else 0.0
            upload = (match.group("name"), match.group("upload"))
            uploads[upload] = min(created, uploads.get(upload, created))
        return [IncompleteUpload(name, upload, started) for (name, upload), started in sorted(uploads.items())]

    def abort_upload(self, upload: IncompleteUpload) -> None:
        """Delete the temporary objects of ``upload``."""
        temporary = f"{self.key(upload.name)}{TMP_MARK}{upload.upload_id}."
        items, _ = self.list_objects(temporary, delimiter=False)
        for item in items:
            self.delete_key(item["name"])

    def remove_root_if_empty(self) -> None:
        """GCS has no directories: a prefix vanishes with its last object."""

    def _no_bucket(self) -> BucketNotFoundError:
        return BucketNotFoundError(
            f"bucket {self.bucket!r} does not exist (for {self.url}): check the bucket name and endpoint_url "
            f"in storage_options ({self.connection.endpoint})", self.url)

    def _check_bucket(self) -> None:
        """Raise :class:`~dcp_ext.errors.BucketNotFoundError` if the bucket does not
        exist (asked once per connection and bucket)."""
        if self.bucket in self.connection.checked_buckets:
            return
        path = f"/storage/v1/b/{quote(self.bucket)}"
        where = f"{self.scheme}://{self.bucket}"
        try:
            self.call(lambda: self.connection.send("GET", path, where, query={"fields": "name"}), where,
                      "checking bucket", check_bucket=False)
        except CheckpointNotFoundError as err:
            raise self._no_bucket() from err
        except DcpExtError as err:
            # A key allowed objects but not buckets.get (a common IAM role): the
            # operation itself will say whether it may proceed.
            log.debug("could not check bucket %s: %s", self.bucket, err)
            return
        self.connection.checked_buckets.add(self.bucket)

    def root_exists(self) -> bool:
        self._check_bucket()
        prefix = f"{self.prefix}/" if self.prefix else ""
        where = self.describe()
        path = f"/storage/v1/b/{quote(self.bucket)}/o"
        query = {"prefix": prefix, "maxResults": "1", "fields": "items(name),prefixes"}
        try:
            page = self.call(lambda: self.connection.json("GET", path, where, query=query), where, "listing",
                             check_bucket=False)
        except CheckpointNotFoundError as err:
            raise self._no_bucket() from err
        return bool(page.get("items") or page.get("prefixes"))

    def ensure_root(self) -> None:
        self._check_bucket()


def _receiver(response: Any) -> Callable[[memoryview], int]:
    """``readinto`` of the response body that lands the bytes in the caller's
    buffer without a copy: http.client's, under urllib3's (urllib3's own
    ``readinto`` reads into a new ``bytes`` and copies it twice). urllib3's
    when the body is content-encoded or its internals differ."""
    raw = getattr(response, "_fp", None)
    if raw is not None and hasattr(raw, "readinto") and not response.headers.get("Content-Encoding"):
        return raw.readinto  # type: ignore[no-any-return]
    return response.readinto  # type: ignore[no-any-return]
