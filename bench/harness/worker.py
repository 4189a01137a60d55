"""What each rank of ``python -m bench`` runs: the interleaved throughput loop and the RSS probe."""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import resource
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from . import azure_systems, gcs_systems
from .machine import process_cpu_seconds
from .state import build_state, local_nbytes, make_spec
from .systems import Ctx, DcpExt, System, make_systems

DROP_CACHES = "/proc/sys/vm/drop_caches"


def drop_page_cache() -> None:
    """Write back dirty pages, then drop the page cache (needs root)."""
    os.sync()
    with open(DROP_CACHES, "w") as f:
        f.write("3\n")


def _log(rank: int, message: str) -> None:
    if rank == 0:
        print(message, flush=True)


def _mesh(world: int) -> Any:
    if world == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _raw_buffer(nbytes: int, seed: int) -> torch.Tensor:
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.random_(generator=torch.Generator().manual_seed(seed))
    return buf


def _import_all(kinds: list[str], s3tc: bool) -> None:
    import dcp_ext  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401

    if "s3" in kinds:
        import boto3  # noqa: F401
        import s3fs  # noqa: F401

        if s3tc:
            import s3torchconnector.dcp  # noqa: F401
    if "az" in kinds:
        import adlfs  # noqa: F401
    if "gcs" in kinds:
        import gcsfs  # noqa: F401  (GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false: set by gcs_systems)


def _systems(kind: str, params: dict[str, Any]) -> list[System]:
    if kind == "gcs":
        return gcs_systems.make_gcs_systems(params)
    return azure_systems.make_systems(params) if kind == "az" else make_systems(kind, params)


def _timed(fn: Any, *args: Any) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _cleanup(ctx: Ctx, system: System, loc: str) -> None:
    """(all ranks) Remove ``system``'s checkpoint, then let the deletes (and
    ext4's online discard) settle before the next timed operation, so they are
    not billed to whoever comes next."""
    dist.barrier()
    if ctx.rank == 0:
        system.cleanup(ctx, loc)
        os.sync()
    dist.barrier()


#: An emulator counts as idle when it used less than this share of a core over one look.
QUIET_SHARE = 0.1
QUIET_LOOK = 0.25  # seconds
QUIET_LIMIT = 20.0  # seconds: the most a timed operation waits for it


def _server_quiet(ctx: Ctx, system: System) -> None:
    """(every rank) Wait until the emulator ``system`` talks to is idle, so every
    timed operation starts with the server in the same state.

    Azurite (one Node.js process) and fake-gcs-server reclaim deleted blobs and
    flush their metadata in the background after a cleanup; on 2 cores that
    work lands in whichever system's save runs next (seen: Azurite busy for
    seconds after a torch/adlfs round's deletions). Rank 0 watches the
    server's CPU time through ``/proc`` (the server runs on this host); every
    rank waits for it at a barrier. Servers without a ``pid`` in their
    settings (S3: SeaweedFS's several processes) are not watched.
    """
    server = ctx.az if system.kind == "az" else ctx.gcs if system.kind == "gcs" else None
    pid = server.get("pid") if server else None
    if pid and ctx.rank == 0:
        deadline = time.monotonic() + QUIET_LIMIT
        before = process_cpu_seconds(pid)
        while before is not None and time.monotonic() < deadline:
            time.sleep(QUIET_LOOK)
            now = process_cpu_seconds(pid)
            if now is None or now - before < QUIET_SHARE * QUIET_LOOK:
                break
            before = now
    dist.barrier()


def _save_and_warm(
    ctx: Ctx, system: System, state: dict[str, Any], dest: dict[str, Any], loc: str, warm: bool, check: bool,
) -> dict[str, float]:
    """One save, then (``warm``) one load straight after it; seconds on the coordinator.
    Each starts with the emulator idle (:func:`_server_quiet`)."""
    if ctx.rank == 0:
        system.cleanup(ctx, loc)  # leftovers of an interrupted run
    _server_quiet(ctx, system)
    times = {"save": _timed(system.save, ctx, state, loc)}
    if warm:
        system.reset_dest(ctx, dest)
        _server_quiet(ctx, system)
        times["load_warm"] = _timed(system.load, ctx, dest, loc)
        if check:
            system.verify(ctx, state, dest)
    dist.barrier()
    return times


def _cold_load(ctx: Ctx, system: System, dest: dict[str, Any], state: dict[str, Any], loc: str, check: bool) -> float:
    """``sync``, drop the page cache, then one timed load (seconds on the coordinator)."""
    system.reset_dest(ctx, dest)
    dist.barrier()
    if ctx.rank == 0:
        drop_page_cache()
    dist.barrier()
    seconds = _timed(system.load, ctx, dest, loc)
    if check:
        system.verify(ctx, state, dest)
    return seconds


