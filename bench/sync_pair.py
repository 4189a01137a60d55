"""Synchronous saves side by side in one world: dcp_ext's against torch's (issue 44).

``python -m bench.sync_pair [--state-size 512MiB] [--saves 12] [--only local|s3]``

``bench.blocking`` compares whole training runs, each system in a world of its
own; on a shared 2-core machine the runs' compute phases drift by more than a
synchronous save costs (its no-checkpoint reference ranged 54-82 s over three
rounds), so its sync-wall ratio measures the machine as much as the save.
Here the two synchronous saves alternate in **one** world (the same two
ranks, model, FSDP2 state, storage and cache state, the order swapped every
save): dcp_ext's ``CheckpointManager.save(tag, model, optim)`` against torch's
``dcp.save(get_state_dict(model, optim), storage_writer=FileSystemWriter(path))``
(``FsspecWriter`` over s3fs on S3), each to a fresh directory. Each save is
timed from a barrier to its return on the slower rank (``all_reduce`` MAX);
the first two of each system are left out (first-save costs); the report
gives each system's median and the median of the paired ratios (each
dcp_ext save against the torch save beside it).

The model is ``bench.blocking``'s (``bench/harness/training.py``: Linear
layers + Adam, one training step so the moments exist), sized by
``--state-size`` (params + 2 moments, fp32, over both ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness.machine import compact_machine_info
from bench.harness.storage import storage
from bench.harness.training import build_training, forward_backward, layer_width, optimizer_step
from bench.harness.world import run_world
from dcp_ext.config import parse_size

SYSTEMS = ("dcp_ext", "torch")
WARMUP = 2


def pair_world(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """(each rank) Alternate the two systems' sync saves; rank 0 returns every save's time."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import dcp_ext

    model, optim, batch = build_training(rank, world_size, cfg["width"], cfg["layers"])
    forward_backward(model, batch)
    optimizer_step(optim)
    root, options = cfg["root"], cfg["options"]
    manager = dcp_ext.CheckpointManager(f"{root}/dcp_ext", storage_options=options)

    def torch_writer(path: str) -> Any:
        if options is None:
            return dcp.FileSystemWriter(path)
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(path, **options)

    seconds: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    for k in range(cfg["saves"]):
        for name in SYSTEMS if k % 2 == 0 else SYSTEMS[::-1]:
            dist.barrier()
            start = time.perf_counter()
            if name == "dcp_ext":
                manager.save(f"s{k}", model, optim)
            else:
                msd, osd = get_state_dict(model, optim)
                dcp.save({"model": msd, "optim": osd}, storage_writer=torch_writer(f"{root}/torch/s{k}"))
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            seconds[name].append(float(took.item()))
    manager.close()
    state_bytes = sum(t.numel() * t.element_size() for t in _local_tensors(model, optim))
    dist.barrier()
    return {"seconds": seconds, "state_bytes_rank0": state_bytes}


def _local_tensors(model: Any, optim: Any) -> list[Any]:
    import torch

    tensors = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    for state in optim.state.values():
        tensors += [v.to_local() if hasattr(v, "to_local") else v for v in state.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0]
    return tensors


def summarize(seconds: dict[str, list[float]]) -> dict[str, Any]:
    """Medians (ms) after the warm-up saves and the median paired ratio dcp_ext / torch."""
    kept = {name: values[WARMUP:] for name, values in seconds.items()}
    ratios = [a / b for a, b in zip(kept["dcp_ext"], kept["torch"])]
    return {
        "median_ms": {name: round(statistics.median(v) * 1e3, 1) for name, v in kept.items()},
        "range_ms": {name: [round(min(v) * 1e3, 1), round(max(v) * 1e3, 1)] for name, v in kept.items()},
        "paired_ratio_median": round(statistics.median(ratios), 3),
        "paired_ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
        "saves_counted": len(ratios),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sync_pair", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--state-size", default="512MiB", help="params + 2 Adam moments (fp32), total over 2 ranks")
    parser.add_argument("--layers", type=int, default=16, help="Linear layers of the model")
    parser.add_argument("--saves", type=int, default=12, help="saves per system (the first 2 are not counted)")
    parser.add_argument("--only", choices=["local", "s3"], help="one storage kind only")
    parser.add_argument("--workdir", default=None, help="where local saves go (default: a temporary directory)")
    parser.add_argument("--out", default=None, help="JSON results file")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.saves <= WARMUP:
        parser.error(f"--saves must be more than {WARMUP} (the first {WARMUP} are not counted)")
    width = layer_width(parse_size(args.state_size), args.layers)
    kinds = [args.only] if args.only else ["local", "s3"]
    results: dict[str, Any] = {"command": " ".join(["python -m bench.sync_pair", *argv]),
                               "machine": compact_machine_info(), "width": width, "layers": args.layers, "kinds": {}}
    with tempfile.TemporaryDirectory(dir=args.workdir) as work:
        for kind in kinds:
            load_start = [round(x, 2) for x in os.getloadavg()]
            with storage(kind, Path(work), f"pair-{kind}") as (root, options):
                cfg = {"root": root, "options": options, "width": width, "layers": args.layers, "saves": args.saves}
                value = run_world(2, "bench.sync_pair:pair_world", cfg)
            summary = summarize(value["seconds"])
            summary.update(seconds=value["seconds"], state_bytes_rank0=value["state_bytes_rank0"],
                           loadavg_start=load_start, loadavg_end=[round(x, 2) for x in os.getloadavg()])
            results["kinds"][kind] = summary
            print(f"{kind}: dcp_ext {summary['median_ms']['dcp_ext']} ms, torch {summary['median_ms']['torch']} ms "
                  f"(medians of {summary['saves_counted']}); paired dcp_ext/torch {summary['paired_ratio_median']}x "
                  f"(range {summary['paired_ratio_range']}); state per rank "
                  f"{value['state_bytes_rank0'] / 2**20:.0f} MiB; load {load_start} -> {summary['loadavg_end']}",
                  flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
