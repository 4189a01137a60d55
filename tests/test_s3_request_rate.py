"""S3 request-rate safety (issue 16): data files under key prefixes, the
adaptive client-side rate limiter, and the fault proxy's per-prefix rate limit.

The multi-rank world saves through a proxy that enforces a request rate per
key prefix as S3 does, loads back, reshards to one process, and runs the CLI
and retention on what it wrote.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import dcp_ext
from dcp_ext import IOConfig, RetryPolicy
from dcp_ext.layout import key_prefix, spread_name
from dcp_ext.storage import open_store
from dcp_ext.storage._rate_limit import AdaptiveRateLimiter, PrefixRateLimiters, key_prefix_of
from dcp_ext.storage._s3_client import get_connection
from dcp_ext.tiers import is_replicated_file
from tests.support.backends import BUCKET
from tests.support.fault_proxy import FaultPlan, FaultProxy, PrefixRateLimit, prefix_of

MiB = 1024 * 1024
HEX_DIR = set("0123456789abcdef")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``dcp-ext ARGS`` in this process (as tests/test_cli.py runs it)."""
    from dcp_ext.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


# -- naming -------------------------------------------------------------------------


def test_key_prefixes_are_dealt_out_with_the_first_character_changing_fastest() -> None:
    assert [key_prefix(i, 256) for i in (0, 1, 2, 15, 16, 17, 255, 256)] == [
        "00", "10", "20", "f0", "01", "11", "ff", "00"]
    assert [key_prefix(i, 16) for i in (0, 9, 15, 16)] == ["0", "9", "f", "0"]
    assert key_prefix(99, 100) == "36" and key_prefix(0, 1) == "0"
    assert len({key_prefix(i, 4096) for i in range(4096)}) == 4096  # no two of the first `count` share one
    assert spread_name("model_rank3.distcp", 3, 256) == "30/model_rank3.distcp"
    assert spread_name("model_rank3.distcp", 3, 0) == "model_rank3.distcp"
    with pytest.raises(ValueError):
        key_prefix(0, 0)
    with pytest.raises(ValueError, match="key_prefixes"):
        IOConfig(key_prefixes=-1)
    assert is_replicated_file("30/replicated_rank0.distcp") and not is_replicated_file("replicated/model_rank0.distcp")


# -- the limiter, on a fake clock -----------------------------------------------------


