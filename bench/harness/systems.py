"""The systems under comparison: how each one saves, loads and cleans up.

Every system gets the same rank-local state dict (``save``) and the same
preallocated destination state dict (``load``) and works on a location of
its own. Checkpointing systems go through stock ``dcp.save`` / ``dcp.load``
with a fresh writer/reader per operation, as a training loop would create
them; the raw ceilings move the same number of bytes per rank without DCP.

Raw ceilings (per rank, its own file/object, ranks in parallel):

* local: plain ``os.write`` of ``raw_chunk``-sized slices of one contiguous
  buffer, then ``fsync``; read back with ``readinto`` into another
  preallocated buffer, sequentially, one thread.
* S3: one multipart upload of ``part_size`` parts sent by a
  ``ThreadPoolExecutor`` of ``s3_concurrency`` threads (boto3; each part is
  copied once into a ``bytes`` body, botocore accepts no ``memoryview``), then ranged GETs of ``part_size`` bytes by the
  same number of threads, each streamed with ``readinto`` into its slice of a
  preallocated buffer. The boto3 client is created once per world.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

MiB = 1 << 20


@dataclass
class Ctx:
    """What a rank knows while running systems."""

    rank: int
    world: int
    params: dict[str, Any]
    workdir: str
    s3: dict[str, Any] | None = None
    raw_src: torch.Tensor | None = None
    raw_dst: torch.Tensor | None = None
    _boto3: Any = field(default=None, repr=False)
    #: Azurite's endpoint, container and connection string (``bench.harness.azure_systems``).
    az: dict[str, Any] | None = None
    _az_pool: Any = field(default=None, repr=False)
    #: fake-gcs-server's endpoint and bucket (``bench.harness.gcs_systems``).
    gcs: dict[str, Any] | None = None
    _gcs_side: Any = field(default=None, repr=False)

    @property
    def bucket(self) -> str:
        assert self.s3 is not None
        return self.s3["bucket"]

    def storage_options(self) -> dict[str, Any]:
        assert self.s3 is not None
        return {
            "key": self.s3["access_key"],
            "secret": self.s3["secret_key"],
            "client_kwargs": {"endpoint_url": self.s3["endpoint_url"], "region_name": self.s3["region"]},
            "config_kwargs": {"s3": {"addressing_style": "path"}},
        }

    def boto3(self) -> Any:
        """A boto3 client configured like dcp_ext's own S3 client."""
        if self._boto3 is None:
            import boto3.session
            import botocore.config
            import botocore.session

            core = botocore.session.Session(
                session_vars={
                    "profile": (None, None, None, None),
                    "config_file": (None, None, os.devnull, None),
                    "credentials_file": (None, None, os.devnull, None),
                }
            )
            n = int(self.params["s3_concurrency"])
            config = botocore.config.Config(
                s3={"addressing_style": "path"},
                retries={"max_attempts": 3, "mode": "standard"},
                max_pool_connections=max(16, 2 * n),
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            )
            assert self.s3 is not None
            self._boto3 = boto3.session.Session(botocore_session=core).client(
                "s3",
                endpoint_url=self.s3["endpoint_url"],
                aws_access_key_id=self.s3["access_key"],
                aws_secret_access_key=self.s3["secret_key"],
                region_name=self.s3["region"],
                config=config,
            )
        return self._boto3

    def delete_prefix(self, prefix: str) -> None:
        client = self.boto3()
        token = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix.rstrip("/") + "/"}
            if token:
                kwargs["ContinuationToken"] = token
            resp = client.list_objects_v2(**kwargs)
            keys = [{"Key": o["Key"]} for o in resp.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})
            if not resp.get("IsTruncated"):
                break
            token = resp.get("NextContinuationToken")


def _byte_view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.numpy()).cast("B")


