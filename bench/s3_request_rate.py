"""S3 request-rate safety (issue 16): ``python -m bench.s3_request_rate``.

Four gloo ranks on CPU save an FSDP2 model through ``CheckpointManager`` to
a moto S3 server behind ``tests/support/fault_proxy.py``, which enforces S3's
per-prefix request rate scaled down: each key prefix (the key up to its last
``/``) accepts ``--rate`` requests per second (default 100; S3: 3,500 writes
per partition), a token bucket of ``--burst`` requests (default a tenth of a
second's worth), and answers the rest with ``503 SlowDown``.

Each rank's shard of the model is ``--parts`` (default 64) parts of
``--part-size`` (default 64 KiB): one data file of 64 multipart parts (and a
short 65th with the file's trailer) per rank. Parts are that small so that
requests, not bytes, are the work, as for a save of thousands of ranks with
16 MiB parts on S3; moto is started with ``S3_UPLOAD_PART_MIN_SIZE`` lowered
and the ranks use an ``IOConfig`` without the 5 MiB check.

Systems (the same save of the same state):

* **SageMaker names** (the default): every rank's file in ``{tag}_partial/``,
  one prefix; adaptive client-side rate limiting;
* **key prefixes**: ``IOConfig(key_prefixes=256)``, each rank's file under
  its own prefix (``{tag}_partial/10/model_rank1.distcp``); rate limiting too;
* with ``--reference``: **SageMaker names, no limiter**, the client as it was
  before the limiter (no pacing; throttles retried like any transient error,
  with exponential backoff and ``max_attempts``), for comparison.

Per round one spawned world saves with every system, the order rotating from
round to round, each save to its own root; every rank passes a barrier, then
times ``manager.save``; a save's time is from the first rank's start to the
last rank's end. The proxy counts requests (retries included) and throttles
per prefix, attributed to a save by its root. Afterwards, untimed, each rank
loads every checkpoint straight from moto (not through the proxy) and checks
it bit for bit. Medians over ``--rounds`` (default 3), with min-max; the
speedup is per round.

``--simulate`` runs instead the threaded simulation quoted in
:mod:`dcp_ext.storage._rate_limit` (no servers, no torch): 4 clients of 8
threads, 65 requests each taking 15 ms, against one 100 requests/s token
bucket shared or one each.

Results: ``bench/results/s3-request-rate-<date>.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from dcp_ext import IOConfig

KiB = 1024
BUCKET = "dcp-ext-bench"
PREFIXES = 256
LABELS = {
    "sagemaker": "SageMaker names",
    "prefixes": f"key prefixes ({PREFIXES})",
    "unlimited": "SageMaker names, no limiter",
}


@dataclasses.dataclass(frozen=True)
class SmallPartConfig(IOConfig):
    """``IOConfig`` without S3's 5 MiB part minimum (moto is started to accept smaller parts)."""

    def __post_init__(self) -> None:
        IOConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "part_size"})


def _model(world_size: int, rows: int, cols: int, seed: int) -> Any:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(cols, rows * world_size, bias=False))
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    return model


def _leaves(model: Any) -> dict[str, Any]:
    return {k: v.to_local().clone() for k, v in model.state_dict().items()}


def _unlimited() -> Any:
    """Make S3 stores the client before the limiter: no pacing, and throttles
    retried like any transient error (exponential backoff, ``max_attempts``).
    Returns the undo."""
    from unittest import mock

    from dcp_ext.storage import s3

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(s3.S3Store, "paced", lambda self, key, attempt: attempt))
    stack.enter_context(mock.patch.object(s3, "is_throttling_s3_error", lambda err: False))
    return stack.close


