"""Training blocked per save: ``python -m bench.blocking``.

A real training loop on 2 gloo ranks (CPU): FSDP2 (``fully_shard`` per layer
and at the root, over ``init_device_mesh("cpu", (2,))``) of a stack of
``--layers`` square Linear layers with ReLUs, sized so that the parameters and
Adam's two moments (fp32) come to ``--state-size`` over both ranks (default
1 GiB: 512 MiB per rank), trained on a batch of 4 rows, runs ``--steps`` steps
(default 50) and checkpoints after every ``--every``-th step (default 10), to
local disk (under ``--workdir``) and to S3 (SeaweedFS on 127.0.0.1, started
as ``python -m bench`` starts it, a fresh server for every S3 run, its data
under ``--workdir`` too). One warm-up step before the loop creates
Adam's state. Systems, each run in a fresh world, in a seeded shuffled order
every round (``--repeats`` rounds):

* **no checkpoint**: the same steps, for the reference wall time;
* **dcp_ext sync**: ``CheckpointManager.save(tag, model, optim)``, which
  returns when the checkpoint has committed;
* **dcp_ext async (blocking copy)**: ``dcp.async_save({"model": msd, "optim":
  osd}, storage_writer=CheckpointWriter(path))`` with no stager: the writer's
  own ``stage()`` copies the state into fresh buffers (parallel threads)
  before the call returns;
* **dcp_ext background staging**: ``CheckpointManager.save(...,
  async_save=True)``: the manager's ``dcp_ext.Stager`` copies into buffers
  reused from save to save, in the background; ``staging_completion`` is
  waited for right before the next ``optimizer.step()``;
* **torch FileSystemWriter (default async)**: ``dcp.async_save`` with torch's
  writer as its own stager (a blocking copy into fresh buffers); on S3
  torch's ``FsspecWriter`` over s3fs, which stages the same way;
* **torch DefaultStager**: ``dcp.async_save(..., async_stager=DefaultStager(
  StagingOptions(use_pinned_memory=False, use_shared_memory=False,
  use_async_staging=True, use_non_blocking_copy=False)))``, one stager reused
  over the run and closed at its end; ``staging_completion`` is waited for
  before the next ``optimizer.step()``.

``msd, osd = get_state_dict(model, optim)`` is taken inside the timed save
call of the stock ``dcp.async_save`` systems (the manager takes it inside its
own ``save``). Every asynchronous system waits for the previous save's upload
right before starting the next save (timed apart from the save call, so the
manager's own wait is a no-op) and for the last one after the loop. All saves
use a second gloo process group (``dist.new_group``): their collectives run
in DCP's upload thread and must not interleave with FSDP's on the default
group.

Measured on each rank's training thread with ``time.perf_counter``, per save:

* **blocked**: how long the save call takes to return;
* **wait for staging**: how long ``staging_completion.result()`` blocks right
  before the next ``optimizer.step()`` (the forward and backward pass in
  between overlap with the copy); 0 for systems without a staging future;
* **until mutable** = blocked + wait for staging: the training time lost
  before the state may change;
* **staging done after**: from the call to the moment the staging future
  resolved (a done-callback's clock; for systems without one, = blocked):
  how long the copy took in wall time, overlap included;
* **wait for previous upload**, before the save call.

Per world: wall time of the steps (barrier to the end of the last step, every
wait included), the drain after the loop (last staging + upload), each rank's
peak RSS (``bench.harness.worker.RssSampler``, every 10 ms, over the loop and the
drain) and its RSS before the model existed, state bytes per rank, and once,
before the loop, a plain ``clone()`` of every local tensor of the state (fresh
allocations): the reference for "until mutable".

A save holds back both ranks, so each save counts with its slower rank's
time. Steady-state figures are medians over saves 2..n of every run of a
system; the first save of each run (buffer allocation, first connections) is
shown apart. The last save of a run has no next step: its wait for staging is
taken in the drain, without compute to overlap, and is left out of the
until-mutable median.

Peak RSS, measured apart: with glibc's default allocator, memory that the
training loop frees (FSDP's all-gathered layers, gradients, the clone above)
stays in its heaps, so a rank's peak RSS follows allocation history more than
what is live (the no-checkpoint runs peak 2.6-3.2 GiB for 0.5 GiB of state).
After the timed worlds, ``--memory-steps`` steps (default 30, a save every
``--every``) of "no checkpoint", dcp_ext background staging and torch
``DefaultStager`` run once more per storage kind with
``MALLOC_MMAP_THRESHOLD_=65536`` in the ranks' environment: every allocation
of 64 KiB or more is its own mapping, returned to the system when freed, so
RSS is what is live. These runs are slower (every big allocation faults its
pages in afresh), so their times are not reported; their peak RSS is, against
the no-checkpoint run of the same setting.

Results: ``bench/results/blocking-<date>.json`` (machine facts, parameters,
every raw sample) and the tables between the ``blocking`` markers of
``bench/README.md``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import json
import os
import random
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness.machine import machine_info, process_cpu_seconds
from bench.harness.report import publish
from bench.harness.storage import storage
from bench.blocking_report import (
    CHECKPOINTING,
    DEFAULT_SYSTEMS,
    MEMORY_ENV,
    MEMORY_SYSTEMS,
    SYSTEMS,
    per_save,
    render,
    world_cpu,
)
from bench.harness.threads import ThreadCpu
from bench.harness.training import BATCH, build_training, forward_backward, layer_width, optimizer_step
from dcp_ext.config import parse_size
from tests.support.dist import run_world

MiB = 1 << 20


# -- the training job (runs on each rank; its model: bench.harness.training) --------


def time_clone(model: Any, optim: Any) -> tuple[float, int]:
    """Seconds of a plain ``clone()`` of every local tensor of the state (fresh
    allocations, as ``{k: v.clone()}``), and the bytes cloned (= state bytes on this rank)."""
    import torch
    import torch.distributed as dist

    from tests.support.dist_workers import app_state, local_leaves

    state = app_state(model, optim)
    dist.barrier()
    start = time.perf_counter()
    leaves = local_leaves(state)
    seconds = time.perf_counter() - start
    nbytes = sum(v.numel() * v.element_size() for v in leaves.values() if isinstance(v, torch.Tensor))
    return seconds, nbytes


# -- systems -------------------------------------------------------------------------


@dataclass
class Pending:
    """A save in flight: ``staging`` must resolve before the next
    ``optimizer.step()``, ``upload`` before the next save (``None``: nothing to wait for)."""

    staging: concurrent.futures.Future[Any] | None = None
    upload: concurrent.futures.Future[Any] | None = None


class Saver:
    """One system's way to save the state under ``root`` (a local path or ``s3://`` URL)."""

    def __init__(self, root: str, group: Any) -> None:
        self.root, self.group = root, group

    def save(self, tag: str, model: Any, optim: Any) -> Pending:
        raise NotImplementedError

    def close(self) -> None:
        """(after the last upload) Release what the system holds."""


