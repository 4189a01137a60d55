"""The systems compared on Azure Blob (``python -m bench --only az`` / ``--azure``): Azurite on 127.0.0.1.

* dcp_ext: ``CheckpointWriter``/``CheckpointReader`` on ``az://bench/...``
  with ``max_concurrency`` = ``--s3-concurrency`` and the default 16 MiB
  blocks and read requests (as the S3 row).
* torch ``FsspecWriter``/``FsspecReader`` over adlfs (``abfs://bench/...``,
  the same connection string): torch's only way to Azure, so the "torch
  default" baseline of the row.
* raw ceiling, per rank, its own blob: ``part_size`` blocks of one
  contiguous buffer staged by ``s3_concurrency`` threads (Put Block, the
  body a ``memoryview`` of the buffer: no copy) and one Put Block List; then
  ranged GETs of ``part_size`` by as many threads, each received with
  ``http.client``'s ``readinto`` straight into its slice of a preallocated
  buffer. Plain urllib3 and a Shared Key signer
  (``tests.support.azurite_server.sign``), nothing of dcp_ext.
"""

from __future__ import annotations

import base64
import email.utils
import re
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import urllib3

from tests.support.azurite_server import sign

from .systems import Ctx, DcpExt, RawLocal, System, TorchFsspec, _byte_view

MiB = 1 << 20
_API = "2021-12-02"


def _request(ctx: Ctx, method: str, blob: str = "", query: dict[str, str] | None = None,
             headers: dict[str, str] | None = None, body: Any = None, stream: bool = False) -> Any:
    """One signed request to the run's container (a pool per rank, kept on ``ctx``)."""
    assert ctx.az is not None
    if ctx._az_pool is None:
        n = int(ctx.params["s3_concurrency"])
        ctx._az_pool = urllib3.PoolManager(maxsize=max(16, 2 * n), retries=False,
                                           timeout=urllib3.Timeout(connect=5, read=120))
    url = f"{ctx.az['endpoint']}/{ctx.az['container']}" + (f"/{urllib.parse.quote(blob, safe='/~')}" if blob else "")
    if query:
        url += "?" + urllib.parse.urlencode(query, quote_via=urllib.parse.quote)
    sent = {"x-ms-version": _API, "x-ms-date": email.utils.formatdate(usegmt=True), **(headers or {})}
    sent["Content-Length"] = str(memoryview(body).nbytes) if body is not None else "0"
    sent["Authorization"] = sign(method, url, sent)
    response = ctx._az_pool.request(method, url, body=body, headers=sent, preload_content=not stream)
    if response.status >= 300:
        raise RuntimeError(f"{method} {url}: HTTP {response.status} {response.data[:300]!r}")
    return response


def delete_prefix(ctx: Ctx, prefix: str) -> None:
    """Delete every blob under ``prefix/`` (staged-only ones included)."""
    marker = ""
    while True:
        query = {"restype": "container", "comp": "list", "prefix": prefix.rstrip("/") + "/",
                 "include": "uncommittedblobs"}
        if marker:
            query["marker"] = marker
        text = _request(ctx, "GET", query=query).data.decode()
        for name in re.findall(r"<Blob><Name>([^<]*)</Name>", text):
            _request(ctx, "DELETE", name)
        found = re.search(r"<NextMarker>([^<]+)</NextMarker>", text)
        if not found:
            return
        marker = found.group(1)


class DcpExtAzure(DcpExt):
    def __init__(self, defaults: bool = False) -> None:
        super().__init__("az", defaults)

    def location(self, ctx: Ctx, tag: str) -> str:
        return f"bench/{self.name}-{tag}"

    def url(self, ctx: Ctx, loc: str) -> str:
        assert ctx.az is not None
        return f"az://{ctx.az['container']}/{loc}"

    def _io_kwargs(self, ctx: Ctx) -> dict[str, Any]:
        assert ctx.az is not None
        kwargs: dict[str, Any] = {"storage_options": {"connection_string": ctx.az["connection_string"]}}
        if not self.defaults:
            kwargs["max_concurrency"] = int(ctx.params["s3_concurrency"])
        return kwargs

    def describe(self, params: dict[str, Any]) -> str:
        if self.defaults:
            return "all settings default (16 MiB blocks, 8 in flight)"
        return f"max_concurrency={params['s3_concurrency']}, other settings default (16 MiB blocks / read requests)"

    def cleanup(self, ctx: Ctx, loc: str) -> None:
        delete_prefix(ctx, loc)


