"""Where a checkpoint's data files are: its own directory, and the earlier checkpoints an incremental one refers to."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

from ..config import IOConfig
from ..errors import CheckpointCorruptError, CheckpointNotFoundError
from ..metadata.document import REFERENCE_PREFIX, split_reference
from ..storage import Location, ReadRequest, Store

__all__ = ["CheckpointFiles"]

#: Checkpoint directories an incremental load reads from at once.
_REFERENCED_DIRS_AT_ONCE = 4


class CheckpointFiles:
    """The stores one checkpoint's data files are read from (each rank has its own).

    Args:
        location: The checkpoint directory (URL, storage options, config).
        store: Read through this store instead of opening ``location``.
    """

    def __init__(self, location: Location, store: Store | None = None) -> None:
        self.location = location
        self._store = store
        self._siblings: dict[str, Store] = {}

    @property
    def path(self) -> str:
        return self.location.url

    @property
    def config(self) -> IOConfig:
        return self.location.config

    @property
    def store(self) -> Store:
        """The store of the checkpoint directory (created on first use)."""
        if self._store is None:
            self._store = self.location.open()
        return self._store

    def moved(self, location: Location) -> None:
        """The checkpoint is now at ``location`` (a new load): forget the stores of the old one."""
        if location.url != self.path:
            self.location = location
            self._store = None
            self._siblings = {}

    def sibling_store(self, directory: str) -> Store:
        """The store of another checkpoint directory under the same root (the
        files an incremental checkpoint's frames refer to), opened once."""
        store = self._siblings.get(directory)
        if store is None:
            parent = self.location.parent() or self.location.at(".")
            store = self._siblings[directory] = parent.child(directory).open()
        return store

    def describe(self, name: str) -> str:
        """Where a data file (or a file an incremental checkpoint refers to) is."""
        if name.startswith(REFERENCE_PREFIX):
            directory, file = split_reference(name, self.path)
            return self.sibling_store(directory).describe(file)
        return self.store.describe(name)

    def file_store(self, name: str) -> tuple[Store, str]:
        """The store holding data file ``name`` of this checkpoint, and its name
        there: this checkpoint's store, or for a file an incremental
        checkpoint refers to (``../tag_partial/file``) the sibling checkpoint's."""
        if name.startswith(REFERENCE_PREFIX):
            directory, file = split_reference(name, self.path)
            return self.sibling_store(directory), file
        return self.store, name

    def read_requests(self, requests: list[ReadRequest]) -> None:
        """Run read requests: those of this checkpoint's files on its store,
        those of files an incremental checkpoint refers to on theirs."""
        store = self.store
        if not any(r.name.startswith(REFERENCE_PREFIX) for r in requests):
            store.read(requests)
            return
        groups: dict[str, list[ReadRequest]] = {}
        for request in requests:
            if request.name.startswith(REFERENCE_PREFIX):
                directory, file = split_reference(request.name, self.path)
                groups.setdefault(directory, []).append(dataclasses.replace(request, name=file))
            else:
                groups.setdefault("", []).append(request)
        if len(groups) == 1:
            self._read_group(*next(iter(groups.items())))
            return
        # The groups at once (each store reads its files in parallel too): one
        # after the other, a load of a frozen base plus a few changed frames
        # would read the base's big file alone, on one stream.
        for directory in groups:
            if directory:
                self.sibling_store(directory)  # opened here, not by racing threads
        with ThreadPoolExecutor(min(len(groups), _REFERENCED_DIRS_AT_ONCE), thread_name_prefix="dcp_ext-refs") as pool:
            for future in [pool.submit(self._read_group, d, g) for d, g in groups.items()]:
                future.result()

    def _read_group(self, directory: str, group: list[ReadRequest]) -> None:
        """Read ``group`` from this checkpoint's store (``directory == ""``) or
        from the sibling checkpoint ``directory`` it refers to."""
        if not directory:
            self.store.read(group)
            return
        sibling = self.sibling_store(directory)
        try:
            sibling.read(group)
        except CheckpointNotFoundError as err:
            where = err.path or sibling.url
            raise CheckpointCorruptError(
                f"{where} is missing, and checkpoint {self.path} needs it: it was saved incrementally and "
                f"refers to frames stored in that file of the earlier checkpoint {directory!r}. "
                f"Restore the file, or load a checkpoint that does not refer to it",
                where,
            ) from err