class ManagerSync(Saver):
    """``CheckpointManager.save``: returns when the checkpoint has committed."""

    def __init__(self, root: str, options: dict[str, Any] | None, group: Any) -> None:
        import dcp_ext

        super().__init__(root, group)
        self.manager = dcp_ext.CheckpointManager(root, storage_options=options, process_group=group)

    def save(self, tag: str, model: Any, optim: Any) -> Pending:
        self.manager.save(tag, model, optim)
        return Pending()

    def close(self) -> None:
        self.manager.close()


class ManagerBackground(ManagerSync):
    """``CheckpointManager.save(..., async_save=True)``: background staging into reused buffers
    (``cpu_share``: the stager's, else the default)."""

    def __init__(self, root: str, options: dict[str, Any] | None, group: Any, cpu_share: float | None = None) -> None:
        import dcp_ext

        Saver.__init__(self, root, group)
        stager = dcp_ext.Stager(cpu_share=cpu_share) if cpu_share is not None else None
        self.manager = dcp_ext.CheckpointManager(root, storage_options=options, process_group=group, stager=stager)
        self.stager = stager

    def close(self) -> None:
        super().close()
        if self.stager is not None:
            self.stager.close()

    def save(self, tag: str, model: Any, optim: Any) -> Pending:
        handle = self.manager.save(tag, model, optim, async_save=True)
        return Pending(handle.staging_completion, handle)


