"""The README's first command: save and load a sharded checkpoint across 2 local processes.

Two ranks form a gloo process group on this machine, shard a small MLP with
FSDP2, take an Adam step, save model + optimizer with ``dcp.save`` and
:class:`~dcp_ext.CheckpointWriter`, load into a freshly initialized sharded
model with :class:`~dcp_ext.CheckpointReader`, and check every shard
bit for bit. Then one process with no process group loads the full weights
from the same checkpoint (as an evaluation job would). Each step prints what
it did and how fast.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
import warnings
from typing import Any

from .dcp_io import CheckpointReader, CheckpointWriter


def _build(world_size: int, width: int, depth: int, seed: int) -> tuple[Any, Any]:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(width, 10))
    if world_size > 0:
        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).square().mean().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def _rank_main(rank: int, world_size: int, rendezvous: str, path: str, width: int, depth: int, out: Any) -> None:
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save


    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        model, optim = _build(world_size, width, depth, seed=0)
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optimizer": osd}

        dist.barrier()
        start = time.perf_counter()
        dcp_save(state, storage_writer=CheckpointWriter(path))
        dist.barrier()
        save_s = time.perf_counter() - start

        fresh, fresh_optim = _build(world_size, width, depth, seed=1)
        msd2, osd2 = get_state_dict(fresh, fresh_optim)
        loaded: dict[str, Any] = {"model": msd2, "optimizer": osd2}
        reader = CheckpointReader(path)
        dist.barrier()
        start = time.perf_counter()
        dcp_load(loaded, storage_reader=reader)
        dist.barrier()
        load_s = time.perf_counter() - start
        set_state_dict(fresh, fresh_optim, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])

        mismatches = 0
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
            if not torch.equal(a.to_local(), b.to_local()):
                mismatches += 1
        for key, state_a in optim.state_dict()["state"].items():
            state_b = fresh_optim.state_dict()["state"][key]
            for field, value in state_a.items():
                value_b = state_b[field]
                local_a = value.to_local() if hasattr(value, "to_local") else value
                local_b = value_b.to_local() if hasattr(value_b, "to_local") else value_b
                if not torch.equal(local_a, local_b):
                    mismatches += 1
        out.put((rank, save_s, load_s, reader.store.stats.snapshot().bytes_read, mismatches))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # All work is done and reported. A gloo rank can still abort (SIGABRT) in
    # its C++ teardown at interpreter exit, which would read as a failure:
    # deliver the result, flush, and leave without that teardown.
    out.close()
    out.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def run(path: str | None, width: int, depth: int, world_size: int = 2) -> int:
    """Run the demo; returns a process exit code (0 when every check passed)."""
    warnings.filterwarnings("ignore")
    import torch
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load


    root = tempfile.mkdtemp(prefix="dcp_ext_demo_")
    path = path or os.path.join(root, "checkpoint")
    rendezvous = os.path.join(root, "rendezvous")
    print(f"dcp_ext demo: {world_size} processes (gloo on CPU), FSDP2-sharded MLP "
          f"{depth} x {width}x{width} + Adam, checkpoint at {path}")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, rendezvous, path, width, depth, out))
        for r in range(world_size)
    ]
    try:
        for proc in procs:
            proc.start()
        results = []
        for _ in procs:
            results.append(out.get(timeout=600))
        for proc in procs:
            proc.join(timeout=60)
        if any(p.exitcode != 0 for p in procs):
            print(f"FAILED: rank exit codes {[p.exitcode for p in procs]}")
            return 1
        results.sort()
        files = sorted(os.listdir(path))
        total = sum(os.path.getsize(os.path.join(path, f)) for f in files)
        save_s = max(r[1] for r in results)
        load_s = max(r[2] for r in results)
        print(f"  saved  {_size(total)} in {len(files)} files {files}")
        print(f"  save:  {save_s:.3f} s  ({total / save_s / 1e9:.2f} GB/s, all ranks, fsync'ed)")
        print(f"  load:  {load_s:.3f} s  ({total / load_s / 1e9:.2f} GB/s)")
        for rank, _, _, nbytes, _ in results:
            print(f"  rank {rank} read {_size(nbytes)} (its own shards)")
        bad = sum(r[4] for r in results)
        print(f"  check: model and optimizer shards {'bit-exact' if bad == 0 else f'{bad} MISMATCHES'}")

        # One process, no process group: the full weights for evaluation.
        plain, _ = _build(0, width, depth, seed=2)
        state = {"model": plain.state_dict()}
        start = time.perf_counter()
        dcp_load(state, storage_reader=CheckpointReader(path))
        one_s = time.perf_counter() - start
        reference, _ = _build(0, width, depth, seed=0)
        same = all(torch.equal(state["model"][k], v) for k, v in reference.state_dict().items())
        print(f"  1 process, no process group: loaded the full model in {one_s:.3f} s, "
              f"{'equal to the original weights' if same else 'MISMATCH'}")
        print("demo " + ("passed" if bad == 0 and same else "FAILED"))
        return 0 if bad == 0 and same else 1
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        shutil.rmtree(root, ignore_errors=True)  # rendezvous, and the checkpoint unless --path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--path", help="checkpoint directory (default: a temporary one, removed after)")
    parser.add_argument("--width", type=int, default=1536, help="hidden size (default 1536)")
    parser.add_argument("--depth", type=int, default=8, help="number of hidden layers (default 8)")