def _round(
    ctx: Ctx, order: list[System], state: dict[str, Any], dest: dict[str, Any], tag: str,
    load_modes: list[str], check: bool, log: Any = None, cold_estimates: dict[str, float] | None = None,
) -> dict[str, dict[str, float]]:
    """One round: every system of ``order`` once; ``{system: {op: seconds}}``.

    Saves (each followed by its warm load) run first, in ``order``. Cold loads
    come after all saves, in the same order, each after its own ``sync`` and
    drop of the page cache, and each starts when its files are ``age``
    seconds old, the same for every system: every system then reads files
    that are equally old (the host under the virtual disk caches recently
    written data, see bench/README.md). ``age`` is the smallest that lets each
    load start on time if the loads before it take as long as estimated
    (``cold_estimates``: seconds per system from the previous round, updated
    here; 3x the warm load without one). The age each cold load actually saw
    is returned as ``cold_age``.
    """
    cold = "cold" in load_modes
    locs = {s.name: s.location(ctx, tag) for s in order}
    times: dict[str, dict[str, float]] = {}
    saved_at: dict[str, float] = {}
    for system in order:
        times[system.name] = _save_and_warm(ctx, system, state, dest, locs[system.name], "warm" in load_modes, check)
        saved_at[system.name] = time.monotonic()
        if not cold:
            _cleanup(ctx, system, locs[system.name])
            if log is not None:
                log(system, times[system.name])
    if cold:
        if ctx.rank == 0:
            os.sync()
        dist.barrier()
        # Rank 0's clock decides; the other ranks follow through the barriers.
        estimates = cold_estimates if cold_estimates is not None else {}
        start = time.monotonic()
        ahead = 0.0  # estimated seconds of the cold loads before this one
        age = 0.0
        for system in order:
            age = max(age, start + ahead - saved_at[system.name])
            warm = times[system.name].get("load_warm", times[system.name]["save"])
            ahead += 1.2 * estimates.get(system.name, 3 * warm)
        for system in order:
            if ctx.rank == 0:
                wait = saved_at[system.name] + age - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
            seen = time.monotonic() - saved_at[system.name]
            times[system.name]["load_cold"] = _cold_load(ctx, system, dest, state, locs[system.name], check)
            times[system.name]["cold_age"] = seen
            estimates[system.name] = times[system.name]["load_cold"]
        for system in order:
            _cleanup(ctx, system, locs[system.name])
            if log is not None:
                log(system, times[system.name])
    return times