class TorchFsspecAzure(TorchFsspec):
    def __init__(self) -> None:
        super().__init__("az")
        self.role = "torch_default"
        self.label = "torch FsspecWriter/Reader (adlfs)"

    def location(self, ctx: Ctx, tag: str) -> str:
        return f"bench/{self.name}-{tag}"

    def url(self, ctx: Ctx, loc: str) -> str:
        assert ctx.az is not None
        return f"abfs://{ctx.az['container']}/{loc}"

    def _kwargs(self, ctx: Ctx) -> dict[str, Any]:
        assert ctx.az is not None
        return {"connection_string": ctx.az["connection_string"], "skip_instance_cache": True}

    def save(self, ctx: Ctx, state: dict[str, Any], loc: str) -> None:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        dcp.save(state, storage_writer=FsspecWriter(self.url(ctx, loc), **self._kwargs(ctx)))

    def cleanup(self, ctx: Ctx, loc: str) -> None:
        delete_prefix(ctx, loc)


class RawAzure(RawLocal):
    kind = "az"
    label = "raw ceiling: urllib3 parallel Put Block + Put Block List / ranged GET"

    def location(self, ctx: Ctx, tag: str) -> str:
        return f"bench/{self.name}-{tag}"

    def describe(self, params: dict[str, Any]) -> str:
        return (f"urllib3 + Shared Key, {params['s3_concurrency']} threads, {params['part_size'] // MiB} MiB blocks "
                f"and ranges, bodies sent and received without copies")

    def _blob(self, ctx: Ctx, loc: str) -> str:
        return f"{loc}/raw_{ctx.rank}.bin"

    def save(self, ctx: Ctx, state: dict[str, Any], loc: str) -> None:
        assert ctx.raw_src is not None
        view = _byte_view(ctx.raw_src)
        part = int(ctx.params["part_size"])
        blob = self._blob(ctx, loc)
        count = -(-view.nbytes // part)
        ids = [base64.b64encode(f"raw-{i:08d}".encode()).decode() for i in range(count)]

        def put(i: int) -> None:
            _request(ctx, "PUT", blob, {"comp": "block", "blockid": ids[i]}, body=view[i * part:(i + 1) * part])

        with ThreadPoolExecutor(int(ctx.params["s3_concurrency"])) as pool:
            list(pool.map(put, range(count)))
        xml = "<?xml version='1.0' encoding='utf-8'?><BlockList>" + "".join(
            f"<Latest>{i}</Latest>" for i in ids) + "</BlockList>"
        _request(ctx, "PUT", blob, {"comp": "blocklist"}, body=xml.encode())
        dist.barrier()

    def load(self, ctx: Ctx, dest: dict[str, Any], loc: str) -> None:
        assert ctx.raw_dst is not None
        view = _byte_view(ctx.raw_dst)
        part = int(ctx.params["part_size"])
        blob = self._blob(ctx, loc)

        def get(i: int) -> None:
            start = i * part
            target = view[start:start + part]
            response = _request(ctx, "GET", blob, headers={"x-ms-range": f"bytes={start}-{start + target.nbytes - 1}"},
                                stream=True)
            done = 0
            while done < target.nbytes:
                n = response._fp.readinto(target[done:])
                if not n:
                    raise EOFError(f"short body for {blob} at {start + done}")
                done += n
            response.release_conn()

        count = -(-view.nbytes // part)
        with ThreadPoolExecutor(int(ctx.params["s3_concurrency"])) as pool:
            list(pool.map(get, range(count)))
        dist.barrier()

    def cleanup(self, ctx: Ctx, loc: str) -> None:
        delete_prefix(ctx, loc)


def make_systems(params: dict[str, Any]) -> list[System]:
    """The systems compared on Azure Blob, in run order."""
    return [DcpExtAzure(), TorchFsspecAzure(), RawAzure()]