class System:
    """One storage system. ``kind`` is ``local`` or ``s3``; ``role`` groups
    systems for ratios (``dcp_ext``, ``raw``, ``torch_default``, ``torch``,
    ``s3torchconnector``)."""

    name = ""
    kind = "local"
    role = "torch"
    label = ""
    note = ""

    def location(self, ctx: Ctx, tag: str) -> str:
        if self.kind == "local":
            return os.path.join(ctx.workdir, "ckpt", f"{self.name}-{tag}")
        return f"bench/{self.name}-{tag}"

    def url(self, ctx: Ctx, loc: str) -> str:
        return loc if self.kind == "local" else f"s3://{ctx.bucket}/{loc}"

    def save(self, ctx: Ctx, state: dict[str, Any], loc: str) -> None:
        raise NotImplementedError

    def load(self, ctx: Ctx, dest: dict[str, Any], loc: str) -> None:
        raise NotImplementedError

    def verify(self, ctx: Ctx, state: dict[str, Any], dest: dict[str, Any]) -> None:
        from .state import verify

        verify(state, dest)

    def reset_dest(self, ctx: Ctx, dest: dict[str, Any]) -> None:
        from .state import reset_dest

        reset_dest(dest)

    def cleanup(self, ctx: Ctx, loc: str) -> None:
        """(rank 0) Remove the checkpoint."""
        if self.kind == "local":
            shutil.rmtree(loc, ignore_errors=True)
        else:
            ctx.delete_prefix(loc)


# -- dcp_ext ------------------------------------------------------------------


class DcpExt(System):
    name = "dcp_ext"
    role = "dcp_ext"

    def __init__(self, kind: str, defaults: bool = False) -> None:
        self.kind = kind
        self.defaults = defaults
        self.label = "dcp_ext CheckpointWriter/Reader"

    def _io_kwargs(self, ctx: Ctx) -> dict[str, Any]:
        if self.kind == "s3":
            kwargs: dict[str, Any] = {"storage_options": ctx.storage_options()}
            if not self.defaults:
                kwargs["max_concurrency"] = int(ctx.params["s3_concurrency"])
            return kwargs
        return {}

    def describe(self, params: dict[str, Any]) -> str:
        if self.defaults:
            return "all settings default (local: fsync on, 1 file/rank; S3: 16 MiB parts, 8 in flight)"
        if self.kind == "s3":
            return f"max_concurrency={params['s3_concurrency']}, other settings default (16 MiB parts / read requests)"
        return "default settings (fsync on, 1 file per rank)"

    def save(self, ctx: Ctx, state: dict[str, Any], loc: str) -> None:
        from dcp_ext import CheckpointWriter

        writer = CheckpointWriter(self.url(ctx, loc), **self._io_kwargs(ctx))
        dcp.save(state, storage_writer=writer)

    def load(self, ctx: Ctx, dest: dict[str, Any], loc: str) -> None:
        from dcp_ext import CheckpointReader

        reader = CheckpointReader(self.url(ctx, loc), **self._io_kwargs(ctx))
        dcp.load(dest, storage_reader=reader)


# -- torch --------------------------------------------------------------------


class TorchFileSystem(System):
    kind = "local"

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.name = f"torch_fs_t{threads}"
        self.role = "torch_default" if threads == 1 else "torch"
        self.label = f"torch FileSystemWriter/Reader, thread_count={threads}" + (" (default)" if threads == 1 else "")

    def describe(self, params: dict[str, Any]) -> str:
        return f"thread_count={self.threads}, sync_files=True (default)"

    def save(self, ctx: Ctx, state: dict[str, Any], loc: str) -> None:
        from torch.distributed.checkpoint import FileSystemWriter

        dcp.save(state, storage_writer=FileSystemWriter(loc, thread_count=self.threads))

    def load(self, ctx: Ctx, dest: dict[str, Any], loc: str) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        dcp.load(dest, storage_reader=FileSystemReader(loc))


