"""Replicated loads, read-once (issue 15): ``python -m bench.replicated``.

Four gloo ranks on CPU load one checkpoint that several ranks need in full or
in part, from local disk and from S3 (SeaweedFS ``weed mini`` on 127.0.0.1,
started as ``python -m bench`` starts it):

* **DDP**: every rank holds the whole state (``bench/harness/state.py``, ``--size``,
  default 1 GiB) as plain tensors and loads all of it: each stored byte is
  needed by 4 ranks.
* **HSDP 2x2**: a ``(2, 2)`` device mesh named ``("replicate", "shard")``,
  every tensor a ``DTensor`` placed ``(Replicate(), Shard(0))``: each rank
  loads half of every tensor, each half is needed by 2 ranks.

Systems (each reads a checkpoint in its own format, saved once per scenario
and storage kind by the same 4-rank world, untimed):

* **dcp_ext read-once**: ``dcp.load(dest, storage_reader=CheckpointReader(url,
  read_once=True), planner=LayoutLoadPlanner())``; a checkpoint saved by
  ``CheckpointWriter``;
* **dcp_ext today**: the same with ``read_once=False`` (every rank reads all
  it needs itself), same checkpoint;
* **torch FileSystemReader** (local) on a ``FileSystemWriter`` checkpoint, and
  **s3torchconnector** ``S3StorageReader`` (S3) on an ``S3StorageWriter``
  checkpoint, both with DCP's default planner, set up as in ``bench/harness/systems.py``
  (the S3 client swapped for one with the SeaweedFS endpoint).

Per load, every rank passes a barrier, then times ``dcp.load`` to its return;
the load's time is the slowest rank's. **Bytes read from storage** are summed
over the ranks:

* dcp_ext: ``reader.store.stats.snapshot().bytes_read`` of each rank's reader
  (every byte its store read: data, metadata, checksums);
* torch FileSystemReader and s3torchconnector: the growth of ``rchar`` in
  ``/proc/self/io`` over the load: bytes the rank's process received through
  ``read``/``pread``/``readv`` system calls (all threads). For local files that
  is what it read from the files (from the page cache or the disk), including
  the read-ahead of torch's buffered file objects that ``torch.load``'s seeks
  within each item discard (~9-10 MB per load of the 355 tensors, measured at
  16 MiB and 256 MiB alike); the
  s3torchconnector CRT client reads its sockets with ``read``, so it is the
  HTTP responses (bodies and headers) plus any file the client opens (a few
  hundred KiB at most, e.g. CA certificates). gloo receives with ``recv``,
  which ``rchar`` does not count (checked: a 100 MB broadcast adds 114 bytes),
  so DCP's plan exchange is not in it. ``rchar`` of every load (dcp_ext too) is
  kept in the results JSON; for dcp_ext on S3 it is near 0 (s3fs's asyncio
  sockets use ``recv``).

*Stored size* is the size of all files/objects of the checkpoint read
(metadata included), so ``bytes / stored`` is 1.0 for a load that reads every
stored byte once, 4.0 for DDP where every rank reads everything.

Page cache: **warm** loads start with every file of the checkpoint (on S3:
every file of the SeaweedFS data directory) read once, untimed, so it is all in
the page cache; **cold** loads (``--local-loads warm,cold``) start after
``sync; echo 3 > /proc/sys/vm/drop_caches`` (root needed). Each load is
verified bit for bit afterwards (untimed). An untimed warm-up load of every
system precedes the rounds (imports, first connections). Rounds: ``--repeats``
(default 3); round 1 runs the systems in the listed order, later rounds in a
seeded shuffled order (the same on every rank); medians with (min-max).

Results: ``bench/results/replicated-<date>.json`` (``--out``) and, with
``--readme``, the ``replicated`` block of bench/README.md.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import math
import os
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dcp_ext.config import parse_size

from .harness.machine import machine_info
from .harness.state import NON_TENSOR, Spec, build_state, local_nbytes, make_spec, reset_dest, verify
from .harness.systems import Ctx, DcpExt, S3TorchConnector, System, TorchFileSystem

MiB = 1 << 20
GiB = 1 << 30
BUCKET = "bench"
WORLD = 4
SCENARIOS = ("ddp", "hsdp")
SCENARIO_TITLES = {
    "ddp": "DDP: 4 ranks, each loads the full state",
    "hsdp": "HSDP 2x2: (Replicate(), Shard(0)), each half needed by 2 ranks",
}
#: Targets of issue 15 (same run).
BYTES_TARGET = 1.05  # read-once bytes read / stored size, replicated 4-rank load
S3_SPEEDUP_TARGET = 2.5  # S3 DDP load: today's time / read-once time
_DROP_CACHES = "/proc/sys/vm/drop_caches"
_PREWARM_CHUNK = 8 * MiB


# -- what each rank runs ---------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One way of loading: ``fmt`` names the checkpoint (format) it reads."""

    name: str
    label: str
    kind: str
    fmt: str
    role: str  # "read_once", "today" or "baseline"


