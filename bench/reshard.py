"""Resharded loads and load planning: ``python -m bench.reshard``.

1. **Resharded loads.** A 1 GiB bf16 model (the transformer-like shapes of
   ``bench/harness/state.py``, FSDP2 ``Shard(0)``) is saved by 4 ranks with
   ``CheckpointManager``, then loaded at 4 ranks (the same partition), 2 and 1
   with dcp_ext (``CheckpointReader`` + ``LayoutLoadPlanner`` given the
   checkpoint's ``partition.json``, under the GC pause that ``dcp_ext.load``
   applies; checksums verified) and with torch's ``FileSystemReader`` +
   ``DefaultLoadPlanner``, alternating, each world fresh. Per rank: wall time
   (barrier to barrier; the checkpoint is in the page cache for both), bytes
   read (dcp_ext: counted by its store; torch: the byte length of every
   stored item its plan touches, which it reads whole), and planning time
   (from ``dcp.load`` to the storage reader's ``read_data``).

2. **Planning scaling.** Synthetic metadata of T tensors (48 x 16 fp32 each)
   as 8 FSDP2 ranks save them (8 chunks per tensor), planned for each of 3
   loading ranks in one process with torch's ``fake`` process group, for T =
   5,000 ... 40,000: JSON metadata decode time and planning time
   (``set_up_planner`` + ``create_local_plan`` + the reader's
   ``set_up_storage_reader``), dcp_ext's planner and DCP's default one.

Results: ``bench/results/reshard-<date>.json`` and the tables between the
``reshard`` markers of ``bench/README.md``.
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
import time
from pathlib import Path
from typing import Any

from bench.harness.report import publish
from bench.harness.state import make_spec
from dcp_ext.config import parse_size
from tests.support.dist import run_world

ROOT = Path(__file__).resolve().parent.parent


def _model(spec: Any, device: str) -> Any:
    import torch
    from torch import nn

    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for i, (_, shape) in enumerate(spec.shapes):
                self.register_parameter(f"p{i}", nn.Parameter(torch.empty(shape, dtype=torch.bfloat16, device=device)))

    return Flat()


def save_world(rank: int, world_size: int, root: str, size: int) -> int:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dcp_ext

    spec = make_spec(size)
    model = _model(spec, "meta")
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            g = torch.Generator().manual_seed(i * 131 + rank)
            p.to_local().copy_(torch.randn(p.to_local().shape, generator=g).to(torch.bfloat16))
    dcp_ext.CheckpointManager(root).save("s", model)
    return spec.nbytes


def load_world(rank: int, world_size: int, root: str, size: int, method: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dcp_ext
    from dcp_ext.layout import Partition

    spec = make_spec(size)
    model = _model(spec, "meta")
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    model.to_empty(device="cpu")
    state = {"model": get_model_state_dict(model)}
    path = f"{root}/s_partial"
    marks: dict[str, float] = {}
    if method == "dcp_ext":

        class Reader(dcp_ext.CheckpointReader):
            def read_data(self, plan: Any, planner: Any) -> Any:
                marks["read"] = time.perf_counter()
                return super().read_data(plan, planner)

        reader: Any = Reader(path)
        partition = Partition.from_json(open(f"{path}/partition.json", "rb").read(), "partition.json")
        planner: Any = dcp_ext.LayoutLoadPlanner(partition=partition, world_size=world_size)
    else:

        class TorchReader(FileSystemReader):
            touched = 0

            def read_data(self, plan: Any, planner: Any) -> Any:
                marks["read"] = time.perf_counter()
                indexes = {item.storage_index for item in plan.items}
                TorchReader.touched = sum(self.storage_data[i].length for i in indexes)
                return super().read_data(plan, planner)

        reader = TorchReader(path)
        planner = None
    dist.barrier()
    start = time.perf_counter()
    if method == "dcp_ext":
        # Exactly what dcp_ext.load / CheckpointManager.resume do around
        # dcp.load: pause the cyclic GC (see dcp_ext/_gc.py).
        from dcp_ext._runtime import gc_paused

        with gc_paused():
            dcp_load(state, storage_reader=reader, planner=planner)
    else:
        dcp_load(state, storage_reader=reader, planner=planner)
    dist.barrier()
    elapsed = time.perf_counter() - start
    if method == "dcp_ext":
        bytes_read = reader.store.stats.snapshot().bytes_read
        fast = planner.fast_path_keys
    else:
        bytes_read, fast = TorchReader.touched, 0
    return {"seconds": elapsed, "planning": marks["read"] - start, "bytes_read": bytes_read, "fast_path": fast}


_PLANNING = r"""
import json, sys, time, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
    TensorProperties, TensorStorageMetadata)
