"""The Azure Blob store (az://, abfs://, abfss://) against Azurite on 127.0.0.1 (issue 42).

Azurite is installed on first use into tests/.node (tests/support/azurite_server.py).
It has limits a real account does not: see docs/guides/storage.md and the
comments below (no Entra ID over http, uncommitted blocks freed at once).
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import socket
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import urllib3.exceptions

import dcp_ext
from dcp_ext import CheckpointManager, IOConfig
from dcp_ext.config import RetryPolicy
from dcp_ext.errors import (
    BucketNotFoundError,
    CheckpointNotFoundError,
    CredentialsError,
    DcpExtError,
    StorageError,
    StoragePermissionError,
    StorageTimeoutError,
    TransientStorageError,
)
from dcp_ext.storage import AzureOptions, AzureStore, Location, store_factory
from dcp_ext.storage._azure_account import DEV_ACCOUNT, DEV_KEY, BearerToken, resolve_account
from dcp_ext.storage._azure_client import AzureConnection, AzureResponseError, clear_azure_connections
from dcp_ext.storage.azure import split_azure_url
from dcp_ext.testing.store import StoreTests
from dcp_ext.testing.store import Location as SuiteLocation
from tests.support import azure_workers, dist
from tests.support.azurite_server import ACCOUNT, KEY, AzuriteServer, serving, start_azurite
from tests.support.compare import state_diff

CONTAINER = "dcp-ext-tests"


@pytest.fixture(scope="module")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AzuriteServer]:
    with serving(tmp_path_factory.mktemp("azurite"), CONTAINER) as server:
        yield server


def _root(server: AzuriteServer) -> str:
    return f"az://{CONTAINER}/{uuid.uuid4().hex[:8]}"


class TestAzureStore(StoreTests):
    """The storage contract, with side doors into Azurite (every blob, staged ones included)."""

    store_factory = AzureStore

    @pytest.fixture
    def location(self, azurite: AzuriteServer) -> SuiteLocation:
        self.server = azurite
        root = _root(azurite)
        return (lambda name: f"{root}/{name}-{uuid.uuid4().hex[:6]}"), azurite.storage_options()

    def _prefix(self, url: str) -> str:
        return split_azure_url(url)[2] + "/"

    def side_door_names(self, url: str) -> list[str] | None:
        prefix = self._prefix(url)
        return [n[len(prefix):] for n in self.server.blob_names(CONTAINER, prefix, uncommitted=True)]

    def side_door_incomplete_uploads(self, url: str) -> list[str] | None:
        prefix = self._prefix(url)
        committed = set(self.server.blob_names(CONTAINER, prefix))
        return [n for n in self.server.blob_names(CONTAINER, prefix, uncommitted=True) if n not in committed]

    def side_door_parts(self, url: str, name: str) -> int | None:
        return self.server.committed_blocks(CONTAINER, self._prefix(url) + name)


# -- accounts, URLs, credentials (no server) -------------------------------------------------------


def test_urls_accounts_and_endpoints_follow_adlfs() -> None:
    key = base64.b64encode(b"k" * 64).decode()
    assert {store_factory(s) for s in ("az", "abfs", "abfss", "AZ")} == {AzureStore}
    assert split_azure_url("az://ckpt/a/b/") == ("ckpt", None, "a/b")
    assert split_azure_url("abfss://ckpt@acct.dfs.core.windows.net/run") == ("ckpt", "acct.dfs.core.windows.net", "run")
    with pytest.raises(ValueError, match="names no container"):
        split_azure_url("az:///x")
    account = resolve_account("az://c/p", None, {"account_name": "acct", "account_key": key}, environ={})
    assert (account.name, account.endpoint, account.auth.how) == ("acct", "https://acct.blob.core.windows.net",
                                                                  "account key")
    # The abfs URL names the account; the store talks to its Blob endpoint (sovereign clouds keep their suffix).
    account = resolve_account("abfs://c@acct.dfs.core.chinacloudapi.cn/p", "acct.dfs.core.chinacloudapi.cn",
                              {"sas_token": "?sv=1&sig=x"}, environ={})
    assert (account.name, account.endpoint, account.auth.how) == ("acct", "https://acct.blob.core.chinacloudapi.cn",
                                                                  "SAS token")
    assert account.auth.authorize("GET", "https://h/c/b?comp=list", {}) == "https://h/c/b?comp=list&sv=1&sig=x"
    account = resolve_account("az://c", None, {"connection_string": f"AccountName=a1;AccountKey={key};"
                                                                     f"EndpointSuffix=core.usgovcloudapi.net"}, environ={})
    assert account.endpoint == "https://a1.blob.core.usgovcloudapi.net"
    account = resolve_account("az://c", None, {"connection_string": "UseDevelopmentStorage=true"}, environ={})
    assert (account.name, account.endpoint) == (DEV_ACCOUNT, f"http://127.0.0.1:10000/{DEV_ACCOUNT}")
    # The variables adlfs reads, when no option is given; AzureOptions.endpoint wins over everything.
    account = resolve_account("az://c", None, {}, "http://127.0.0.1:9/x",
                              environ={"AZURE_STORAGE_ACCOUNT_NAME": "envacct", "AZURE_STORAGE_ACCOUNT_KEY": key})
    assert (account.name, account.endpoint, account.auth.how) == ("envacct", "http://127.0.0.1:9/x", "account key")
    with pytest.raises(ValueError, match="names the account 'acct' but storage_options give 'other'"):
        resolve_account("abfs://c@acct.dfs.core.windows.net", "acct.dfs.core.windows.net", {"account_name": "other"})
    with pytest.raises(ValueError, match=r"\['read_timeout'\].*AzureOptions.read_timeout"):
        resolve_account("az://c", None, {"account_name": "a", "read_timeout": 3})
    with pytest.raises(CredentialsError, match="no Azure storage account for az://c/p"):
        resolve_account("az://c/p", None, {}, environ={})
    with pytest.raises(ValueError, match="block_size"):
        AzureOptions(block_size=1000)
    with pytest.raises(ValueError, match="request_deadline"):
        AzureOptions(connect_timeout=5, read_timeout=20, request_deadline=10)
    assert AzureOptions.from_config(IOConfig(part_size=32 << 20, max_concurrency=3)) == AzureOptions(
        block_size=32 << 20, max_concurrency=3)


def test_entra_id_tokens_are_fetched_once_and_renewed_before_they_expire() -> None:
    class Credential:
        def __init__(self) -> None:
            self.calls: list[str] = []
            self.lifetime = 3600.0

        def get_token(self, scope: str) -> Any:
            self.calls.append(scope)
            return type("AccessToken", (), {"token": f"t{len(self.calls)}", "expires_on": time.time() + self.lifetime})

    credential = Credential()
    auth = BearerToken(credential)
    headers: dict[str, str] = {}
    for _ in range(3):
        auth.authorize("GET", "https://a.blob.core.windows.net/c/b", headers)
    assert headers["Authorization"] == "Bearer t1" and credential.calls == ["https://storage.azure.com/.default"]
    credential.lifetime = 60.0  # the next token expires within the renewal margin: fetched every time
    auth._expires = 0.0
    auth.authorize("GET", "https://a/c/b", headers)
    auth.authorize("GET", "https://a/c/b", headers)
    assert headers["Authorization"] == "Bearer t3"
    account = resolve_account("az://c", None, {"account_name": "a", "credential": credential}, environ={})
    assert account.auth.how == "Entra ID token"


# -- against Azurite ---------------------------------------------------------------------------------


def _account_sas(permissions: str) -> str:
    """An account SAS for the development account (version 2021-12-02 string-to-sign)."""
    expiry = (datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    fields = [ACCOUNT, permissions, "b", "sco", "", expiry, "", "https,http", "2021-12-02", ""]
    digest = hmac.new(base64.b64decode(KEY), ("\n".join(fields) + "\n").encode(), hashlib.sha256).digest()
    return urllib.parse.urlencode({"sv": "2021-12-02", "ss": "b", "srt": "sco", "sp": permissions, "se": expiry,
                                   "spr": "https,http", "sig": base64.b64encode(digest).decode()})


def test_credentials_and_errors_are_typed_and_name_the_blob(azurite: AzuriteServer) -> None:
    """Account key, connection string, SAS (and a read-only one), the abfs URL
    form; a missing blob, a missing container, a wrong key, a wrong SAS."""
    prefix = uuid.uuid4().hex[:8]
    at = AzureOptions(endpoint=azurite.endpoint)
    keyed = Location(f"abfss://{CONTAINER}@{ACCOUNT}.dfs.core.windows.net/{prefix}", {"account_key": KEY},
                     options=at).open()
    keyed.write_file("a.json", b"{}")
    assert azurite.get_blob(CONTAINER, f"{prefix}/a.json") == b"{}"
    sas = Location(f"az://{CONTAINER}/{prefix}", {"account_name": ACCOUNT, "sas_token": _account_sas("racwdl")},
                   options=at).open()
    assert sas.read_file("a.json") == b"{}" and sas.list_names() == ["a.json"]
    assert sas.create_exclusive("lock", b"1") and not sas.create_exclusive("lock", b"2")
    reader = Location(f"abfs://{CONTAINER}/{prefix}", {"account_name": ACCOUNT, "sas_token": _account_sas("rl")},
                      options=at).open()
    assert reader.read_file("lock") == b"1"
    with pytest.raises(StoragePermissionError, match=f"{prefix}/b.json.*AuthorizationPermissionMismatch") as denied:
        reader.write_file("b.json", b"x")
    assert not isinstance(denied.value, CredentialsError)
    store = Location(f"az://{CONTAINER}/{prefix}", azurite.storage_options()).open()
    with pytest.raises(CheckpointNotFoundError, match=f"az://{CONTAINER}/{prefix}/missing.json.*BlobNotFound"):
        store.read_file("missing.json")
    assert not store.exists("missing.json") and store.size("a.json") == 2
    store.delete("missing.json")
    elsewhere = Location("az://no-such-container/x", azurite.storage_options()).open()
    with pytest.raises(BucketNotFoundError, match="container 'no-such-container' does not exist"):
        elsewhere.ensure_root()
    with pytest.raises(BucketNotFoundError, match="az://no-such-container/x/f"):
        elsewhere.read_file("f")
    wrong = base64.b64encode(b"0" * 64).decode()
    for options in ({"account_name": ACCOUNT, "account_key": wrong},
                    {"account_name": ACCOUNT, "sas_token": _account_sas("rl").replace("sig=", "sig=AA")}):
        with pytest.raises(CredentialsError, match=f"Azure rejected the credentials.*{prefix}/a.json.*403"):
            Location(f"az://{CONTAINER}/{prefix}", options, options=at).open().read_file("a.json")


def test_transient_failures_are_retried_within_bounds(azurite: AzuriteServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """503 ServerBusy and a reset are retried; a failure that outlasts the
    retries is a TransientStorageError naming the blob."""
    config = IOConfig(retry=RetryPolicy(max_attempts=4, base_delay=0.01, max_delay=0.05))
    store = AzureStore(f"az://{CONTAINER}/{uuid.uuid4().hex[:8]}", config, azurite.storage_options())
    send = AzureConnection.send
    faults: list[BaseException] = []
    calls = []

    def flaky(self: AzureConnection, method: str, container: str, blob: str = "", **kwargs: Any) -> Any:
        calls.append((method, blob))
        if faults:
            raise faults.pop(0)
        return send(self, method, container, blob, **kwargs)

    monkeypatch.setattr(AzureConnection, "send", flaky)
    faults[:] = [AzureResponseError(503, "ServerBusy", "busy", "r1"),
                 urllib3.exceptions.ProtocolError("Connection aborted.", ConnectionResetError(104, "reset"))]
    store.write_file("x.json", b"1")
    assert len(calls) == 3 and store.read_file("x.json") == b"1"
    faults[:] = [AzureResponseError(500, "InternalError", "oops", f"r{i}") for i in range(4)]
    with pytest.raises(TransientStorageError, match=r"x.json: HTTP 500 InternalError: oops; x-ms-request-id r3"):
        store.read_file("x.json")
    faults[:] = [AzureResponseError(400, "InvalidHeaderValue", "bad", "r9")]
    calls.clear()
    with pytest.raises(StorageError, match="InvalidHeaderValue") as info:
        store.read_file("x.json")
    assert len(calls) == 1 and not isinstance(info.value, TransientStorageError)  # not retried


def test_a_silent_endpoint_times_out_within_the_deadline() -> None:
    """An endpoint that accepts connections and never answers: the request
    ends within its deadline with an error naming the endpoint, the blob and
    the settings, and the next request is not sent at all."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}/{ACCOUNT}"
        options = AzureOptions(endpoint=endpoint, connect_timeout=0.5, read_timeout=0.5, request_deadline=1.5)
        store = AzureStore(f"az://{CONTAINER}/quiet", IOConfig(), {"account_name": DEV_ACCOUNT, "account_key": DEV_KEY},
                           options)
        started = time.monotonic()
        with pytest.raises(StorageTimeoutError, match=f"{endpoint} did not answer in time reading az://{CONTAINER}/"
                           f"quiet/meta.json.*read_timeout=0.5 s.*request_deadline=1.5 s") as info:
            store.read_file("meta.json")
        elapsed = time.monotonic() - started
        assert elapsed < 3.0, elapsed
        assert isinstance(info.value, TimeoutError)
        started = time.monotonic()
        with pytest.raises(StorageTimeoutError, match="not sent"):
            store.write_file("other.json", b"{}")
        assert time.monotonic() - started < 0.2
    clear_azure_connections()