class TorchFsspec(System):
    name = "torch_fsspec"

    def __init__(self, kind: str) -> None:
        self.kind = kind
        # On S3 it is torch's only option, so the "torch default" baseline.
        self.role = "torch_default" if kind == "s3" else "torch_fsspec"
        self.label = "torch FsspecWriter/Reader" + (" (file://)" if kind == "local" else " (s3fs)")

    def describe(self, params: dict[str, Any]) -> str:
        return "default settings (thread_count=1, sync_files=True)"

    def url(self, ctx: Ctx, loc: str) -> str:
        return "file://" + loc if self.kind == "local" else f"s3://{ctx.bucket}/{loc}"

    def _kwargs(self, ctx: Ctx) -> dict[str, Any]:
        return ctx.storage_options() if self.kind == "s3" else {}

    def save(self, ctx: Ctx, state: dict[str, Any], loc: str) -> None:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        dcp.save(state, storage_writer=FsspecWriter(self.url(ctx, loc), **self._kwargs(ctx)))

    def load(self, ctx: Ctx, dest: dict[str, Any], loc: str) -> None:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        dcp.load(dest, storage_reader=FsspecReader(self.url(ctx, loc), **self._kwargs(ctx)))


# -- s3torchconnector -----------------------------------------------------------


class S3TorchConnector(System):
    name = "s3torchconnector"
    kind = "s3"
    role = "s3torchconnector"
    label = "s3torchconnector S3StorageWriter/Reader"

    def describe(self, params: dict[str, Any]) -> str:
        return (
            f"writer thread_count={params['s3_concurrency']}; reader has no thread knob "
            f"(one file at a time, CRT client parallelism); part_size={params['part_size'] // MiB} MiB, "
            f"throughput_target_gbps=10 (default), dcp_optimized reader (default)"
        )

    def _config(self, ctx: Ctx) -> Any:
        from s3torchconnector import S3ClientConfig

        return S3ClientConfig(force_path_style=True, part_size=int(ctx.params["part_size"]))

    def _client(self, ctx: Ctx, config: Any) -> Any:
        # The DCP classes take no endpoint; their S3FileSystem keeps its client
        # in ``_client`` (created lazily), so swap in one that has it.
        from s3torchconnector._s3client import S3Client
        from s3torchconnector._user_agent import UserAgent

        assert ctx.s3 is not None
        return S3Client(
            ctx.s3["region"],
            endpoint=ctx.s3["endpoint_url"],
            user_agent=UserAgent(["dcp", torch.__version__]),
            s3client_config=config,
        )

    def save(self, ctx: Ctx, state: dict[str, Any], loc: str) -> None:
        from s3torchconnector.dcp import S3StorageWriter

        assert ctx.s3 is not None
        config = self._config(ctx)
        writer = S3StorageWriter(
            ctx.s3["region"], self.url(ctx, loc), s3client_config=config,
            thread_count=int(ctx.params["s3_concurrency"]),
        )
        writer.fs._client = self._client(ctx, config)
        dcp.save(state, storage_writer=writer)

    def load(self, ctx: Ctx, dest: dict[str, Any], loc: str) -> None:
        from s3torchconnector.dcp import S3StorageReader

        assert ctx.s3 is not None
        config = self._config(ctx)
        reader = S3StorageReader(ctx.s3["region"], self.url(ctx, loc), s3client_config=config)
        reader.fs._client = self._client(ctx, config)
        dcp.load(dest, storage_reader=reader)


# -- raw ceilings -----------------------------------------------------------------


