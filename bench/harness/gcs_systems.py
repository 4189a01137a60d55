"""The systems compared on GCS (``python -m bench --only gcs`` or ``--gcs``): fake-gcs-server on 127.0.0.1.

* dcp_ext's ``CheckpointWriter``/``CheckpointReader`` on ``gs://`` (its own
  urllib3 client: parallel composite uploads, ranged parallel reads);
* torch's ``FsspecWriter``/``FsspecReader`` over gcsfs (torch's only way to
  GCS): the baseline;
* the raw ceiling as issue 42 defines it ("the SDK's or fsspec's own
  parallel put/get of the same bytes"), :class:`GcsfsCeiling`: gcsfs's own
  calls on the same bytes per rank, from the same buffers: ``fs.pipe`` of the
  ``part_size`` slices as separate objects (``batch_size`` =
  ``gcs_concurrency`` uploads in flight; gcsfs has no parallel upload of one
  object, its ``pipe_file`` of one large object is a sequential resumable
  upload), ``fs.merge`` (compose, 32 sources per call) and ``fs.rm`` of the
  parts; then ``fs.cat_ranges`` of ``part_size`` ranges, ``batch_size`` =
  ``gcs_concurrency`` in flight, each returned ``bytes`` copied into the
  preallocated buffer. (gcsfs's other parallel read, ``cat_file(path,
  concurrency=N)``, splits the object into N ranges and joins them into one
  more copy: 1.28 s against ``cat_ranges``' 0.73 s for 256 MiB here.)
* the stricter hand-written ceiling, :class:`RawGCS`: the same bytes per
  rank, ``part_size`` parts uploaded by ``gcs_concurrency`` threads (media
  uploads, then one compose per 32 parts and a delete of the parts, what any
  parallel upload to GCS must do), read back with ranged GETs by as many
  threads, each received with ``readinto`` straight into a preallocated
  buffer. Plain urllib3, no dcp_ext code, no copies.

The emulator holds objects in memory; its compose copies the bytes (real GCS
composes without copying), which bounds every writer's speed here.
"""

from __future__ import annotations

import json
import os
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .systems import Ctx, RawLocal, System, _byte_view

MiB = 1 << 20
_COMPOSE = 32

# gcsfs >= 2026.3 probes a gRPC API the emulator lacks for 60 s per call unless this is off
# (/tmp/notes/stores.md); it must be set before gcsfs is imported (cli.py sets it too, for the ranks).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def _q(name: str) -> str:
    return urllib.parse.quote(name, safe="")


class _Side:
    """urllib3 requests to the emulator (the raw ceiling's client and everyone's cleanup)."""

    def __init__(self, endpoint: str, threads: int) -> None:
        import urllib3

        self.endpoint = endpoint
        self.pool = urllib3.PoolManager(maxsize=max(16, 2 * threads), retries=False,
                                        timeout=urllib3.Timeout(connect=5, read=120))

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.pool.request(method, self.endpoint + path, **kwargs)
        if response.status >= 300 and not (method == "DELETE" and response.status == 404):
            raise RuntimeError(f"{method} {path}: HTTP {response.status} {response.data[:200]!r}")
        return response

    def delete_prefix(self, bucket: str, prefix: str) -> None:
        token = ""
        while True:
            query = urllib.parse.urlencode({"prefix": prefix.rstrip("/") + "/", **({"pageToken": token} if token else {})})
            page = json.loads(self.request("GET", f"/storage/v1/b/{bucket}/o?{query}").data)
            names = [item["name"] for item in page.get("items", [])]
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda n: self.request("DELETE", f"/storage/v1/b/{bucket}/o/{_q(n)}"), names))
            token = page.get("nextPageToken", "")
            if not token:
                return


def _side(ctx: Ctx) -> _Side:
    if ctx._gcs_side is None:
        assert ctx.gcs is not None
        ctx._gcs_side = _Side(ctx.gcs["endpoint_url"], int(ctx.params["gcs_concurrency"]))
    side: _Side = ctx._gcs_side
    return side


class _OnGCS(System):
    kind = "gcs"

    def location(self, ctx: Ctx, tag: str) -> str:
        return f"bench/{self.name}-{tag}"

    def url(self, ctx: Ctx, loc: str) -> str:
        assert ctx.gcs is not None
        return f"gs://{ctx.gcs['bucket']}/{loc}"

    def storage_options(self, ctx: Ctx) -> dict[str, Any]:
        assert ctx.gcs is not None
        return {"endpoint_url": ctx.gcs["endpoint_url"], "token": "anon"}

    def cleanup(self, ctx: Ctx, loc: str) -> None:
        assert ctx.gcs is not None
        _side(ctx).delete_prefix(ctx.gcs["bucket"], loc)


