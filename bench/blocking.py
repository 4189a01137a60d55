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
import os
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness.machine import machine_info
from bench.harness.report import publish
from bench.harness.storage import storage
from bench.harness.training import BATCH, build_training, forward_backward, layer_width, optimizer_step
from dcp_ext.config import parse_size
from tests.support.dist import run_world

MiB = 1 << 20
GiB = 1 << 30

# The memory worlds (see the module docstring): these systems, with this allocator setting.
MEMORY_SYSTEMS = ["none", "dcp_ext_background", "torch_default_stager"]
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}

# name -> label; "none" first, then the checkpointing systems in table order.
SYSTEMS: dict[str, str] = {
    "none": "no checkpoint",
    "dcp_ext_sync": "dcp_ext sync (`CheckpointManager.save`)",
    "dcp_ext_async_copy": "dcp_ext async, blocking copy (`dcp.async_save` + `CheckpointWriter`, no stager)",
    "dcp_ext_background": "dcp_ext background staging (`CheckpointManager.save(async_save=True)`)",
    "torch_fs_async": "torch FileSystemWriter, default async (`dcp.async_save`, writer stages)",
    "torch_default_stager": "torch DefaultStager (async staging, no pinned/shared memory)",
}
CHECKPOINTING = [name for name in SYSTEMS if name != "none"]


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
    """``CheckpointManager.save(..., async_save=True)``: background staging into reused buffers."""

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
    if system == "dcp_ext_async_copy":
        from dcp_ext import CheckpointWriter

        return StockAsync(root, group, lambda path: CheckpointWriter(path, storage_options=options))
    torch_writer = lambda path: _torch_writer(path, options)  # noqa: E731
    if system == "torch_fs_async":
        return StockAsync(root, group, torch_writer)
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