def throughput(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Save and load every system ``repeats`` times, interleaved; rank 0 returns
    ``{kind: {system: {"save": [s, ...], "load": [s, ...]}}}`` plus details."""
    params = cfg["params"]
    kinds: list[str] = cfg["kinds"]
    _import_all(kinds, params.get("s3torchconnector", True))
    mesh = _mesh(world)
    spec = make_spec(int(cfg["size"]), int(cfg["layers"]))
    t0 = time.perf_counter()
    state = build_state(spec, rank, world, mesh)
    dest = build_state(spec, rank, world, mesh, fill=False)
    nbytes = local_nbytes(state)
    ctx = Ctx(
        rank, world, params, cfg["workdir"], cfg.get("s3"),
        raw_src=_raw_buffer(nbytes, 7 + rank), raw_dst=torch.zeros(nbytes, dtype=torch.uint8), az=cfg.get("az"),
        gcs=cfg.get("gcs"),
    )
    _log(rank, f"  [{world} rank(s)] built state dicts: {spec.count} tensors, "
               f"{spec.nbytes / 2**20:.1f} MiB total, {nbytes / 2**20:.1f} MiB on this rank "
               f"({time.perf_counter() - t0:.1f}s)")
    systems = {kind: _systems(kind, params) for kind in kinds}

    if cfg.get("warmup", True):
        # Untimed pass on a small state dict: imports, lazy init, first connections.
        t0 = time.perf_counter()
        small_spec = make_spec(4 << 20, 2)
        small = build_state(small_spec, rank, world, mesh)
        small_dest = build_state(small_spec, rank, world, mesh, fill=False)
        small_n = local_nbytes(small)
        wctx = dataclasses.replace(
            ctx, raw_src=_raw_buffer(small_n, 3), raw_dst=torch.zeros(small_n, dtype=torch.uint8)
        )
        for kind in kinds:
            _round(wctx, systems[kind], small, small_dest, f"w{world}-warmup", ["warm"], True)
        ctx._boto3, ctx._az_pool, ctx._gcs_side = wctx._boto3, wctx._az_pool, wctx._gcs_side
        del small, small_dest, wctx
        gc.collect()
        _log(rank, f"  [{world} rank(s)] warm-up pass done ({time.perf_counter() - t0:.1f}s)")

    samples: dict[str, dict[str, dict[str, list[float]]]] = {}
    cold_ages: dict[str, dict[str, list[float]]] = {}
    total = spec.nbytes
    for kind in kinds:
        modes = list(cfg["load_modes"][kind])
        samples[kind] = {s.name: {op: [] for op in ["save", *(f"load_{m}" for m in modes)]} for s in systems[kind]}
        ages: dict[str, list[float]] = {s.name: [] for s in systems[kind]}
        cold_ages[kind] = ages
        estimates: dict[str, float] = {}  # cold load seconds per system, from the previous round
        repeats = int(cfg["repeats"][kind])
        for rep in range(repeats):
            # Every round runs every system once (interleaved). Round 0 keeps the
            # listed order; later rounds use a seeded shuffle (the same on every
            # rank), so no system always runs first, last or right after the
            # same other system: periodic disturbances (host flushes, other
            # tenants) then spread as noise over all systems instead of biasing one.
            order = list(systems[kind])
            if rep:
                random.Random(1000 + rep).shuffle(order)

            def log(system: System, times: dict[str, float], rep: int = rep, kind: str = kind,
                    repeats: int = repeats) -> None:
                _log(rank, f"  [{world} rank(s) {kind} {rep + 1}/{repeats}] {system.name:<17}" + "".join(
                    f"  {op} {secs:6.2f}s {total / secs / 1e9:6.3f} GB/s" for op, secs in times.items()
                    if op != "cold_age") + (f"  (files {times['cold_age']:.1f}s old)" if "cold_age" in times else ""))

            rounds = _round(ctx, order, state, dest, f"w{world}-r{rep}", modes, bool(cfg["verify"]), log, estimates)
            for name, times in rounds.items():
                for op, secs in times.items():
                    if op == "cold_age":
                        ages[name].append(secs)
                    else:
                        samples[kind][name][op].append(secs)
    return {
        "samples": samples,
        "cold_age_seconds": {k: v for k, v in cold_ages.items() if any(v.values())},
        "total_bytes": total,
        "rank_bytes": nbytes,
        "tensors": spec.count,
        "systems": {
            kind: [
                {"name": s.name, "label": s.label, "role": s.role, "settings": s.describe(params)}
                for s in systems[kind]
            ]
            for kind in kinds
        },
    }


class RssSampler:
    """Samples this process's RSS every ``interval`` seconds in a thread."""

    def __init__(self, interval: float = 0.01) -> None:
        import psutil

        self._proc = psutil.Process()
        self._interval = interval
        self._stop = threading.Event()
        self.peak = 0
        self.samples = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        return int(self._proc.memory_info().rss)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            self.samples += 1
            self._stop.wait(self._interval)

    def __enter__(self) -> RssSampler:
        self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def _maxrss() -> int:
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(kib) * (1024 if sys.platform != "darwin" else 1)


def rss(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Peak RSS of each rank during one dcp_ext save in a fresh process.

    The writer uses dcp_ext's default settings (for S3: only the endpoint and
    credentials are given), so the S3 figure includes the default 8 parts in
    flight."""
    import psutil

    kind = cfg["kind"]
    params = cfg["params"]
    _import_all([kind], False)
    mesh = _mesh(world)
    proc = psutil.Process()
    gc.collect()
    before_state = int(proc.memory_info().rss)
    spec = make_spec(int(cfg["size"]), int(cfg["layers"]))
    state = build_state(spec, rank, world, mesh)
    gc.collect()
    ctx = Ctx(rank, world, params, cfg["workdir"], cfg.get("s3"), az=cfg.get("az"), gcs=cfg.get("gcs"))
    system: System = azure_systems.DcpExtAzure(defaults=True) if kind == "az" else \
        gcs_systems.DcpExtGCS() if kind == "gcs" else DcpExt(kind, defaults=True)
    loc = system.location(ctx, f"rss-w{world}")
    if rank == 0:
        system.cleanup(ctx, loc)
    baseline = int(proc.memory_info().rss)
    maxrss_before = _maxrss()
    dist.barrier()
    with RssSampler(float(cfg.get("interval", 0.01))) as sampler:
        t0 = time.perf_counter()
        system.save(ctx, state, loc)
        seconds = time.perf_counter() - t0
    maxrss_after = _maxrss()
    # ru_maxrss is exact but covers the whole life of the process: it tells
    # the save's peak only if the save raised it.
    peak = max(sampler.peak, maxrss_after if maxrss_after > maxrss_before else 0)
    mine = {
        "rank": rank,
        "state_bytes": local_nbytes(state),
        "rss_before_state": before_state,
        "rss_baseline": baseline,
        "rss_peak_sampled": sampler.peak,
        "samples": sampler.samples,
        "ru_maxrss_before_save": maxrss_before,
        "ru_maxrss_after_save": maxrss_after,
        "rss_peak": peak,
        "save_seconds": seconds,
    }
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    dist.barrier()
    if rank == 0:
        system.cleanup(ctx, loc)
    return {"kind": kind, "world": world, "settings": system.describe(params), "ranks": gathered}
