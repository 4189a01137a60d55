"""Streamed writes to GCS: parts uploaded in parallel as temporary objects, composed at commit.

GCS's JSON API has no multipart upload of parts sent in parallel (its XML API
has one, but no emulator on PyPI implements it, so it could not be tested
here: /tmp/notes/stores.md, issue 42). A resumable upload is one sequential
stream. So a file larger than one part is a *parallel composite upload*:

1. each full part buffer is uploaded as the temporary object
   ``{name}{TMP_MARK}{upload}.p{n:06d}`` (one media upload, sent straight from
   the pooled buffer), up to ``max_concurrency`` at a time;
2. once 32 consecutive parts are stored and the file goes on past them, they
   are composed (GCS takes at most 32 sources per compose) into
   ``{name}{TMP_MARK}{upload}.g1-{i:06d}`` and deleted, while the upload goes
   on: a long upload keeps at most a few dozen temporaries and its commit has
   little left to do;
3. the commit composes the groups and the remaining parts into the final
   name (folding the last 32 parts into a group first if that makes 33
   sources, and composing 32 at a time into further groups first above 1,024
   parts), then deletes the temporaries. A file of at most 32 parts is one
   compose of its parts: no compose copies a lone group.

The final object appears at once, whole, at the last compose: nothing is
visible under its name before. An abort, or a failed commit, deletes every
temporary of the upload (found by listing its name); a crashed process leaves
them, and :meth:`GCSStore.list_incomplete_uploads` reports them by upload.
A file smaller than one part is a single multipart upload at commit.

On real GCS a composite object has a CRC32C but no MD5, and its parts are
billed operations; the compose requests copy no data there (on the emulator
they do, which is why it writes large files slowly).
"""

from __future__ import annotations

import logging
import re
import threading
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Protocol

from ..errors import StorageError
from ._base import TMP_MARK, IOStats, ObjectWriter
from ._gcs_options import GCSOptions

__all__ = ["GCSWriter", "PartStore", "MAX_COMPOSE", "temporary_pattern", "fold_plan"]

log = logging.getLogger("dcp_ext.gcs")

#: Sources one compose request may name (GCS's limit).
MAX_COMPOSE = 32


def temporary_pattern() -> re.Pattern[str]:
    """Matches the temporary objects of an upload in parts (relative to a
    root): groups ``name`` (the file's) and ``upload`` (the upload's id)."""
    return re.compile(rf"(?P<name>.+){re.escape(TMP_MARK)}(?P<upload>[0-9a-f]{{12}})\.(?:p\d+|g\d+-\d+)")


