"""A torch_checkpointing ``Storage`` backed by dcp_ext's stores: local/POSIX, S3, any fsspec URL.

`torch_checkpointing <https://github.com/meta-pytorch/torch_checkpointing>`_
(0.1.1) is not DCP: it writes its own files (``{item}_{rank}.pt`` with
``torch.save``, safetensors, JSON, a pickled resharding metadata file) through
a pluggable ``Storage``, chosen by the ``StorageConfig`` given to its
``CheckpointManager.Config(storage_config=...)`` (or its savers and reader).
:class:`DcpExtStorageConfig` is one: its :class:`DcpExtStorage` puts every
file through dcp_ext's stores, so a checkpoint may live on S3 (or any fsspec
URL) with ``storage_options``, and gets their bounded waits and retries,
parallel multipart uploads, files that appear only whole and durable,
parallel ranged reads straight into torch_checkpointing's buffers (its mmap
fills and resharding reads), and :class:`~dcp_ext.IOConfig` tunables
(``io_options``). The config is a plain dataclass: it pickles into the
asynchronous saver's spawned process, where each process opens its own stores.

torch_checkpointing turns every location into a ``pathlib.Path``, which makes
``s3://bucket/x`` the local path ``s3:/bucket/x``; the storage restores the
URL (``remap_path`` returns it), so checkpoint ids are written as usual::

    import torch
    from torch_checkpointing import CheckpointManager
    from dcp_ext.integrations.torch_checkpointing import DcpExtStorageConfig, commit_marker, is_committed

    opts = {"client_kwargs": {"region_name": "us-east-1"}}
    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = DcpExtStorageConfig(storage_options=opts)
    config.save.writer_config.write_to_temp_dir = False   # object stores: no directory rename ...
    config.finalize_callback = commit_marker               # ... a commit marker instead
    config.save.writer_config.file_write_max_threads = 4   # a rank's files upload at once
    manager = config.build()
    manager.save("s3://bucket/run1/step_100", {"model": model.state_dict(), "step": 100})
    if is_committed("s3://bucket/run1/step_100", opts):
        state = manager.load("s3://bucket/run1/step_100", into={"model": model.state_dict(), "step": None})

**Commits.** By default torch_checkpointing writes into a temporary sibling
directory and, after every rank passed its barrier, rank 0 renames it onto
the final path: the commit. :meth:`DcpExtStorage.rename` follows the table of
torch_checkpointing's ``Storage.rename`` (contents land at the destination,
an occupied destination raises) and is atomic on local and POSIX file
systems (``os.rename``). An object store has no directories: there a
directory rename copies every object and deletes the originals, which is
neither atomic nor cheap (every byte is copied again). For object stores, set
``write_to_temp_dir=False`` (the barrier stays) and commit with
:func:`commit_marker` as the ``finalize_callback``: after the barrier each
rank asks to create the marker ``dcp_ext.committed`` in the checkpoint
directory with a create-if-absent write (a conditional ``PUT`` on S3); one
succeeds. Readers check it with :func:`is_committed` (torch_checkpointing's
own reader does not). A directory holding the marker is sealed: ``mkdir`` on
it, which torch_checkpointing's writer calls before writing any file, raises
``FileExistsError``, so a save never rewrites a committed checkpoint in place
(save each step to a new path, or delete the old one first with ``rmdir``,
which removes the marker before any data file).

**Throughput on object stores.** Each file torch_checkpointing writes is
one stream into one upload: ``torch.save`` fills ``part_size`` buffers, each
sent as a part of a multipart upload as soon as it is full, up to
``max_concurrency`` parts in flight (a file under one part is one ``PUT``);
``close`` returns once the upload is complete, so a closed file is durable.
torch_checkpointing writes a rank's files one after another
(``file_write_max_threads=1``, its default), so each file's last parts go
out with the connections half idle before the next file starts; set
``file_write_max_threads`` to 4 on object stores (as above) and the storage
writes the files at once, their parts sharing the store's
``max_concurrency + 1`` part buffers (memory stays bounded). Besides the
uploads a save sends one bucket check and one ``HEAD`` per directory
(``mkdir``: is it sealed?) and, with :func:`commit_marker`, the marker's
``PUT``; nothing per file. On SeaweedFS (``python -m bench.frameworks``,
bench/README.md; 2 ranks, 385 MiB) such a save took 5.74 s with one thread
(0.76x a raw boto3 multipart upload of the same bytes) and 4.51 s with
three (1.04x); with four, in a later 5-round run, 4.57 s (0.98x): with
concurrent files, what is left is the server.

**What differs from torch_checkpointing's local backend**: object stores
have no directories, so writing a file needs no ``mkdir`` first (on local
paths a missing parent raises ``RuntimeError``, as there), ``mkdir`` on them
only checks the bucket, and an empty "directory" does not exist; every
write goes to a temporary name first (readers never see half a file);
``delete`` of a missing file raises ``FileNotFoundError`` on every backend;
``ReadArgs.direct_io`` is not used (dcp_ext's local reads are buffered
``preadv``); ``ReadArgs.known_size_bytes`` is trusted as the size (a
shorter file raises :class:`~dcp_ext.CheckpointCorruptError`).

Tested on CPU, one process, locally and on S3 (SeaweedFS): every method
against torch_checkpointing's ``LocalFileSystemStorage``, and
``CheckpointManager`` saves (synchronous and asynchronous, with the marker
commit) and loads, bit-exact. Not exercised: several ranks, resharding loads
(``DefaultResharder``), Hugging Face consolidation, ``background_cleanup``
with a large tree. torchtitan 0.3.0 does not save through torch_checkpointing
(its ``TorchCheckpointingManager`` is an unused stub whose module does not
import with torch_checkpointing 0.1.1; its checkpoints go through DCP, which
:mod:`dcp_ext.integrations.torchtitan` covers). Install:
``pip install torch_checkpointing==0.1.1``.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch_checkpointing.checkpoint_writer import CallbackArgs
from torch_checkpointing.storage.base_storage import ReadArgs, Storage, StorageConfig
from typing_extensions import Buffer

from dcp_ext.config import IOConfig
from dcp_ext.errors import InvalidOptionError
from dcp_ext.storage import TMP_MARK, Location, Store

from ._io_options import io_config
from ._paths import location
from ._tc_streams import StoreRangeReader, StoreWriteStream, read_whole

__all__ = ["DcpExtStorageConfig", "DcpExtStorage", "commit_marker", "is_committed", "COMMIT_MARKER"]

log = logging.getLogger("dcp_ext.integrations.torch_checkpointing")

#: The commit marker :func:`commit_marker` writes in a checkpoint directory.
COMMIT_MARKER = "dcp_ext.committed"


@dataclass
class DcpExtStorageConfig(StorageConfig):
    """Where and how :class:`DcpExtStorage` reaches storage (picklable: it
    crosses into torch_checkpointing's asynchronous saver process).

    Attributes:
        storage_options: fsspec/s3fs options (S3 ``endpoint_url``, ``key``,
            ``secret``, ``client_kwargs``...), for every URL used.
        io_options: :class:`~dcp_ext.IOConfig` fields (``{"max_concurrency":
            16, "part_size": "32MiB"}``); unset ones keep their ``DCP_EXT_*``
            environment value or default. Checked when the config is made.
    """

    storage_options: dict[str, Any] = field(default_factory=dict)
    io_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.storage_options, dict):
            raise InvalidOptionError(f"storage_options must be a dict, not {type(self.storage_options).__name__}")
        io_config(self.io_options, "io_options")

    def create_storage(self) -> DcpExtStorage:
        return DcpExtStorage(self)


def _split(url: str) -> tuple[str, str]:
    """``(directory, name)`` of a file location (local path or URL).

    Raises:
        IsADirectoryError: A bucket or file system root, which cannot be a file.
    """
    if "://" not in url:
        parent, name = os.path.split(os.path.abspath(url))
    else:
        parent, _, name = url.rstrip("/").rpartition("/")
        if parent.endswith(":/"):  # s3://bucket: a bucket, not a file
            name = ""
    if not name:
        raise IsADirectoryError(errno.EISDIR, "not a file location", url)
    return parent, name


class DcpExtStorage(Storage):
    """torch_checkpointing's ``Storage`` on dcp_ext's stores (see the module doc).

    Thread-safe: torch_checkpointing writes and reads files from several
    threads. Stores are opened once per directory and process.
    """

    def __init__(self, config: DcpExtStorageConfig) -> None:
        self._options = dict(config.storage_options)
        self._config = io_config(config.io_options, "io_options") or IOConfig.from_env()
        self._stores: dict[str, Store] = {}
        self._lock = threading.Lock()

    # -- locations ------------------------------------------------------------
    def _store(self, directory: str) -> Store:
        with self._lock:
            store = self._stores.get(directory)
            if store is None:
                store = self._stores[directory] = Location(directory, self._options, self._config).open()
            return store

    def _file(self, path: Path) -> tuple[Store, str]:
        directory, name = _split(location(path))
        return self._store(directory), name

    @staticmethod
    def _is_local(url: str) -> bool:
        return "://" not in url

    @property
    def mmap_fill_workers(self) -> int | None:
        """Parallel ranged reads of one file torch_checkpointing's mmap fill uses: ``max_concurrency``."""
        return self._config.max_concurrency

    @property
    def mmap_fill_chunk_bytes(self) -> int | None:
        """Bytes per ranged read of the mmap fill: ``read_request_size``."""
        return self._config.read_request_size

    def remap_path(self, path: Path) -> str:
        """The location as a string, a URL that ``pathlib`` collapsed restored."""
        return location(path)

    # -- files ------------------------------------------------------------------
    def stream_read(self, path: Path, read_args: ReadArgs | None = None) -> io.RawIOBase:
        """A readable, seekable stream of the file: in memory (read by parallel
        ranged reads) with ``pre_read_full_file`` (the default), else ranged
        reads on demand, each ``readinto`` straight into the caller's buffer.

        Raises:
            FileNotFoundError: (a dcp_ext subclass) the file does not exist.
        """
        store, name = self._file(path)
        known = read_args.known_size_bytes if read_args is not None else None
        size = known if known is not None else store.size(name)
        if read_args is None or read_args.pre_read_full_file:
            return read_whole(store, name, size)
        return StoreRangeReader(store, name, size)

    def read(self, path: Path, read_args: ReadArgs | None = None) -> bytes:
        with self.stream_read(path, read_args) as stream:
            return stream.read()

    def stream_write(self, path: Path) -> io.IOBase:
        """A writable stream; the file appears, whole and durable, when it
        closes (nothing if its ``with`` block raises).

        Raises:
            RuntimeError: (local paths) the parent directory does not exist,
                as torch_checkpointing's local backend.
        """
        url = location(path)
        directory, _ = _split(url)
        if self._is_local(url) and not os.path.isdir(directory):
            raise RuntimeError(f"Parent directory does not exist, create it!: {directory}")
        store, name = self._file(path)
        return StoreWriteStream(store.open_writer(name))

    def write(self, path: Path, data: Buffer) -> None:
        with self.stream_write(path) as stream:
            stream.write(memoryview(data).cast("B"))

    def delete(self, path: Path) -> None:
        """Delete a file.

        Raises:
            FileNotFoundError: It does not exist.
            IsADirectoryError: It is a directory.
        """
        store, name = self._file(path)
        if not store.exists(name):
            if self.isdir(path):
                raise IsADirectoryError(errno.EISDIR, "is a directory, not a file", location(path))
            raise FileNotFoundError(errno.ENOENT, "no such file", location(path))
        store.delete(name)

    def getsize(self, path: Path) -> int:
        """The file's size in bytes.

        Raises:
            FileNotFoundError: (a dcp_ext subclass) it does not exist.
        """
        store, name = self._file(path)
        return store.size(name)

    # -- directories ----------------------------------------------------------------
    def _sealed(self, url: str) -> None:
        if self._store(url).exists(COMMIT_MARKER):
            raise FileExistsError(errno.EEXIST, f"holds a committed checkpoint ({COMMIT_MARKER}); save to a new "
                                  f"path, or delete it first (rmdir)", url)

    def mkdir(self, path: Path, recursive: bool = True) -> None:
        """Create a directory (local paths; on object stores, check the bucket).

        Raises:
            FileExistsError: It holds a committed checkpoint (:data:`COMMIT_MARKER`),
                or ``recursive=False`` and it exists (local).
            FileNotFoundError: ``recursive=False`` and the parent is missing (local).
        """
        url = location(path)
        if not self._is_local(url):
            self._store(url).ensure_root()
            self._sealed(url)
            return
        if recursive:
            os.makedirs(url, exist_ok=True)
            self._sealed(url)
        else:
            os.mkdir(url)

    def rmdir(self, path: Path) -> None:
        """Delete a directory and everything in it, its commit marker first.

        Raises:
            FileNotFoundError: It does not exist.
        """
        url = location(path)
        if not self.isdir(path):
            raise FileNotFoundError(errno.ENOENT, "no such directory", url)
        store = self._store(url)
        store.delete(COMMIT_MARKER)  # un-committed before any data file goes
        if self._is_local(url):
            shutil.rmtree(url)
            return
        for name in store.list_tree():
            store.delete(name)
        store.remove_root_if_empty()

    def ls(self, path: Path) -> list[str]:
        """Names of the files and directories directly in a directory
        (temporaries of writes in progress left out).

        Raises:
            FileNotFoundError: It does not exist (on object stores: holds nothing).
            NotADirectoryError: It is a file (local).
        """
        url = location(path)
        if self._is_local(url):
            names = os.listdir(url)
        else:
            files, dirs = self._store(url).list_entries()
            names = files + dirs
            if not names:
                raise FileNotFoundError(errno.ENOENT, "no such directory", url)
        return sorted(n for n in names if TMP_MARK not in n)

    def exists(self, path: Path) -> bool:
        """Whether a file or a directory is there."""
        url = location(path)
        if self._is_local(url):
            return os.path.exists(url)
        try:
            store, name = self._file(path)
            if store.exists(name):
                return True
        except IsADirectoryError:
            pass
        return self.isdir(path)

    def isdir(self, path: Path) -> bool:
        """Whether a directory is there (object stores: anything under the prefix)."""
        url = location(path)
        if self._is_local(url):
            return os.path.isdir(url)
        return self._store(url).root_exists()

    # -- the commit primitive ---------------------------------------------------------
    def rename(self, src_path: Path, dst_path: Path, is_directory: bool = False,
               background_cleanup: bool = False) -> None:
        """Move a file or directory so it lands at ``dst_path`` (the table of
        torch_checkpointing's ``Storage.rename``): atomic ``os.rename`` /
        ``os.replace`` on one local file system; elsewhere (object stores,
        across file systems) a copy, then the originals are deleted, in a
        background thread for a directory with ``background_cleanup``.

        Raises:
            FileExistsError: The destination is occupied (a populated directory;
                a directory onto a file; a file onto a directory).
            FileNotFoundError: Nothing at ``src_path``.
        """
        src, dst = location(src_path), location(dst_path)
        directory = self.isdir(src_path)
        if not directory and not self.exists(src_path):
            raise FileNotFoundError(errno.ENOENT, "nothing to rename", src)
        if self._is_local(src) and self._is_local(dst):
            try:
                (os.rename if directory else os.replace)(src, dst)
                return
            except OSError as err:
                if err.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                    raise _occupied(src, dst, err.errno) from err
                if err.errno != errno.EXDEV:
                    raise
        if directory:
            self._copy_tree(src, dst, background_cleanup)
        else:
            self._copy_file(src, dst)

    def _copy_file(self, src: str, dst: str) -> None:
        if self.isdir(Path(dst)):
            raise _occupied(src, dst, errno.EISDIR)
        (src_store, src_name), (dst_store, dst_name) = self._file(Path(src)), self._file(Path(dst))
        _copy(src_store, src_name, dst_store, dst_name)
        src_store.delete(src_name)

    def _copy_tree(self, src: str, dst: str, background_cleanup: bool) -> None:
        source, target = self._store(src), self._store(dst)
        try:
            dst_file = self._file(Path(dst))
        except IsADirectoryError:
            dst_file = None
        if dst_file is not None and dst_file[0].exists(dst_file[1]):
            raise _occupied(src, dst, errno.ENOTDIR)
        if target.root_exists() and target.list_tree():
            raise _occupied(src, dst, errno.ENOTEMPTY)
        names = source.list_tree()
        for name in names:  # object by object: not atomic (see the module doc)
            _copy(source, name, target, name)

        def cleanup() -> None:
            for name in names:
                source.delete(name)
            source.remove_root_if_empty()
            if self._is_local(src):
                shutil.rmtree(src, ignore_errors=True)

        def cleanup_logged() -> None:
            try:
                cleanup()
            except Exception as err:  # noqa: BLE001 - a background thread: the copy is committed, report it
                log.warning("renamed %s to %s, but deleting the originals failed: %s", src, dst, err)

        if background_cleanup:
            threading.Thread(target=cleanup_logged, name="dcp_ext-rename-cleanup", daemon=True).start()
        else:
            cleanup()


def _occupied(src: str, dst: str, number: int) -> FileExistsError:
    return FileExistsError(number, f"refusing to rename {src} onto {dst}: the destination is occupied (a rename "
                                   f"commits onto unoccupied space); delete it first if it is to be replaced", dst)


def _copy(source: Store, name: str, target: Store, to: str) -> None:
    """Copy one file between stores in ``part_size`` pieces (never whole in memory)."""
    size = source.size(name)
    step = target.config.part_size
    with target.open_writer(to, size_hint=size) as writer:
        for offset in range(0, size, step):
            writer.write(source.read_range(name, offset, min(step, size - offset)))
        writer.commit()


def commit_marker(args: CallbackArgs) -> None:
    """(every rank, after torch_checkpointing's barrier) Commit the checkpoint at
    ``args.path``: create :data:`COMMIT_MARKER` there if it is absent (one rank
    creates it; a create-if-absent write, so the others change nothing).

    Use as ``CheckpointManager.Config(finalize_callback=commit_marker)`` with
    ``write_to_temp_dir=False``; ``args.storage`` must be a :class:`DcpExtStorage`.
    """
    storage = args.storage
    if not isinstance(storage, DcpExtStorage):
        raise InvalidOptionError(f"commit_marker needs DcpExtStorageConfig as the storage_config, not "
                                 f"{type(storage).__name__}")
    record = {"committed_at": time.time(), "by": "dcp_ext.integrations.torch_checkpointing"}
    storage._store(location(args.path)).create_exclusive(COMMIT_MARKER, json.dumps(record).encode())


def is_committed(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> bool:
    """Whether the checkpoint at ``path`` was committed by :func:`commit_marker`."""
    return Location.of(location(path), storage_options).open().exists(COMMIT_MARKER)