class StockAsync(Saver):
    """``dcp.async_save(get_state_dict(model, optim), storage_writer=writer(path),
    async_stager=stager)``; ``stager=None``: the writer stages itself."""

    def __init__(self, root: str, group: Any, writer: Callable[[str], Any], stager: Any = None) -> None:
        super().__init__(root, group)
        self.writer, self.stager = writer, stager

    def save(self, tag: str, model: Any, optim: Any) -> Pending:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

        from tests.support.dist_workers import app_state

        response = dcp.async_save(app_state(model, optim), storage_writer=self.writer(f"{self.root}/{tag}"),
                                  process_group=self.group, async_stager=self.stager)
        if isinstance(response, AsyncSaveResponse):
            return Pending(response.staging_completion, response.upload_completion)
        return Pending(None, response)

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


class StockSync(Saver):
    """``dcp.save(get_state_dict(model, optim), storage_writer=writer(path))``: returns when committed."""

    def __init__(self, root: str, group: Any, writer: Callable[[str], Any]) -> None:
        super().__init__(root, group)
        self.writer = writer

    def save(self, tag: str, model: Any, optim: Any) -> Pending:
        import torch.distributed.checkpoint as dcp

        from tests.support.dist_workers import app_state

        dcp.save(app_state(model, optim), storage_writer=self.writer(f"{self.root}/{tag}"), process_group=self.group)
        return Pending()


def _torch_writer(path: str, options: dict[str, Any] | None) -> Any:
    """torch's writer for ``path``: ``FileSystemWriter`` locally, ``FsspecWriter`` (s3fs) on S3."""
    if options is None:
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(path)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(path, **options)


def make_saver(system: str, root: str, options: dict[str, Any] | None, group: Any) -> Saver | None:
    """The saver of ``system`` (``None`` for "none")."""
    if system == "none":
        return None
    if system == "dcp_ext_sync":
        return ManagerSync(root, options, group)
    if system == "dcp_ext_background":
        return ManagerBackground(root, options, group)
    if system == "dcp_ext_background_full":
        return ManagerBackground(root, options, group, cpu_share=1.0)
    if system == "dcp_ext_background_low":
        return ManagerBackground(root, options, group, cpu_share=0.05)
    if system == "dcp_ext_background_notrim":
        # An experiment (issue 44): the writer's malloc_trim after write_data left out.
        import dcp_ext.dcp_io._writer as writer_module

        writer_module.release_free_memory = lambda: None  # type: ignore[attr-defined]
        return ManagerBackground(root, options, group)
    if system == "dcp_ext_async_copy":
        from dcp_ext import CheckpointWriter

        return StockAsync(root, group, lambda path: CheckpointWriter(path, storage_options=options))
    torch_writer = lambda path: _torch_writer(path, options)  # noqa: E731
    if system == "torch_fs_async":
        return StockAsync(root, group, torch_writer)
    if system == "torch_sync":
        return StockSync(root, group, torch_writer)
    if system == "torch_default_stager":
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                              use_async_staging=True, use_non_blocking_copy=False))
        return StockAsync(root, group, torch_writer, stager)
    raise ValueError(f"unknown system {system!r}")


# -- the timed loop ------------------------------------------------------------------


def waited(future: concurrent.futures.Future[Any] | None) -> float:
    """Seconds spent in ``future.result()`` (0 for ``None``); a failed save raises."""
    if future is None:
        return 0.0
    start = time.perf_counter()
    future.result()
    return time.perf_counter() - start