class _Clock:
    """Time that moves only when a test (or a limiter's sleep) moves it."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _limiter(clock: _Clock, **settings: Any) -> AdaptiveRateLimiter:
    return AdaptiveRateLimiter(clock=clock, sleep=clock.sleep, **settings)


def _succeed(limiter: AdaptiveRateLimiter, clock: _Clock, count: int, every: float) -> None:
    for _ in range(count):
        limiter.succeeded(limiter.acquire())
        clock.now += every


def test_limiter_is_free_until_a_throttle_then_cuts_from_the_accepted_rate() -> None:
    clock = _Clock()
    limiter = _limiter(clock, growth=0.0)  # the rate stays where the cut put it
    _succeed(limiter, clock, 20, every=0.025)  # 40/s accepted over 0.5 s
    assert clock.slept == [] and limiter.stats().rate is None
    sent = limiter.acquire()
    assert limiter.throttled(sent)
    stats = limiter.stats()
    assert stats.rate == pytest.approx(0.7 * 40) and stats.cuts == 1 and stats.throttles == 1
    # Requests now go 1/28 s apart, the first a full interval after the cut.
    cut_at = clock.now
    first, second = limiter.acquire(), limiter.acquire()
    assert first - cut_at == pytest.approx(1 / 28) and second - first == pytest.approx(1 / 28)
    assert sum(clock.slept) == pytest.approx(second - cut_at)
    assert limiter.stats().waited == pytest.approx(2 / 28)


def test_limiter_cuts_once_per_event_and_only_downwards() -> None:
    clock = _Clock()
    limiter = _limiter(clock)
    _succeed(limiter, clock, 20, every=0.025)
    in_flight = [limiter.acquire() for _ in range(4)]  # sent before the throttle comes back
    assert limiter.throttled(in_flight[0])
    rate = limiter.stats().rate
    assert not any(limiter.throttled(sent) for sent in in_flight[1:])  # the same event
    assert limiter.stats().rate == rate and limiter.stats().throttles == 4 and limiter.stats().cuts == 1
    # Throttles of requests sent after the cut cut again, from the accepted
    # rate: the pace stays near 0.7 x accepted instead of compounding 0.7^n.
    for _ in range(3):
        clock.now += 0.01
        assert limiter.throttled(limiter.acquire())
    assert limiter.stats().rate == pytest.approx(0.7 * 20 / clock_span(clock, 1000.0), rel=0.02)
    # A throttle never raises the pace: with the accepted rate now far above
    # it (responses of earlier requests), nothing changes.
    before = limiter.stats()
    for _ in range(40):
        limiter.succeeded(clock.now - 0.3)
    assert not limiter.throttled(limiter.acquire())
    assert limiter.stats().cuts == before.cuts


def clock_span(clock: _Clock, first: float) -> float:
    return min(1.0, clock.now - first)


def test_limiter_recovers_and_probes_faster_the_longer_it_is_not_throttled() -> None:
    clock = _Clock()
    limiter = _limiter(clock, growth=0.5, probe=1e9)  # linear growth only
    _succeed(limiter, clock, 20, every=0.025)
    limiter.throttled(limiter.acquire())
    cut_at = clock.now
    clock.now = cut_at + 0.6  # (1 - beta) / growth: back to the accepted rate
    assert limiter.stats().rate == pytest.approx(40.0)
    other = _Clock()
    probing = _limiter(other, growth=0.5, probe=0.5)
    _succeed(probing, other, 20, every=0.025)
    probing.throttled(probing.acquire())
    other.now += 1.0
    assert probing.stats().rate == pytest.approx(28 + 0.5 * 40 * 1.0 * (1 + (1.0 / 0.5) ** 2))
    clock.now = cut_at + 2.0
    assert limiter.stats().rate == pytest.approx(28 + 0.5 * 40 * 2)
    # 10 successes in the last second: the next throttle cuts to 0.7 * 10/s.
    _succeed(limiter, clock, 10, every=0.09)
    assert limiter.throttled(limiter.acquire())
    assert limiter.stats().rate == pytest.approx(7.0, rel=0.1)


def test_a_starved_client_is_cut_from_what_it_sent_and_never_below_the_floor() -> None:
    clock = _Clock()
    limiter = _limiter(clock)
    for _ in range(30):  # 30 sent in 0.3 s, none accepted: others took the prefix's tokens
        limiter.acquire()
        clock.now += 0.01
    assert limiter.throttled(clock.now - 0.001)
    assert limiter.stats().rate == pytest.approx(0.7 * 0.5 * 30 / 0.3, rel=0.05)
    floor = _limiter(_Clock(), min_rate=5.0)  # one request sent: 0.7 * 0.5 * 1 / 0.1 s would be 3.5/s
    assert floor.throttled(floor.acquire())
    assert floor.stats().rate == pytest.approx(5.0)
    with pytest.raises(ValueError):
        AdaptiveRateLimiter(beta=1.0)


def test_prefix_limiters_are_one_per_prefix_and_shared() -> None:
    limiters = PrefixRateLimiters(label="s3://b/")
    a = limiters.for_key("ck/t_partial/00/model_rank0.distcp")
    assert a is limiters.for_key("ck/t_partial/00/optimizer_rank0.distcp")
    assert a is not limiters.for_key("ck/t_partial/10/model_rank1.distcp")
    assert key_prefix_of("ck/t_partial/x") == "ck/t_partial" and key_prefix_of("top") == ""
    assert a.name == "s3://b/ck/t_partial/00/"
    assert set(limiters.stats()) == {"ck/t_partial/00", "ck/t_partial/10"}


# -- the proxy's per-prefix rate -------------------------------------------------------


def test_proxy_enforces_a_request_rate_per_prefix(moto_server) -> None:
    import botocore.exceptions

    run = f"proxy-rate-{uuid.uuid4().hex[:8]}"
    assert prefix_of("PUT", f"/{BUCKET}/{run}/x/a%20b?partNumber=1") == f"{BUCKET}/{run}/x"
    assert prefix_of("GET", f"/{BUCKET}?list-type=2&prefix={run}%2Fx%2F") == f"{BUCKET}/{run}/x"
    assert prefix_of("HEAD", f"/{BUCKET}") == BUCKET
    with FaultProxy(moto_server.endpoint_url, rate_limit=PrefixRateLimit(rate=5, burst=3)) as proxy:
        # dcp_ext's own botocore client: no retries of its own.
        client = get_connection(moto_server.storage_options(endpoint_url=proxy.endpoint_url), IOConfig()).client
        outcomes = []
        for i in range(8):
            try:
                client.put_object(Bucket=BUCKET, Key=f"{run}/x/{i}", Body=b"x")
                outcomes.append("ok")
            except botocore.exceptions.ClientError as err:
                assert err.response["ResponseMetadata"]["HTTPStatusCode"] == 503
                assert err.response["Error"]["Code"] == "SlowDown"
                assert "reduce your request rate" in err.response["Error"]["Message"]
                outcomes.append("throttled")
        client.put_object(Bucket=BUCKET, Key=f"{run}/y/0", Body=b"y")  # another prefix: its own bucket
        time.sleep(0.45)  # two tokens back
        client.put_object(Bucket=BUCKET, Key=f"{run}/x/again", Body=b"x")
        stats = proxy.prefix_stats()
    assert outcomes[:3] == ["ok"] * 3 and outcomes.count("throttled") >= 4, outcomes
    x = stats[f"{BUCKET}/{run}/x"]
    assert x.requests == 9 and x.throttled == outcomes.count("throttled")
    assert stats[f"{BUCKET}/{run}/y"].throttled == 0
    # Throttled requests never reached the server.
    keys = [o["Key"] for o in moto_server.boto3_client().list_objects_v2(Bucket=BUCKET, Prefix=run)["Contents"]]
    assert len(keys) == outcomes.count("ok") + 2


def test_a_store_paces_a_throttled_prefix(moto_server) -> None:
    """Eight threads writing 40 small files to one prefix limited to 20/s: the
    store's limiter cuts in, the writes all succeed, few requests are refused."""
    config = IOConfig(retry=RetryPolicy(max_attempts=8, base_delay=0.01, max_delay=0.1))
    with FaultProxy(moto_server.endpoint_url, rate_limit=PrefixRateLimit(rate=20, burst=2)) as proxy:
        store = open_store(f"s3://{BUCKET}/paced-{uuid.uuid4().hex[:8]}/ck", config,
                           moto_server.storage_options(endpoint_url=proxy.endpoint_url))
        store.ensure_root()
        names = iter(range(40))
        lock = threading.Lock()

        def write() -> None:
            while True:
                with lock:
                    n = next(names, None)
                if n is None:
                    return
                store.write_file(f"30/f{n}", b"x" * 100)

        start = time.monotonic()
        threads = [threading.Thread(target=write) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        elapsed = time.monotonic() - start
        limited = store.rate_limit_stats()[f"{store.prefix}/30"]  # type: ignore[attr-defined]
        seen = proxy.prefix_stats()[f"{BUCKET}/{store.prefix}/30"]  # type: ignore[attr-defined]
    requests, throttled = seen.requests, seen.throttled
    assert limited.cuts >= 1 and limited.throttles == throttled and limited.requests == requests
    assert sorted(store.list_tree()) == sorted(f"30/f{n}" for n in range(40))
    assert elapsed >= (40 - 2) / 20 * 0.9, elapsed  # nobody beats the rate
    assert throttled <= 0.3 * requests, (throttled, requests)


def test_a_prefix_that_refuses_everything_fails_after_the_paced_attempts(moto_server) -> None:
    """Throttles are retried, paced, up to PACED_ATTEMPTS_FACTOR x max_attempts
    times (a shared prefix refuses a request several times in a row by bad
    luck), then the save fails with S3's error and aborts its upload."""
    from dcp_ext.storage._retry import PACED_ATTEMPTS_FACTOR

    def is_put(method: str, path: str) -> bool:
        return method == "PUT"

    config = IOConfig(retry=RetryPolicy(max_attempts=1, base_delay=0.01, max_delay=0.02))
    with FaultProxy(moto_server.endpoint_url, FaultPlan(rate=1.0, faults=("slowdown",), match=is_put)) as proxy:
        store = open_store(f"s3://{BUCKET}/refused-{uuid.uuid4().hex[:8]}/ck", config,
                           moto_server.storage_options(endpoint_url=proxy.endpoint_url))
        start = time.monotonic()
        with pytest.raises(dcp_ext.StorageError, match="SlowDown"):
            store.write_file("f", b"x")
        elapsed = time.monotonic() - start
        puts = [entry for entry in proxy.log if entry.method == "PUT"]
    assert len(puts) == 1 * PACED_ATTEMPTS_FACTOR
    assert elapsed < 10, elapsed
    assert store.rate_limit_stats()[store.prefix].cuts >= 2  # type: ignore[attr-defined]


# -- stores with sub-directories -------------------------------------------------------


@pytest.mark.parametrize("kind", ["memory", "local", "moto"])
def test_stores_list_and_delete_files_under_key_prefixes(kind: str, make_backend) -> None:
    backend = make_backend(kind)
    store = open_store(backend.url("tree"), IOConfig(), backend.storage_options)
    store.ensure_root()
    for name in ("a.distcp", "00/b.distcp", "10/c.distcp"):
        with store.open_writer(name) as writer:
            writer.write(name.encode())
            writer.commit()
    assert store.list_names() == ["a.distcp"]
    assert {"00", "10"} <= set(store.list_dirs())
    assert store.list_tree() == ["00/b.distcp", "10/c.distcp", "a.distcp"]
    assert store.read_file("10/c.distcp") == b"10/c.distcp"
    for name in store.list_tree():
        store.delete(name)
    store.remove_root_if_empty()
    assert store.list_tree() == []
    if kind == "local":
        assert not Path(store.url).exists()  # the emptied key-prefix directories went too


def test_local_saves_under_key_prefixes_retention_leftovers_and_cli(tmp_path: Path) -> None:
    root = tmp_path / "root"
    config = IOConfig(key_prefixes=16, fsync=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 32)).sum().backward()
    optim.step()
    # What a crashed save left: data under a key prefix, no metadata, its save
    # lock (dcp_ext's mark) from a host that stopped renewing it two hours ago.
    (root / "z_partial" / "00").mkdir(parents=True)
    (root / "z_partial" / "00" / "model_rank0.distcp").write_bytes(b"partial")
    (root / "z_partial" / ".dcp_ext.saving").write_text(json.dumps(
        {"save_id": "crashed", "started": time.time() - 7200, "host": "elsewhere", "pid": 1}))
    manager = dcp_ext.CheckpointManager(root, config=config)
    for tag in ("a", "b", "c"):
        manager.save(tag, model, optim, num_kept_partial_checkpoints=1)
    assert sorted(p.name for p in root.iterdir()) == ["c_partial", "newest"]  # a, b and z gone, dirs and all
    tree = sorted(str(p.relative_to(root / "c_partial")) for p in (root / "c_partial").rglob("*") if p.is_file())
    data = [n for n in tree if n.endswith(".distcp")]
    assert data and all("/" in n and set(n.split("/")[0]) <= HEX_DIR for n in data), tree
    fresh = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    dcp_ext.CheckpointManager(root).resume(fresh)  # no setting needed to load
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    listed = _cli("ls", str(root))
    assert listed.returncode == 0 and "committed" in listed.stdout, listed
    verified = _cli("verify", str(root / "c_partial"))
    assert verified.returncode == 0, verified.stdout + verified.stderr

    # dcp_ext.save with DCP's default planner: the writer's own names, spread too;
    # an overwrite removes stale data and temporary files under the prefixes.
    path = tmp_path / "plain"
    (path / "70").mkdir(parents=True)
    (path / "70" / "__7_0.distcp").write_bytes(b"stale")
    (path / "00").mkdir()
    (path / "00" / "__0_0.distcp.dcp_ext-tmp-123456789abc").write_bytes(b"crash")
    dcp_ext.save({"w": torch.arange(10.0)}, path, config=config, overwrite=True)
    assert sorted(str(p.relative_to(path)) for p in path.rglob("*.distcp*")) == ["0/__0_0.distcp"]


