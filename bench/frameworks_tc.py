"""The torch_checkpointing rows of ``python -m bench.frameworks`` (issue 43).

The bench model's FSDP2 parameters and AdamW moments (the same tensors, the
same bytes as every framework row) as torch_checkpointing 0.1.1 payload
items: ``model`` (the parameters, ``Shard(0)`` DTensors), ``optimizer``
(``{name: {"exp_avg", "exp_avg_sq"}}``, DTensors) and ``step`` (an int),
each item with torch_checkpointing's default ``ItemSpec`` (no resharder:
its metadata manager, which a resharder wires in, gathers with CUDA tensors
and does not run on a CPU-only torch; each rank's file holds its shards,
loadable at the same sharding). Saved with one ``CheckpointManager`` per system, synchronous
(``Config.with_sync_save()``, as the other rows save), each save into a fresh
directory, by:

* **torch_checkpointing's own** storage, ``LocalFileSystemStorageConfig``
  (written into a temporary sibling directory, rank 0 renames it onto the
  final path after the barrier), with one setting changed:
  ``use_direct_io=False``. Its default ``O_DIRECT`` opens each file with
  ``O_DIRECT`` and writes it through Python's buffered file, whose last,
  partial block is refused (``OSError: [Errno 22]`` when ``torch.save``'s
  stream closes, ext4): it cannot save this state at all, so the stock rows
  write buffered (page cache, as every other row; it never calls ``fsync``,
  dcp_ext's stores do, for every file). Local disk only: it writes
  local paths, and torch_checkpointing ships no backend for S3.
* **dcp_ext**: ``config.storage_config = DcpExtStorageConfig(...)``
  (``dcp_ext.integrations.torch_checkpointing``); locally with
  torch_checkpointing's own temporary-directory commit (an ``os.rename``), on
  S3 the way the guide documents for object stores:
  ``write_to_temp_dir=False`` and ``finalize_callback=commit_marker``.

Both write a rank's files from ``WRITE_THREADS`` (4) threads
(``file_write_max_threads``, torch_checkpointing's own option, default 1),
as the guide says for object stores: with one thread each file's upload
drains before the next file starts (on S3 dcp_ext took 5.74 s with one
thread and 4.51 s with three, the raw ceiling 4.37 and 4.69 s in the same
runs); the stock rows get the same setting. Everything else is
torch_checkpointing's defaults for both (``{item}_{rank}.pt`` files by
``torch.save``). After a system's first
(warm-up) save, untimed, each rank loads it back into fresh tensors and
checks every tensor is bit-exact (on S3 after checking the commit marker;
the uploaded stock save through ``DcpExtStorage``), so a row never times a
save it cannot load.

Two references for the S3 row, same run, same tensors (issue 43: where does
a torch_checkpointing save on S3 lose time?):

* ``tc_dcp``: ``dcp_ext.save`` of the same payload (torch DCP with dcp_ext's
  ``CheckpointWriter``, its defaults: what dcp_ext's own save of these bytes
  costs), locally and on S3;
* ``tc_raw`` (S3): the S3 server's ceiling for these bytes: each rank's
  tensor bytes, copied into one buffer before the save (untimed), sent as
  one boto3 multipart upload of 16 MiB parts from ``s3_concurrency`` threads
  (the main table's raw ceiling, ``bench.harness.systems.RawS3``).
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["TorchCheckpointingSystem", "TcDcpSystem", "TcRawSystem", "tc_payload", "tc_systems"]

#: Part size of the raw ceiling's multipart upload (the main table's).
RAW_PART = 16 << 20
#: ``file_write_max_threads`` of every torch_checkpointing row (the guide's setting for object stores).
WRITE_THREADS = 4


def tc_payload(model: Any, optimizers: Any, step: int) -> dict[str, Any]:
    """(each rank) The model and its AdamW moments as a torch_checkpointing payload."""
    optimizer = optimizers.optimizers[0]
    params = dict(model.named_parameters())
    return {"model": {n: p.detach() for n, p in params.items()},
            "optimizer": {n: {k: optimizer.state[p][k] for k in ("exp_avg", "exp_avg_sq")}
                          for n, p in params.items()},
            "step": step}


def _templates(value: Any) -> Any:
    """Fresh zero tensors (DTensors alike) shaped as ``value``'s, to load into."""
    import torch

    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: _templates(v) for k, v in value.items()}
    return None


def _same(saved: Any, loaded: Any, path: str = "") -> None:
    import torch

    from bench.harness.state import local_tensor

    if isinstance(saved, torch.Tensor):
        a, b = local_tensor(saved), local_tensor(loaded)
        assert a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{path} differs"
    elif isinstance(saved, dict):
        assert set(saved) == set(loaded), f"{path}: keys differ"
        for k, v in saved.items():
            _same(v, loaded[k], f"{path}.{k}")
    else:
        assert saved == loaded, f"{path}: {saved!r} != {loaded!r}"