from dcp_ext.metadata import StoredItem, encode_metadata, decode_metadata
from dcp_ext.planners import LayoutLoadPlanner
from dcp_ext.dcp_io._reader import CheckpointReader

T, SAVERS, LOADERS, ROWS, COLS = {count}, 8, 3, 48, 16
state_md, items = {{}}, {{}}
chunk_rows = ROWS // SAVERS
for t in range(T):
    fqn = f"model.layer{{t}}.weight"
    chunks = []
    for r in range(SAVERS):
        off = (r * chunk_rows, 0)
        chunks.append(ChunkStorageMetadata(torch.Size(off), torch.Size((chunk_rows, COLS))))
        items[MetadataIndex(fqn, off)] = StoredItem(f"model_rank{{r}}.distcp", t * 4096, 4096, 0, chunk_rows * COLS * 4)
    state_md[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size((ROWS, COLS)), chunks)
doc = encode_metadata(Metadata(state_dict_metadata=state_md), items, world_size=SAVERS)
start = time.perf_counter()
decoded = decode_metadata(doc, "synthetic").metadata
decode_s = time.perf_counter() - start
result = {{"tensors": T, "metadata_bytes": len(doc), "decode_s": decode_s, "ours": [], "default": []}}
for rank in range(LOADERS):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=LOADERS)
    mesh = init_device_mesh("cpu", (LOADERS,))
    rows = ROWS // LOADERS
    sd = {{"model": {{f"layer{{t}}.weight": DTensor.from_local(torch.empty(rows, COLS), mesh, [Shard(0)], run_check=False,
        shape=torch.Size((ROWS, COLS)), stride=(COLS, 1)) for t in range(T)}}}}
    for name, planner in (("ours", LayoutLoadPlanner()), ("default", DefaultLoadPlanner())):
        reader = CheckpointReader("/nonexistent")
        start = time.perf_counter()
        planner.set_up_planner(sd, decoded, rank == 0)
        reader.set_up_storage_reader(decoded, rank == 0)
        plan = reader.prepare_local_plan(planner.create_local_plan())
        result[name].append(time.perf_counter() - start)
        assert len(plan.items) >= T * 3, len(plan.items)  # a 16-row shard spans 3-4 saved 6-row chunks
    dist.destroy_process_group()