def test_a_tiered_save_spreads_its_files_on_both_tiers(tmp_path: Path, moto_server) -> None:
    root = f"s3://{BUCKET}/tiered-{uuid.uuid4().hex[:8]}"
    model = torch.nn.Sequential(torch.nn.Linear(16, 4))
    manager = dcp_ext.CheckpointManager(root, storage_options=moto_server.storage_options(),
                                        config=IOConfig(key_prefixes=16, fsync=False),
                                        local_tier=tmp_path / "tier", persist_every=1)
    try:
        manager.save("a", model)
        manager.wait_for_persist()
        fresh = torch.nn.Sequential(torch.nn.Linear(16, 4))
        manager.resume(fresh)
        assert manager.last_restore_plan is not None and manager.last_restore_plan.local_complete
    finally:
        manager.close()
    assert torch.equal(fresh[0].weight, model[0].weight)
    keys = [o["Key"] for o in moto_server.boto3_client().list_objects_v2(
        Bucket=BUCKET, Prefix=root.split("/", 3)[3])["Contents"]]
    assert any(k.endswith("a_partial/0/replicated_rank0.distcp") for k in keys), keys
    assert (tmp_path / "tier" / "a_partial" / "0" / "replicated_rank0.distcp").is_file()


# -- a real world through the rate-limited proxy ---------------------------------------


