"""Fine-tuning load and full-checkpoint export: ``python -m bench.finetune``.

1. **Fine-tuning load** of a full safetensors checkpoint (default 1 GiB bf16,
   the transformer-like shapes of ``bench/harness/state.py``) into a model built on the
   meta device and sharded with FSDP2 over 2 ranks, two ways, each in a fresh
   2-rank world, alternating:

   * ``dcp_ext``: ``dcp_ext.load_pretrained(model, file)``: every rank
     reads only its rows with ranged reads;
   * ``rank0_broadcast``: the pattern of the SageMaker fine-tuning page: rank 0
     loads the whole file (``safetensors.torch.load_file``, as
     ``from_pretrained`` does), the other ranks hold empty weights, and the
     weights are broadcast into the sharded model
     (``set_model_state_dict(..., StateDictOptions(full_state_dict=True,
     broadcast_from_rank0=True))``, FSDP2's ``sync_module_states``).

   Reported: wall time (barrier to barrier, file in the page cache for both)
   and each rank's peak RSS (sampled every 5 ms) above its RSS before the
   model existed.

2. **Export** of a partial checkpoint (saved by the same 2-rank world) to one
   safetensors file with ``CheckpointManager.export`` in a fresh single
   process: GB/s and peak RSS above the process's RSS before exporting.

Results: ``bench/results/finetune-<date>.json`` and the table between the
``finetune`` markers of ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.harness.report import publish
from bench.harness.state import make_spec
from dcp_ext.config import parse_size
from tests.support.dist import run_world

ROOT = Path(__file__).resolve().parent.parent


class _PeakRSS:
    """Samples this process's RSS in a thread; ``peak`` in bytes."""

    def __init__(self) -> None:
        import psutil

        self._process = psutil.Process()
        self.baseline = self._process.memory_info().rss
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)
        return self.peak


def _model(spec: Any, device: str) -> Any:
    import torch
    from torch import nn

    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for i, (_, shape) in enumerate(spec.shapes):
                self.register_parameter(f"p{i}", nn.Parameter(torch.empty(shape, dtype=torch.bfloat16, device=device)))

    return Flat()


