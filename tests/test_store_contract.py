"""The storage contract (dcp_ext.testing.store.StoreTests): every backend (memory, local, moto S3, SeaweedFS S3) passes it."""

from __future__ import annotations

import os

import pytest

from dcp_ext.storage import TMP_MARK
from dcp_ext.testing.store import Location, StoreTests
from tests.support.backends import Backend
from tests.support.fault_proxy import FaultProxy


class TestBackends(StoreTests):
    """dcp_ext's own backends, with side doors into local disk and the S3 servers."""

    @pytest.fixture
    def location(self, backend: Backend) -> Location:
        self.backend = backend
        return backend.url, backend.storage_options

    def _s3(self, url: str) -> tuple[object, str, str] | None:
        server = self.backend.server
        if server is None:
            return None
        bucket, _, prefix = url[len("s3://"):].partition("/")
        return server.boto3_client(), bucket, prefix

    def side_door_names(self, url: str) -> list[str] | None:
        if self.backend.name == "local":
            return [os.path.relpath(os.path.join(d, f), url) for d, _, fs in os.walk(url) for f in fs]
        return None

    def side_door_incomplete_uploads(self, url: str) -> list[str] | None:
        s3 = self._s3(url)
        if s3 is None:
            return None
        client, bucket, prefix = s3
        uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])  # type: ignore[attr-defined]
        return [u["Key"] for u in uploads]

    def side_door_parts(self, url: str, name: str) -> int | None:
        s3 = self._s3(url)
        if s3 is None:
            return None
        client, bucket, prefix = s3
        etag = client.head_object(Bucket=bucket, Key=f"{prefix}/{name}")["ETag"].strip('"')  # type: ignore[attr-defined]
        return int(etag.rpartition("-")[2]) if "-" in etag else 1

    def test_racing_creators_have_exactly_one_winner(self, location: Location) -> None:
        if self.backend.name != "moto":
            super().test_racing_creators_have_exactly_one_winner(location)
            return
        # moto's conditional PUT is check-then-write without a lock (a CI run saw two
        # winners), where S3 and SeaweedFS decide atomically. So on moto the race runs
        # through a proxy that forwards conditional PUTs one at a time (the server's
        # atomicity), and the test proves the client's side: every creator's PUT
        # carries ``If-None-Match: *`` and exactly one of them is told it won.
        url_of, options = location
        conditional = lambda method, path, headers: method == "PUT" and any(  # noqa: E731
            k.lower() == "if-none-match" for k in headers)
        server = self.backend.server
        assert server is not None
        with FaultProxy(server.endpoint_url, serialize=conditional) as proxy:
            super().test_racing_creators_have_exactly_one_winner(
                (url_of, server.storage_options(proxy.endpoint_url)))
            creates = [e for e in proxy.log if e.method == "PUT" and "/race-" in e.path and "/lock" in e.path]
        assert len(creates) == 8 * 10, [e.path for e in creates]
        assert {e.header("If-None-Match") for e in creates} == {"*"}

    def test_local_commit_leaves_no_temporary_file(self, location: Location) -> None:
        store = self.store(location)
        store.ensure_root()
        with store.open_writer("x.distcp") as writer:
            writer.write(b"data")
            writer.commit()
        names = self.side_door_names(store.url)
        assert names is None or not any(TMP_MARK in n for n in names), names
