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
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

from ..errors import StorageError
from ._base import TMP_MARK, IOStats
from ._gcs_options import GCSOptions
from ._part_upload import PartBuffers, PartUploadWriter

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
    part_buffers: PartBuffers

    def key(self, name: str) -> str: ...
    def describe(self, name: str = "") -> str: ...
    def where(self, key: str) -> str: ...
    def upload(self, key: str, data: bytes | bytearray | memoryview, doing: str) -> dict[str, Any]: ...
    def upload_media(self, key: str, data: memoryview, doing: str) -> dict[str, Any]: ...
    def compose(self, key: str, sources: Sequence[str], doing: str) -> dict[str, Any]: ...
    def delete_key(self, key: str) -> None: ...
    def list_objects(self, prefix: str, delimiter: bool) -> tuple[list[dict[str, Any]], list[str]]: ...


class GCSWriter(PartUploadWriter):
    """A parallel composite upload from the store's pooled part buffers (see the module docstring)."""

    def __init__(self, store: PartStore, name: str) -> None:
        super().__init__(name, store.part_buffers, store.options.part_size, store.options.max_concurrency,
                         store.stats, "dcp_ext-gcs-put")
        self._store = store
        self._key = store.key(name)
        self._where = store.describe(name)
        self._temporary = f"{self._key}{TMP_MARK}{uuid.uuid4().hex[:12]}"
        self._group_left: dict[int, int] = {}  # group -> its parts not stored yet
        self._folding: set[int] = set()  # groups being (or already) composed
        self._groups: dict[int, str] = {}  # group -> the temporary its parts were composed into

    def _part(self, number: int) -> str:
        return f"{self._temporary}.p{number:06d}"

    def _group(self, level: int, number: int) -> str:
        return f"{self._temporary}.g{level}-{number:06d}"

    # -- parts --------------------------------------------------------------------------------
    def _before_part(self, index: int) -> None:
        with self._lock:
            self._group_left.setdefault(index // MAX_COMPOSE, MAX_COMPOSE)

    def _part_sent(self, index: int) -> None:
        if index and index % MAX_COMPOSE == 0:
            self._fold_if_ready(index // MAX_COMPOSE - 1)  # the file goes on past that group

    def _send_part(self, index: int, buffer: bytearray, length: int) -> None:
        self._store.upload_media(self._part(index), memoryview(buffer)[:length],
                                 f"uploading part {index} of {self._where} as")

    def _part_stored(self, index: int) -> None:
        group = index // MAX_COMPOSE
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

    # -- commit / abort -----------------------------------------------------------------------
    def _put_whole(self, body: memoryview) -> None:
        self._store.upload(self._key, body, "writing")

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

    def _complete(self) -> None:
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

    def _discard(self) -> None:
        if not self._parts:
            return
        try:
            items, _ = self._store.list_objects(self._temporary + ".", delimiter=False)
            for item in items:
                self._store.delete_key(item["name"])
        except Exception as err:  # noqa: BLE001 - the final name is untouched either way
            log.warning("could not delete the temporary parts of %s (cleanup removes them later): %s",
                        self._where, err)
