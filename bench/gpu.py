"""The GPU path, measured where there is a GPU: ``python -m bench.gpu``.

Issue 44: every other figure of this bench comes from CPUs. On a machine with
CUDA GPUs this runs one gloo rank per GPU (``--gpus``, default all), each
holding ``--size`` of bf16 tensors on its GPU (``--tensors`` of them), and
measures, per GPU, in ``--repeats`` rounds (median and min–max):

* **save GB/s**: ``dcp.save`` of the GPU state through ``CheckpointWriter``
  (synchronous: the writer copies each tensor to the host as it writes it),
  and ``dcp.async_save`` with ``dcp_ext.Stager`` (device-to-host copies on a
  side stream into pinned, reused buffers) until the upload is done;
* **load GB/s**: ``dcp_ext.load`` into preallocated GPU tensors (bytes read
  into host buffers, then copied to the device), verified bit for bit;
* **training blocked, ms per GiB** and **goodput**: a training loop on the
  GPU (``--steps`` steps of bf16 matmuls over the state, the state updated in
  place each step like an optimizer step) that checkpoints every
  ``--every`` steps with (a) ``dcp_ext.Stager`` and (b) torch's
  ``DefaultStager(StagingOptions(use_pinned_memory=True,
  use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=True))``,
  both through ``dcp.async_save`` with ``CheckpointWriter`` and each waiting
  for its staging future before the next in-place update. *Blocked* = the
  save call plus that wait, per save, per GiB of the rank's state;
  *goodput* = the loop's time without checkpoints / its time with them.

Results: ``bench/results/gpu-<date>.json`` and a table on stdout (and, with
``--readme``, in bench/README.md's ``gpu`` block).

Without a CUDA GPU it stops at once with ``NoGpuError`` and exit status 2;
``--device cpu`` runs the same measurements on CPU tensors (no pinned memory,
no streams: a check of the harness, not a GPU figure).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness.machine import machine_info
from bench.harness.report import update_readme
from dcp_ext.config import parse_size

GiB = 1 << 30
EXIT_NO_GPU = 2


class NoGpuError(RuntimeError):
    """``bench.gpu`` was asked for CUDA measurements on a machine without a CUDA GPU."""


def require_gpus(wanted: int | None) -> int:
    """The GPUs to use (``wanted``, default all).

    Raises:
        NoGpuError: torch sees no CUDA GPU, or fewer than ``wanted``.
    """
    import torch

    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise NoGpuError(f"no CUDA GPU: torch.cuda.is_available() is False (torch {torch.__version__}, {build}); "
                         f"run it on a machine with a GPU, or pass --device cpu to check the harness on CPU")
    count = torch.cuda.device_count()
    if wanted is not None and wanted > count:
        raise NoGpuError(f"--gpus {wanted} asked for, but torch sees {count} CUDA GPU(s)")
    return wanted or count


# -- each rank ------------------------------------------------------------------------------


def _state(rank: int, device: Any, nbytes: int, tensors: int) -> dict[str, Any]:
    import torch

    numel = max(1, nbytes // 2 // tensors)
    gen = torch.Generator(device="cpu").manual_seed(1000 + rank)
    return {f"rank{rank}.t{i}": torch.randn(numel, generator=gen).to(torch.bfloat16).to(device)
            for i in range(tensors)}


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Any, device: Any) -> float:
    import torch.distributed as dist

    _sync(device)
    dist.barrier()
    began = time.perf_counter()
    fn()
    _sync(device)
    dist.barrier()
    return time.perf_counter() - began


def _loop(state: dict[str, Any], steps: int, every: int, stager: Any, root: str, device: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_ext import CheckpointWriter

    work = [torch.randn(2048, 2048, device=device, dtype=torch.bfloat16) / 45 for _ in range(2)]
    blocked, upload = [], None
    staging = None
    _sync(device)
    dist.barrier()
    began = time.perf_counter()
    for step in range(1, steps + 1):
        for _ in range(4):
            work[0] = work[0] @ work[1]
        if staging is not None:  # the state may change only once it is staged
            t = time.perf_counter()
            staging.result()
            blocked[-1] += time.perf_counter() - t
            staging = None
        for tensor in state.values():
            tensor.mul_(0.999)
        if stager is not None and step % every == 0:
            if upload is not None:
                upload.result()
            t = time.perf_counter()
            response = dcp.async_save(state, storage_writer=CheckpointWriter(f"{root}/step{step}"),
                                      async_stager=stager)
            blocked.append(time.perf_counter() - t)
            staging, upload = response.staging_completion, response.upload_completion
            if hasattr(stager, "release_after"):
                stager.release_after(upload)
    _sync(device)
    wall = time.perf_counter() - began
    if staging is not None:
        staging.result()
    if upload is not None:
        upload.result()
    return {"wall": wall, "blocked": blocked}


def _round(path: str, state: dict[str, Any], stager: Any, pinned: bool, cfg: dict[str, Any], device: Any,
           out: dict[str, Any]) -> None:
    """One round of every measurement, its checkpoints under ``path``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    import dcp_ext

    def sync_save() -> None:
        dcp.save(state, storage_writer=dcp_ext.CheckpointWriter(f"{path}/sync"))

    def background() -> None:
        response = dcp.async_save(state, storage_writer=dcp_ext.CheckpointWriter(f"{path}/background"),
                                  async_stager=stager)
        stager.release_after(response.upload_completion)
        response.upload_completion.result()

    target = {k: torch.zeros_like(v) for k, v in state.items()}

    def load() -> None:
        dcp_ext.load(target, f"{path}/sync", strict=False)  # each rank loads its own keys

    out["save_sync"].append(_timed(sync_save, device))
    out["save_async"].append(_timed(background, device))
    out["load"].append(_timed(load, device))
    if not all(torch.equal(target[k].view(torch.int16), state[k].view(torch.int16)) for k in state):
        raise AssertionError(f"{path}: a load differs from the state saved")
    target.clear()
    torch_stager = DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                                use_async_staging=True, use_non_blocking_copy=pinned))
    for name, chosen in (("none", None), ("dcp_ext", stager), ("torch", torch_stager)):
        out["loops"][name].append(_loop(state, cfg["steps"], cfg["every"], chosen, f"{path}/loop-{name}", device))
    torch_stager.close()