def timed_save(saver: Saver, tag: str, model: Any, optim: Any, previous: Pending) -> tuple[dict[str, Any], Pending]:
    """Wait for the previous upload, then save; the save's record and what is in flight."""
    record: dict[str, Any] = {"tag": tag, "wait_upload": waited(previous.upload)}
    start = time.perf_counter()
    pending = saver.save(tag, model, optim)
    record["blocked"] = time.perf_counter() - start
    record["wait_staging"] = 0.0
    record["followed_by_step"] = True
    record["staging_done_after"] = record["blocked"]
    if pending.staging is not None:
        record["staging_done_after"] = None

        def done(_: Any) -> None:
            record["staging_done_after"] = time.perf_counter() - start

        pending.staging.add_done_callback(done)
    return record, pending


def training_loop(model: Any, optim: Any, batch: Any, saver: Saver | None, steps: int, every: int,
                  cpu: Any = None, machine: Any = None) -> dict[str, Any]:
    """``steps`` training steps, saving after every ``every``-th; then the drain.

    ``cpu`` (a :class:`~bench.harness.threads.ThreadCpu`) is told where the
    steps and the drain begin; ``machine`` (a :class:`MachineCpu`) is read there too.

    Returns wall and drain seconds, per-step seconds, each step's compute
    seconds (forward/backward and optimizer step, waits and save calls
    excluded) and one record per save.
    """
    import torch.distributed as dist

    saves: list[dict[str, Any]] = []
    step_seconds: list[float] = []
    compute_seconds: list[float] = []
    pending = Pending()
    dist.barrier()
    if cpu is not None:
        cpu.mark("steps")
    if machine is not None:
        machine.mark("steps")
    start = time.perf_counter()
    busy: list[bool] = []  # a save in flight during the step, or made in it
    for step in range(1, steps + 1):
        began = time.perf_counter()
        busy.append(pending.staging is not None or (pending.upload is not None and not pending.upload.done()))
        forward_backward(model, batch)
        computed = time.perf_counter() - began
        if pending.staging is not None:
            saves[-1]["wait_staging"] = waited(pending.staging)
            pending.staging = None
        stepped = time.perf_counter()
        optimizer_step(optim)
        computed += time.perf_counter() - stepped
        compute_seconds.append(computed)
        if saver is not None and step % every == 0:
            record, pending = timed_save(saver, f"step{step}", model, optim, pending)
            saves.append(record)
            busy[-1] = True
        step_seconds.append(time.perf_counter() - began)
    wall = time.perf_counter() - start
    if cpu is not None:
        cpu.mark("drain")
    if machine is not None:
        machine.mark("drain")
    if pending.staging is not None:
        saves[-1]["wait_staging"] = waited(pending.staging)
        saves[-1]["followed_by_step"] = False
    drain_upload = waited(pending.upload)
    if saver is not None:
        saver.close()
    drain = time.perf_counter() - start - wall
    return {"wall": wall, "drain": drain, "drain_upload": drain_upload, "step_seconds": step_seconds,
            "compute_seconds": compute_seconds, "busy": busy, "saves": saves}


class MachineCpu:
    """Busy CPU seconds of the whole machine (``/proc/stat``) and of the S3
    server's process (``/proc/<pid>/stat``), per phase: what else ran while the steps did."""

    def __init__(self, server_pid: int | None) -> None:
        self.server_pid = server_pid
        self.phases: dict[str, dict[str, float]] = {}
        self._phase: str | None = None
        self._at: dict[str, float] = {}

    @staticmethod
    def _busy() -> float:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    def _server(self) -> float:
        if self.server_pid is None:
            return 0.0
        return process_cpu_seconds(self.server_pid, children=True) or 0.0

    def _read(self) -> dict[str, float]:
        return {"machine_busy": self._busy(), "server": self._server(), "wall": time.perf_counter()}

    def mark(self, phase: str | None) -> None:
        now = self._read()
        if self._phase is not None:
            self.phases[self._phase] = {key: now[key] - self._at[key] for key in now}
        self._phase, self._at = phase, now