def _round(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """(each rank) Save with every system in ``spec["order"]``, then check every load."""
    import torch
    import torch.distributed as dist

    import dcp_ext

    rows = spec["parts"] * spec["part_size"] // (4 * spec["cols"])
    model = _model(world_size, rows, spec["cols"], seed=spec["round"])
    report: dict[str, Any] = {}
    for system in spec["order"]:
        config = SmallPartConfig(part_size=spec["part_size"], key_prefixes=PREFIXES if system == "prefixes" else 0)
        manager = dcp_ext.CheckpointManager(spec["roots"][system], storage_options=spec["proxied"], config=config)
        undo = _unlimited() if system == "unlimited" else None
        dist.barrier()
        start = time.monotonic()
        error = None
        try:
            manager.save("t1", model)
        except Exception as err:  # noqa: BLE001 - reported (the reference client may give up)
            error = f"{type(err).__name__}: {err}"
        end = time.monotonic()
        if undo is not None:
            undo()
        report[system] = {"start": start, "end": end, "error": error}
        manager.close()
    expected = _leaves(model)
    for system in spec["order"]:
        if report[system]["error"] is not None:
            report[system]["exact"] = False
            continue
        fresh = _model(world_size, rows, spec["cols"], seed=1000)
        manager = dcp_ext.CheckpointManager(spec["roots"][system], storage_options=spec["direct"],
                                            config=SmallPartConfig(part_size=spec["part_size"]))
        manager.resume(fresh)
        loaded = _leaves(fresh)
        report[system]["exact"] = all(torch.equal(loaded[k], v) for k, v in expected.items())
        manager.close()
    return report


def _stats_for(prefix_stats: dict[str, Any], root_key: str) -> dict[str, Any]:
    mine = {p: s for p, s in prefix_stats.items() if p == root_key or p.startswith(root_key + "/")}
    requests = sum(s.requests for s in mine.values())
    throttled = sum(s.throttled for s in mine.values())
    return {
        "requests": requests,
        "throttled": throttled,
        "throttled_pct": 100.0 * throttled / requests if requests else 0.0,
        "prefixes": {p[len(root_key):] or "/": dataclasses.asdict(s) for p, s in mine.items()},
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tests.support.dist import run_world
    from tests.support.fault_proxy import FaultProxy, PrefixRateLimit
    from tests.support.s3_servers import isolated_aws_env, start_moto, start_seaweedfs

    systems = ("sagemaker", "prefixes", *(("unlimited",) if args.reference else ()))
    rounds: list[dict[str, Any]] = []
    limit = PrefixRateLimit(args.rate, args.burst)
    with tempfile.TemporaryDirectory(prefix="bench-s3-rate-") as tmp, isolated_aws_env():
        if args.server == "seaweedfs":
            if args.part_size < 5 * 1024 * KiB:
                raise SystemExit(
                    "SeaweedFS refuses multipart parts under 5 MiB when an upload completes (EntityTooSmall, "
                    "as S3 does): use --part-size 5242880 or more with --server seaweedfs"
                )
            server = start_seaweedfs(tmp)  # Go: far less CPU per request than moto
        else:
            server = start_moto(tmp, env={"S3_UPLOAD_PART_MIN_SIZE": str(args.part_size)})
        try:
            server.create_bucket(BUCKET)
            with FaultProxy(server.endpoint_url, rate_limit=limit) as proxy:
                run_id = uuid.uuid4().hex[:8]
                for number in range(args.rounds):
                    shift = number % len(systems)
                    order = systems[shift:] + systems[:shift]
                    keys = {s: f"rate-{run_id}/{s}-r{number}" for s in systems}
                    spec = {
                        "round": number, "order": order, "parts": args.parts, "part_size": args.part_size,
                        "cols": 256,
                        "roots": {s: f"s3://{BUCKET}/{k}" for s, k in keys.items()},
                        "proxied": server.storage_options(endpoint_url=proxy.endpoint_url),
                        "direct": server.storage_options(),
                    }
                    proxy.reset_log()
                    reports = run_world(args.ranks, _round, spec, timeout=900)
                    counted = proxy.prefix_stats()
                    result: dict[str, Any] = {"round": number, "order": list(order)}
                    for system in systems:
                        starts = [r[system]["start"] for r in reports]
                        ends = [r[system]["end"] for r in reports]
                        errors = sorted({r[system]["error"] for r in reports if r[system]["error"]})
                        result[system] = {
                            "seconds": max(ends) - min(starts),
                            "rank_seconds": [e - s for s, e in zip(starts, ends)],
                            "exact": all(r[system]["exact"] for r in reports),
                            "errors": errors,
                            **_stats_for(counted, f"{BUCKET}/{keys[system]}"),
                        }
                    result["speedup"] = result["sagemaker"]["seconds"] / result["prefixes"]["seconds"]
                    rounds.append(result)
                    print(_round_line(result, systems), flush=True)
        finally:
            server.stop()
    return {
        "benchmark": "s3_request_rate",
        "date": datetime.date.today().isoformat(),
        "machine": {"cores": os.cpu_count(), "python": sys.version.split()[0],
                    "load_average_at_end": os.getloadavg()},
        "settings": {"ranks": args.ranks, "parts_per_rank": args.parts, "part_size": args.part_size,
                     "rate_per_prefix": args.rate, "burst": limit.capacity, "key_prefixes": PREFIXES,
                     "server": ("SeaweedFS" if args.server == "seaweedfs" else "moto (S3_UPLOAD_PART_MIN_SIZE lowered)")
                     + " behind tests/support/fault_proxy.py"},
        "systems": list(systems),
        "rounds": rounds,
        "summary": _summary(rounds, systems),
    }


def _round_line(result: dict[str, Any], systems: tuple[str, ...]) -> str:
    parts = [f"round {result['round']} ({', '.join(result['order'])}):"]
    for system in systems:
        r = result[system]
        failed = f", FAILED: {r['errors'][0][:80]}" if r["errors"] else ""
        parts.append(f"{system} {r['seconds']:.2f} s, {r['requests']} req, {r['throttled_pct']:.1f}% throttled,"
                     f" exact={r['exact']}{failed};")
    parts.append(f"speedup {result['speedup']:.2f}x")
    return " ".join(parts)


def _median_range(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _summary(rounds: list[dict[str, Any]], systems: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for system in systems:
        out[system] = {
            "seconds": _median_range([r[system]["seconds"] for r in rounds]),
            "requests": _median_range([r[system]["requests"] for r in rounds]),
            "throttled_pct": _median_range([r[system]["throttled_pct"] for r in rounds]),
            "exact": all(r[system]["exact"] for r in rounds),
            "failed_rounds": sum(1 for r in rounds if r[system]["errors"]),
        }
    out["speedup"] = _median_range([r["speedup"] for r in rounds])
    return out


def _table(record: dict[str, Any]) -> str:
    summary = record["summary"]

    def fmt(entry: dict[str, float], spec: str, unit: str = "") -> str:
        return f"{entry['median']:{spec}}{unit} ({entry['min']:{spec}}-{entry['max']:{spec}})"

    rows = [["system", "save wall time", "requests", "throttled", "loads exact", "failed saves"]]
    for system in record["systems"]:
        s = summary[system]
        rows.append([LABELS[system], fmt(s["seconds"], ".2f", " s"), fmt(s["requests"], ".0f"),
                     fmt(s["throttled_pct"], ".1f", " %"), str(s["exact"]), str(s["failed_rounds"])])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.append(f"speedup of key prefixes over SageMaker names (per round): {fmt(summary['speedup'], '.2f', 'x')}")
    settings = record["settings"]
    lines.insert(0, f"{settings['ranks']} ranks x {settings['parts_per_rank']} parts of {settings['part_size'] // KiB} KiB,"
                    f" {settings['rate_per_prefix']:.0f} requests/s per prefix (burst {settings['burst']:.0f}),"
                    f" {len(record['rounds'])} rounds; median (min-max)")
    return "\n".join(lines)


# -- the threaded simulation ------------------------------------------------------------


class _Bucket:
    def __init__(self, rate: float, capacity: float) -> None:
        self.rate, self.capacity, self.tokens = rate, capacity, capacity
        self.when = time.monotonic()
        self.lock = threading.Lock()

    def take(self) -> bool:
        with self.lock:
            now = time.monotonic()
            self.tokens = min(self.capacity, self.tokens + (now - self.when) * self.rate)
            self.when = now
            if self.tokens >= 1:
                self.tokens -= 1
                return True
            return False


def _simulate_once(shared: bool, limiter: dict[str, Any] | None, clients: int = 4, requests: int = 65,
                   threads: int = 8, latency: float = 0.015) -> dict[str, float]:
    from dcp_ext.storage._rate_limit import AdaptiveRateLimiter

    buckets = [_Bucket(100, 10)] * clients if shared else [_Bucket(100, 10) for _ in range(clients)]
    sent = throttled = 0
    lock = threading.Lock()
    ends: list[float] = []

    def client(index: int) -> None:
        nonlocal sent, throttled
        pace = AdaptiveRateLimiter(**limiter) if limiter is not None else None
        left = [requests]

        def worker() -> None:
            nonlocal sent, throttled
            while True:
                with lock:
                    if left[0] <= 0:
                        return
                    left[0] -= 1
                attempt = 1
                while True:
                    when = pace.acquire() if pace is not None else time.monotonic()
                    time.sleep(latency)
                    with lock:
                        sent += 1
                    if buckets[index].take():
                        if pace is not None:
                            pace.succeeded(when)
                        break
                    if pace is not None:
                        pace.throttled(when)
                    with lock:
                        throttled += 1
                    time.sleep(random.uniform(0, min(4.0, 0.1 * 2 ** (attempt - 1))))  # RetryPolicy's backoff
                    attempt += 1

        workers = [threading.Thread(target=worker) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        with lock:
            ends.append(time.monotonic())

    start = time.monotonic()
    everyone = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for c in everyone:
        c.start()
    for c in everyone:
        c.join()
    return {"seconds": max(ends) - start, "requests": sent, "throttled_pct": 100.0 * throttled / sent}


def simulate(repeats: int) -> dict[str, Any]:
    variants = {
        "dcp_ext limiter": {},
        "no limiter": None,
        "cut from accepted rate only (sent_share=0)": {"sent_share": 0.0},
        "cut from sent rate (sent_share=1)": {"sent_share": 1.0},
    }
    out: dict[str, Any] = {}
    for name, settings in variants.items():
        for shared in (True, False):
            runs = [_simulate_once(shared, settings) for _ in range(repeats)]
            key = f"{name}, {'one shared bucket' if shared else 'a bucket each'}"
            out[key] = {"seconds": sorted(round(r["seconds"], 2) for r in runs),
                        "throttled_pct": sorted(round(r["throttled_pct"], 1) for r in runs)}
            print(f"{key}: {out[key]['seconds']} s, throttled {out[key]['throttled_pct']} %", flush=True)
    return {"benchmark": "s3_request_rate.simulate", "date": datetime.date.today().isoformat(),
            "setting": "4 clients x 8 threads, 65 requests of 15 ms each, 100 requests/s token buckets of 10",
            "ideal_seconds": {"shared": 2.6, "each": 0.65}, "results": out}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.s3_request_rate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--parts", type=int, default=64, help="multipart parts per rank")
    parser.add_argument("--part-size", type=int, default=64 * KiB)
    parser.add_argument("--rate", type=float, default=100.0, help="requests per second per prefix")
    parser.add_argument("--burst", type=float, default=None, help="token bucket size (default: rate / 10)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--server", choices=("moto", "seaweedfs"), default="moto",
                        help="the S3 server behind the rate-limiting proxy")
    parser.add_argument("--reference", action="store_true", help="also save with SageMaker names and no limiter")
    parser.add_argument("--simulate", action="store_true", help="run the threaded limiter simulation instead")
    parser.add_argument("--out", default=None, help="results JSON (default bench/results/s3-request-rate-<date>.json)")
    args = parser.parse_args(argv)
    if args.simulate:
        record = simulate(args.rounds)
        name = f"s3-request-rate-simulation-{record['date']}.json"
    else:
        record = run(args)
        print(_table(record))
        name = f"s3-request-rate-{record['date']}.json"
    out = Path(args.out or Path(__file__).parent / "results" / name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