def training_loop(model: Any, optim: Any, batch: Any, saver: Saver | None, steps: int, every: int) -> dict[str, Any]:
    """``steps`` training steps, saving after every ``every``-th; then the drain.

    Returns wall and drain seconds, per-step seconds and one record per save.
    """
    import torch.distributed as dist

    saves: list[dict[str, Any]] = []
    step_seconds: list[float] = []
    pending = Pending()
    dist.barrier()
    start = time.perf_counter()
    for step in range(1, steps + 1):
        began = time.perf_counter()
        forward_backward(model, batch)
        if pending.staging is not None:
            saves[-1]["wait_staging"] = waited(pending.staging)
            pending.staging = None
        optimizer_step(optim)
        if saver is not None and step % every == 0:
            record, pending = timed_save(saver, f"step{step}", model, optim, pending)
            saves.append(record)
        step_seconds.append(time.perf_counter() - began)
    wall = time.perf_counter() - start
    if pending.staging is not None:
        saves[-1]["wait_staging"] = waited(pending.staging)
        saves[-1]["followed_by_step"] = False
    drain_upload = waited(pending.upload)
    if saver is not None:
        saver.close()
    drain = time.perf_counter() - start - wall
    return {"wall": wall, "drain": drain, "drain_upload": drain_upload, "step_seconds": step_seconds,
            "saves": saves}


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
    with RssSampler(0.01) as sampler:
        run = training_loop(model, optim, batch, saver, cfg["steps"], cfg["every"])
    return {
        "rank": rank, "state_bytes": state_bytes, "clone_seconds": clone_seconds,
        "rss_start": rss_start, "rss_before_loop": rss_before_loop, "rss_peak": sampler.peak,
        "rss_samples": sampler.samples, "torch_threads": torch.get_num_threads(), **run,
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
        with storage(kind, workdir, name) as (root, options), environment(MEMORY_ENV if memory else {}):
            cfg = {"system": system, "root": root, "options": options, "width": width, "layers": args.layers,
                   "steps": args.memory_steps if memory else args.steps, "every": args.every}
            ranks = run_world(2, train_world, cfg, timeout=args.world_timeout,
                              collective_timeout=args.world_timeout)
        worlds.append({"round": round_no, "system": system, "kind": kind, "memory": memory, "ranks": ranks})
        print(_progress_line(worlds[-1]), flush=True)
    return worlds


def _progress_line(world: dict[str, Any]) -> str:
    saves = per_save(world)
    blocked = ", ".join(f"{s['blocked'] * 1e3:.0f}" for s in saves)
    mutable = ", ".join(f"{s['until_mutable'] * 1e3:.0f}" for s in saves)
    r0 = world["ranks"][0]
    return (f"  {'memory ' if world['memory'] else ''}round {world['round']} {world['system']:22s} {world['kind']:5s} wall {r0['wall']:.2f}s "
            f"drain {r0['drain']:.2f}s clone {max(r['clone_seconds'] for r in world['ranks']) * 1e3:.0f} ms; "
            f"blocked ms [{blocked}] until mutable ms [{mutable}]; peak RSS MiB "
            f"{[round(r['rss_peak'] / MiB) for r in world['ranks']]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.blocking", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--state-size", default="1GiB", help="params + 2 Adam moments (fp32), total over 2 ranks")
    parser.add_argument("--layers", type=int, default=16, help="Linear layers of the model")
    parser.add_argument("--steps", type=int, default=50, help="training steps per run")
    parser.add_argument("--every", type=int, default=10, help="save after every N-th step")
    parser.add_argument("--repeats", type=int, default=1, help="rounds (every system once per round)")
    parser.add_argument("--only", choices=["local", "s3"], help="one storage kind only")
    parser.add_argument("--seed", type=int, default=1, help="seed of the run order")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help="comma-separated systems of the timed worlds (of: " + ", ".join(SYSTEMS) + ")")
    parser.add_argument("--memory-steps", type=int, default=30,
                        help="steps of each memory world (0: no memory worlds)")
    parser.add_argument("--workdir", default=None,
                        help="scratch directory for local checkpoints and SeaweedFS data (None: a new one in /tmp)")
    parser.add_argument("--world-timeout", type=float, default=3600.0, help="seconds before a world is killed")
    parser.add_argument("--no-readme", action="store_true", help="do not render into bench/README.md")
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
    publish(record, "blocking", render(record), readme=not args.no_readme)
    return 0


# -- summary and markdown ------------------------------------------------------------


def per_save(world: dict[str, Any]) -> list[dict[str, Any]]:
    """The world's saves, each with its slower rank's times (seconds), and
    ``until_mutable`` = blocked + wait for staging."""
    ranks = world["ranks"]
    out = []
    for i, first in enumerate(ranks[0]["saves"]):
        records = [r["saves"][i] for r in ranks]
        out.append({
            "index": i, "tag": first["tag"], "followed_by_step": first["followed_by_step"],
            **{key: max(rec[key] for rec in records)
               for key in ("blocked", "wait_staging", "wait_upload", "staging_done_after")},
            "until_mutable": max(rec["blocked"] + rec["wait_staging"] for rec in records),
        })
    return out


def summarize(worlds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (system, storage) of ``worlds``: medians (seconds) over the steady-state
    saves, the first saves, wall times and peak RSS; plus the clone reference and state size."""
    med = statistics.median
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for world in worlds:
        row = rows.setdefault((world["system"], world["kind"]), {"saves": [], "first": [], "wall": [],
                                                                 "drain": [], "rss": []})
        saves = per_save(world)
        row["first"] += saves[:1]
        row["saves"] += saves[1:]
        row["wall"].append(max(r["wall"] for r in world["ranks"]))
        row["drain"].append(max(r["drain"] for r in world["ranks"]))
        row["rss"].append([(r["rss_peak"], r["rss_start"]) for r in world["ranks"]])
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for key, row in rows.items():
        steady, mutable = row["saves"], [s for s in row["saves"] if s["followed_by_step"]]
        pick = lambda saves, field: med([s[field] for s in saves]) if saves else None  # noqa: E731
        out[key] = {
            "n": len(steady), "n_mutable": len(mutable),
            **{field: pick(steady, field) for field in ("blocked", "wait_upload", "staging_done_after")},
            "wait_staging": pick(mutable, "wait_staging"), "until_mutable": pick(mutable, "until_mutable"),
            "first_blocked": pick(row["first"], "blocked"), "first_until_mutable": pick(row["first"], "until_mutable"),
            "wall": med(row["wall"]), "drain": med(row["drain"]),
            "rss_peak": [max(w[k][0] for w in row["rss"]) for k in range(2)],
            "rss_start": [max(w[k][1] for w in row["rss"]) for k in range(2)],
        }
    ranks = [r for w in worlds for r in w["ranks"]]
    return {
        "rows": out,
        "clone": med([max(r["clone_seconds"] for r in w["ranks"]) for w in worlds]),
        "state_bytes": max(r["state_bytes"] for r in ranks),
        "torch_threads": sorted({r["torch_threads"] for r in ranks}),
    }


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:,.0f}"


def targets(summary: dict[str, Any], kinds: list[str], memory: dict[str, Any] | None = None,
            ) -> list[tuple[str, str, str, bool]]:
    """(target, measured, threshold, met) rows, per storage kind; peak RSS from
    the ``memory`` worlds' summary when there is one."""
    rows = summary["rows"]
    state = summary["state_bytes"]
    out = []
    for kind in kinds:
        bg = rows.get(("dcp_ext_background", kind))
        if bg is None or bg["blocked"] is None:  # no steady-state save (a run of a single save)
            continue
        per_gib = bg["blocked"] * 1e3 / (state / GiB)
        out.append((f"{kind}: background staging, blocked per save per GiB of state per rank",
                    f"{per_gib:.1f} ms/GiB ({_ms(bg['blocked'])} ms / {state / GiB:.3f} GiB)", "≤ 20 ms/GiB",
                    per_gib <= 20))
        stager = rows.get(("torch_default_stager", kind))
        if stager is not None and stager["blocked"] is not None:
            ratio = bg["blocked"] / stager["blocked"]
            out.append((f"{kind}: background staging blocked / torch DefaultStager blocked",
                        f"{ratio:.2f}× ({_ms(bg['blocked'])} / {_ms(stager['blocked'])} ms)", "≤ 1.0×", ratio <= 1.0))
        if bg["until_mutable"] is not None:
            ratio = bg["until_mutable"] / summary["clone"]
            out.append((f"{kind}: background staging until mutable / plain clone() of the state",
                        f"{ratio:.2f}× ({_ms(bg['until_mutable'])} / {_ms(summary['clone'])} ms)", "≤ 0.5×",
                        ratio <= 0.5))
        copy, torch_fs = rows.get(("dcp_ext_async_copy", kind)), rows.get(("torch_fs_async", kind))
        if copy is not None and torch_fs is not None and None not in (copy["blocked"], torch_fs["blocked"]):
            ratio = copy["blocked"] / torch_fs["blocked"]
            out.append((f"{kind}: `dcp.async_save` blocked, CheckpointWriter / torch's "
                        f"{'FileSystemWriter' if kind == 'local' else 'FsspecWriter'}",
                        f"{ratio:.2f}× ({_ms(copy['blocked'])} / {_ms(torch_fs['blocked'])} ms)", "≤ 1.0×",
                        ratio <= 1.0))
        source = memory["rows"] if memory else rows
        if ("dcp_ext_background", kind) in source:
            out += rss_targets(kind, source[("dcp_ext_background", kind)], source.get(("none", "-")), state,
                               "memory runs" if memory else "timed runs")
    return out


def rss_targets(kind: str, bg: dict[str, Any], none: dict[str, Any] | None, state: int, where: str,
                ) -> list[tuple[str, str, str, bool]]:
    """Peak RSS of the background-staging runs against 2 × state + 256 MiB per rank: as
    measured, above the RSS before the model existed, and (a reading of the target)
    what checkpointing adds to the no-checkpoint runs' peak, against state + 256 MiB."""
    budget = 2 * state + 256 * MiB
    both = lambda values: " / ".join(f"{v / MiB:,.0f}" for v in values) + " MiB"  # noqa: E731
    label = f"{kind}: background staging, peak RSS rank 0 / 1 ({where})"
    above = [peak - start for peak, start in zip(bg["rss_peak"], bg["rss_start"])]
    out = [(label, both(bg["rss_peak"]), f"≤ {budget / MiB:,.0f} MiB (2 × state + 256 MiB)",
            max(bg["rss_peak"]) <= budget),
           (f"{label}, above the RSS before the model (Python, torch, gloo)", both(above),
            f"≤ {budget / MiB:,.0f} MiB", max(above) <= budget)]
    if none is not None:
        added = [peak - base for peak, base in zip(bg["rss_peak"], none["rss_peak"])]
        out.append((f"{label}, above the no-checkpoint runs' peak (what checkpointing adds)", both(added),
                    f"≤ {(state + 256 * MiB) / MiB:,.0f} MiB (state + 256 MiB: the state itself is in both)",
                    max(added) <= state + 256 * MiB))
    return out


def memory_table(memory: dict[str, Any], p: dict[str, Any], state: int) -> list[str]:
    """Markdown lines: peak RSS of the memory worlds (``MALLOC_MMAP_THRESHOLD_``)."""
    rows = memory["rows"]
    none = rows.get(("none", "-"))
    env = " ".join(f"{k}={v}" for k, v in p.get("memory_env", MEMORY_ENV).items())
    lines = ["", f"#### Peak RSS with `{env}` ({p['memory_steps']} steps, a save every {p['every']})", "",
             "Freed memory goes back to the system at once, so RSS is what is live: the state "
             f"({state / MiB:,.0f} MiB per rank), gradients, FSDP's all-gathered layers, the runtime, and what "
             "checkpointing holds (staging buffers, upload buffers).", "",
             "| system | storage | peak RSS rank 0 / 1 (MiB) | above the no-checkpoint run's peak (MiB) |",
             "|---|---|---:|---:|"]
    for (system, kind), row in sorted(rows.items(), key=lambda item: (MEMORY_SYSTEMS.index(item[0][0]), item[0][1])):
        added = "–" if none is None or system == "none" else " / ".join(
            f"{(peak - base) / MiB:,.0f}" for peak, base in zip(row["rss_peak"], none["rss_peak"]))
        lines.append(f"| {SYSTEMS[system]} | {kind} | "
                     f"{row['rss_peak'][0] / MiB:,.0f} / {row['rss_peak'][1] / MiB:,.0f} | {added} |")
    return lines


def render(record: dict[str, Any]) -> str:
    """Markdown: the conditions, one table per storage kind, the targets."""
    summary = summarize([w for w in record["worlds"] if not w.get("memory")])
    memory_worlds = [w for w in record["worlds"] if w.get("memory")]
    memory = summarize(memory_worlds) if memory_worlds else None
    p, m = record["params"], record["machine"]
    rows = summary["rows"]
    state = summary["state_bytes"]
    none = rows.get(("none", "-"))
    lines = [
        f"Run of {record['date']} on `{m['machine_id']}`: {m['cpu_count']} × {m['cpu_model']}, "
        f"{m['ram_gib']:.1f} GiB RAM; torch {m['versions'].get('torch')}, dcp_ext {m['versions'].get('dcp_ext')} "
        f"(commit `{m['git_commit'][:12]}`{', dirty tree' if m['git_dirty'] else ''}); load average at start/end "
        f"{m['loadavg_start']} / {record['loadavg_end']}; run time {record['runtime_seconds'] / 60:.1f} min.",
        "",
        f"2 ranks, FSDP2 on CPU (gloo), {p['layers']} × Linear({p['width']}, {p['width']}) + Adam, batch {p['batch']}: "
        f"state (fp32 params + 2 moments) {state / MiB:,.0f} MiB per rank, {2 * state / GiB:.2f} GiB in all; "
        f"{p['steps']} steps, a save every {p['every']} steps; {p['repeats']} round(s), every system in a fresh "
        f"world, seeded shuffled order; torch intra-op threads per rank: {summary['torch_threads']}. Reference: a plain `clone()` of every local tensor of the state takes "
        f"**{_ms(summary['clone'])} ms** (median over worlds, slower rank).",
        "",
        f"Command: `{record['command']}`",
        "",
        "Times per save in ms, the slower rank's; median over saves 2..n of every run (first save apart). "
        "*Until mutable* = blocked + wait for staging before the next `optimizer.step()` (saves followed by a step "
        "only); *staging done after*: from the call until the staging future resolved (overlapping the "
        "forward/backward); *wall*: the steps, every wait included, vs the same steps without checkpoints; "
        "*drain*: after the loop, until the last upload is done.",
    ]
    for kind in p["kinds"]:
        title = ("Local disk" + f" (`{m.get('workdir_device', '?')}`)") if kind == "local" else \
            "S3: SeaweedFS on 127.0.0.1 (torch systems through `FsspecWriter` + s3fs)"
        lines += ["", f"#### {title}", "",
                  "| system | saves | blocked | first save: blocked / until mutable | wait for staging | until mutable "
                  "| staging done after | wait for previous upload | wall (s) | vs no checkpoint | drain (s) "
                  "| peak RSS rank 0 / 1 (MiB) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        if none is not None:
            lines.append(f"| {SYSTEMS['none']} | – | – | – | – | – | – | – | {none['wall']:.2f} | 1.00× | – | "
                         f"{none['rss_peak'][0] / MiB:,.0f} / {none['rss_peak'][1] / MiB:,.0f} |")
        for system in CHECKPOINTING:
            row = rows.get((system, kind))
            if row is None:
                continue
            vs = f"{row['wall'] / none['wall']:.2f}×" if none else "–"
            lines.append(
                f"| {SYSTEMS[system]} | {row['n']} | **{_ms(row['blocked'])}** | "
                f"{_ms(row['first_blocked'])} / {_ms(row['first_until_mutable'])} | "
                f"{_ms(row['wait_staging'])} | **{_ms(row['until_mutable'])}** | {_ms(row['staging_done_after'])} | "
                f"{_ms(row['wait_upload'])} | {row['wall']:.2f} | {vs} | {row['drain']:.2f} | "
                f"{row['rss_peak'][0] / MiB:,.0f} / {row['rss_peak'][1] / MiB:,.0f} |")
    if memory is not None:
        lines += memory_table(memory, p, state)
    lines += ["", "#### Targets (same run)", "", "| target | measured | threshold | met |", "|---|---|---|---|"]
    lines += [f"| {t} | {v} | {th} | {'✅' if ok else '❌'} |" for t, v, th, ok in targets(summary, p["kinds"], memory)]
    start = max(r for row in rows.values() for r in row["rss_start"])
    lines += ["", f"RSS before the model existed (Python, torch, gloo; highest rank and run): {start / MiB:,.0f} MiB."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