def train_world(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One run of ``cfg["system"]`` on this rank: build, warm up, time a clone, then the loop."""
    import gc

    import psutil
    import torch
    import torch.distributed as dist

    from bench.harness.worker import RssSampler

    process = psutil.Process()
    rss_start = int(process.memory_info().rss)
    model, optim, batch = build_training(rank, world_size, cfg["width"], cfg["layers"])
    forward_backward(model, batch)  # warm-up: Adam's moments exist from here on
    optimizer_step(optim)
    group = dist.new_group(backend="gloo")
    clone_seconds, state_bytes = time_clone(model, optim)
    saver = make_saver(cfg["system"], cfg["root"], cfg["options"], group)
    gc.collect()
    rss_before_loop = int(process.memory_info().rss)
    machine = MachineCpu(cfg.get("server_pid")) if rank == 0 else None
    # Every 10 ms costs a rank ~5% of a core (psutil), which the timed runs
    # leave to training: 50 ms there, 10 ms in the memory worlds.
    with RssSampler(cfg.get("rss_interval", 0.01)) as sampler:
        cpu = ThreadCpu(bench_threads=[sampler._thread])
        run = training_loop(model, optim, batch, saver, cfg["steps"], cfg["every"], cpu, machine)
        phases = cpu.stop()
        if machine is not None:
            machine.mark(None)
    return {
        "rank": rank, "state_bytes": state_bytes, "clone_seconds": clone_seconds,
        "rss_start": rss_start, "rss_before_loop": rss_before_loop, "rss_peak": sampler.peak,
        "rss_samples": sampler.samples, "torch_threads": torch.get_num_threads(), **run,
        "cpu": {name: {"by_role": p.by_role, "process": p.process, "wall": p.wall} for name, p in phases.items()},
        "threads": cpu.threads(),
        "machine_cpu": machine.phases if machine is not None else None,
    }


# -- driver --------------------------------------------------------------------------


def schedule(kinds: list[str], repeats: int, seed: int, systems: list[str] | None = None,
             ) -> list[list[tuple[str, str]]]:
    """Per round, the (system, storage) runs in a seeded shuffled order; "none" once per round."""
    chosen = systems or list(SYSTEMS)
    runs = [("none", "-")] if "none" in chosen else []
    runs += [(system, kind) for kind in kinds for system in CHECKPOINTING if system in chosen]
    rounds = []
    for round_no in range(repeats):
        order = list(runs)
        random.Random(seed * 1000 + round_no).shuffle(order)
        rounds.append(order)
    return rounds


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` (so in the ranks spawned meanwhile), restored afterwards."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_all(args: argparse.Namespace, width: int, workdir: Path) -> list[dict[str, Any]]:
    """Every world of every round, then the memory worlds; one record per world
    with every rank's results (``memory``: a memory world)."""
    runs = [(round_no, system, kind, False)
            for round_no, order in enumerate(schedule(args.kinds, args.repeats, args.seed, args.systems))
            for system, kind in order]
    if args.memory_steps:
        runs += [(0, system, kind, True)
                 for system, kind in schedule(args.kinds, 1, args.seed, MEMORY_SYSTEMS)[0]]
    worlds = []
    for round_no, system, kind, memory in runs:
        name = f"{system}-{kind}-{'mem' if memory else f'r{round_no}'}"
        loadavg = [round(x, 2) for x in os.getloadavg()]
        with storage(kind, workdir, name) as (root, options), environment(MEMORY_ENV if memory else {}):
            cfg = {"system": system, "root": root, "options": options, "width": width, "layers": args.layers,
                   "steps": args.memory_steps if memory else args.steps, "every": args.every,
                   "server_pid": _server_pid() if kind == "s3" else None, "rss_interval": 0.01 if memory else 0.05}
            ranks = run_world(2, train_world, cfg, timeout=args.world_timeout,
                              collective_timeout=args.world_timeout)
        worlds.append({"round": round_no, "system": system, "kind": kind, "memory": memory, "ranks": ranks,
                       "loadavg": loadavg})
        print(_progress_line(worlds[-1]), flush=True)
    return worlds


def _server_pid() -> int | None:
    """The pid of the SeaweedFS server this process started for the current run."""
    import psutil

    servers = [p for p in psutil.Process().children(recursive=True) if p.name() == "weed"]
    return servers[-1].pid if servers else None


def _progress_line(world: dict[str, Any]) -> str:
    saves = per_save(world)
    blocked = ", ".join(f"{s['blocked'] * 1e3:.0f}" for s in saves)
    mutable = ", ".join(f"{s['until_mutable'] * 1e3:.0f}" for s in saves)
    r0 = world["ranks"][0]
    cpu = world_cpu(world)
    roles = ", ".join(f"{role} {sec:.2f}" for role, sec in sorted(cpu["checkpoint_roles"].items(), key=lambda kv: -kv[1])
                      if sec >= 0.01)
    return (f"  {'memory ' if world['memory'] else ''}round {world['round']} {world['system']:22s} {world['kind']:5s} wall {r0['wall']:.2f}s "
            f"drain {r0['drain']:.2f}s clone {max(r['clone_seconds'] for r in world['ranks']) * 1e3:.0f} ms; "
            f"blocked ms [{blocked}] until mutable ms [{mutable}]; peak RSS MiB "
            f"{[round(r['rss_peak'] / MiB) for r in world['ranks']]}\n"
            f"    cpu: checkpoint {cpu['checkpoint_steps']:.2f}s in steps + {cpu['checkpoint_drain']:.2f}s in drain "
            f"[{roles}]; training threads {cpu['training_steps']:.2f}s; compute {cpu['compute']:.2f}s; "
            f"server {cpu['server_steps']:.2f}s; others on the machine {cpu['others_steps']:.2f}s; "
            f"load {world.get('loadavg')}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.blocking", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--state-size", default="1GiB", help="params + 2 Adam moments (fp32), total over 2 ranks")
    parser.add_argument("--layers", type=int, default=16, help="Linear layers of the model")
    parser.add_argument("--steps", type=int, default=50, help="training steps per run")
    parser.add_argument("--every", type=int, default=10, help="save after every N-th step")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (every system once per round)")
    parser.add_argument("--only", choices=["local", "s3"], help="one storage kind only")
    parser.add_argument("--seed", type=int, default=1, help="seed of the run order")
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                        help="comma-separated systems of the timed worlds (of: " + ", ".join(SYSTEMS) + ")")
    parser.add_argument("--memory-steps", type=int, default=30,
                        help="steps of each memory world (0: no memory worlds)")
    parser.add_argument("--workdir", default=None,
                        help="scratch directory for local checkpoints and SeaweedFS data (None: a new one in /tmp)")
    parser.add_argument("--world-timeout", type=float, default=3600.0, help="seconds before a world is killed")
    parser.add_argument("--no-readme", action="store_true", help="do not render into bench/README.md")
    parser.add_argument("--out", default=None,
                        help="results JSON here instead of bench/results/blocking-<date>.json (implies --no-readme)")
    args = parser.parse_args(argv)
    args.kinds = [args.only] if args.only else ["local", "s3"]
    args.systems = [name.strip() for name in args.systems.split(",") if name.strip()]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {list(SYSTEMS)}")
    width = layer_width(parse_size(args.state_size), args.layers)
    owned = args.workdir is None
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dcp_ext_blocking_")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.blocking " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    started = time.monotonic()
    record: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "command": command, "machine": machine_info(workdir),
        "params": {"state_size": parse_size(args.state_size), "layers": args.layers, "width": width,
                   "batch": BATCH, "steps": args.steps, "every": args.every, "repeats": args.repeats,
                   "kinds": args.kinds, "seed": args.seed, "world_size": 2, "systems": args.systems,
                   "memory_steps": args.memory_steps, "memory_env": MEMORY_ENV},
        "systems": SYSTEMS,
    }
    print(f"{command}\nworkdir {workdir}; {args.layers} x Linear({width}, {width}); "
          f"{record['machine']['cpu_count']} CPUs, load average {record['machine']['loadavg_start']}", flush=True)

    try:
        record["worlds"] = run_all(args, width, workdir)
    finally:
        if owned:
            shutil.rmtree(workdir, ignore_errors=True)
    record["runtime_seconds"] = time.monotonic() - started
    record["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))
        print(render(record))
        print(f"results written to {args.out}")
    else:
        publish(record, "blocking", render(record), readme=not args.no_readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