def fold_plan(count: int, fan_in: int = MAX_COMPOSE) -> list[int]:
    """How many composes each round of folding ``count`` sources takes until at
    most ``fan_in`` are left (``[]`` when there are no more than that already)."""
    rounds = []
    while count > fan_in:
        count = -(-count // fan_in)
        rounds.append(count)
    return rounds


class PartStore(Protocol):
    """What a :class:`GCSWriter` needs of its store (:class:`~dcp_ext.storage.GCSStore`)."""

    options: GCSOptions
    stats: IOStats
    part_buffers: Any  # the store's pooled part buffers (get / put / join / leave)

    def key(self, name: str) -> str: ...
    def describe(self, name: str = "") -> str: ...
    def where(self, key: str) -> str: ...
    def upload(self, key: str, data: bytes | bytearray | memoryview, doing: str) -> dict[str, Any]: ...
    def upload_media(self, key: str, data: memoryview, doing: str) -> dict[str, Any]: ...
    def compose(self, key: str, sources: Sequence[str], doing: str) -> dict[str, Any]: ...
    def delete_key(self, key: str) -> None: ...
    def list_objects(self, prefix: str, delimiter: bool) -> tuple[list[dict[str, Any]], list[str]]: ...


class GCSWriter(ObjectWriter):
    """A parallel composite upload from the store's pooled part buffers (see the module docstring)."""

    def __init__(self, store: PartStore, name: str) -> None:
        super().__init__(name)
        self._store = store
        self._key = store.key(name)
        self._where = store.describe(name)
        self._part_size = store.options.part_size
        self._buffers = store.part_buffers
        self._buffers.join()
        self._left_pool = False
        self._buffer: bytearray | None = None
        self._filled = 0
        self._temporary = f"{self._key}{TMP_MARK}{uuid.uuid4().hex[:12]}"
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[Future[None]] = []
        self._parts = 0
        self._group_left: dict[int, int] = {}  # group -> its parts not stored yet
        self._folding: set[int] = set()  # groups being (or already) composed
        self._groups: dict[int, str] = {}  # group -> the temporary its parts were composed into
        self._error: BaseException | None = None
        self._stopping = False  # aborting: fold nothing more
        self._lock = threading.Lock()
        self._done = False

    def _part(self, number: int) -> str:
        return f"{self._temporary}.p{number:06d}"

    def _group(self, level: int, number: int) -> str:
        return f"{self._temporary}.g{level}-{number:06d}"

    # -- writing ------------------------------------------------------------------------------
    def write(self, data: memoryview | bytes | bytearray) -> None:
        self._raise_if_failed()
        view = memoryview(data).cast("B")
        self.position += view.nbytes
        while view.nbytes:
            if self._buffer is None:
                self._buffer = self._buffers.get(self._part_size)
                self._filled = 0
            take = min(view.nbytes, self._part_size - self._filled)
            self._buffer[self._filled : self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            if self._filled == self._part_size:
                buffer, self._buffer, self._filled = self._buffer, None, 0
                self._send(buffer, self._part_size)

    def _raise_if_failed(self) -> None:
        with self._lock:
            error = self._error
        if error is not None:
            raise error

    def _fail(self, err: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = err

    def _submit(self, fn: Any, *args: Any) -> Future[None]:
        assert self._pool is not None
        future: Future[None] = self._pool.submit(fn, *args)
        with self._lock:
            self._futures.append(future)
        return future

    def _send(self, buffer: bytearray, length: int) -> None:
        """Upload ``buffer[:length]`` as the next part; the buffer goes back to the pool after."""
        self._raise_if_failed()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._store.options.max_concurrency, thread_name_prefix="dcp_ext-gcs-put")
        with self._lock:
            number = self._parts
            self._parts += 1
            self._group_left.setdefault(number // MAX_COMPOSE, MAX_COMPOSE)
        future = self._submit(self._upload_part, number, buffer, length)
        if number and number % MAX_COMPOSE == 0:
            self._fold_if_ready(number // MAX_COMPOSE - 1)  # the file goes on past that group
        # A part cancelled before it ran gives its buffer back here.
        future.add_done_callback(lambda f: self._buffers.put(buffer) if f.cancelled() else None)

    def _upload_part(self, number: int, buffer: bytearray, length: int) -> None:
        try:
            self._raise_if_failed()  # another part failed for good: this upload is lost anyway
            self._store.upload_media(self._part(number), memoryview(buffer)[:length],
                                     f"uploading part {number} of {self._where} as")
        except BaseException as err:
            self._fail(err)
            raise
        finally:
            self._buffers.put(buffer)
        group = number // MAX_COMPOSE
        with self._lock:
            self._group_left[group] -= 1
        self._fold_if_ready(group)

    def _fold_if_ready(self, group: int) -> None:
        """Fold ``group`` now, while the upload goes on, once its parts are all
        stored and a later part was sent (the last group waits for the commit)."""
        with self._lock:
            ready = (self._group_left.get(group) == 0 and self._parts > (group + 1) * MAX_COMPOSE
                     and group not in self._folding and self._error is None and not self._stopping)
            if ready:
                self._folding.add(group)
        if ready:
            self._submit(self._fold_group, group)

    def _fold_group(self, group: int) -> None:
        parts = [self._part(n) for n in range(group * MAX_COMPOSE, min(self._parts, (group + 1) * MAX_COMPOSE))]
        name = self._group(1, group)
        try:
            self._store.compose(name, parts, f"composing parts of {self._where} into")
        except BaseException as err:
            self._fail(err)
            raise
        with self._lock:
            self._groups[group] = name
        for part in parts:
            self._submit(self._delete_quietly, part)

    def _delete_quietly(self, key: str) -> None:
        try:
            self._store.delete_key(key)
        except Exception as err:  # noqa: BLE001 - a leftover part is cleanup's, not a failed save
            log.warning("could not delete %s, a temporary part of %s (cleanup removes it later): %s",
                        self._store.where(key), self._where, err)

    def _wait(self) -> None:
        """Wait for every task, those that tasks submitted included."""
        while True:
            with self._lock:
                pending = [f for f in self._futures if not f.done()]
            if not pending:
                break
            wait(pending)
        with self._lock:
            self._futures.clear()

    # -- commit / abort -----------------------------------------------------------------------
    def commit(self) -> None:
        try:
            if self._parts == 0:
                body = memoryview(self._buffer)[: self._filled] if self._buffer is not None else memoryview(b"")
                self._store.upload(self._key, body, "writing")
            else:
                if self._filled:
                    buffer, self._buffer, length, self._filled = self._buffer, None, self._filled, 0
                    assert buffer is not None
                    self._send(buffer, length)
                self._wait()
                self._raise_if_failed()
                self._compose_final()
        except BaseException:
            self.abort()
            raise
        self._done = True
        self._release()
        self._store.stats.add_written_file(self.position)

    def _sources(self) -> list[str]:
        """The stored pieces of the file, in order: composed groups and loose parts."""
        sources: list[str] = []
        for group in range(-(-self._parts // MAX_COMPOSE)):
            if group in self._groups:
                sources.append(self._groups[group])
            else:
                last = min(self._parts, (group + 1) * MAX_COMPOSE)
                sources.extend(self._part(n) for n in range(group * MAX_COMPOSE, last))
        return sources

    def _compose_final(self) -> None:
        sources = self._sources()
        last = (self._parts - 1) // MAX_COMPOSE
        loose = self._parts - last * MAX_COMPOSE if last not in self._groups else 0
        if len(sources) > MAX_COMPOSE and loose > 1:  # the last group's parts make it too many
            self._fold_group(last)
            self._wait()
            self._raise_if_failed()
            sources = self._sources()
        level = 1
        while len(sources) > MAX_COMPOSE:  # more than 1,024 parts: compose of composes
            level += 1
            batches = [sources[i : i + MAX_COMPOSE] for i in range(0, len(sources), MAX_COMPOSE)]
            names = [self._group(level, i) for i in range(len(batches))]
            for name, batch in zip(names, batches):
                self._submit(self._compose_batch, name, batch)
            self._wait()
            self._raise_if_failed()
            sources = names
        result = self._store.compose(self._key, sources, "committing")
        size = int(result.get("size", self.position))
        if size != self.position:
            self._store.delete_key(self._key)
            raise StorageError(f"{self._where}: composed {size} bytes, {self.position} were written", self._where)
        for source in sources:
            self._submit(self._delete_quietly, source)
        self._wait()

    def _compose_batch(self, name: str, batch: list[str]) -> None:
        try:
            self._store.compose(name, batch, f"composing parts of {self._where} into")
        except BaseException as err:
            self._fail(err)
            raise
        for source in batch:
            self._submit(self._delete_quietly, source)

    def _release(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._left_pool:
            return
        self._left_pool = True
        if self._buffer is not None:
            self._buffers.put(self._buffer)
            self._buffer = None
        self._buffers.leave()

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        with self._lock:
            self._stopping = True
            futures = list(self._futures)
        for future in futures:
            future.cancel()
        self._wait()
        self._release()
        if self._parts:
            try:
                items, _ = self._store.list_objects(self._temporary + ".", delimiter=False)
                for item in items:
                    self._store.delete_key(item["name"])
            except Exception as err:  # noqa: BLE001 - the final name is untouched either way
                log.warning("could not delete the temporary parts of %s (cleanup removes them later): %s",
                            self._where, err)