def gpu_rank(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One GPU's measurements (see the module docstring)."""
    import torch
    import torch.distributed as dist

    import dcp_ext

    device = torch.device(cfg["device"], rank) if cfg["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    state = _state(rank, device, cfg["size"], cfg["tensors"])
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    root = cfg["root"]
    out: dict[str, Any] = {"rank": rank, "device": str(device), "bytes": nbytes, "save_sync": [], "save_async": [],
                           "load": [], "loops": {"none": [], "dcp_ext": [], "torch": []}}
    pinned = device.type == "cuda"
    stager = dcp_ext.Stager(pin_memory=pinned)
    for r in range(cfg["repeats"]):
        _round(f"{root}/r{r}", state, stager, pinned, cfg, device, out)
        dist.barrier()
        if rank == 0:  # every rank's uploads are done: the round's checkpoints go
            shutil.rmtree(f"{root}/r{r}", ignore_errors=True)
    stager.close()
    return out


# -- summary ----------------------------------------------------------------------------------


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def summarize(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per GPU: save/load GB/s, blocked ms per GiB (median save) and goodput (median round)."""
    rows = []
    for r in ranks:
        gb, gib = r["bytes"] / 1e9, r["bytes"] / GiB
        row: dict[str, Any] = {"gpu": r["device"], "gib": gib}
        for key in ("save_sync", "save_async", "load"):
            row[key] = [gb / s for s in r[key]]
        for name in ("dcp_ext", "torch"):
            blocked = [b for loop in r["loops"][name] for b in loop["blocked"][1:]] or \
                      [b for loop in r["loops"][name] for b in loop["blocked"]]
            row[f"blocked_{name}"] = statistics.median(blocked) * 1e3 / gib if blocked else float("nan")
            row[f"goodput_{name}"] = [n["wall"] / w["wall"] for n, w in zip(r["loops"]["none"], r["loops"][name],
                                                                           strict=True)]
        rows.append(row)
    return rows


def render(record: dict[str, Any]) -> str:
    p, m = record["params"], record["machine"]
    lines = [f"Run of {record['date']}: {p['gpus']} × {record.get('gpu_name', '?')}, {m['cpu_count']} CPUs, "
             f"torch {m['versions'].get('torch')}, dcp_ext {m['versions'].get('dcp_ext')}; {p['size'] / GiB:.2f} GiB "
             f"bf16 per GPU in {p['tensors']} tensors; {p['repeats']} round(s); loop: {p['steps']} steps, a save "
             f"every {p['every']}; storage `{p['root_kind']}`.", "", f"Command: `{record['command']}`", "",
             "| GPU | save GB/s, sync | save GB/s, background (Stager) | load GB/s | blocked ms/GiB, dcp_ext Stager "
             "| blocked ms/GiB, torch DefaultStager (pinned) | goodput, dcp_ext | goodput, torch |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in summarize(record["ranks"]):
        lines.append(f"| {row['gpu']} | {_spread(row['save_sync'])} | {_spread(row['save_async'])} | "
                     f"{_spread(row['load'])} | {row['blocked_dcp_ext']:.1f} | {row['blocked_torch']:.1f} | "
                     f"{_spread(row['goodput_dcp_ext'])} | {_spread(row['goodput_torch'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=None, help="GPUs (one rank each; default: all)")
    parser.add_argument("--size", default="1GiB", help="bf16 state per GPU")
    parser.add_argument("--tensors", type=int, default=64, help="tensors per GPU")
    parser.add_argument("--repeats", type=int, default=3, help="rounds")
    parser.add_argument("--steps", type=int, default=40, help="training loop steps")
    parser.add_argument("--every", type=int, default=10, help="a save every N steps")
    parser.add_argument("--workdir", default=None, help="where checkpoints go (default: a new directory in /tmp)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: run the harness on CPU tensors (a check, not a GPU figure)")
    parser.add_argument("--out", default=None, help="results JSON (default bench/results/gpu-<date>.json)")
    parser.add_argument("--readme", action="store_true", help="render into bench/README.md's gpu block")
    args = parser.parse_args(argv)
    try:
        gpus = require_gpus(args.gpus) if args.device == "cuda" else (args.gpus or 1)
    except NoGpuError as err:
        print(f"python -m bench.gpu: {type(err).__name__}: {err}", file=sys.stderr)
        return EXIT_NO_GPU
    import torch

    from tests.support.dist import run_world

    owned = args.workdir is None
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dcp_ext_gpu_")).resolve()
    cfg = {"device": args.device, "size": parse_size(args.size), "tensors": args.tensors, "repeats": args.repeats,
           "steps": args.steps, "every": args.every, "root": str(workdir / "ckpt")}
    command = "python -m bench.gpu " + " ".join(argv if argv is not None else sys.argv[1:])
    record: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "command": command, "machine": machine_info(workdir),
        "params": {**cfg, "gpus": gpus, "root_kind": "local"},
        "gpu_name": torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU (harness check)",
    }
    try:
        record["ranks"] = run_world(gpus, gpu_rank, cfg, timeout=3600, collective_timeout=3600)
    finally:
        if owned:
            shutil.rmtree(workdir, ignore_errors=True)
    markdown = render(record)
    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / f"gpu-{record['date']}.json"
    out.write_text(json.dumps(record, indent=1))
    print(markdown)
    if args.readme:
        update_readme(Path(__file__).resolve().parent / "README.md", markdown, "gpu")
    print(f"results written to {out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # the check in the parent stays fork-safe
    sys.exit(main())
