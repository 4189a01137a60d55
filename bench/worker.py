"""What each rank runs: the interleaved throughput loop and the RSS probe."""

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


def _timed(fn: Any, *args: Any) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _run_once(
    ctx: Ctx, system: System, state: dict[str, Any], dest: dict[str, Any], tag: str,
    load_modes: list[str], check: bool,
) -> dict[str, float]:
    """One save, then one load per mode (``warm``: straight after the save;
    ``cold``: after dropping the page cache); seconds on the coordinator."""
    loc = system.location(ctx, tag)
    if ctx.rank == 0:
        system.cleanup(ctx, loc)  # leftovers of an interrupted run
    dist.barrier()
    times = {"save": _timed(system.save, ctx, state, loc)}
    for mode in load_modes:
        system.reset_dest(ctx, dest)
        if mode == "cold":
            if ctx.rank == 0:
                drop_page_cache()
            dist.barrier()
        times[f"load_{mode}"] = _timed(system.load, ctx, dest, loc)
        if check:
            system.verify(ctx, state, dest)
    dist.barrier()
    if ctx.rank == 0:
        system.cleanup(ctx, loc)
        # Let the deletes (and ext4's online discard) settle before the next
        # timed operation, so they are not billed to whoever comes next.
        os.sync()
    dist.barrier()
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
        raw_src=_raw_buffer(nbytes, 7 + rank), raw_dst=torch.zeros(nbytes, dtype=torch.uint8),
    )
    _log(rank, f"  [{world} rank(s)] built state dicts: {spec.count} tensors, "
               f"{spec.nbytes / 2**20:.1f} MiB total, {nbytes / 2**20:.1f} MiB on this rank "
               f"({time.perf_counter() - t0:.1f}s)")
    systems = {kind: make_systems(kind, params) for kind in kinds}

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
            for system in systems[kind]:
                _run_once(wctx, system, small, small_dest, f"w{world}-warmup", ["warm"], True)
        ctx._boto3 = wctx._boto3
        del small, small_dest, wctx
        gc.collect()
        _log(rank, f"  [{world} rank(s)] warm-up pass done ({time.perf_counter() - t0:.1f}s)")

    samples: dict[str, dict[str, dict[str, list[float]]]] = {}
    total = spec.nbytes
    for kind in kinds:
        modes = list(cfg["load_modes"][kind])
        samples[kind] = {s.name: {op: [] for op in ["save", *(f"load_{m}" for m in modes)]} for s in systems[kind]}
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
            for system in order:
                times = _run_once(ctx, system, state, dest, f"w{world}-r{rep}", modes, bool(cfg["verify"]))
                for op, secs in times.items():
                    samples[kind][system.name][op].append(secs)
                _log(rank, f"  [{world} rank(s) {kind} {rep + 1}/{repeats}] {system.name:<17}" + "".join(
                    f"  {op} {secs:6.2f}s {total / secs / 1e9:6.3f} GB/s" for op, secs in times.items()))
    return {
        "samples": samples,
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
    ctx = Ctx(rank, world, params, cfg["workdir"], cfg.get("s3"))
    system = DcpExt(kind, defaults=True)
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
