"""The systems compared on Azure Blob (``python -m bench --only az`` / ``--azure``): Azurite on 127.0.0.1.

* dcp_ext: ``CheckpointWriter``/``CheckpointReader`` on ``az://bench/...``
  with ``max_concurrency`` = ``--s3-concurrency`` and the default 16 MiB
  blocks and read requests (as the S3 row).
* torch ``FsspecWriter``/``FsspecReader`` over adlfs (``abfs://bench/...``,
  the same connection string): torch's only way to Azure, so the "torch
  default" baseline of the row.
* the raw ceiling as issue 42 defines it ("the SDK's or fsspec's own
  parallel put/get of the same bytes"), :class:`SdkCeiling`: per rank, its
  own blob, azure-storage-blob's ``BlobClient.upload_blob(stream,
  length=..., max_concurrency=N, overwrite=True)`` and
  ``download_blob(max_concurrency=N).readinto(stream)``, N =
  ``s3_concurrency`` (dcp_ext's ``max_concurrency``), the streams thin
  seekable views of the same preallocated buffers the urllib3 ceiling uses
  (no copy of the whole buffer; the SDK copies each block it sends and
  each chunk it receives). Block and chunk sizes (``max_block_size``,
  ``max_single_put_size``, ``max_chunk_get_size``, ``max_single_get_size``)
  are ``part_size`` (16 MiB), as dcp_ext's and the urllib3 loop's: with the
  SDK's defaults (4 MiB blocks and chunks, 32 MiB first GET) the same 256 MiB
  took 2.4 s to save and 2.5 s to load here, against 1.4 s and 0.64 s.
* the stricter hand-written ceiling, :class:`RawAzure`, per rank, its own
  blob: ``part_size`` blocks of one
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
import io
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
    label = "stricter hand-written ceiling: urllib3 parallel Put Block + Put Block List / ranged GET"

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


class _View(io.RawIOBase):
    """A seekable stream over a ``memoryview``: the SDK reads blocks from it (``read``) or
    writes chunks into it (``write``) at the positions it seeks to; nothing else is buffered."""

    def __init__(self, view: memoryview, writable: bool) -> None:
        super().__init__()
        self._view, self._pos, self._writable = view, 0, writable

    def readable(self) -> bool:
        return not self._writable

    def writable(self) -> bool:
        return self._writable

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._view.nbytes}[whence]
        self._pos = base + offset
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            size = self._view.nbytes - self._pos
        out = self._view[self._pos:self._pos + size].tobytes()
        self._pos += len(out)
        return out

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        n = min(target.nbytes, self._view.nbytes - self._pos)
        target[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def write(self, data: Any) -> int:
        body = memoryview(data).cast("B")
        if self._pos + body.nbytes > self._view.nbytes:
            raise ValueError(f"write of {body.nbytes} bytes at {self._pos} past the buffer's {self._view.nbytes}")
        self._view[self._pos:self._pos + body.nbytes] = body
        self._pos += body.nbytes
        return body.nbytes


class SdkCeiling(RawLocal):
    """Issue 42's raw ceiling on Azure: the SDK's own parallel upload/download of the raw bytes."""

    name = "raw_sdk"
    kind = "az"
    role = "raw_sdk"
    label = "raw ceiling (issue 42's): azure-storage-blob upload_blob / download_blob, max_concurrency"

    def __init__(self) -> None:
        self._service: Any = None

    def location(self, ctx: Ctx, tag: str) -> str:
        return f"bench/{self.name}-{tag}"

    def describe(self, params: dict[str, Any]) -> str:
        from azure.storage.blob import __version__

        mib = params["part_size"] // MiB
        return (f"azure-storage-blob {__version__}, max_concurrency={params['s3_concurrency']}, {mib} MiB blocks "
                f"and chunks (max_block_size = max_single_put_size = max_chunk_get_size = max_single_get_size), "
                f"read from / written into the buffer through a seekable view")

    def _client(self, ctx: Ctx, loc: str) -> Any:
        assert ctx.az is not None
        if self._service is None:
            from azure.storage.blob import BlobServiceClient

            part = int(ctx.params["part_size"])
            self._service = BlobServiceClient.from_connection_string(
                ctx.az["connection_string"], max_block_size=part, max_single_put_size=part,
                max_chunk_get_size=part, max_single_get_size=part)
        return self._service.get_blob_client(ctx.az["container"], f"{loc}/raw_{ctx.rank}.bin")

    def save(self, ctx: Ctx, state: dict[str, Any], loc: str) -> None:
        assert ctx.raw_src is not None
        view = _byte_view(ctx.raw_src)
        self._client(ctx, loc).upload_blob(_View(view, writable=False), length=view.nbytes, overwrite=True,
                                           max_concurrency=int(ctx.params["s3_concurrency"]))
        dist.barrier()

    def load(self, ctx: Ctx, dest: dict[str, Any], loc: str) -> None:
        assert ctx.raw_dst is not None
        view = _byte_view(ctx.raw_dst)
        stream = self._client(ctx, loc).download_blob(max_concurrency=int(ctx.params["s3_concurrency"]))
        got = stream.readinto(_View(view, writable=True))
        if got != view.nbytes:
            raise EOFError(f"short download into the buffer: {got} of {view.nbytes} bytes")
        dist.barrier()

    def cleanup(self, ctx: Ctx, loc: str) -> None:
        delete_prefix(ctx, loc)


def make_systems(params: dict[str, Any]) -> list[System]:
    """The systems compared on Azure Blob, in run order."""
    return [DcpExtAzure(), TorchFsspecAzure(), SdkCeiling(), RawAzure()]