class DcpExtGCS(_OnGCS):
    name = "dcp_ext"
    role = "dcp_ext"
    label = "dcp_ext CheckpointWriter/Reader"

    def describe(self, params: dict[str, Any]) -> str:
        return f"max_concurrency={params['gcs_concurrency']}, other settings default (16 MiB parts / read requests)"

    def save(self, ctx: Ctx, state: dict[str, Any], loc: str) -> None:
        from dcp_ext import CheckpointWriter

        writer = CheckpointWriter(self.url(ctx, loc), storage_options=self.storage_options(ctx),
                                  max_concurrency=int(ctx.params["gcs_concurrency"]))
        dcp.save(state, storage_writer=writer)

    def load(self, ctx: Ctx, dest: dict[str, Any], loc: str) -> None:
        from dcp_ext import CheckpointReader

        reader = CheckpointReader(self.url(ctx, loc), storage_options=self.storage_options(ctx),
                                  max_concurrency=int(ctx.params["gcs_concurrency"]))
        dcp.load(dest, storage_reader=reader)


class TorchFsspecGCS(_OnGCS):
    name = "torch_fsspec"
    role = "torch_default"  # torch's only way to GCS
    label = "torch FsspecWriter/Reader (gcsfs)"

    def describe(self, params: dict[str, Any]) -> str:
        import gcsfs

        return f"default settings (thread_count=1, sync_files=True), gcsfs {gcsfs.__version__}"

    def save(self, ctx: Ctx, state: dict[str, Any], loc: str) -> None:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        dcp.save(state, storage_writer=FsspecWriter(self.url(ctx, loc), **self.storage_options(ctx)))

    def load(self, ctx: Ctx, dest: dict[str, Any], loc: str) -> None:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        dcp.load(dest, storage_reader=FsspecReader(self.url(ctx, loc), **self.storage_options(ctx)))