def variants(kind: str) -> list[Variant]:
    """The systems compared on ``kind`` storage, in the order of round 1."""
    base = (
        Variant("torch_fs", "torch FileSystemReader", "local", "torch", "baseline")
        if kind == "local"
        else Variant("s3torchconnector", "s3torchconnector S3StorageReader", "s3", "s3tc", "baseline")
    )
    return [
        Variant("dcp_ext_read_once", "dcp_ext read-once (`read_once=True`)", kind, "dcp_ext", "read_once"),
        Variant("dcp_ext_today", "dcp_ext today (`read_once=False`)", kind, "dcp_ext", "today"),
        base,
    ]


def _format_system(kind: str, fmt: str) -> System:
    """The bench.harness.systems class that saves (and for the baselines loads) ``fmt``."""
    if fmt == "dcp_ext":
        return DcpExt(kind)
    if fmt == "torch":
        return TorchFileSystem(1)
    return S3TorchConnector()


def rchar() -> int:
    """Bytes this process has received through read-type system calls."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def _fill(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    tensor.view(torch.int16).random_(generator=torch.Generator().manual_seed(seed))
    return tensor


def build_replicated(spec: Spec, scenario: str, mesh: Any, fill: bool = True) -> dict[str, Any]:
    """This rank's state dict: ``ddp``, the same full tensors on every rank;
    ``hsdp``, ``DTensor``s placed ``(Replicate(), Shard(0))`` on ``mesh`` (the
    two ranks of a replica group hold the same half)."""
    if scenario == "ddp":
        return build_state(spec, 0, 1, None, fill=fill)
    from torch.distributed.tensor import DTensor, Replicate, Shard

    shard = mesh.get_local_rank("shard")
    parts = mesh.size(mesh_dim=1)
    state: dict[str, Any] = {}
    for idx, (name, shape) in enumerate(spec.shapes):
        local = torch.zeros((shape[0] // parts, *shape[1:]), dtype=torch.bfloat16)
        if fill:
            _fill(local, idx * 1009 + shard)
        stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
        state[name] = DTensor.from_local(
            local, mesh, [Replicate(), Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride
        )
    if fill:
        state.update(copy.deepcopy(NON_TENSOR))
    else:
        reset_dest(state)
    return state


def _prewarm(paths: list[str]) -> None:
    """Read every file under ``paths`` once, so it is in the page cache."""
    buf = bytearray(_PREWARM_CHUNK)
    for root in paths:
        for folder, _, files in os.walk(root):
            for name in files:
                try:
                    with open(os.path.join(folder, name), "rb", buffering=0) as f:
                        while f.readinto(buf):
                            pass
                except OSError:
                    pass  # a file SeaweedFS removed meanwhile


def _drop_page_cache() -> None:
    os.sync()
    with open(_DROP_CACHES, "w") as f:
        f.write("3\n")


def _stored_bytes(ctx: Ctx, kind: str, loc: str) -> int:
    if kind == "local":
        return sum(os.path.getsize(os.path.join(d, n)) for d, _, files in os.walk(loc) for n in files)
    client = ctx.boto3()
    total, token = 0, None
    while True:
        kwargs: dict[str, Any] = {"Bucket": ctx.bucket, "Prefix": loc.rstrip("/") + "/"}
        if token:
            kwargs["ContinuationToken"] = token
        resp = client.list_objects_v2(**kwargs)
        total += sum(int(o["Size"]) for o in resp.get("Contents", []))
        if not resp.get("IsTruncated"):
            return total
        token = resp.get("NextContinuationToken")


def _load_dcp_ext(ctx: Ctx, variant: Variant, dest: dict[str, Any], url: str) -> int:
    import torch.distributed.checkpoint as dcp

    from dcp_ext import CheckpointReader, LayoutLoadPlanner

    kwargs: dict[str, Any] = {}
    if variant.kind == "s3":
        kwargs = {"storage_options": ctx.storage_options(), "max_concurrency": int(ctx.params["s3_concurrency"])}
    reader = CheckpointReader(url, read_once=variant.role == "read_once", **kwargs)
    dcp.load(dest, storage_reader=reader, planner=LayoutLoadPlanner())
    return int(reader.store.stats.snapshot().bytes_read)


def _one_load(
    ctx: Ctx, variant: Variant, source: dict[str, Any], dest: dict[str, Any], loc: str, mode: str,
    warm_paths: list[str], check: bool,
) -> dict[str, Any]:
    """(all ranks) Prepare the page cache, load, verify; every rank's figures."""
    import torch.distributed as dist

    reset_dest(dest)
    gc.collect()
    dist.barrier()
    if ctx.rank == 0:
        if mode == "cold":
            _drop_page_cache()
        else:
            _prewarm(warm_paths)
    dist.barrier()
    system = _format_system(variant.kind, variant.fmt)
    store_bytes: int | None = None
    before = rchar()
    start = time.perf_counter()
    if variant.fmt == "dcp_ext":
        store_bytes = _load_dcp_ext(ctx, variant, dest, system.url(ctx, loc))
    else:
        system.load(ctx, dest, loc)
    seconds = time.perf_counter() - start
    read = rchar() - before
    if check:
        verify(source, dest)
    mine = {"seconds": seconds, "store_bytes": store_bytes, "rchar": read}
    gathered: list[Any] = [None] * ctx.world
    dist.all_gather_object(gathered, mine)
    return {
        "seconds": max(r["seconds"] for r in gathered),
        "bytes": sum(_rank_bytes(r) for r in gathered),
        "ranks": gathered,
    }