class TorchCheckpointingSystem:
    """A torch_checkpointing ``CheckpointManager`` save of :func:`tc_payload` (a system of bench.frameworks)."""

    framework = "torch_checkpointing"
    #: Not in bench.frameworks' table of what a save pays storing nothing (that one measures DCP).
    fixed_costs = False

    def __init__(self, kind: str, root: str, job: dict[str, Any], stock: bool,
                 options: dict[str, Any] | None, fsync: bool = True, staging: str | None = None) -> None:
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        from dcp_ext.integrations.torch_checkpointing import DcpExtStorageConfig, commit_marker

        self.kind = kind
        self.stock = stock
        upload = stock and kind != "local"
        self.name = ("tc_stock_upload" if upload else "tc_stock") if stock else (
            "tc_dcp_ext" if fsync else "tc_dcp_ext_nofsync")
        self.root = f"{root}/{self.name}"
        self.job = job
        self.options = dict(options or {})
        self.checked = False
        #: (S3 stock row) where the stock storage writes before the upload.
        self.staging = f"{staging}/{self.name}" if upload else None
        #: (S3 stock row) reads the uploaded save back for the bit-exact check.
        self.reader: Any = None
        config = CheckpointManager.Config.with_sync_save()
        if stock:
            config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)  # O_DIRECT fails: module doc
            self.label = "torch_checkpointing CheckpointManager, LocalFileSystemStorage (stock)"
            self.settings = ("sync save, `LocalFileSystemStorageConfig(use_direct_io=False)` (its O_DIRECT default "
                             "fails on close), no fsync, temp dir + rename")
            if upload:
                assert staging is not None, "torch_checkpointing's own storage writes local paths only: stage first"
                self.label += " to local disk, then s3fs `put` of the folder (no S3 backend)"
                self.settings += "; then rank 0 `S3FileSystem.put(dir, url, recursive=True)`, s3fs defaults; both timed"
                reader = CheckpointManager.Config.with_sync_save()
                reader.storage_config = DcpExtStorageConfig(storage_options=self.options)
                self.reader = reader.build()
        else:
            # fsync=False: the stock storage's terms (it never fsyncs), for a like-for-like local row.
            config.storage_config = DcpExtStorageConfig(storage_options=self.options,
                                                        io_options=None if fsync else {"fsync": False})
            self.label = "dcp_ext DcpExtStorageConfig (torch_checkpointing)" + ("" if fsync else ", no fsync")
            if kind == "local":
                self.settings = ("sync save, dcp_ext store defaults (files fsynced), temp dir + rename" if fsync else
                                 "sync save, `io_options={'fsync': False}` (as the stock row), temp dir + rename")
            else:
                config.save.writer_config.write_to_temp_dir = False  # object stores: no directory rename ...
                config.finalize_callback = commit_marker  # ... a commit marker instead (the guide's way)
                self.settings = ("sync save, dcp_ext store defaults, `write_to_temp_dir=False` + "
                                 "`commit_marker`")
        config.save.writer_config.file_write_max_threads = WRITE_THREADS
        self.settings += f", `file_write_max_threads={WRITE_THREADS}`"
        self.manager = config.build()

    def prepare(self) -> dict[str, Any]:
        """This rank's tensors (for the byte count)."""
        return tc_payload(self.job["model"], self.job["optimizers"], 0)

    def before(self, i: int) -> None:
        """(all ranks) Nothing: the manager makes the directory."""

    def save(self, i: int) -> str:
        import torch.distributed as dist

        where = f"{self.root}/save-{i}"
        payload = tc_payload(self.job["model"], self.job["optimizers"], i)
        if self.staging is None:
            assert self.manager.save(where, payload) is None
            return where
        staged = f"{self.staging}/save-{i}"
        assert self.manager.save(staged, payload) is None  # rank 0 renamed the temporary directory onto it
        if dist.get_rank() == 0:
            from bench.frameworks_megatron import upload_folder

            upload_folder(staged, where, self.options)
        dist.barrier()
        return where

    def after(self, i: int, where: str) -> None:
        """(all ranks, untimed) First save only: load it back and check it
        bit-exact. The S3 stock row: delete the local copy the upload came from."""
        import torch.distributed as dist

        if self.staging is not None and dist.get_rank() == 0:
                shutil.rmtree(f"{self.staging}/save-{i}")
        if self.checked:
            return
        from dcp_ext.integrations.torch_checkpointing import is_committed

        if self.kind != "local" and not self.stock:
            assert is_committed(where, self.options), f"{where}: no commit marker"
        saved = tc_payload(self.job["model"], self.job["optimizers"], i)
        loaded = (self.reader or self.manager).load(where, into={k: _templates(v) for k, v in saved.items()})
        _same(saved, dict(loaded))
        self.checked = True

    def close(self) -> None:
        self.manager.close()
        if self.reader is not None:
            self.reader.close()