def test_azurite_stopped_mid_upload_fails_bounded_typed_and_commits_nothing(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A save whose endpoint stops after its first staged block: the save
    fails within ~2 request deadlines with a dcp_ext error naming the blob;
    after a restart (same data on disk) nothing of it is committed, and its
    staged block is listed as an incomplete upload and can be discarded.

    One block in flight at a time: Azurite saves its metadata when it stops
    only once every connection is idle (a connection busy at SIGTERM keeps
    it open for its 5 s keep-alive, and our 5 s grace then kills it unsaved)."""
    server = start_azurite(tmp_path / "azurite")
    try:
        server.create_container(CONTAINER)
        options = AzureOptions(block_size=1 << 20, max_concurrency=1, connect_timeout=1, read_timeout=2,
                               request_deadline=4)
        where = Location(f"az://{CONTAINER}/dying/step1_partial", server.storage_options(), IOConfig(), options)
        state = {f"w{i}": torch.randn(512, 512) for i in range(6)}  # 6 MiB: blocks of 1 MiB
        send = AzureConnection.send
        blocks: list[str] = []
        stopped: list[float] = []

        def dying(self: AzureConnection, method: str, container: str, blob: str = "", **kwargs: Any) -> Any:
            query = kwargs.get("query") or {}
            if query.get("comp") == "block":
                blocks.append(blob)
                if len(blocks) == 2:
                    server.stop()  # SIGTERM: Azurite saves and exits; later connections are refused
                    stopped.append(time.monotonic())
            return send(self, method, container, blob, **kwargs)

        monkeypatch.setattr(AzureConnection, "send", dying)
        with pytest.raises(BaseException) as info:
            dcp_ext.save(state, where)
        elapsed = time.monotonic() - stopped[0]
        error = dcp_ext.errors.unwrap_checkpoint_exception(info.value)
        assert isinstance(error, StorageError), repr(error)
        assert "dying/step1_partial/" in str(error) and ".distcp" in str(error), str(error)
        assert elapsed < 2 * options.request_deadline + 2, elapsed
        monkeypatch.setattr(AzureConnection, "send", send)
        server.restart()
        clear_azure_connections()  # the connection remembers the dead endpoint for a few seconds
        committed = server.blob_names(CONTAINER, "dying/")
        assert not any(n.endswith((".distcp", "dcp_ext.metadata.json", ".metadata")) for n in committed), committed
        store = where.open()
        pending = store.list_incomplete_uploads()
        assert pending and all(p.name.endswith(".distcp") for p in pending), pending
        for upload in pending:
            store.abort_upload(upload)
        assert store.list_incomplete_uploads() == []
        assert not any(n.endswith(".distcp") for n in server.blob_names(CONTAINER, "dying/", uncommitted=True))
    finally:
        server.stop()
        clear_azure_connections()


def test_two_rank_world_saves_resumes_and_reshards(azurite: AzuriteServer) -> None:
    """One spawned 2-rank gloo world: FSDP2 + Adam saved sharded through
    CheckpointWriter and loaded back; a CheckpointManager with KeepLast(2)
    saving three steps and resuming the newest. Then this process (no
    process group) loads both 2-rank checkpoints into one plain model: bit-exact."""
    root = _root(azurite)
    options = azurite.storage_options()
    out = dist.run_world(2, azure_workers.world, root, options, timeout=180)[0]
    assert out["sharded_diff"] == [] and out["resumed_diff"] == []
    assert out["tags"] == ["step2", "step3"] and out["newest"] == "step3" and out["resumed_tag"] == "step3"
    got = azure_workers.load_into_one_rank(f"{root}/sharded", options, manager=False)
    assert state_diff(out["sharded_ref"], got) == []
    got = azure_workers.load_into_one_rank(f"{root}/managed", options, manager=True)
    assert state_diff(out["managed_ref"], got) == []
    prefix = root.split("/", 3)[3]
    blobs = azurite.blob_names(CONTAINER, f"{prefix}/managed/")
    assert {b.split("/")[2] for b in blobs} == {"newest", "step2_partial", "step3_partial"}, blobs
    data = [b for b in azurite.blob_names(CONTAINER, f"{prefix}/sharded/") if b.endswith(".distcp")]
    assert len(data) == 2 and all(azurite.committed_blocks(CONTAINER, b) > 1 for b in data), data
    assert set(azurite.blob_names(CONTAINER, prefix, uncommitted=True)) == set(azurite.blob_names(CONTAINER, prefix))


def test_racing_saves_of_one_checkpoint_have_exactly_one_winner(azurite: AzuriteServer) -> None:
    """Two processes save tag step1 under one root at the same moment: one
    commits, the other is refused (CheckpointExistsError or
    CheckpointInProgressError), and the checkpoint holds the winner's weights."""
    root = _root(azurite)
    options = azurite.storage_options()
    ctx = dist.context()
    barrier = ctx.Barrier(2)
    outcomes, codes = dist.run_processes(ctx, azure_workers.racer,
                                         [(k, root, options, barrier) for k in (0, 1)], timeout=120)
    assert codes == [0, 0]
    won = [k for k, o in outcomes.items() if o[0] == "won"]
    lost = [o for o in outcomes.values() if o[0] != "won"]
    assert len(won) == 1 and len(lost) == 1, outcomes
    assert lost[0][0] == "lost" and lost[0][1] in ("CheckpointExistsError", "CheckpointInProgressError"), outcomes
    torch.manual_seed(won[0])
    expected = torch.nn.Linear(256, 256)
    loaded = torch.nn.Linear(256, 256)
    CheckpointManager(azure_workers.location(root, options)).resume(loaded)
    assert state_diff(expected.state_dict(), loaded.state_dict()) == []


def test_racing_threads_on_one_store_and_a_lost_answer(azurite: AzuriteServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """create_exclusive whose first attempt created the blob but lost its
    answer: the retry's 409 is recognised as our own blob (True), not another's."""
    config = IOConfig(retry=RetryPolicy(base_delay=0.01))
    store = AzureStore(f"az://{CONTAINER}/{uuid.uuid4().hex[:8]}", config, azurite.storage_options())
    send = AzureConnection.send
    lost = threading.Event()

    def answer_lost(self: AzureConnection, method: str, container: str, blob: str = "", **kwargs: Any) -> Any:
        response = send(self, method, container, blob, **kwargs)
        if (kwargs.get("headers") or {}).get("If-None-Match") == "*" and not lost.is_set():
            lost.set()
            raise urllib3.exceptions.ProtocolError("Connection aborted.", ConnectionResetError(104, "reset"))
        return response

    monkeypatch.setattr(AzureConnection, "send", answer_lost)
    assert store.create_exclusive("lock", b"mine") is True and lost.is_set()
    assert store.create_exclusive("lock", b"theirs") is False
    assert azurite.get_blob(CONTAINER, store.blob("lock")) == b"mine"


def test_errors_pickle_for_dcp(azurite: AzuriteServer) -> None:
    """DCP sends rank errors to the coordinator with pickle: ours survive it."""
    import pickle

    store = Location(f"az://{CONTAINER}/p", azurite.storage_options()).open()
    try:
        store.read_file("nope")
    except DcpExtError as err:
        again = pickle.loads(pickle.dumps(err))
        assert type(again) is type(err) and str(again) == str(err)