class RawLocal(System):
    name = "raw"
    kind = "local"
    role = "raw"
    label = "raw ceiling: write()+fsync / readinto()"

    def describe(self, params: dict[str, Any]) -> str:
        return f"{params['raw_chunk'] // MiB} MiB write()/readinto() calls, one thread per rank, fsync"

    def _file(self, ctx: Ctx, loc: str) -> str:
        return os.path.join(loc, f"raw_{ctx.rank}.bin")

    def save(self, ctx: Ctx, state: dict[str, Any], loc: str) -> None:
        assert ctx.raw_src is not None
        os.makedirs(loc, exist_ok=True)
        view = _byte_view(ctx.raw_src)
        chunk = int(ctx.params["raw_chunk"])
        fd = os.open(self._file(ctx, loc), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            pos = 0
            while pos < view.nbytes:
                pos += os.write(fd, view[pos : pos + chunk])
            os.fsync(fd)
        finally:
            os.close(fd)
        dist.barrier()

    def load(self, ctx: Ctx, dest: dict[str, Any], loc: str) -> None:
        assert ctx.raw_dst is not None
        view = _byte_view(ctx.raw_dst)
        chunk = int(ctx.params["raw_chunk"])
        with open(self._file(ctx, loc), "rb", buffering=0) as f:
            pos = 0
            while pos < view.nbytes:
                n = f.readinto(view[pos : pos + chunk])
                if not n:
                    raise EOFError("raw file is short")
                pos += n
        dist.barrier()

    def reset_dest(self, ctx: Ctx, dest: dict[str, Any]) -> None:
        assert ctx.raw_dst is not None
        ctx.raw_dst.zero_()

    def verify(self, ctx: Ctx, state: dict[str, Any], dest: dict[str, Any]) -> None:
        if not torch.equal(ctx.raw_src, ctx.raw_dst):
            raise AssertionError("raw read-back differs")


class RawS3(RawLocal):
    kind = "s3"
    label = "raw ceiling: boto3 multipart PUT / ranged GET"

    def describe(self, params: dict[str, Any]) -> str:
        return (
            f"boto3, {params['s3_concurrency']} threads, {params['part_size'] // MiB} MiB parts and ranges, "
            f"client reused, checksums only when required (as dcp_ext)"
        )

    def _key(self, ctx: Ctx, loc: str) -> str:
        return f"{loc}/raw_{ctx.rank}.bin"

    def save(self, ctx: Ctx, state: dict[str, Any], loc: str) -> None:
        assert ctx.raw_src is not None
        client = ctx.boto3()
        view = _byte_view(ctx.raw_src)
        part = int(ctx.params["part_size"])
        key = self._key(ctx, loc)
        if view.nbytes <= part:
            client.put_object(Bucket=ctx.bucket, Key=key, Body=bytes(view))
        else:
            upload = client.create_multipart_upload(Bucket=ctx.bucket, Key=key)["UploadId"]

            def put(i: int) -> dict[str, Any]:
                body = bytes(view[i * part : (i + 1) * part])  # botocore takes no memoryview
                resp = client.upload_part(
                    Bucket=ctx.bucket, Key=key, UploadId=upload, PartNumber=i + 1, Body=body
                )
                return {"PartNumber": i + 1, "ETag": resp["ETag"]}

            count = -(-view.nbytes // part)
            with ThreadPoolExecutor(int(ctx.params["s3_concurrency"])) as pool:
                parts = list(pool.map(put, range(count)))
            client.complete_multipart_upload(
                Bucket=ctx.bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts}
            )
        dist.barrier()

    def load(self, ctx: Ctx, dest: dict[str, Any], loc: str) -> None:
        assert ctx.raw_dst is not None
        client = ctx.boto3()
        view = _byte_view(ctx.raw_dst)
        part = int(ctx.params["part_size"])
        key = self._key(ctx, loc)

        def get(i: int) -> None:
            start = i * part
            target = view[start : start + part]
            resp = client.get_object(
                Bucket=ctx.bucket, Key=key, Range=f"bytes={start}-{start + target.nbytes - 1}"
            )
            raw = resp["Body"]._raw_stream
            done = 0
            while done < target.nbytes:
                n = raw.readinto(target[done:])
                if not n:
                    raise EOFError(f"short body for {key} at {start + done}")
                done += n
            resp["Body"].close()

        count = -(-view.nbytes // part)
        with ThreadPoolExecutor(int(ctx.params["s3_concurrency"])) as pool:
            list(pool.map(get, range(count)))
        dist.barrier()

    def cleanup(self, ctx: Ctx, loc: str) -> None:
        ctx.delete_prefix(loc)


def make_systems(kind: str, params: dict[str, Any]) -> list[System]:
    """The systems compared on ``kind`` storage, in run order."""
    if kind == "local":
        threads = [int(t) for t in params["torch_threads"]]
        return [
            DcpExt("local"),
            *[TorchFileSystem(t) for t in threads],
            TorchFsspec("local"),
            RawLocal(),
        ]
    systems: list[System] = [DcpExt("s3"), TorchFsspec("s3")]
    if params.get("s3torchconnector", True):
        systems.append(S3TorchConnector())
    systems.append(RawS3())
    return systems