class TcDcpSystem:
    """``dcp_ext.save`` of :func:`tc_payload` (a reference row: dcp_ext's own DCP save of the same tensors)."""

    framework = "torch_checkpointing"
    fixed_costs = False

    def __init__(self, kind: str, root: str, job: dict[str, Any], options: dict[str, Any] | None) -> None:
        self.kind = kind
        self.name = "tc_dcp"
        self.root = f"{root}/{self.name}"
        self.job = job
        self.options = dict(options or {})
        self.label = "reference: dcp_ext.save (DCP) of the same payload"
        self.settings = "`dcp_ext.save(payload, path)`, CheckpointWriter defaults" + (
            " (fsync on)" if kind == "local" else " (16 MiB parts, 8 in flight)")

    def prepare(self) -> dict[str, Any]:
        return tc_payload(self.job["model"], self.job["optimizers"], 0)

    def before(self, i: int) -> None:
        """(all ranks) Nothing: the writer makes the directory."""

    def save(self, i: int) -> str:
        import dcp_ext

        where = f"{self.root}/save-{i}"
        dcp_ext.save(tc_payload(self.job["model"], self.job["optimizers"], i), where,
                     storage_options=self.options or None)
        return where

    def close(self) -> None:
        """Nothing to release."""


class TcRawSystem:
    """(S3) Each rank's tensor bytes of :func:`tc_payload` as one boto3 multipart upload: the server's ceiling."""

    framework = "torch_checkpointing"
    fixed_costs = False

    def __init__(self, root: str, job: dict[str, Any], ctx: Any) -> None:
        self.kind = "s3"
        self.name = "tc_raw"
        self.root = f"{root}/{self.name}"
        self.job = job
        self.ctx = ctx
        self.threads = int(ctx.params["s3_concurrency"])
        self.data: Any = None
        self.label = "reference: raw ceiling, boto3 multipart PUT of the same bytes"
        self.settings = (f"one object per rank, {RAW_PART >> 20} MiB parts from {self.threads} threads, boto3 "
                         "configured as dcp_ext's client (as the main table's raw ceiling)")

    def prepare(self) -> dict[str, Any]:
        return tc_payload(self.job["model"], self.job["optimizers"], 0)

    def before(self, i: int) -> None:
        """(untimed, once) This rank's tensor bytes, copied into one buffer."""
        if self.data is None:
            import torch

            from bench.harness.state import local_tensor

            tensors = _tensors(self.prepare())
            self.data = torch.cat([local_tensor(t).detach().reshape(-1).view(torch.uint8) for t in tensors])

    def save(self, i: int) -> str:
        import torch.distributed as dist

        where = f"{self.root}/save-{i}"
        client, bucket = self.ctx.boto3(), self.ctx.bucket
        key = f"{where.split('/', 3)[3]}/raw_{dist.get_rank()}.bin"
        view = memoryview(self.data.numpy()).cast("B")
        upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]

        def put(n: int) -> dict[str, Any]:
            body = bytes(view[n * RAW_PART:(n + 1) * RAW_PART])  # botocore takes no memoryview
            etag = client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=n + 1, Body=body)["ETag"]
            return {"PartNumber": n + 1, "ETag": etag}

        with ThreadPoolExecutor(self.threads) as pool:
            parts = list(pool.map(put, range(-(-view.nbytes // RAW_PART))))
        client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts})
        dist.barrier()
        return where

    def close(self) -> None:
        self.data = None


def _tensors(value: Any) -> list[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def tc_systems(kind: str, root: str, job: dict[str, Any], options: dict[str, Any] | None, ctx: Any,
               staging: str) -> list[Any]:
    """The torch_checkpointing systems of storage ``kind``: stock (on S3: saved to ``staging``, then
    uploaded), dcp_ext's storage (locally also without fsync, the stock row's terms) and the references."""
    systems: list[Any] = [TorchCheckpointingSystem(kind, root, job, stock=True, options=options, staging=staging)]
    if kind == "local":
        systems.append(TorchCheckpointingSystem(kind, root, job, stock=False, options=None, fsync=False))
    systems += [TorchCheckpointingSystem(kind, root, job, stock=False, options=options),
                TcDcpSystem(kind, root, job, options)]
    if kind != "local":
        systems.append(TcRawSystem(root, job, ctx))
    return systems