def _world(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """(each rank) Save 3 tags with key prefixes (keeping 2) and one without,
    resume the newest into a fresh model; rank 0 returns the full model state."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from tests.support.dist_workers import app_state, local_leaves, make_fsdp

    model, optim = make_fsdp(world_size, seed=0)
    retry = RetryPolicy(max_attempts=10, base_delay=0.01, max_delay=0.2)
    config = IOConfig(key_prefixes=256, max_concurrency=4, retry=retry, fsync=False)
    manager = dcp_ext.CheckpointManager(spec["root"], storage_options=spec["proxied"], config=config)
    for tag in ("a", "b", "c"):
        manager.save(tag, model, optim, user_content={"tag": tag}, num_kept_partial_checkpoints=2)
    flat = dcp_ext.CheckpointManager(spec["flat"], storage_options=spec["proxied"],
                                     config=dataclasses.replace(config, key_prefixes=0))
    flat.save("a", model, optim)
    expected = local_leaves(app_state(model, optim))
    fresh_model, fresh_optim = make_fsdp(world_size, seed=99)
    loaded = dcp_ext.CheckpointManager(spec["root"], storage_options=spec["proxied"], config=config)
    result = loaded.resume(fresh_model, fresh_optim)
    got = local_leaves(app_state(fresh_model, fresh_optim))
    exact = got.keys() == expected.keys() and all(
        torch.equal(v, got[k]) if isinstance(v, torch.Tensor) else v == got[k] for k, v in expected.items())
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    dist.barrier()
    return {"tag": result.tag, "user_content": result.user_content, "exact": exact,
            "full": full if rank == 0 else None}


def test_a_two_rank_save_through_a_per_prefix_rate_limit(moto_server) -> None:
    from tests.support.dist import run_world
    from tests.support.dist_workers import make_model

    run = f"ratelimited-{uuid.uuid4().hex[:8]}"
    root, flat = f"s3://{BUCKET}/{run}/keyed", f"s3://{BUCKET}/{run}/flat"
    direct = moto_server.storage_options()
    # 8 requests/s per prefix, 2 at once: 26-29 of ~165 requests throttled in three runs (one with three CPU
    # burners beside it). At 20/s with 4 at once it was 5 on a quiet machine and 0 in a slow suite run.
    with FaultProxy(moto_server.endpoint_url, rate_limit=PrefixRateLimit(rate=8, burst=2)) as proxy:
        spec = {"root": root, "flat": flat, "proxied": moto_server.storage_options(endpoint_url=proxy.endpoint_url)}
        reports = run_world(2, _world, spec, timeout=180)
        counted = proxy.prefix_stats()
    assert [r["tag"] for r in reports] == ["c", "c"] and reports[0]["user_content"] == {"tag": "c"}
    assert all(r["exact"] for r in reports), "the 2-rank resume differs from the saved state"
    assert sum(s.throttled for s in counted.values()) > 0, counted  # the limit was met and lived with

    # Where the files are: each data file under its own key prefix; the flat save under SageMaker's names.
    listing = moto_server.boto3_client().list_objects_v2(Bucket=BUCKET, Prefix=f"{run}/")
    keys = sorted(o["Key"][len(run) + 1:] for o in listing["Contents"])
    keyed = [k for k in keys if k.startswith("keyed/")]
    assert not [k for k in keyed if k.startswith("keyed/a_partial/")], keyed  # retention left nothing of "a"
    data = [k for k in keyed if k.startswith("keyed/c_partial/") and k.endswith(".distcp")]
    assert sorted(data) == ["keyed/c_partial/00/model_rank0.distcp", "keyed/c_partial/10/optimizer_rank0.distcp",
                            "keyed/c_partial/20/model_rank1.distcp", "keyed/c_partial/30/optimizer_rank1.distcp"]
    assert sorted(k for k in keys if k.startswith("flat/a_partial/") and k.endswith(".distcp")) == [
        "flat/a_partial/model_rank0.distcp", "flat/a_partial/model_rank1.distcp",
        "flat/a_partial/optimizer_rank0.distcp", "flat/a_partial/optimizer_rank1.distcp"]
    used = {p for p in counted if p.startswith(f"{BUCKET}/{run}/keyed/c_partial/")}
    assert len(used) == 4, sorted(counted)  # each file's requests went to its own prefix
    assert moto_server.boto3_client().list_multipart_uploads(Bucket=BUCKET, Prefix=run).get("Uploads", []) == []

    # One process loads the 2-rank checkpoint (resharded) with no setting.
    model = make_model(seed=5)
    dcp_ext.CheckpointManager(root, storage_options=direct).resume(model)
    full = reports[0]["full"]
    assert full.keys() == model.state_dict().keys()
    assert all(torch.equal(full[k], v) for k, v in model.state_dict().items())

    options = ["--storage-options", json.dumps(direct)]
    listed = _cli("ls", root, *options)
    assert listed.returncode == 0, listed.stderr
    assert [line.split()[0] for line in listed.stdout.splitlines()[1:]] == ["b", "c"]
    verified = _cli("verify", f"{root}/c_partial", *options)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "4 files" in verified.stdout, verified.stdout
    pruned = _cli("prune", root, "--keep", "1", *options)
    assert pruned.returncode == 0, pruned.stderr
    remaining = moto_server.boto3_client().list_objects_v2(Bucket=BUCKET, Prefix=f"{run}/keyed/b_partial/")
    assert remaining.get("KeyCount", 0) == 0, remaining.get("Contents")


def test_the_default_keeps_sagemaker_names(tmp_path: Path) -> None:
    assert IOConfig().key_prefixes == 0 and IOConfig.from_env().key_prefixes == 0
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DCP_EXT_KEY_PREFIXES", "64")
        assert IOConfig.from_env().key_prefixes == 64
    model = torch.nn.Linear(4, 4)
    dcp_ext.save_checkpoint(tmp_path, "t", model)
    dcp_ext.close_checkpoints()
    names = sorted(os.listdir(tmp_path / "t_partial"))
    assert "model_rank0.distcp" in names and not any((tmp_path / "t_partial" / n).is_dir() for n in names)