print(json.dumps(result))
"""


def planning_scaling(counts: list[int]) -> list[dict[str, Any]]:
    out = []
    for count in counts:
        script = _PLANNING.format(count=count)
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=3600,
                              cwd=ROOT)
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-4000:])
        record = json.loads(done.stdout.strip().splitlines()[-1])
        out.append(record)
        print(f"  planning {count:>6} tensors: decode {record['decode_s']:.3f}s, ours "
              f"{max(record['ours']):.3f}s/rank, default {max(record['default']):.3f}s/rank", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.reshard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1GiB", help="model size (default 1GiB)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per method and world size (default 3)")
    parser.add_argument("--counts", default="5000,10000,20000,40000", help="tensor counts for the planning scaling")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args(argv)
    size = parse_size(args.size)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="dcp_ext_reshard_"))
    root = str(work / "root")
    nbytes = run_world(4, save_world, root, size, timeout=3600)[0]
    print(f"saved {nbytes / 2**30:.2f} GiB at 4 ranks in {root}", flush=True)
    loads: dict[str, dict[str, list[list[dict[str, Any]]]]] = {}
    for world in (4, 2, 1):
        loads[str(world)] = {"dcp_ext": [], "torch": []}
        for round_ in range(args.repeats):
            order = ["dcp_ext", "torch"] if round_ % 2 == 0 else ["torch", "dcp_ext"]
            for method in order:
                result = run_world(world, load_world, root, size, method, timeout=3600)
                loads[str(world)][method].append(result)
                print(f"  load at {world}: {method:8s} {result[0]['seconds']:.3f}s planning "
                      f"{result[0]['planning']:.3f}s bytes/rank {[r['bytes_read'] for r in result]}", flush=True)
    scaling = planning_scaling([int(c) for c in args.counts.split(",")])
    record = {"date": datetime.date.today().isoformat(), "size_bytes": nbytes, "repeats": args.repeats,
              "cpus": os.cpu_count(), "loads": loads, "planning": scaling}
    publish(record, "reshard", render(record), readme=not args.no_readme)
    return 0


def render(record: dict[str, Any]) -> str:
    nbytes = record["size_bytes"]
    med = statistics.median
    rows = []
    speeds: dict[tuple[str, str], float] = {}
    for world, methods in record["loads"].items():
        for method, rounds in methods.items():
            seconds = med([r[0]["seconds"] for r in rounds])
            planning = med([r[0]["planning"] for r in rounds])
            per_rank = [max(r[k]["bytes_read"] for r in rounds) for k in range(int(world))]
            ideal = nbytes / int(world)
            speeds[(world, method)] = nbytes / 1e9 / seconds
            worst = max(per_rank) / ideal
            rows.append(f"| 4 → {world} | {method} | {nbytes / 1e9 / seconds:.2f} | {seconds:.3f} | {planning:.3f} | "
                        f"{max(per_rank) / 2**20:.1f} MiB | {worst:.3f}× |")
    same = speeds[("4", "dcp_ext")]
    lines = [
        f"Run of {record['date']}, {record['cpus']} CPUs: {nbytes / 2**30:.2f} GiB bf16 saved by 4 FSDP2 ranks, "
        f"loaded at 4 (same partition), 2 and 1; median of {record['repeats']} rounds, fresh world each, page cache warm.",
        "",
        "| reshard | reader | GB/s | time (s) | planning (s) | most bytes read by a rank | vs ideal (size / M) |",
        "|---|---|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "Targets: resharded load ≥ 0.8× the same-partition load: "
        + ", ".join(f"4 → {w}: **{speeds[(w, 'dcp_ext')] / same:.2f}×**" for w in ("2", "1"))
        + "; ≥ 1.5× torch's reader on the same reshard: "
        + ", ".join(f"4 → {w}: **{speeds[(w, 'dcp_ext')] / speeds[(w, 'torch')]:.2f}×**" for w in ("2", "1"))
        + ".",
        "",
        "Planning (synthetic metadata, 8 saving ranks, 3 loading ranks, slowest rank; JSON decode once per rank):",
        "",
        "| tensors | saved chunks | metadata JSON | decode (s) | dcp_ext plan (s) | DCP default plan (s) | dcp_ext growth vs half as many |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    previous = None
    for rec in record["planning"]:
        ours = max(rec["ours"])
        growth = f"{ours / previous:.2f}×" if previous else ""
        lines.append(f"| {rec['tensors']:,} | {rec['tensors'] * 8:,} | {rec['metadata_bytes'] / 2**20:.1f} MiB | "
                     f"{rec['decode_s']:.3f} | {ours:.3f} | {max(rec['default']):.3f} | {growth} |")
        previous = ours
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
