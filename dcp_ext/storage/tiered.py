"""One checkpoint read from several copies of it: each file from the first copy that has it intact.

:class:`TieredStore` is read-only. Its sources are the same checkpoint
directory in different tiers, fastest first (a node's local tier, then the
persistent root). Each file is read from the first source that has it; when
the reader finds a file damaged (a checksum mismatch or a short read), it
calls :meth:`TieredStore.fall_back` and reads that file again from the next
source that has it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..errors import CheckpointNotFoundError, DcpExtError
from ._base import ObjectWriter, Store
from ._ranges import ReadRequest

__all__ = ["TieredStore"]

log = logging.getLogger("dcp_ext.tiers")


class TieredStore(Store):
    """Read a checkpoint from ``sources``, each file from the first that has it.

    Args:
        sources: ``(label, store)`` pairs, fastest first; every store holds
            (a part of) the same checkpoint directory.

    Attributes:
        stats: Data-file bytes read through this store, all sources together;
            :meth:`bytes_by_source` splits them.
    """

    def __init__(self, sources: Sequence[tuple[str, Store]]) -> None:
        if not sources:
            raise ValueError("TieredStore needs at least one source")
        first = sources[0][1]
        super().__init__(first.url, first.config)
        self.kind = first.kind
        self.sources = tuple(sources)
        self._route: dict[str, int] = {}
        self._skipped: dict[str, set[int]] = {}

    # -- routing ----------------------------------------------------------------
    def _index_for(self, name: str) -> int:
        index = self._route.get(name)
        if index is not None:
            return index
        skipped = self._skipped.get(name, set())
        for i, (_, store) in enumerate(self.sources):
            if i not in skipped and store.exists(name):
                self._route[name] = i
                return i
        raise CheckpointNotFoundError(
            f"{name} is in none of the copies of this checkpoint: "
            + ", ".join(f"{label} ({store.describe(name)})" for label, store in self.sources),
            self.sources[0][1].describe(name),
        )

    def source_of(self, name: str) -> tuple[str, Store]:
        """``(label, store)`` that ``name`` is read from."""
        return self.sources[self._index_for(name)]

    def fall_back(self, error: DcpExtError) -> bool:
        """Stop reading the file ``error`` names from its current source.

        Returns:
            Whether another source has the file (read it again from there).
        """
        for name, index in list(self._route.items()):
            label, store = self.sources[index]
            if error.path is not None and error.path.startswith(store.describe(name)):
                del self._route[name]
                self._skipped.setdefault(name, set()).add(index)
                try:
                    next_label, next_store = self.source_of(name)
                except CheckpointNotFoundError:
                    return False
                log.warning("%s copy of %s is damaged (%s); reading it from %s (%s) instead",
                            label, store.describe(name), error, next_label, next_store.describe(name))
                return True
        return False

    def routes(self) -> dict[str, str]:
        """The source label each file read so far came from, by file name."""
        return {name: self.sources[index][0] for name, index in sorted(self._route.items())}

    def bytes_by_source(self) -> dict[str, int]:
        """Data-file bytes read from each source, by label."""
        return {label: store.stats.snapshot().bytes_read for label, store in self.sources}

    # -- reads ------------------------------------------------------------------
    def describe(self, name: str = "") -> str:
        if not name:
            return " | ".join(store.describe() for _, store in self.sources)
        return self.source_of(name)[1].describe(name)

    def read_file(self, name: str) -> bytes:
        return self.source_of(name)[1].read_file(name)

    def read_head(self, name: str, length: int) -> bytes:
        return self.source_of(name)[1].read_head(name, length)

    def read_range(self, name: str, offset: int, length: int, allow_short: bool = False) -> bytes:
        return self.source_of(name)[1].read_range(name, offset, length, allow_short)

    def size(self, name: str) -> int:
        return self.source_of(name)[1].size(name)

    def read(self, requests: Sequence[ReadRequest]) -> None:
        groups: dict[int, list[ReadRequest]] = {}
        for request in requests:
            groups.setdefault(self._index_for(request.name), []).append(request)
        for index, group in groups.items():
            self.sources[index][1].read(group)
            for request in group:
                self.stats.add_read(request.name, request.length)

    def _run_reads(self, requests: Sequence[ReadRequest]) -> None:  # pragma: no cover - read() routes
        raise AssertionError("TieredStore.read routes requests to its sources")

    def exists(self, name: str) -> bool:
        try:
            self._index_for(name)
        except CheckpointNotFoundError:
            return False
        return True

    def list_names(self) -> list[str]:
        return sorted({n for _, store in self.sources for n in store.list_names()})

    def list_dirs(self) -> list[str]:
        return sorted({n for _, store in self.sources for n in store.list_dirs()})

    def list_tree(self) -> list[str]:
        return sorted({n for _, store in self.sources for n in store.list_tree()})

    def root_exists(self) -> bool:
        return any(store.root_exists() for _, store in self.sources)

    # -- read-only ----------------------------------------------------------------
    def _read_only(self) -> NotImplementedError:
        return NotImplementedError("a TieredStore only reads; write to one of its sources")

    def write_file(self, name: str, data: bytes) -> None:
        raise self._read_only()

    def open_writer(self, name: str, size_hint: int | None = None) -> ObjectWriter:
        raise self._read_only()

    def delete(self, name: str) -> None:
        raise self._read_only()

    def remove_root_if_empty(self) -> None:
        raise self._read_only()

    def ensure_root(self) -> None:
        raise self._read_only()
