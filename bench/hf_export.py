"""Hugging Face export (issue 18): ``python -m bench.hf_export``.

Exports the bench's 1 GiB model (``bench/harness/state.py``: 355 bf16 tensors with the
names of a decoder-only transformer, largest 48 MiB) as a Hugging Face
safetensors folder, on 2 gloo ranks on CPU, the model sharded with FSDP2
(``fully_shard`` over ``init_device_mesh("cpu", (2,))``; each rank holds half
the rows of every tensor), on local disk.

Two sources, each exported by several systems:

* **live**: the training state in memory, ``get_model_state_dict(model)``
  (a flat ``{fqn: DTensor}``):

  * ``dcp_ext``: ``dcp_ext.save_hf(state, dest, max_shard_size=...)``;
  * ``torch``: ``dcp.save(state, storage_writer=HuggingFaceStorageWriter(dest,
    save_distributed=True, enable_consolidation=True,
    fqn_to_index_mapping=...))``: every rank writes its shards into
    ``dest/sharded/``, then the coordinator's ``finish`` consolidates them into
    ``dest`` (torch's ``consolidate_safetensors_files``), inside ``dcp.save``;
    the mapping splits the tensors into the same files of at most
    ``max_shard_size`` as the HF convention (tensors in order, a new file when
    the next tensor would overflow it);
  * ``torch_every_rank``: the same writer with ``enable_consolidation=False``
    into ``dest/sharded/``, then torch's
    ``consolidate_safetensors_files_on_every_rank(dest/sharded, dest, mapping)``
    (each rank writes the output files whose index is its rank modulo 2,
    rank 0 the index); the distributed consolidation torch offers;
  * ``today``: ``dcp_ext.full.save_full`` into ``dest/model.safetensors`` (what
    ``CheckpointManager.save(tag, model, partial=False)`` runs: every rank
    all-gathers each tensor in turn, the coordinator streams one file);
  * ``raw`` (a ceiling, not an HF folder): each rank writes the bytes with ``os.write``
    of its own shards to one file and fsyncs it: the same bytes written by
    both ranks at once with no exchange, no headers, no Python per tensor.

* **checkpoint**: the 2-rank partial checkpoint ``ROOT/bench_partial`` written
  once by ``CheckpointManager(ROOT).save("bench", model)``:

  * ``dcp_ext``: ``dcp_ext.export_hf(ROOT/bench_partial, dest, max_shard_size=...)``
    on 2 ranks;
  * ``torch``: the torch way to turn a DCP checkpoint into HF: allocate the
    sharded state (empty DTensors of the model's shapes, inside the timed and
    measured region), ``dcp.load`` it (the files are dcp_ext's, so the storage
    reader is ``dcp_ext.CheckpointReader``: torch's ``FileSystemReader`` cannot
    read them), then the same ``dcp.save`` with ``HuggingFaceStorageWriter`` and
    consolidation as above;
  * ``today``: ``CheckpointManager(ROOT).export("bench", out=dest/model.safetensors)``
    in one process (a world of 1 rank; ``dcp_ext/export.py``).

Conditions, the same for every system:

* **Fresh processes**: every measurement runs in its own freshly spawned world
  (2 ranks; 1 for ``checkpoint/today``), so no allocator cache or ``ru_maxrss``
  of an earlier system is inherited. Each world first builds what the system
  starts from (live: the sharded model, filled with seeded bits, the same in
  every world; checkpoint: nothing but the process group), then runs the same
  system once untimed on a 4 MiB model (imports, lazy initialisation), deletes
  that output and ``os.sync()``\\ s.
* **Page cache**: before every measurement the previous output is deleted and
  ``os.sync()`` runs (untimed), so no system starts with another's dirty pages
  to write back. From a checkpoint, the source files are read once (untimed)
  right before the call: every system reads a warm source.
* **Durability**: every system's time ends with its outputs fsynced. dcp_ext
  (``IOConfig(fsync=True)``, the default) and today's paths fsync their
  files themselves; torch's ``FileSystemWriter`` fsyncs the ``sharded/`` files
  (``sync_files=True``), but its consolidation writes the output files and the
  index with plain ``open``/``write``: the harness fsyncs each of them and the
  directory right after ``dcp.save`` (or the consolidation) returns, on the
  rank that wrote it, inside the timed region.
* **Destination**: a path that does not exist yet, inside a parent directory
  created and fsynced beforehand.
* **Timing**: every rank passes a ``dist.barrier()``, then calls the system;
  the time is the slowest rank's, from the barrier to its return (plus the
  fsyncs above). GB/s = 10^9 bytes of tensor data (the same for every
  system) / seconds.
* **Memory**: each rank samples its RSS with psutil every 10 ms in a thread
  during the call (and takes ``ru_maxrss`` when the call raised it); the
  baseline is the RSS right before the call (after ``gc.collect()`` and
  ``malloc_trim``), so for the live systems it includes the state the rank
  already holds: "above the state". ``checkpoint/torch`` has to build the
  state inside the call, so its figure includes it. CPU: user + system
  seconds of the rank's process during the call (``getrusage``, all its
  threads; the kernel's writeback threads are not counted).
* **Order**: rounds alternate the order of the systems (round r rotates the
  list by r) and of the two sources.
* **Correctness**: after the world ended (untimed), the parent reads every
  output tensor with ``safetensors.safe_open`` (through the index when there
  is one) and compares its bits with the full tensor rebuilt from the seeds,
  and checks that the key sets are equal: every output of every round by
  default (``--verify first``: the first round of each system; ``none``).

Results: ``bench/results/hf-export-<date>.json`` (every sample, load average
and ``uptime`` at start and end and before every measurement) and the block
between the ``hf-export`` markers of bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dcp_ext.config import parse_size

from .harness.machine import machine_info
from .hf_export_report import (TAG, WORLD, MiB, _Phases, _top_functions, render, render_profile, summarize,
                               verify_output)
from .hf_export_report import LABELS, PHASE_TARGETS, RSS_HEADROOM, SPEED_TARGETS  # noqa: F401 - re-exported: the suite's constants stay importable from here

WARMUP_TAG = "warmup"
WARMUP_SIZE = 4 << 20
MODES = ("live", "checkpoint")
SYSTEMS: dict[str, tuple[str, ...]] = {
    "live": ("dcp_ext", "torch", "torch_every_rank", "today", "raw"),
    "checkpoint": ("dcp_ext", "torch", "today"),
}
#: Experiments, run only when named in ``--systems``: dcp_ext with ``sync_file_range`` writeback off
#: (``dcp_ext.storage.local._start_writeback = None`` in the rank's process; fsync at commit unchanged).
EXPERIMENTS: dict[str, tuple[str, ...]] = {
    "live": ("dcp_ext_nowb", "today_nowb"),
    "checkpoint": ("dcp_ext_nowb", "today_nowb"),
}


# -- the model ------------------------------------------------------------------------------------


def build_model(spec: Any, rank: int, mesh: Any, fill: bool = True) -> Any:
    """The bench model (``spec``'s names and shapes) sharded with FSDP2 on ``mesh``.

    ``fill``: every parameter's local shard gets the seeded bits of
    ``bench.harness.state`` (seed ``index * 1009 + rank``), so the full tensors are
    known to the parent; otherwise it stays uninitialised.
    """
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from .harness.state import DTYPE, _fill

    with torch.device("meta"):
        root = nn.Module()
        for name, shape in spec.shapes:
            *path, leaf = name.split(".")
            module = root
            for part in path:
                if part not in module._modules:
                    module.add_module(part, nn.Module())
                module = module._modules[part]
            module.register_parameter(leaf, nn.Parameter(torch.empty(shape, dtype=DTYPE)))
    fully_shard(root, mesh=mesh)
    root.to_empty(device="cpu")
    if fill:
        params = dict(root.named_parameters())
        with torch.no_grad():
            for idx, (name, _) in enumerate(spec.shapes):
                _fill(params[name].to_local(), seed=idx * 1009 + rank)
    return root


def full_tensor(spec: Any, idx: int, world: int = WORLD) -> Any:
    """The full tensor ``idx`` of the filled model (its ``world`` row blocks, rebuilt from the seeds)."""
    import torch

    from .harness.state import DTYPE, _fill

    shape = spec.shapes[idx][1]
    rows = shape[0] // world
    return torch.cat([_fill(torch.empty((rows, *shape[1:]), dtype=DTYPE), seed=idx * 1009 + r) for r in range(world)])


def shard_mapping(spec: Any, max_shard_bytes: int) -> dict[str, int]:
    """``{fqn: file index from 1}``: tensors in order, a new file when the next would overflow (HF's rule)."""
    from .harness.state import ESIZE

    mapping: dict[str, int] = {}
    index, used = 1, 0
    for name, shape in spec.shapes:
        size = math.prod(shape) * ESIZE
        if used and used + size > max_shard_bytes:
            index, used = index + 1, 0
        mapping[name] = index
        used += size
    return mapping


# -- helpers run on each rank ---------------------------------------------------------------------


def _malloc_trim() -> None:
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_outputs(dest: str, files: list[str]) -> None:
    """fsync ``files`` (names under ``dest``) and ``dest`` itself."""
    for name in files:
        _fsync_path(os.path.join(dest, name))
    _fsync_path(dest, directory=True)


def _read_all(directory: str) -> int:
    """Read every file under ``directory`` (into the page cache); bytes read."""
    total = 0
    buf = bytearray(16 * MiB)
    view = memoryview(buf)
    for base, _, names in os.walk(directory):
        for name in names:
            with open(os.path.join(base, name), "rb", buffering=0) as f:
                while n := f.readinto(view):
                    total += n
    return total


def _tree_bytes(path: str) -> tuple[int, int, int]:
    """(bytes of all files under ``path``, file count, bytes of ``*.safetensors`` directly in it)."""
    total = files = top = 0
    for base, _, names in os.walk(path):
        for name in names:
            size = os.path.getsize(os.path.join(base, name))
            total += size
            files += 1
            if base == path and name.endswith(".safetensors"):
                top += size
    return total, files, top


def _run_system(mode: str, system: str, rank: int, world: int, cfg: dict[str, Any], state: Any, spec: Any,
                mesh: Any, source: str, dest: str) -> None:
    """(all ranks of the system's world) One export of ``mode``/``system`` into ``dest``, outputs fsynced."""
    import torch
    import torch.distributed.checkpoint as dcp

    max_shard = cfg["max_shard_size"]
    if system.endswith("_nowb"):
        import dcp_ext.storage.local

        dcp_ext.storage.local._start_writeback = None  # type: ignore[attr-defined]
        system = system.removesuffix("_nowb")
    if mode == "live" and system == "dcp_ext":
        import dcp_ext

        dcp_ext.save_hf(state, dest, max_shard_size=max_shard)
    elif mode == "checkpoint" and system == "dcp_ext":
        import dcp_ext

        dcp_ext.export_hf(source, dest, max_shard_size=max_shard)
    elif mode == "live" and system == "today":
        from dcp_ext.config import IOConfig
        from dcp_ext.full._write import save_full
        from dcp_ext._runtime import GroupView
        from dcp_ext.storage import open_store

        save_full(GroupView(None), open_store(dest, IOConfig()), "model.safetensors", state)
    elif mode == "checkpoint" and system == "today":
        import dcp_ext

        os.makedirs(dest)  # export() writes into an existing directory
        dcp_ext.CheckpointManager(os.path.dirname(source)).export(
            os.path.basename(source).removesuffix("_partial"), out=os.path.join(dest, "model.safetensors"))
    elif mode == "live" and system == "raw":
        os.makedirs(dest, exist_ok=True)
        fd = os.open(os.path.join(dest, f"rank{rank}.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for value in state.values():
                local = value.to_local() if hasattr(value, "to_local") else value
                view = memoryview(local.contiguous().view(-1).view(torch.uint8).numpy())
                while view.nbytes:
                    view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_path(dest, directory=True)
    elif system in ("torch", "torch_every_rank"):
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        mapping = shard_mapping(spec, parse_size(max_shard))
        if mode == "checkpoint":
            import dcp_ext

            model = build_model(spec, rank, mesh, fill=False)
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            state = get_model_state_dict(model)
            dcp.load({"model": state}, storage_reader=dcp_ext.CheckpointReader(source))
        every_rank = system == "torch_every_rank"
        writer = HuggingFaceStorageWriter(os.path.join(dest, "sharded") if every_rank else dest,
                                          fqn_to_index_mapping=mapping, save_distributed=True,
                                          enable_consolidation=not every_rank)
        dcp.save(state, storage_writer=writer)
        count = max(mapping.values())
        from torch.distributed.checkpoint._hf_utils import _gen_file_name

        if every_rank:
            from torch.distributed.checkpoint._consolidate_hf_safetensors import (
                consolidate_safetensors_files_on_every_rank,
            )

            consolidate_safetensors_files_on_every_rank(os.path.join(dest, "sharded"), dest, mapping,
                                                        process_group=None)
            mine = [_gen_file_name(i, count) for i in range(1, count + 1) if i % world == rank]
            _fsync_outputs(dest, mine + (["model.safetensors.index.json"] if rank == 0 else []))
        elif rank == 0:
            _fsync_outputs(dest, [_gen_file_name(i, count) for i in range(1, count + 1)]
                           + ["model.safetensors.index.json"])
    else:
        raise ValueError(f"unknown system {mode}/{system}")


def measure_world(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """(each rank) Build the source, warm up, then one measured export; every rank returns its sample."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from .harness.state import make_spec
    from .harness.worker import RssSampler, _maxrss

    warnings.filterwarnings("ignore")
    mode, system = cfg["mode"], cfg["system"]
    spec = make_spec(int(cfg["size"]), int(cfg["layers"]))
    small = make_spec(WARMUP_SIZE, 2)
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
    t0 = time.perf_counter()
    state = small_state = None
    if mode == "live":
        state = get_model_state_dict(build_model(spec, rank, mesh))
        small_state = get_model_state_dict(build_model(small, rank, mesh))
    built = time.perf_counter() - t0
    # Untimed warm-up: the same system on the 4 MiB model.
    warm_dest = os.path.join(cfg["workdir"], "warmup", f"{mode}-{system}")
    if rank == 0:
        shutil.rmtree(warm_dest, ignore_errors=True)
        os.makedirs(os.path.dirname(warm_dest), exist_ok=True)
    dist.barrier()
    t0 = time.perf_counter()
    _run_system(mode, system, rank, world, cfg, small_state, small, mesh, cfg["warmup_source"], warm_dest)
    dist.barrier()
    warmup = time.perf_counter() - t0
    dest = cfg["dest"]
    if rank == 0:
        shutil.rmtree(warm_dest, ignore_errors=True)
        shutil.rmtree(dest, ignore_errors=True)
        parent = os.path.dirname(dest)
        os.makedirs(parent, exist_ok=True)
        _fsync_path(parent, directory=True)
        os.sync()
        if mode == "checkpoint":
            _read_all(cfg["source"])  # warm source for every system
    del small_state
    gc.collect()
    _malloc_trim()
    dist.barrier()
    baseline = RssSampler().rss()
    maxrss_before = _maxrss()
    phases = profiler = None
    if cfg.get("profile"):
        import cProfile

        phases = _Phases()
        phases.install()
        profiler = cProfile.Profile()
    dist.barrier()
    import resource

    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    with RssSampler(0.01) as sampler:
        t0 = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        _run_system(mode, system, rank, world, cfg, state, spec, mesh, cfg["source"], dest)
        if profiler is not None:
            profiler.disable()
        seconds = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    maxrss_after = _maxrss()
    peak = max(sampler.peak, maxrss_after if maxrss_after > maxrss_before else 0)
    slowest = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    dist.barrier()
    extra: dict[str, Any] = {}
    if phases is not None and profiler is not None:
        phases.uninstall()
        extra = {"phases": phases.report(), "profile": _top_functions(profiler)}
    return {**extra, "rank": rank, "seconds": seconds, "cpu_user": cpu1.ru_utime - cpu0.ru_utime,
            "cpu_system": cpu1.ru_stime - cpu0.ru_stime, "slowest": float(slowest.item()), "rss_baseline": baseline,
            "rss_peak_sampled": sampler.peak, "rss_samples": sampler.samples, "ru_maxrss_before": maxrss_before,
            "ru_maxrss_after": maxrss_after, "rss_peak": peak, "build_seconds": built, "warmup_seconds": warmup}


def setup_world(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """(each rank) Write the partial checkpoints the ``checkpoint`` systems export (bench and warm-up size)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dcp_ext

    from .harness.state import make_spec

    warnings.filterwarnings("ignore")
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    for tag, size, layers, root in ((TAG, int(cfg["size"]), int(cfg["layers"]), cfg["root"]),
                                    (WARMUP_TAG, WARMUP_SIZE, 2, cfg["warmup_root"])):
        model = build_model(make_spec(size, layers), rank, mesh)
        manager = dcp_ext.CheckpointManager(root)
        dist.barrier()
        t0 = time.perf_counter()
        manager.save(tag, model)
        dist.barrier()
        out[tag] = {"seconds": time.perf_counter() - t0}
        manager.close()
        del model
    return out


# -- driver ---------------------------------------------------------------------------------------


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def schedule(modes: tuple[str, ...], systems: dict[str, tuple[str, ...]], rounds: int) -> list[tuple[int, str, str, int]]:
    """(round, mode, system, position): round r rotates every mode's systems by r; modes alternate."""
    out = []
    for r in range(rounds):
        order = list(modes) if r % 2 == 0 else list(reversed(modes))
        for mode in order:
            names = list(systems[mode])
            k = r % len(names) if names else 0
            for position, name in enumerate(names[k:] + names[:k]):
                out.append((r, mode, name, position))
    return out


def run(modes: tuple[str, ...], systems: dict[str, tuple[str, ...]], size: int, layers: int, rounds: int,
        max_shard_size: str, verify: str, workdir: Path | None, command: str,
        log: Callable[[str], None] = print, profile: bool = False) -> dict[str, Any]:
    """Set up, measure every (round, mode, system) in a fresh world, verify; the results record."""
    from tests.support.dist import run_world

    from .harness.state import ESIZE, make_spec

    owned = workdir is None
    work = Path(workdir or tempfile.mkdtemp(prefix="dcp_ext_hf_export_", dir=_default_parent())).resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    spec = make_spec(size, layers)
    largest = max(math.prod(s) for _, s in spec.shapes) * ESIZE
    params = {"modes": list(modes), "systems": {m: list(systems[m]) for m in modes}, "size": size, "layers": layers,
              "rounds": rounds, "max_shard_size": max_shard_size, "verify": verify, "world": WORLD,
              "profile": profile}
    record: dict[str, Any] = {
        "format": 1, "date": datetime.date.today().isoformat(), "command": command,
        "machine": machine_info(work), "uptime_start": _uptime(), "params": params,
        "model": {"tensors": spec.count, "tensor_bytes": spec.nbytes, "largest_tensor_bytes": largest,
                  "rank_bytes": spec.nbytes // WORLD,
                  "files_at_max_shard_size": max(shard_mapping(spec, parse_size(max_shard_size)).values())},
    }
    log(f"{command}\nworkdir {work} ({record['machine']['workdir_device']}); {record['uptime_start']}")
    base = {"size": size, "layers": layers, "max_shard_size": max_shard_size, "workdir": str(work),
            "profile": profile}
    try:
        if "checkpoint" in modes:
            t0 = time.monotonic()
            cfg = {**base, "root": str(work / "ckpt"), "warmup_root": str(work / "ckpt-warmup")}
            record["setup"] = run_world(WORLD, setup_world, cfg, timeout=1800, collective_timeout=900)[0]
            stored = _tree_bytes(str(work / "ckpt" / f"{TAG}_partial"))
            record["setup"]["partial_bytes"], record["setup"]["partial_files"] = stored[0], stored[1]
            log(f"partial checkpoint written in {record['setup'][TAG]['seconds']:.2f}s "
                f"({stored[0] / MiB:,.1f} MiB, {stored[1]} files; setup {time.monotonic() - t0:.1f}s)")
        expected: dict[str, Any] | None = None
        if verify != "none":
            t0 = time.monotonic()
            expected = {name: full_tensor(spec, i) for i, (name, _) in enumerate(spec.shapes)}
            log(f"expected tensors rebuilt in {time.monotonic() - t0:.1f}s")
        samples: list[dict[str, Any]] = []
        verified: set[tuple[str, str]] = set()
        for rnd, mode, system, position in schedule(modes, systems, rounds):
            dest = str(work / "out" / f"r{rnd}-{mode}-{system}")
            cfg = {**base, "mode": mode, "system": system, "dest": dest,
                   "source": str(work / "ckpt" / f"{TAG}_partial"),
                   "warmup_source": str(work / "ckpt-warmup" / f"{WARMUP_TAG}_partial")}
            world = 1 if (mode, system) in (("checkpoint", "today"), ("checkpoint", "today_nowb")) else WORLD
            load = _loadavg()
            t0 = time.monotonic()
            ranks = run_world(world, measure_world, cfg, timeout=1800, collective_timeout=900)
            wall = time.monotonic() - t0
            written, files, top = _tree_bytes(dest)
            sample: dict[str, Any] = {
                "round": rnd, "mode": mode, "system": system, "position": position, "world": world,
                "seconds": ranks[0]["slowest"], "ranks": ranks, "bytes_written": written, "files_written": files,
                "output_bytes": top, "loadavg_before": load, "world_seconds": wall,
            }
            check = system != "raw" and (verify == "all" or (verify == "first" and (mode, system) not in verified))
            if check and expected is not None:
                t1 = time.monotonic()
                sample["verified"] = verify_output(dest, spec, expected)
                sample["verify_seconds"] = time.monotonic() - t1
                verified.add((mode, system))
            shutil.rmtree(dest, ignore_errors=True)
            os.sync()
            samples.append(sample)
            above = ", ".join(f"{(r['rss_peak'] - r['rss_baseline']) / MiB:,.0f}" for r in ranks)
            cpu = ", ".join(f"{r['cpu_user'] + r['cpu_system']:.2f}" for r in ranks)
            log(f"  [r{rnd + 1}/{rounds} {mode:<10} {system:<16}] {sample['seconds']:6.2f}s "
                f"{spec.nbytes / sample['seconds'] / 1e9:6.3f} GB/s  peak RSS above baseline {above} MiB  "
                f"CPU {cpu} s  "
                f"written {written / MiB:,.0f} MiB in {files} files"
                + (f"  verified {sample['verified']['tensors']} tensors" if "verified" in sample else "")
                + f"  (load {load[0]:.2f}; world {wall:.0f}s)")
            if profile:
                for r in ranks:
                    log(f"      rank {r['rank']} phases: " + ", ".join(
                        f"{k} {v['seconds']:.3f}s/{v['calls']}" for k, v in r["phases"].items()))
                    log(f"      rank {r['rank']} most own time: " + ", ".join(
                        f"{f['function']} {f['own']:.3f}s/{f['calls']}" for f in r["profile"][:8]))
        record["samples"] = samples
    finally:
        if owned:
            shutil.rmtree(work, ignore_errors=True)
    record["runtime_seconds"] = time.monotonic() - started
    record["loadavg_end"] = _loadavg()
    record["uptime_end"] = _uptime()
    record["summary"] = summarize(record)
    return record


def _default_parent() -> str | None:
    """A temp root on /work's disk when /tmp is not on it (tmpfs)."""
    tmp = tempfile.gettempdir()
    try:
        if os.stat(tmp).st_dev == os.stat("/work").st_dev:
            return None
    except OSError:
        return None
    parent = "/work/.bench_tmp"
    os.makedirs(parent, exist_ok=True)
    return parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hf_export", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--size", default=None, help="model size (default 1GiB; --quick: 64MiB)")
    parser.add_argument("--layers", type=int, default=32, help="decoder layers of the model")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 3; --quick: 1)")
    parser.add_argument("--max-shard-size", default="256MB", help="max_shard_size of dcp_ext and of torch's mapping")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: live, checkpoint")
    parser.add_argument("--systems", default=None, help="comma-separated subset of dcp_ext, torch, torch_every_rank, "
                        "today, raw (default all), plus the experiments dcp_ext_nowb, today_nowb (sync_file_range "
                        "writeback off)")
    parser.add_argument("--verify", choices=["first", "all", "none"], default="all",
                        help="check outputs bit for bit: first round of each system, every round, or never")
    parser.add_argument("--quick", action="store_true", help="64 MiB, 1 round")
    parser.add_argument("--workdir", default=None, help="scratch directory on the disk under test (default: a temp "
                        "dir on /work's disk)")
    parser.add_argument("--out", default=None, help="results JSON (default bench/results/hf-export-<date>.json)")
    parser.add_argument("--no-readme", action="store_true", help="leave bench/README.md alone")
    parser.add_argument("--render", metavar="JSON", help="only re-render README's block from a results JSON")
    parser.add_argument("--profile", action="store_true", help="instrumented run (phase timers and cProfile in "
                        "every rank; times carry their overhead): 1 round unless --rounds, JSON "
                        "hf-export-<date>-profile.json, README block hf-export-profile")
    args = parser.parse_args(argv)
    if args.render:
        from .harness.report import update_readme

        rendered = json.loads(Path(args.render).read_text())
        profiled = rendered["params"].get("profile", False)
        text = render_profile(rendered) if profiled else render(rendered)
        update_readme(Path(__file__).resolve().parent / "README.md", text,
                      "hf-export-profile" if profiled else "hf-export")
        print(text)
        return 0
    modes = tuple(m for m in args.modes.split(",") if m)
    if set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(set(modes) - set(MODES))}")
    wanted = None if args.systems is None else set(args.systems.split(","))
    systems = {m: tuple(s for s in SYSTEMS[m] + EXPERIMENTS[m] if (wanted is None and s in SYSTEMS[m])
                        or (wanted is not None and s in wanted)) for m in modes}
    size = parse_size(args.size or ("64MiB" if args.quick else "1GiB"))
    rounds = args.rounds or (1 if args.quick or args.profile else 3)
    command = "python -m bench.hf_export " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    record = run(modes, systems, size, args.layers, rounds, args.max_shard_size, args.verify,
                 Path(args.workdir) if args.workdir else None, command.strip(),
                 log=lambda m: print(m, flush=True), profile=args.profile)
    from .harness.report import update_readme

    bench = Path(__file__).resolve().parent
    suffix = "-quick" if args.quick else "-profile" if args.profile else ""
    default_name = f"hf-export-{record['date']}{suffix}.json"
    out = Path(args.out) if args.out else bench / "results" / default_name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    markdown = render_profile(record) if args.profile else render(record)
    print("\n" + markdown + "\n")
    print(f"results written to {out}")
    if not args.quick and not args.no_readme:
        update_readme(bench / "README.md", markdown, "hf-export-profile" if args.profile else "hf-export")
        print(f"block rendered into {bench / 'README.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