def _rank_bytes(figures: dict[str, Any]) -> int:
    """One rank's bytes read from storage: its store's counter, else ``rchar``."""
    return int(figures["store_bytes"] if figures["store_bytes"] is not None else figures["rchar"])


def replicated_world(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """(each rank) One scenario: save each format once, then the rounds of loads;
    rank 0's return value holds every sample."""
    import torch.distributed as dist

    import dcp_ext  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401

    scenario: str = cfg["scenario"]
    kinds: list[str] = cfg["kinds"]
    mesh = None
    if scenario == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    spec = make_spec(int(cfg["size"]), int(cfg["layers"]))
    source = build_replicated(spec, scenario, mesh)
    dest = build_replicated(spec, scenario, mesh, fill=False)
    ctx = Ctx(rank, world, cfg["params"], cfg["workdir"], cfg.get("s3"))
    log: Callable[[str], None] = (lambda m: print(m, flush=True)) if rank == 0 else (lambda m: None)
    log(f"  [{scenario}] {spec.count} tensors, {spec.nbytes / MiB:,.1f} MiB stored once, "
        f"{local_nbytes(source) / MiB:,.1f} MiB on each rank")
    out: dict[str, Any] = {"scenario": scenario, "rank_bytes": local_nbytes(source), "kinds": {}}
    for kind in kinds:
        systems = variants(kind)
        if kind == "s3":
            import s3torchconnector.dcp  # noqa: F401
        locs: dict[str, str] = {}
        stored: dict[str, int] = {}
        for fmt in dict.fromkeys(v.fmt for v in systems):
            fs = _format_system(kind, fmt)
            loc = fs.location(ctx, f"replicated-{scenario}")
            if rank == 0:
                fs.cleanup(ctx, loc)
            dist.barrier()
            t0 = time.perf_counter()
            fs.save(ctx, source, loc)
            dist.barrier()
            locs[fmt] = loc
            if rank == 0:
                stored[fmt] = _stored_bytes(ctx, kind, loc)
                log(f"  [{scenario} {kind}] saved the {fmt} checkpoint: {stored[fmt] / MiB:,.1f} MiB "
                    f"({time.perf_counter() - t0:.1f}s, untimed)")
        if rank == 0:
            os.sync()  # the saves' writeback must not land in a timed load
        dist.barrier()

        def warm_paths(fmt: str, kind: str = kind, locs: dict[str, str] = locs) -> list[str]:
            if kind == "local":
                return [locs[fmt]]
            return [cfg["s3"]["data_dir"]]

        modes: list[str] = list(cfg["load_modes"][kind])
        if cfg.get("warmup", True):
            for v in systems:
                _one_load(ctx, v, source, dest, locs[v.fmt], "warm", warm_paths(v.fmt), True)
            log(f"  [{scenario} {kind}] warm-up loads done (untimed)")
        samples: dict[str, dict[str, list[dict[str, Any]]]] = {v.name: {m: [] for m in modes} for v in systems}
        repeats = int(cfg["repeats"])
        for rep in range(repeats):
            order = list(systems)
            if rep:
                random.Random(1000 + rep).shuffle(order)
            for v in order:
                for mode in modes:
                    sample = _one_load(ctx, v, source, dest, locs[v.fmt], mode, warm_paths(v.fmt),
                                       bool(cfg["verify"]))
                    samples[v.name][mode].append(sample)
                    log(f"  [{scenario} {kind} {rep + 1}/{repeats}] {v.name:<18} {mode:<4} "
                        f"{sample['seconds']:7.3f}s  {sample['bytes'] / MiB:10,.1f} MiB read "
                        f"({sample['bytes'] / stored[v.fmt] if rank == 0 else 0:.2f}x stored)")
        dist.barrier()
        if rank == 0:
            for fmt, loc in locs.items():
                _format_system(kind, fmt).cleanup(ctx, loc)
            os.sync()
        dist.barrier()
        out["kinds"][kind] = {
            "systems": [{"name": v.name, "label": v.label, "role": v.role, "format": v.fmt} for v in systems],
            "stored_bytes": stored,
            "samples": samples,
        }
    out["tensors"] = spec.count
    out["total_bytes"] = spec.nbytes
    dist.barrier()
    return out


# -- summary and markdown ----------------------------------------------------------------


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(record: dict[str, Any]) -> dict[str, Any]:
    """Medians, bytes/stored, ratios and target verdicts from the raw samples."""
    out: dict[str, Any] = {"rows": [], "targets": []}
    for scenario, data in record["scenarios"].items():
        for kind, kdata in data["kinds"].items():
            meta = {s["name"]: s for s in kdata["systems"]}
            by_role = {s["role"]: s["name"] for s in kdata["systems"]}
            for name, modes in kdata["samples"].items():
                stored = int(kdata["stored_bytes"][meta[name]["format"]])
                for mode, samples in modes.items():
                    if not samples:
                        continue
                    secs = [s["seconds"] for s in samples]
                    nbytes = [float(s["bytes"]) for s in samples]
                    row: dict[str, Any] = {
                        "scenario": scenario, "kind": kind, "mode": mode, "system": name,
                        "label": meta[name]["label"], "role": meta[name]["role"], "stored_bytes": stored,
                        "seconds": _stats(secs), "bytes": _stats(nbytes),
                        "bytes_over_stored": statistics.median(nbytes) / stored,
                        "rank_bytes_median": [statistics.median(_rank_bytes(s["ranks"][r]) for s in samples)
                                              for r in range(len(samples[0]["ranks"]))],
                    }
                    # Speed-ups of read-once (its time / theirs inverted): ratio of
                    # medians and the median of per-round ratios.
                    if meta[name]["role"] == "read_once":
                        for other in ("today", "baseline"):
                            theirs = kdata["samples"][by_role[other]].get(mode, [])
                            if theirs:
                                t_other = [s["seconds"] for s in theirs]
                                row[f"speedup_vs_{other}"] = {
                                    "ratio": statistics.median(t_other) / statistics.median(secs),
                                    "paired": statistics.median(b / a for a, b in zip(secs, t_other)),
                                }
                    out["rows"].append(row)
    for row in out["rows"]:
        if row["role"] != "read_once":
            continue
        where = f"{row['kind']}, {row['scenario'].upper()}, {row['mode']}"
        out["targets"].append({
            "id": f"bytes_{row['kind']}_{row['scenario']}_{row['mode']}",
            "text": f"bytes read from storage / stored size, read-once ({where})",
            "value": row["bytes_over_stored"], "op": "≤", "threshold": BYTES_TARGET,
            "met": row["bytes_over_stored"] <= BYTES_TARGET,
        })
        if row["kind"] == "s3" and "speedup_vs_today" in row:
            sp = row["speedup_vs_today"]
            out["targets"].append({
                "id": f"s3_speedup_{row['scenario']}_{row['mode']}",
                "text": f"S3 load time, dcp_ext today / read-once ({row['scenario'].upper()}, {row['mode']})",
                "value": sp["ratio"], "paired": sp["paired"], "op": "≥",
                "threshold": S3_SPEEDUP_TARGET if row["scenario"] == "ddp" else None,
                "met": sp["ratio"] >= S3_SPEEDUP_TARGET if row["scenario"] == "ddp" else None,
            })
    return out


def _secs(s: dict[str, float]) -> str:
    return f"{s['median']:.2f} <sub>({s['min']:.2f}–{s['max']:.2f})</sub>"


def _speedup(row: dict[str, Any], key: str) -> str:
    sp = row.get(key)
    return f"{sp['ratio']:.2f}× [{sp['paired']:.2f}]" if sp else "–"


def render(record: dict[str, Any]) -> str:
    """Markdown of a results record (the ``replicated`` block of bench/README.md)."""
    summary = record.get("summary") or summarize(record)
    m, p = record["machine"], record["params"]
    lines = [
        f"Run of {record['date']} on `{m['machine_id']}`: {m['cpu_count']} × {m['cpu_model']}, "
        f"{m['ram_gib']:.1f} GiB RAM; torch {m['versions'].get('torch')}, dcp_ext {m['versions'].get('dcp_ext')} "
        f"(commit `{m['git_commit'][:12]}`{', dirty tree' if m.get('git_dirty') else ''}), s3torchconnector "
        f"{m['versions'].get('s3torchconnector', '–')}, SeaweedFS {m.get('seaweedfs_version', '–')}; load average "
        f"at start/end {m['loadavg_start']} / {record['loadavg_end']}; run time {record['runtime_seconds'] / 60:.1f} min.",
        "",
        f"4 gloo ranks on CPU; state: {record['tensors']} bf16 tensors, {record['total_bytes'] / GiB:.3f} GiB stored "
        f"once ({record['total_bytes'] / 1e9:.3f} GB); {p['repeats']} round(s), order shuffled (seeded) after the "
        f"first; loads: local {' and '.join(p['load_modes'].get('local', [])) or '–'}, S3 "
        f"{' and '.join(p['load_modes'].get('s3', [])) or '–'}; S3 `max_concurrency` "
        f"{p['s3_concurrency']}, s3torchconnector part size {p['part_size'] // MiB} MiB. Time: slowest rank, "
        "barrier before `dcp.load` to its return, median (min–max). Bytes: read from storage, summed over ranks "
        "(dcp_ext: its store's counter; torch and s3torchconnector: `/proc/self/io` `rchar`), median; "
        "× stored = over the size of that checkpoint's files. Speed-up = other time / read-once time, "
        "ratio of medians [median of per-round ratios].",
        "",
        f"Command: `{record['command']}`",
        "",
    ]
    titles = {"local": f"Local disk (`{m.get('workdir_device', '?')}`)", "s3": "S3: SeaweedFS `weed mini` on 127.0.0.1"}
    for kind in ("local", "s3"):
        rows = [r for r in summary["rows"] if r["kind"] == kind]
        if not rows:
            continue
        lines += [
            f"#### {titles[kind]}",
            "",
            "| scenario | system | cache | load time (s) | GiB read from storage | × stored | "
            "read-once speed-up vs this |",
            "|---|---|---|---:|---:|---:|---:|",
        ]
        for r in rows:
            ro = next((x for x in rows if x["scenario"] == r["scenario"] and x["mode"] == r["mode"]
                       and x["role"] == "read_once"), None)
            vs = "–" if ro is None or r["role"] == "read_once" else _speedup(ro, f"speedup_vs_{r['role']}")
            lines.append(
                f"| {r['scenario'].upper()} | {r['label']} | {r['mode']} | {_secs(r['seconds'])} | "
                f"{r['bytes']['median'] / GiB:,.3f} | {r['bytes_over_stored']:.2f}× | {vs} |"
            )
        lines.append("")
    lines += ["#### Targets (same run)", "", "| target | measured | threshold | met |", "|---|---:|---|---|"]
    for t in summary["targets"]:
        value = f"{t['value']:.2f}×" + (f" [{t['paired']:.2f}]" if "paired" in t else "")
        if t["threshold"] is None:
            lines.append(f"| {t['text']} | {value} | (info) | – |")
        else:
            lines.append(f"| {t['text']} | {value} | {t['op']} {t['threshold']}× | {'✅' if t['met'] else '❌'} |")
    return "\n".join(lines)


# -- driver ---------------------------------------------------------------------------------


def run(
    size: int = GiB,
    kinds: tuple[str, ...] = ("local", "s3"),
    repeats: int = 3,
    scenarios: tuple[str, ...] = SCENARIOS,
    load_modes: dict[str, list[str]] | None = None,
    layers: int = 32,
    s3_concurrency: int = 4,
    part_size: int = 16 * MiB,
    verify_loads: bool = True,
    warmup: bool = True,
    workdir: Path | None = None,
    command: str = "python -m bench.replicated",
    world_timeout: float = 4 * 3600.0,
) -> dict[str, Any]:
    """Run every scenario in its own 4-rank world; the results record (with
    machine facts and ``summary``), not yet written anywhere."""
    from tests.support.s3_servers import isolated_aws_env, start_seaweedfs

    from .harness.world import run_world

    modes = load_modes or {"local": ["warm"], "s3": ["warm"]}
    if any("cold" in modes.get(k, []) for k in kinds) and not os.access(_DROP_CACHES, os.W_OK):
        raise SystemExit(f"cold loads need write access to {_DROP_CACHES} (root)")
    owned = workdir is None
    work = Path(workdir or tempfile.mkdtemp(prefix="dcp_ext_replicated_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    params: dict[str, Any] = {
        "size": size, "layers": layers, "kinds": list(kinds), "scenarios": list(scenarios), "repeats": repeats,
        "load_modes": {k: list(modes.get(k, ["warm"])) for k in kinds}, "s3_concurrency": s3_concurrency,
        "part_size": part_size, "verify": verify_loads, "warmup": warmup, "world": WORLD,
    }
    record: dict[str, Any] = {
        "format": 1, "date": datetime.date.today().isoformat(), "command": command,
        "machine": machine_info(work), "params": params, "scenarios": {},
    }
    print(f"{command}\nworkdir {work}; load average {record['machine']['loadavg_start']}", flush=True)
    server = None
    try:
        s3info = None
        if "s3" in kinds:
            server = start_seaweedfs(work / "seaweedfs")
            server.create_bucket(BUCKET)
            s3info = {"endpoint_url": server.endpoint_url, "access_key": server.access_key,
                      "secret_key": server.secret_key, "region": server.region, "bucket": BUCKET,
                      "data_dir": str(server.data_dir)}
            print(f"SeaweedFS at {server.endpoint_url} (started in {server.startup_seconds:.1f}s)", flush=True)
        ctx_params = {"s3_concurrency": s3_concurrency, "part_size": part_size}
        with isolated_aws_env(server):
            for scenario in scenarios:
                print(f"{SCENARIO_TITLES[scenario]}: {', '.join(kinds)}", flush=True)
                cfg = {"scenario": scenario, "kinds": list(kinds), "size": size, "layers": layers,
                       "workdir": str(work), "s3": s3info, "params": ctx_params, "repeats": repeats,
                       "load_modes": params["load_modes"], "verify": verify_loads, "warmup": warmup}
                data = run_world(WORLD, "bench.replicated:replicated_world", cfg, world_timeout)
                record["scenarios"][scenario] = data
                record["tensors"] = data["tensors"]
                record["total_bytes"] = data["total_bytes"]
    finally:
        if server is not None:
            server.stop()
        if owned:
            shutil.rmtree(work, ignore_errors=True)
    record["runtime_seconds"] = time.monotonic() - started
    record["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    record["summary"] = summarize(record)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replicated", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default=None, help="state size, stored once (default 1GiB; --quick: 128MiB)")
    parser.add_argument("--only", choices=["local", "s3"], help="one storage kind only")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated: ddp,hsdp")
    parser.add_argument("--repeats", type=int, default=None, help="rounds (default 3; --quick: 1)")
    parser.add_argument("--local-loads", default="warm", help="warm, cold or warm,cold")
    parser.add_argument("--s3-loads", default="warm", help="warm, cold or warm,cold")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--s3-concurrency", type=int, default=4, help="dcp_ext max_concurrency on S3")
    parser.add_argument("--part-size", default="16MiB", help="s3torchconnector part size")
    parser.add_argument("--quick", action="store_true", help="--size 128MiB --repeats 1 unless given")
    parser.add_argument("--no-verify", action="store_true")
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument("--workdir", default=None, help="where checkpoints and SeaweedFS's data live")
    parser.add_argument("--out", default=None, help="results JSON (default bench/results/replicated-<date>.json)")
    parser.add_argument("--readme", action="store_true", help="render the block into bench/README.md")
    args = parser.parse_args(argv)
    size = parse_size(args.size or ("128MiB" if args.quick else "1GiB"))
    repeats = args.repeats or (1 if args.quick else 3)
    kinds = (args.only,) if args.only else ("local", "s3")
    scenarios = tuple(s for s in args.scenarios.split(",") if s)
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}")
    modes = {"local": args.local_loads.split(","), "s3": args.s3_loads.split(",")}
    if any(m not in ("warm", "cold") for ms in modes.values() for m in ms):
        parser.error("load modes are warm and cold")
    command = "python -m bench.replicated " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    record = run(
        size=size, kinds=kinds, repeats=repeats, scenarios=scenarios, load_modes=modes, layers=args.layers,
        s3_concurrency=args.s3_concurrency, part_size=parse_size(args.part_size), verify_loads=not args.no_verify,
        warmup=not args.no_warmup, workdir=Path(args.workdir) if args.workdir else None, command=command.strip(),
    )
    from .harness.report import update_readme

    bench = Path(__file__).resolve().parent
    out = Path(args.out) if args.out else bench / "results" / f"replicated-{record['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    markdown = render(record)
    print("\n" + markdown + "\n")
    print(f"results written to {out}")
    if args.readme:
        update_readme(bench / "README.md", markdown, "replicated")
        print(f"block rendered into {bench / 'README.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
