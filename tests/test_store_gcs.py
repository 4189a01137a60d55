"""The GCS store (issue 42) against a real emulator: fake-gcs-server v1.54.0 on 127.0.0.1.

* the storage contract (:class:`~dcp_ext.testing.store.StoreTests`) by class,
  with side doors into the emulator and a recording proxy that counts parts;
* what the save lock relies on: the emulator itself refuses a second
  ``ifGenerationMatch=0`` create, the store sends exactly that request, and
  a lost answer of a create that went through is still a win;
* parallel composite uploads: parts in flight bounded by the pooled buffers,
  at most 32 sources per compose and composes of composes, no temporaries
  left after a commit or an abort, leftovers reported and cleaned by a root;
* typed errors naming the object: missing object and bucket, 401/403,
  throttling and server errors retried then transient, resets retried,
  silence bounded and named; credentials (access token, service-account
  key through google-auth, none without google-auth), options;
* end to end (:mod:`tests.support.gcs_workers`): a 2-rank sharded save
  loaded into 1 rank bit-exact and the manager with retention in one spawned
  world; two processes racing for one checkpoint; the server killed mid-upload.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from dcp_ext import IOConfig, RetryPolicy
from dcp_ext.errors import (
    BucketNotFoundError,
    CheckpointNotFoundError,
    CredentialsError,
    DcpExtError,
    StoragePermissionError,
    StorageTimeoutError,
    TransientStorageError,
)
from dcp_ext.storage import TMP_MARK, GCSOptions, GCSStore, Location, store_factory
from dcp_ext.storage import _gcs_writer
from dcp_ext.storage._gcs_client import clear_gcs_connections
from dcp_ext.testing.store import CONFIG, StoreTests
from dcp_ext.testing.store import Location as Space
from tests.support import dist, gcs_workers
from tests.support.fault_proxy import FaultPlan, FaultProxy
from tests.support.gcs_server import GCSServer, serving, start_fake_gcs
from tests.support.stalling_s3 import SilentEndpoint

BUCKET = "dcp-ext-gcs"
KiB, MiB = 1 << 10, 1 << 20
#: Fast retries, so a failing request costs milliseconds, not seconds.
FAST = IOConfig(retry=RetryPolicy(max_attempts=4, base_delay=0.01, max_delay=0.05))


@pytest.fixture(scope="module")
def server() -> Iterator[GCSServer]:
    with serving(BUCKET) as running:
        yield running


@pytest.fixture(scope="module")
def proxy(server: GCSServer) -> Iterator[FaultProxy]:
    """A recording proxy (no faults unless a test sets a plan) in front of the emulator."""
    with FaultProxy(server.endpoint_url) as running:
        yield running


@pytest.fixture(autouse=True)
def _fresh_connections() -> Iterator[None]:
    clear_gcs_connections()  # no silence or bucket knowledge carried between tests
    yield
    clear_gcs_connections()


def _url(name: str = "t") -> str:
    return f"gs://{BUCKET}/{name}-{uuid.uuid4().hex[:8]}"


def _options(endpoint: str, **kwargs: Any) -> GCSOptions:
    return GCSOptions(endpoint=endpoint, anonymous=True, **kwargs)


def _requests(proxy: FaultProxy, pattern: str) -> list[str]:
    return [f"{e.method} {e.path}" for e in list(proxy.log) if re.search(pattern, f"{e.method} {e.path}")]


# -- the contract ------------------------------------------------------------------------------


class TestGCSStore(StoreTests):
    """The contract suite, stores opened by class, requests through the recording proxy."""

    store_factory = GCSStore

    @pytest.fixture
    def location(self, server: GCSServer, proxy: FaultProxy) -> Space:
        self.server, self.proxy = server, proxy
        run = uuid.uuid4().hex[:8]
        return (lambda name: f"gs://{BUCKET}/contract-{run}/{name}"), server.storage_options(proxy.endpoint_url)

    def _key(self, url: str) -> str:
        return url[len(f"gs://{BUCKET}/"):]

    def side_door_names(self, url: str) -> list[str] | None:
        prefix = self._key(url) + "/"
        return [n[len(prefix):] for n in self.server.names(BUCKET, prefix)]

    def side_door_incomplete_uploads(self, url: str) -> list[str] | None:
        names = self.side_door_names(url) or []
        return sorted({n.split(TMP_MARK)[0] for n in names if TMP_MARK in n})

    def side_door_parts(self, url: str, name: str) -> int | None:
        # The emulator keeps no componentCount: count the part uploads the proxy saw.
        key = f"{self._key(url)}/{name}{TMP_MARK}"
        uploads = [e for e in list(self.proxy.log) if "uploadType=media" in e.path
                   and key.replace("/", "%2F") in e.path]
        return len(uploads) or 1

    def test_registry_opens_the_gcs_store_for_both_schemes(self, location: Space) -> None:
        url_of, options = location
        for scheme in ("gs", "gcs"):
            store = Location(url_of(scheme).replace("gs://", f"{scheme}://"), options, CONFIG).open()
            assert isinstance(store, GCSStore) and store_factory(scheme) is GCSStore
            store.write_file("x", b"1")
            assert store.describe("x").startswith(f"{scheme}://{BUCKET}/") and store.read_file("x") == b"1"


# -- the save lock's condition -----------------------------------------------------------------


def _multipart_body(name: str, data: bytes, boundary: str = "b0und") -> tuple[bytes, dict[str, str]]:
    body = (f"--{boundary}\r\nContent-Type: application/json\r\n\r\n{json.dumps({'name': name})}\r\n--{boundary}\r\n"
            f"Content-Type: application/octet-stream\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
    return body, {"Content-Type": f"multipart/related; boundary={boundary}"}


def test_the_emulator_refuses_a_second_conditional_create_and_the_store_sends_that_request(
        server: GCSServer, proxy: FaultProxy) -> None:
    # The emulator itself, through a side door: 200, then 412, the first content kept.
    name = f"cond-{uuid.uuid4().hex[:8]}/lock"
    path = f"/upload/storage/v1/b/{BUCKET}/o?uploadType=multipart&ifGenerationMatch=0"
    first = server.request("POST", path, *_multipart_body(name, b"first"))
    second = server.request("POST", path, *_multipart_body(name, b"second"))
    assert (first[0], second[0]) == (200, 412), (first, second[1][:200])
    assert server.read(BUCKET, name) == b"first"
    # Its limit, documented in docs/guarantees.md: a media upload ignores the condition.
    media = f"/upload/storage/v1/b/{BUCKET}/o?uploadType=media&name={name.replace('/', '%2F')}&ifGenerationMatch=0"
    assert server.request("POST", media, b"overwritten")[0] == 200
    assert server.read(BUCKET, name) == b"overwritten"
    # The store's create_exclusive is exactly the request the emulator conditions.
    store = GCSStore(_url("lock"), FAST, None, _options(proxy.endpoint_url))
    proxy.reset_log()
    assert store.create_exclusive("lock", b"mine") is True
    assert store.create_exclusive("lock", b"theirs") is False
    creates = _requests(proxy, r"^POST /upload/")
    assert len(creates) == 2 and all("uploadType=multipart" in c and "ifGenerationMatch=0" in c for c in creates)
    assert store.read_file("lock") == b"mine"


def test_a_create_whose_answer_was_lost_still_wins(server: GCSServer) -> None:
    """The proxy forwards the create (the object is made) and cuts the answer
    short: the retry meets 412, and the store sees its own bytes there."""
    plan = FaultPlan(rate=1.0, faults=("truncate",), limit=1, match=lambda m, p: "ifGenerationMatch=0" in p)
    with FaultProxy(server.endpoint_url, plan) as cutting:
        store = GCSStore(_url("lost"), FAST, None, _options(cutting.endpoint_url))
        assert store.create_exclusive("lock", b"record of this writer") is True
        assert [e.fault for e in cutting.log if "ifGenerationMatch" in e.path] == ["truncate", None]
        assert store.create_exclusive("lock", b"record of another writer") is False
        assert store.read_file("lock") == b"record of this writer"


# -- parallel composite uploads ----------------------------------------------------------------


def test_fold_plan() -> None:
    assert _gcs_writer.fold_plan(32) == [] and _gcs_writer.fold_plan(33) == [2]
    assert _gcs_writer.fold_plan(1025) == [33, 2] and _gcs_writer.fold_plan(10, fan_in=3) == [4, 2]


class _ComposeSpy:
    """Records the sources of every compose a store sends (at most ``limit`` each)."""

    def __init__(self, store: GCSStore, limit: int) -> None:
        self.calls: list[tuple[str, int]] = []
        self._compose, self._limit = store.compose, limit
        store.compose = self  # type: ignore[method-assign]

    def __call__(self, key: str, sources: Sequence[str], doing: str) -> dict[str, Any]:
        assert 0 < len(sources) <= self._limit, (key, len(sources))
        self.calls.append((key, len(sources)))
        return self._compose(key, sources, doing)


@pytest.mark.parametrize("fan_in, parts, composes", [
    (32, 32, [32]), (32, 64, [32, 32, 2]), (4, 21, [4] * 5 + [4, 2] + [2])])
def test_parts_are_composed_32_at_most_and_nothing_is_left(
        server: GCSServer, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch, fan_in: int, parts: int,
        composes: list[int]) -> None:
    """Sources per compose request, in order. 32 parts: one compose. 64: the
    first 32 folded during the upload (the file went on), the last 32 at the
    commit (33 sources otherwise), then 2. With a fan-in of 4 (GCS's 32
    made small), 21 parts need composes of composes: 5 groups (folded during
    the upload) + 1 part, folded into 2, then 1."""
    monkeypatch.setattr(_gcs_writer, "MAX_COMPOSE", fan_in)
    part = 256 * KiB
    store = GCSStore(_url("compose"), FAST, None, _options(proxy.endpoint_url, part_size=part, max_concurrency=3))
    spy = _ComposeSpy(store, fan_in)
    data = bytes(range(256)) * (parts * part // 256 - 1) + b"tail"
    allocated: list[int] = []
    get = store.part_buffers.get

    def counting_get(size: int) -> bytearray:
        buffer = get(size)
        allocated.append(store.part_buffers._allocated)
        return buffer

    monkeypatch.setattr(store.part_buffers, "get", counting_get)
    proxy.reset_log()
    with store.open_writer("big.distcp") as writer:
        for start in range(0, len(data), 100_000):
            writer.write(data[start : start + 100_000])
        assert not store.exists("big.distcp")  # nothing under the final name before the commit
        writer.commit()
    assert store.read_file("big.distcp") == data
    assert max(allocated) <= 3 + 1  # max_concurrency + 1 buffers, whatever the file's size
    assert len(_requests(proxy, r"uploadType=media")) == parts
    assert [n for _, n in spy.calls] == composes
    assert [k for k, _ in spy.calls if k.endswith("big.distcp")] == [store.key("big.distcp")]  # the last one
    key = store.key("")
    assert server.names(BUCKET, key) == [key + "big.distcp"]  # every part and group deleted
    assert store.list_incomplete_uploads() == []


def test_a_failed_part_aborts_and_leftovers_of_a_crash_are_reported_and_cleaned(
        server: GCSServer, monkeypatch: pytest.MonkeyPatch) -> None:
    from dcp_ext.guard import _save_lock
    from dcp_ext.root._root import CheckpointRoot

    part = 256 * KiB
    # A part upload failing for good (500 on every attempt) fails the write, which deletes its parts.
    plan = FaultPlan(rate=1.0, faults=("internal",), match=lambda m, p: "uploadType=media" in p and "p000002" in p)
    root = _url("leftovers")
    with FaultProxy(server.endpoint_url, plan) as failing:
        store = GCSStore(root + "/t1_partial", FAST, None, _options(failing.endpoint_url, part_size=part))
        with pytest.raises(TransientStorageError, match=r"t1_partial/a\.distcp.*p000002") as info:
            with store.open_writer("a.distcp") as writer:
                writer.write(b"x" * (5 * part))
                writer.commit()
        assert "retries exhausted" in str(info.value)
    assert server.names(BUCKET, store.key("")) == []
    # A writer that never commits nor aborts (a crashed rank): its parts are a reported upload.
    store = GCSStore(root + "/t1_partial", FAST, None, _options(server.endpoint_url, part_size=part))
    writer = store.open_writer("b.distcp")
    writer.write(b"y" * (3 * part))
    writer._wait()  # type: ignore[attr-defined]
    (upload,) = store.list_incomplete_uploads()
    assert upload.name == "b.distcp" and abs(upload.initiated - time.time()) < 120
    # The root's cleanup aborts it once it is older than the stale-lock limit.
    options = {"endpoint_url": server.endpoint_url, "token": "anon"}
    assert CheckpointRoot(root, FAST, options).remove_leftovers().uploads == ()
    monkeypatch.setattr(_save_lock, "STALE_LOCK_SECONDS", 0.0)
    report = CheckpointRoot(root, FAST, options).remove_leftovers()
    assert report.uploads == ("t1_partial/b.distcp",)
    assert not any(TMP_MARK in n for n in server.names(BUCKET, store.key("")))


# -- errors ------------------------------------------------------------------------------------


def test_modified_is_the_objects_updated_time(server: GCSServer) -> None:
    from dcp_ext.storage.gcs import _timestamp

    assert _timestamp("2026-11-28T11:13:32.690335Z") == pytest.approx(1795864412.690335)
    assert _timestamp("2026-11-28T11:13:32.5Z") == _timestamp("2026-11-28T12:13:32.500+01:00")
    assert _timestamp("2026-11-28T11:13:32Z") == pytest.approx(1795864412.0)
    store = GCSStore(_url("mtime"), FAST, None, _options(server.endpoint_url))
    store.write_file("x.json", b"{}")
    modified = store.modified("x.json")
    assert modified is not None and abs(modified - time.time()) < 60
    with pytest.raises(CheckpointNotFoundError, match="y.json"):
        store.modified("y.json")


def test_missing_objects_and_buckets_are_told_apart(server: GCSServer) -> None:
    store = GCSStore(_url("missing"), FAST, None, _options(server.endpoint_url))
    with pytest.raises(CheckpointNotFoundError, match=r"missing-\w+/nothing\.json does not exist") as info:
        store.read_file("nothing.json")
    assert not isinstance(info.value, BucketNotFoundError)
    assert store.exists("nothing.json") is False and store.root_exists() is False
    with pytest.raises(CheckpointNotFoundError, match="nothing.json"):
        store.size("nothing.json")
    absent = GCSStore("gs://no-such-bucket/ck", FAST, None, _options(server.endpoint_url))
    for action in (lambda: absent.read_file("x.json"), absent.list_names, absent.root_exists,
                   lambda: absent.write_file("x.json", b"1")):
        with pytest.raises(BucketNotFoundError, match="'no-such-bucket' does not exist"):
            action()


class _Answering(ThreadingHTTPServer):
    """A JSON API endpoint that answers every request with one status (and records the headers)."""

    daemon_threads = True

    def __init__(self, status: int, reason: str) -> None:
        self.status, self.reason, self.seen = status, reason, []  # type: ignore[var-annotated]
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length", 0) or 0)
                body = self.rfile.read(length) if length else b""
                outer.seen.append((self.command, self.path, dict(self.headers), body))
                payload = json.dumps(_token_answer() if self.path == "/token" else
                                     {"error": {"code": outer.status, "message": outer.reason,
                                                "errors": [{"reason": outer.reason}]}}).encode()
                self.send_response(200 if self.path == "/token" else outer.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_DELETE = _answer

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def _token_answer() -> dict[str, Any]:
    return {"access_token": "token-from-the-token-endpoint", "expires_in": 3600, "token_type": "Bearer"}


@pytest.mark.parametrize("status, reason, error", [
    (401, "authError", CredentialsError), (403, "forbidden", StoragePermissionError)])
def test_refused_credentials_and_permissions_are_typed(status: int, reason: str, error: type[Exception]) -> None:
    endpoint = _Answering(status, reason)
    try:
        store = GCSStore("gs://b/ck", FAST, {"access_token": "secret-token"}, GCSOptions(endpoint=endpoint.url))
        with pytest.raises(error, match=rf"gs://b/ck/meta\.json \(HTTP {status} {reason}") as info:
            store.read_file("meta.json")
        assert isinstance(info.value, PermissionError)
        assert len(endpoint.seen) == 1  # not retried
        assert endpoint.seen[0][2]["Authorization"] == "Bearer secret-token"
        assert "secret-token" not in repr(store.options)
    finally:
        endpoint.shutdown()


def test_throttling_server_errors_and_resets_are_retried_then_transient(server: GCSServer) -> None:
    plan = FaultPlan(rate=1.0, faults=("slowdown", "internal", "reset"), limit=3)
    with FaultProxy(server.endpoint_url, plan) as faulty:
        store = GCSStore(_url("retry"), FAST, None, _options(faulty.endpoint_url))
        store.write_file("a.json", b"{}")  # 503, 500, reset, then through
        assert [e.fault for e in faulty.log] == ["slowdown", "internal", "reset", None]
        assert store.read_file("a.json") == b"{}"
        faulty.plan = FaultPlan(rate=1.0, faults=("slowdown",))
        faulty.reset_log()
        started = time.monotonic()
        with pytest.raises(TransientStorageError, match=r"(?s)retry-\w+/a\.json \(HTTP 503.*retries exhausted"):
            store.read_file("a.json")
        assert len(faulty.log) == FAST.retry.max_attempts and time.monotonic() - started < 5


def test_a_silent_endpoint_fails_in_bounded_time_naming_endpoint_object_and_settings() -> None:
    options = GCSOptions(anonymous=True, connect_timeout=0.3, read_timeout=0.5, request_deadline=1.5)
    with SilentEndpoint() as silent:
        store = GCSStore("gs://b/ck", FAST, None, GCSOptions(**{**options.__dict__, "endpoint": silent.endpoint_url}))
        started = time.monotonic()
        with pytest.raises(StorageTimeoutError) as info:
            store.read_file("meta.json")
        took = time.monotonic() - started
        message = str(info.value)
        assert silent.endpoint_url in message and "gs://b/ck/meta.json" in message
        assert "read_timeout=0.5 s" in message and "request_deadline=1.5 s" in message
        assert 0.4 < took < 1.5 + 1.0, took  # attempts of 0.8 s within a 1.5 s deadline
        # The next request fails at once instead of waiting again.
        started = time.monotonic()
        with pytest.raises(StorageTimeoutError, match="not sent"):
            store.write_file("other.json", b"{}")
        assert time.monotonic() - started < 0.2


# -- credentials and options -------------------------------------------------------------------


def _service_account_key(token_uri: str) -> dict[str, str]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    return {"type": "service_account", "project_id": "p", "private_key_id": "k1", "private_key": pem,
            "client_email": "ckpt@p.iam.gserviceaccount.com", "client_id": "1", "token_uri": token_uri}


def test_a_service_account_key_goes_through_google_auth(tmp_path: Path) -> None:
    pytest.importorskip("google.auth")
    endpoint = _Answering(404, "notFound")
    try:
        key = tmp_path / "key.json"
        key.write_text(json.dumps(_service_account_key(endpoint.url + "/token")))
        store = GCSStore("gs://b/ck", FAST, {"endpoint_url": endpoint.url, "token": str(key)})
        assert store.exists("x") is False
        token_request, object_request = endpoint.seen[0], endpoint.seen[1]
        assert token_request[1] == "/token" and b"assertion=" in token_request[3]  # a signed JWT exchanged
        assert object_request[2]["Authorization"] == "Bearer token-from-the-token-endpoint"
    finally:
        endpoint.shutdown()


def test_credentials_need_google_auth_unless_anonymous_or_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "google.auth", None)  # as if google-auth were not installed
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    store = GCSStore("gs://b/ck", FAST, {"endpoint_url": "http://127.0.0.1:9"})
    with pytest.raises(CredentialsError, match=r"gs://b/ck/x.*need google-auth: pip install google-auth \(dcp_ext's \[gcs\] extra\)"):
        store.read_file("x")


def test_options_from_storage_options_config_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    config = IOConfig(part_size=8 * MiB, max_concurrency=3, s3_read_timeout=7.0, s3_request_deadline=30.0)
    options = GCSOptions.resolve(config, {"endpoint_url": "http://127.0.0.1:1/", "token": "anon", "project": "p"})
    assert (options.endpoint, options.anonymous, options.part_size, options.max_concurrency) == \
        ("http://127.0.0.1:1", True, 8 * MiB, 3)
    assert (options.read_timeout, options.request_deadline) == (7.0, 30.0)
    assert GCSOptions.resolve(config, {"access_token": "t"}).credentials_kind == "access token"
    with pytest.raises(ValueError, match=r"unsupported GCS storage_options \['key'\]"):
        GCSOptions.resolve(config, {"key": "k"})
    with pytest.raises(ValueError, match="endpoint given twice"):
        GCSOptions.resolve(config, {"endpoint_url": "http://a"}, GCSOptions(endpoint="http://b"))
    with pytest.raises(ValueError, match="one kind of credentials"):
        GCSOptions(anonymous=True, access_token="t")
    with pytest.raises(ValueError, match="part_size must be >= 256 KiB"):
        GCSOptions(part_size=1000)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:4443")
    emulated = GCSOptions.resolve(config, {})
    assert (emulated.endpoint, emulated.anonymous) == ("http://127.0.0.1:4443", True)


# -- end to end --------------------------------------------------------------------------------


def test_two_rank_save_resharded_into_one_and_the_manager_with_retention(server: GCSServer) -> None:
    """One spawned 2-rank gloo world saves an FSDP2 model + Adam (parts of 256
    KiB, so data files are composed) and keeps the last two of three manager
    saves; this process (1 rank) loads both, bit-exact."""
    root = Location(_url("e2e"), options=_options(server.endpoint_url, part_size=256 * KiB, max_concurrency=4))
    full = dist.run_world(2, gcs_workers.sharded_world, root, timeout=180)[0]
    gcs_workers.check_one_rank_loads(root, full)


def test_two_processes_racing_for_one_checkpoint(server: GCSServer) -> None:
    root = _url("race")
    ctx = dist.context()
    barrier = ctx.Barrier(2)
    options = server.storage_options()
    outcomes, codes = dist.run_processes(
        ctx, gcs_workers.race, [(root, options, seed, barrier) for seed in (1, 2)], timeout=180)
    assert codes == [0, 0]
    gcs_workers.check_race(root, options, outcomes)


def test_the_server_killed_mid_upload_fails_the_save_in_bounded_time_and_commits_nothing(
        tmp_path: Path) -> None:
    data = tmp_path / "objects"
    first = start_fake_gcs(data)
    try:
        first.create_bucket(BUCKET)
        # Each part upload answers 0.3 s late: the save is mid-upload for a while.
        slow = FaultPlan(rate=1.0, faults=("delay",), delay=0.3, match=lambda m, p: "uploadType=media" in p)
        with FaultProxy(first.endpoint_url, slow) as proxy:
            outcome = gcs_workers.save_while_killed(_url("killed"), proxy, first)
    finally:
        first.stop()
    assert isinstance(outcome["error"], DcpExtError), outcome
    assert outcome["seconds_after_kill"] < gcs_workers.KILL_BOUND_SECONDS, outcome
    # Restarted on the same files: nothing of the save is committed.
    with serving(None, data) as second:
        gcs_workers.check_nothing_committed(outcome["url"], second)