class RawGCS(_OnGCS, RawLocal):
    name = "raw"
    role = "raw"
    label = "stricter hand-written ceiling: urllib3 parallel part uploads + compose / ranged GETs"

    def describe(self, params: dict[str, Any]) -> str:
        return (f"urllib3, {params['gcs_concurrency']} threads, {params['part_size'] // MiB} MiB parts and ranges, "
                f"compose of the parts, reads straight into the buffer")

    def _key(self, ctx: Ctx, loc: str) -> str:
        return f"{loc}/raw_{ctx.rank}.bin"

    def save(self, ctx: Ctx, state: dict[str, Any], loc: str) -> None:
        assert ctx.raw_src is not None and ctx.gcs is not None
        side, bucket = _side(ctx), ctx.gcs["bucket"]
        view = _byte_view(ctx.raw_src)
        part = int(ctx.params["part_size"])
        key = self._key(ctx, loc)
        count = -(-view.nbytes // part)
        parts = [f"{key}.part{i:05d}" for i in range(count)]

        def put(i: int) -> None:
            side.request("POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={_q(parts[i])}",
                         body=view[i * part : (i + 1) * part], headers={"Content-Type": "application/octet-stream"})

        def compose(dest: str, sources: list[str]) -> None:
            body = json.dumps({"sourceObjects": [{"name": s} for s in sources]}).encode()
            side.request("POST", f"/storage/v1/b/{bucket}/o/{_q(dest)}/compose", body=body,
                         headers={"Content-Type": "application/json"})

        with ThreadPoolExecutor(int(ctx.params["gcs_concurrency"])) as pool:
            list(pool.map(put, range(count)))
            sources, level = parts, 0
            while len(sources) > _COMPOSE:
                level += 1
                batches = [sources[i : i + _COMPOSE] for i in range(0, len(sources), _COMPOSE)]
                names = [f"{key}.c{level}-{i}" for i in range(len(batches))]
                list(pool.map(compose, names, batches))
                parts += names
                sources = names
            compose(key, sources)
            list(pool.map(lambda n: side.request("DELETE", f"/storage/v1/b/{bucket}/o/{_q(n)}"), parts))
        dist.barrier()

    def load(self, ctx: Ctx, dest: dict[str, Any], loc: str) -> None:
        assert ctx.raw_dst is not None and ctx.gcs is not None
        side, bucket = _side(ctx), ctx.gcs["bucket"]
        view = _byte_view(ctx.raw_dst)
        part = int(ctx.params["part_size"])
        path = f"/storage/v1/b/{bucket}/o/{_q(self._key(ctx, loc))}?alt=media"

        def get(i: int) -> None:
            start = i * part
            target = view[start : start + part]
            response = side.request("GET", path, headers={"Range": f"bytes={start}-{start + target.nbytes - 1}"},
                                    preload_content=False)
            raw = response._fp  # http.client's response: readinto lands in the buffer without a copy
            done = 0
            while done < target.nbytes:
                n = raw.readinto(target[done:])
                if not n:
                    raise EOFError(f"short body at {start + done}")
                done += n
            response.release_conn()

        with ThreadPoolExecutor(int(ctx.params["gcs_concurrency"])) as pool:
            list(pool.map(get, range(-(-view.nbytes // part))))
        dist.barrier()

    def cleanup(self, ctx: Ctx, loc: str) -> None:
        _OnGCS.cleanup(self, ctx, loc)


class GcsfsCeiling(_OnGCS, RawLocal):
    """Issue 42's raw ceiling on GCS: gcsfs's own parallel put/get of the raw bytes (see the module doc)."""

    name = "raw_sdk"
    role = "raw_sdk"
    label = "raw ceiling (issue 42's): gcsfs parallel pipe of parts + merge / cat_ranges"

    def __init__(self) -> None:
        self._fs: Any = None

    def describe(self, params: dict[str, Any]) -> str:
        import gcsfs

        return (f"gcsfs {gcsfs.__version__}: pipe of {params['part_size'] // MiB} MiB parts, batch_size="
                f"{params['gcs_concurrency']}, merge (compose) and rm of the parts / cat_ranges of "
                f"{params['part_size'] // MiB} MiB, batch_size={params['gcs_concurrency']}, copied into the buffer")

    def _gcsfs(self, ctx: Ctx) -> Any:
        if self._fs is None:
            import gcsfs

            self._fs = gcsfs.GCSFileSystem(skip_instance_cache=True, **self.storage_options(ctx))
        return self._fs

    def _path(self, ctx: Ctx, loc: str) -> str:
        assert ctx.gcs is not None
        return f"{ctx.gcs['bucket']}/{loc}/raw_{ctx.rank}.bin"

    def save(self, ctx: Ctx, state: dict[str, Any], loc: str) -> None:
        assert ctx.raw_src is not None
        fs, view = self._gcsfs(ctx), _byte_view(ctx.raw_src)
        part, n = int(ctx.params["part_size"]), int(ctx.params["gcs_concurrency"])
        path = self._path(ctx, loc)
        count = -(-view.nbytes // part)
        parts = [f"{path}.part{i:05d}" for i in range(count)]
        fs.pipe({name: view[i * part : (i + 1) * part] for i, name in enumerate(parts)}, batch_size=n)
        sources, level, made = parts, 0, list(parts)
        with ThreadPoolExecutor(n) as pool:
            while len(sources) > _COMPOSE:
                level += 1
                batches = [sources[i : i + _COMPOSE] for i in range(0, len(sources), _COMPOSE)]
                names = [f"{path}.c{level}-{i}" for i in range(len(batches))]
                list(pool.map(fs.merge, names, batches))
                made += names
                sources = names
        fs.merge(path, sources)
        fs.rm(made)
        dist.barrier()

    def load(self, ctx: Ctx, dest: dict[str, Any], loc: str) -> None:
        assert ctx.raw_dst is not None
        fs, view = self._gcsfs(ctx), _byte_view(ctx.raw_dst)
        part = int(ctx.params["part_size"])
        path = self._path(ctx, loc)
        starts = list(range(0, view.nbytes, part))
        ends = [min(start + part, view.nbytes) for start in starts]
        bodies = fs.cat_ranges([path] * len(starts), starts, ends,
                               batch_size=int(ctx.params["gcs_concurrency"]), on_error="raise")
        for start, end, body in zip(starts, ends, bodies):
            if len(body) != end - start:
                raise EOFError(f"short body for {path} at {start}: {len(body)} of {end - start} bytes")
            view[start:end] = body
        dist.barrier()

    def cleanup(self, ctx: Ctx, loc: str) -> None:
        _OnGCS.cleanup(self, ctx, loc)


def make_gcs_systems(params: dict[str, Any]) -> list[System]:
    """The systems compared on GCS, in run order."""
    return [DcpExtGCS(), TorchFsspecGCS(), GcsfsCeiling(), RawGCS()]
