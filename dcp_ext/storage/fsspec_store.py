"""Any other fsspec file system (``memory://``, ``gcs://``, ``abfs://``, ``sftp://`` ...).

Writes stream through ``fs.open(..., "wb")`` under a temporary name and are
moved into place on commit. Reads use the file system's ranged ``cat_file``:
concurrently on its event loop for async file systems, from a thread pool
otherwise. S3 has its own, faster backend (:mod:`dcp_ext.storage.s3`).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..config import IOConfig
from ..errors import (
    CheckpointNotFoundError,
    DcpExtError,
    NotACheckpointError,
    StorageError,
    StoragePermissionError,
    TransientStorageError,
)
from ._base import TMP_MARK, ObjectWriter, Store, scatter
from ._ranges import ReadRequest
from ._retry import retry_sync

__all__ = ["FsspecStore"]


def _translate(err: BaseException, where: str, doing: str) -> DcpExtError:
    if isinstance(err, DcpExtError):
        return err
    if isinstance(err, FileNotFoundError):
        return CheckpointNotFoundError(f"{where} does not exist ({doing})", where)
    if isinstance(err, PermissionError):
        return StoragePermissionError(f"permission denied {doing} {where}: {err}", where)
    if isinstance(err, NotADirectoryError):
        return NotACheckpointError(f"{where}: not a directory ({doing})", where)
    return StorageError(f"storage error {doing} {where}: {type(err).__name__}: {err}", where)


def _is_transient(err: BaseException) -> bool:
    return isinstance(err, (TransientStorageError, ConnectionError, TimeoutError))


class _FsspecWriter(ObjectWriter):
    def __init__(self, store: FsspecStore, name: str) -> None:
        super().__init__(name)
        self._store = store
        self._final = store.path(name)
        self._tmp = f"{self._final}{TMP_MARK}{uuid.uuid4().hex[:12]}"
        self._done = False
        try:
            self._file = store.fs.open(self._tmp, "wb")
        except Exception as err:
            raise _translate(err, store.describe(name), "creating") from err

    def write(self, data: memoryview | bytes | bytearray) -> None:
        view = memoryview(data).cast("B")
        try:
            self._file.write(view)
        except Exception as err:
            raise _translate(err, self._store.describe(self.name), "writing") from err
        self.position += view.nbytes

    def commit(self) -> None:
        try:
            self._file.close()
            self._store.fs.mv(self._tmp, self._final)
        except Exception as err:
            self.abort()
            raise _translate(err, self._store.describe(self.name), "committing") from err
        self._done = True
        self._store.stats.add_written_file(self.position)

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        discard = getattr(self._file, "discard", None)
        try:
            if callable(discard):
                discard()
            else:
                self._file.close()
        except Exception:
            pass
        try:
            self._store.fs.rm_file(self._tmp)
        except Exception:
            pass  # the temporary name is never read as data


class FsspecStore(Store):
    """A checkpoint directory on any fsspec file system.

    Args:
        url: An fsspec URL such as ``memory://ckpt/step10``.
        config: I/O tunables.
        storage_options: Passed to ``fsspec.core.url_to_fs``.
        filesystem: A file system instance to reuse instead.
    """

    kind = "fsspec"

    def __init__(
        self,
        url: str,
        config: IOConfig,
        storage_options: dict[str, Any] | None = None,
        filesystem: Any = None,
    ) -> None:
        super().__init__(url, config)
        import fsspec.core

        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self.fs = filesystem if filesystem is not None else fs
        """The fsspec file system the store works through."""
        self.root = root.rstrip("/")
        """The root's path within ``fs`` (the URL without its scheme), without a trailing ``/``."""
        self._async = bool(getattr(self.fs, "async_impl", False))

    def path(self, name: str) -> str:
        """The path of ``name`` within ``fs``."""
        return f"{self.root}/{name}"

    # -- small files --------------------------------------------------------
    def read_file(self, name: str) -> bytes:
        try:
            return bytes(self.fs.cat_file(self.path(name)))
        except Exception as err:
            raise _translate(err, self.describe(name), "reading") from err

    def write_file(self, name: str, data: bytes) -> None:
        try:
            if self._async:
                # Object stores publish a single PUT atomically.
                self.fs.pipe_file(self.path(name), bytes(data))
            else:
                tmp = f"{self.path(name)}{TMP_MARK}{uuid.uuid4().hex[:12]}"
                self.fs.pipe_file(tmp, bytes(data))
                self.fs.mv(tmp, self.path(name))
        except Exception as err:
            raise _translate(err, self.describe(name), "writing") from err

    def create_exclusive(self, name: str, data: bytes) -> bool:
        # fsspec's ``pipe_file(mode="create")`` is as atomic as the backend
        # makes it (a conditional PUT on object stores that support one, an
        # exclusive create on local files); backends without it get the base
        # class's check-then-write, which concurrent callers can race.
        try:
            self.fs.pipe_file(self.path(name), bytes(data), mode="create")
        except FileExistsError:
            return False
        except (TypeError, NotImplementedError):
            return super().create_exclusive(name, data)
        except Exception as err:
            raise _translate(err, self.describe(name), "creating") from err
        return True

    def modified(self, name: str) -> float | None:
        try:
            stamp = self.fs.modified(self.path(name))
        except FileNotFoundError as err:
            raise _translate(err, self.describe(name), "checking") from err
        except Exception:
            return None  # the file system does not record it
        return float(stamp.timestamp()) if hasattr(stamp, "timestamp") else None

    # -- data files -----------------------------------------------------------
    def open_writer(self, name: str, size_hint: int | None = None) -> ObjectWriter:
        return _FsspecWriter(self, name)

    def _accept(self, request: ReadRequest, data: bytes) -> None:
        if len(data) != request.length:
            raise self._short_read(request.name, request.offset, request.length, len(data))
        if request.is_direct:
            request.targets[0][1][:] = data
        else:
            scatter(request, memoryview(data))
        self._finished(request)

    def _fetch_sync(self, request: ReadRequest) -> None:
        where = self.describe(request.name)
        end = request.offset + request.length

        def attempt() -> bytes:
            return bytes(self.fs.cat_file(self.path(request.name), start=request.offset, end=end))

        try:
            data = retry_sync(attempt, self.config.retry, _is_transient, f"reading {where}")
        except Exception as err:
            raise _translate(err, where, "reading") from err
        self._accept(request, data)

    def _run_reads(self, requests: Sequence[ReadRequest]) -> None:
        if self._async:
            self._run_reads_async(requests)
            return
        workers = min(self.config.max_concurrency, len(requests))
        if workers <= 1:
            for request in requests:
                self._fetch_sync(request)
            return
        with ThreadPoolExecutor(workers, thread_name_prefix="dcp_ext-read") as pool:
            for future in [pool.submit(self._fetch_sync, r) for r in requests]:
                future.result()

    def _run_reads_async(self, requests: Sequence[ReadRequest]) -> None:
        import fsspec.asyn

        async def run_all() -> None:
            slots = asyncio.Semaphore(self.config.max_concurrency)

            async def one(request: ReadRequest) -> None:
                async with slots:
                    try:
                        data = await self.fs._cat_file(
                            self.path(request.name), start=request.offset,
                            end=request.offset + request.length,
                        )
                    except Exception as err:
                        raise _translate(err, self.describe(request.name), "reading") from err
                    self._accept(request, bytes(data))

            await asyncio.gather(*(one(r) for r in requests))

        fsspec.asyn.sync(self.fs.loop, run_all)

    # -- namespace ------------------------------------------------------------
    def exists(self, name: str) -> bool:
        try:
            return bool(self.fs.isfile(self.path(name)))
        except Exception as err:
            raise _translate(err, self.describe(name), "checking") from err

    def delete(self, name: str) -> None:
        try:
            self.fs.rm_file(self.path(name))
        except FileNotFoundError:
            pass
        except Exception as err:
            raise _translate(err, self.describe(name), "deleting") from err

    def list_names(self) -> list[str]:
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        except Exception as err:
            raise _translate(err, self.url, "listing") from err
        prefix = self.root + "/"
        names = []
        for entry in entries:
            if entry.get("type") != "file":
                continue
            full = entry["name"].rstrip("/")
            rel = full[len(prefix):] if full.startswith(prefix) else full.rsplit("/", 1)[-1]
            rel = rel.lstrip("/")
            if rel and "/" not in rel:
                names.append(rel)
        return sorted(names)

    def list_tree(self) -> list[str]:
        try:
            found = self.fs.find(self.root)
        except FileNotFoundError:
            return []
        except Exception as err:
            raise _translate(err, self.url, "listing") from err
        prefix = self.root + "/"
        return sorted(path[len(prefix):] for path in map(str, found) if path.startswith(prefix))

    def list_dirs(self) -> list[str]:
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        except Exception as err:
            raise _translate(err, self.url, "listing") from err
        names = []
        for entry in entries:
            if entry.get("type") == "directory":
                names.append(entry["name"].rstrip("/").rsplit("/", 1)[-1])
        return sorted(n for n in names if n)

    def _read_range_short(self, name: str, offset: int, length: int) -> bytes:
        try:
            return bytes(self.fs.cat_file(self.path(name), start=offset, end=offset + length))
        except Exception as err:
            raise _translate(err, self.describe(name), "reading") from err

    def size(self, name: str) -> int:
        try:
            return int(self.fs.size(self.path(name)))
        except Exception as err:
            raise _translate(err, self.describe(name), "checking") from err

    def remove_root_if_empty(self) -> None:
        try:
            if not self.fs.ls(self.root):
                self.fs.rmdir(self.root)
        except Exception:
            pass

    def root_exists(self) -> bool:
        try:
            if self.fs.isfile(self.root):
                raise NotACheckpointError(f"{self.url} is a file, not a checkpoint directory", self.url)
            return bool(self.fs.isdir(self.root))
        except DcpExtError:
            raise
        except Exception as err:
            raise _translate(err, self.url, "checking") from err

    def ensure_root(self) -> None:
        try:
            self.fs.makedirs(self.root, exist_ok=True)
        except Exception as err:
            raise _translate(err, self.url, "creating directory") from err