def make_checkpoint(path: str, spec: Any) -> int:
    """Write the full checkpoint (safetensors) with deterministic content."""
    import torch

    from dcp_ext.config import IOConfig
    from dcp_ext.full._write import FullTensorSpec, full_layout, stream_full_checkpoint
    from dcp_ext.storage import open_store

    specs = [FullTensorSpec(f"p{i}", torch.bfloat16, shape) for i, (_, shape) in enumerate(spec.shapes)]
    layout = full_layout(specs, "safetensors")

    def fetch(i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(i)
        return torch.randn(specs[i].shape, generator=g, dtype=torch.float32).to(torch.bfloat16)

    store = open_store(os.path.dirname(path), IOConfig(fsync=False))
    with store.open_writer(os.path.basename(path)) as writer:
        stream_full_checkpoint(writer, specs, layout, fetch)
        writer.commit()
    return layout.total_bytes(specs)


def finetune_world(rank: int, world_size: int, method: str, path: str, size: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dcp_ext

    spec = make_spec(size)
    mesh = init_device_mesh("cpu", (world_size,))
    rss = _PeakRSS()
    dist.barrier()
    start = time.perf_counter()
    model = _model(spec, "meta")
    fully_shard(model, mesh=mesh)
    if method == "dcp_ext":
        report = dcp_ext.load_pretrained(model, path)
        bytes_read = report.bytes_read
    else:
        full: dict[str, Any] = {}
        bytes_read = 0
        if rank == 0:
            import safetensors.torch

            full = safetensors.torch.load_file(path)
            bytes_read = os.path.getsize(path)
        model.to_empty(device="cpu")
        set_model_state_dict(
            model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        )
        del full
    dist.barrier()
    elapsed = time.perf_counter() - start
    peak = rss.stop()
    # Check a few shards against the file's content.
    for i in (0, len(spec.shapes) // 2, len(spec.shapes) - 1):
        g = torch.Generator().manual_seed(i)
        want = torch.randn(spec.shapes[i][1], generator=g, dtype=torch.float32).to(torch.bfloat16)
        local = getattr(model, f"p{i}").to_local()
        rows = want.shape[0] // world_size
        assert torch.equal(local, want[rank * rows : rank * rows + local.shape[0]]), (method, i)
    return {"seconds": elapsed, "peak": peak, "baseline": rss.baseline, "bytes_read": bytes_read}


def save_partial_world(rank: int, world_size: int, root: str, size: int) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dcp_ext

    spec = make_spec(size)
    model = _model(spec, "cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    dcp_ext.CheckpointManager(root).save("partial", model)


_EXPORT = """
import json, sys, time, threading, psutil
from bench.finetune import _PeakRSS  # run with cwd = the repository root
import dcp_ext
manager = dcp_ext.CheckpointManager({root!r})
manager.tags()
rss = _PeakRSS()
start = time.perf_counter()
manager.export("partial", out={out!r}, overwrite=True)
elapsed = time.perf_counter() - start
peak = rss.stop()
print(json.dumps({{"seconds": elapsed, "peak": peak, "baseline": rss.baseline}}))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.finetune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1GiB", help="model size (default 1GiB)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per method (default 3)")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--no-readme", action="store_true", help="do not update bench/README.md")
    args = parser.parse_args(argv)
    size = parse_size(args.size)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="dcp_ext_finetune_"))
    work.mkdir(parents=True, exist_ok=True)
    spec = make_spec(size)
    file = str(work / "model.safetensors")
    nbytes = make_checkpoint(file, spec)
    print(f"full checkpoint: {nbytes / 2**30:.2f} GiB, {spec.count} tensors at {file}", flush=True)

    samples: dict[str, list[list[dict[str, Any]]]] = {"dcp_ext": [], "rank0_broadcast": []}
    for round_ in range(args.repeats):
        order = ["dcp_ext", "rank0_broadcast"] if round_ % 2 == 0 else ["rank0_broadcast", "dcp_ext"]
        for method in order:
            result = run_world(2, finetune_world, method, file, size, timeout=1800)
            samples[method].append(result)
            print(f"  round {round_ + 1} {method:16s} {result[0]['seconds']:.2f}s  peak RSS "
                  f"{[round((r['peak'] - r['baseline']) / 2**20) for r in result]} MiB above baseline", flush=True)

    run_world(2, save_partial_world, str(work / "root"), size, timeout=1800)
    exports = []
    for _ in range(args.repeats):
        script = _EXPORT.format(root=str(work / "root"), out="exported")
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=1800,
                              cwd=ROOT)
        if done.returncode != 0:
            raise RuntimeError(done.stderr)
        exports.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"  export {exports[-1]['seconds']:.2f}s", flush=True)

    def med(values: list[float]) -> float:
        return statistics.median(values)

    summary: dict[str, Any] = {}
    for method, rounds in samples.items():
        summary[method] = {
            "seconds": med([r[0]["seconds"] for r in rounds]),
            "peak_above_baseline_mib": [med([(r[k]["peak"] - r[k]["baseline"]) / 2**20 for r in rounds]) for k in range(2)],
            "peak_mib": [med([r[k]["peak"] / 2**20 for r in rounds]) for k in range(2)],
            "bytes_read": [rounds[0][k]["bytes_read"] for k in range(2)],
        }
    summary["export"] = {
        "seconds": med([e["seconds"] for e in exports]),
        "gb_per_s": nbytes / 1e9 / med([e["seconds"] for e in exports]),
        "peak_above_baseline_mib": med([(e["peak"] - e["baseline"]) / 2**20 for e in exports]),
    }
    a, b = summary["dcp_ext"], summary["rank0_broadcast"]
    summary["speedup"] = b["seconds"] / a["seconds"]
    summary["rank0_peak_ratio"] = a["peak_mib"][0] / b["peak_mib"][0]
    summary["rank0_peak_above_baseline_ratio"] = a["peak_above_baseline_mib"][0] / b["peak_above_baseline_mib"][0]
    record = {
        "date": datetime.date.today().isoformat(),
        "size_bytes": nbytes,
        "tensors": spec.count,
        "repeats": args.repeats,
        "cpus": os.cpu_count(),
        "summary": summary,
        "samples": samples,
        "exports": exports,
    }
    publish(record, "finetune", render(record), readme=not args.no_readme)
    return 0


def render(record: dict[str, Any]) -> str:
    s = record["summary"]
    a, b, e = s["dcp_ext"], s["rank0_broadcast"], s["export"]
    gib = record["size_bytes"] / 2**30
    return "\n".join([
        f"Run of {record['date']}, {record['cpus']} CPUs: a {gib:.2f} GiB bf16 full safetensors checkpoint "
        f"({record['tensors']} tensors) loaded into a meta-device model sharded with FSDP2 over 2 ranks; "
        f"median of {record['repeats']} rounds per method, each in a fresh world, file in the page cache.",
        "",
        "| method | time (s) | rank 0 peak RSS (MiB) | rank 1 peak RSS (MiB) | rank 0 / rank 1 above baseline (MiB) | bytes read rank 0 / rank 1 |",
        "|---|---:|---:|---:|---:|---:|",
        f"| dcp_ext `load_pretrained` (sliced reads) | {a['seconds']:.2f} | {a['peak_mib'][0]:.0f} | {a['peak_mib'][1]:.0f} | "
        f"{a['peak_above_baseline_mib'][0]:.0f} / {a['peak_above_baseline_mib'][1]:.0f} | {a['bytes_read'][0]:,} / {a['bytes_read'][1]:,} |",
        f"| rank 0 loads, broadcast (`broadcast_from_rank0`) | {b['seconds']:.2f} | {b['peak_mib'][0]:.0f} | {b['peak_mib'][1]:.0f} | "
        f"{b['peak_above_baseline_mib'][0]:.0f} / {b['peak_above_baseline_mib'][1]:.0f} | {b['bytes_read'][0]:,} / {b['bytes_read'][1]:,} |",
        "",
        f"Targets: dcp_ext ≥ 1.5× faster: **{s['speedup']:.2f}×**; rank 0 peak RSS ≤ 0.6×: "
        f"**{s['rank0_peak_ratio']:.2f}×** absolute, **{s['rank0_peak_above_baseline_ratio']:.2f}×** above baseline.",
        "",
        f"Export of the same model saved as a 2-rank partial checkpoint to one safetensors file "
        f"(`CheckpointManager.export`, one process): **{e['gb_per_s']:.2f} GB/s** ({e['seconds']:.2f} s), "
        f"peak RSS **{e['peak_above_baseline_mib']:.0f} MiB** above the process's RSS before exporting "
        f"(model: {gib * 1024:.0f} MiB).",
    ])


if __name__ == "__main__":
    sys.exit(main())
