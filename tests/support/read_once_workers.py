"""Rank code for test_read_once.py: replicated loads read every stored byte once."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import dcp_ext
from dcp_ext import CheckpointReader, CheckpointWriter, IOConfig, LayoutLoadPlanner
from dcp_ext._runtime import failpoints as _failpoints
from dcp_ext._runtime.nodes import NODE_RANK_ENV
from tests.support.compare import state_diff
from tests.support.dist_workers import data_bytes


def full_state(seed: int = 0) -> dict[str, Any]:
    """Tensors of every size class: one that is split among owners (24 MiB),
    MiB-sized ones, small ones, a 0-d one, an integer one, and a non-tensor value."""
    g = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {
        "embed": torch.randn(3072, 2048, generator=g),  # 24 MiB fp32
        "norm": torch.randn(2048, generator=g),
        "scale": torch.tensor(1.5),
        "ids": torch.randint(0, 1 << 30, (1000,), generator=g),
        "extra": {"step": 7, "name": "run"},
    }
    for i in range(6):
        state[f"layer{i}.weight"] = torch.randn(512, 512 + 64 * i, generator=g).to(torch.bfloat16)
        state[f"layer{i}.bias"] = torch.randn(512, generator=g)
    return state


def zeros_like(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: zeros_like(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return None


_READERS: list[CheckpointReader] = []  # every reader of this process, for its exchange ids


def _load(state: dict[str, Any], path: str, **reader_args: Any) -> tuple[CheckpointReader, float]:
    reader_args.setdefault("read_once", True)  # local files: the default is off on one host
    reader = CheckpointReader(path, **reader_args)
    _READERS.append(reader)
    start = time.perf_counter()
    dcp.load(state, storage_reader=reader, planner=LayoutLoadPlanner())
    return reader, time.perf_counter() - start


def _outcome(reader: CheckpointReader, expected: Any, loaded: Any) -> dict[str, Any]:
    exchange = reader.last_exchange
    plan = exchange.plan if exchange else None
    return {
        "remote": sum(len(s.remote) * s.nbytes for s in plan.sends) if plan else 0,
        "nearby": sum(s.nbytes for s in plan.sends if s.segment_offset >= 0) if plan else 0,
        "bytes_read": reader.store.stats.snapshot().bytes_read,
        "sent": exchange.bytes_sent if exchange else 0,
        "received": exchange.bytes_received if exchange else 0,
        "batches": exchange.plan.batches if exchange else 0,
        "diff": state_diff(expected, loaded),
    }


def _hsdp_state(mesh: Any) -> dict[str, Any]:
    placements = [Replicate(), Shard(0)]
    return {k: distribute_tensor(v, mesh, placements) if isinstance(v, torch.Tensor) and v.dim() else v
            for k, v in full_state(1).items()}


def _zero_dtensors(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            z = v.detach().clone()
            (z.to_local() if hasattr(z, "to_local") else z).zero_()
            out[k] = z
        else:
            out[k] = zeros_like(v)
    return out


def _local(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.to_local() if hasattr(v, "to_local") else v for k, v in state.items()}


def _fsdp_model() -> nn.Module:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(256, 512), nn.BatchNorm1d(512), nn.Linear(512, 256))
    model[1].running_mean.uniform_()  # buffers: plain tensors, the same on every rank
    model[1].running_var.uniform_()
    return model


def four_rank_suite(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """DDP, HSDP 2x2 and FSDP2-with-buffers loads, read-once and not; a
    damaged file and a rank failing mid-exchange (every rank raises the same
    error). Also saves the checkpoints the 3-rank world reshards."""
    out: dict[str, Any] = {}
    ddp_path, hsdp_path, fsdp_path = (f"{root}/{name}" for name in ("ddp", "hsdp", "fsdp"))

    # DDP: every rank holds (and loads) the whole state.
    expected = full_state()
    dcp.save(expected, storage_writer=CheckpointWriter(ddp_path))
    out["ddp_stored"] = data_bytes(ddp_path)
    for read_once in (True, False):
        loaded = zeros_like(expected)
        reader, _ = _load(loaded, ddp_path, read_once=read_once)
        out[f"ddp/{read_once}"] = _outcome(reader, expected, loaded)
    # Small batches: many rounds of the exchange, same result.
    loaded = zeros_like(expected)
    reader, _ = _load(loaded, ddp_path, config=IOConfig(read_buffer_bytes=1 << 20))
    out["ddp/small_batches"] = _outcome(reader, expected, loaded)
    # Over the network only, and as two simulated nodes of two ranks each
    # (shared memory within a node, the network between them).
    loaded = zeros_like(expected)
    reader, _ = _load(loaded, ddp_path, shared_memory=False, config=IOConfig(read_buffer_bytes=8 << 20))
    out["ddp/network"] = _outcome(reader, expected, loaded)
    # The default (read_once=None) on local files: off on one host (the
    # page cache serves every rank), on across (simulated) nodes.
    loaded = zeros_like(expected)
    reader, _ = _load(loaded, ddp_path, read_once=None)
    out["ddp/auto_one_host"] = _outcome(reader, expected, loaded)
    os.environ[NODE_RANK_ENV] = str(rank // 2)
    loaded = zeros_like(expected)
    reader, _ = _load(loaded, ddp_path, config=IOConfig(read_buffer_bytes=8 << 20), read_once=None)
    out["ddp/two_nodes"] = _outcome(reader, expected, loaded)
    os.environ.pop(NODE_RANK_ENV)

    # HSDP 2x2: replicate x shard; each half is needed by two ranks.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    saved = _hsdp_state(mesh)
    dcp.save(saved, storage_writer=CheckpointWriter(hsdp_path))
    out["hsdp_stored"] = data_bytes(hsdp_path)
    loaded = _zero_dtensors(saved)
    reader, _ = _load(loaded, hsdp_path)
    out["hsdp"] = _outcome(reader, _local(saved), _local(loaded))

    # FSDP2 over 4 ranks with BatchNorm buffers (replicated plain tensors).
    model = _fsdp_model()
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    model_state = get_model_state_dict(model)
    dcp.save(model_state, storage_writer=CheckpointWriter(fsdp_path))
    fresh = _fsdp_model()
    for p in fresh.parameters():
        p.data.zero_()
    for b in fresh.buffers():
        b.zero_()
    fully_shard(fresh, mesh=init_device_mesh("cpu", (world_size,)))
    fresh_state = get_model_state_dict(fresh)
    reader, _ = _load(fresh_state, fsdp_path)
    out["fsdp"] = _outcome(reader, _local(model_state), _local(fresh_state))
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    out["fsdp_buffer_bytes"] = buffer_bytes
    out["fsdp_stored"] = data_bytes(fsdp_path)

    # A damaged byte in a shared item: whichever rank owns it fails its
    # checksum, and every rank raises that same error.
    dist.barrier()
    damaged = f"{root}/ddp_damaged"
    if rank == 0:
        import shutil

        shutil.copytree(ddp_path, damaged)
        data = next(p for p in Path(damaged).iterdir() if p.suffix == ".distcp")
        with open(data, "r+b") as f:
            f.seek(data.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x40]))
    dist.barrier()
    out["damaged"] = _failure(lambda: _load(zeros_like(expected), damaged))

    # One rank fails while preparing an exchange batch.
    if rank == 2:
        os.environ["DCP_EXT_FAIL_AT"] = "mid_exchange"
        _failpoints.reload()
    out["mid_exchange"] = _failure(
        lambda: _load(zeros_like(expected), ddp_path, config=IOConfig(read_buffer_bytes=1 << 20))
    )
    os.environ.pop("DCP_EXT_FAIL_AT", None)
    _failpoints.reload()

    # This world's shared-memory segments (other jobs on the machine may have theirs).
    ids = {r.last_exchange.plan.exchange_id for r in _READERS if r.last_exchange is not None}
    assert len(ids) >= 8
    out["shm_left"] = sorted(p.name for p in Path("/dev/shm").glob("dcp_ext-*") if p.name.split("-")[1] in ids)
    # The group still works: a normal load after the failures.
    loaded = zeros_like(expected)
    reader, _ = _load(loaded, ddp_path)
    out["after_failures"] = _outcome(reader, expected, loaded)
    return out


def _failure(load: Any) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        load()
    except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        inner = dcp_ext.errors.unwrap_checkpoint_exception(err)
        return {"type": type(inner).__name__, "message": str(inner), "seconds": time.perf_counter() - start}
    return {"type": None, "message": "", "seconds": time.perf_counter() - start}


def three_rank_reshard(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """4 -> 3: the DDP checkpoint and the HSDP one, loaded whole on 3 ranks."""
    out: dict[str, Any] = {}
    expected = full_state()
    loaded = zeros_like(expected)
    reader, _ = _load(loaded, f"{root}/ddp")
    out["ddp"] = _outcome(reader, expected, loaded)
    hsdp_full = {k: v for k, v in full_state(1).items()}
    loaded = zeros_like(hsdp_full)
    reader, _ = _load(loaded, f"{root}/hsdp")
    out["hsdp"] = _outcome(reader, hsdp_full, loaded)
    # 3 ranks of a 1-D mesh, the HSDP checkpoint resharded to Shard(0) over 3
    # (uneven rows), with the 0-d and non-tensor values replicated.
    mesh = init_device_mesh("cpu", (world_size,))
    sharded = {k: distribute_tensor(v, mesh, [Shard(0)]) if isinstance(v, torch.Tensor) and v.dim() else v
               for k, v in full_state(1).items()}
    for read_once in (True, False):
        loaded_sharded = _zero_dtensors(sharded)
        reader, _ = _load(loaded_sharded, f"{root}/hsdp", read_once=read_once)
        out[f"hsdp_to_fsdp3/{read_once}"] = _outcome(reader, _local(sharded), _local(loaded_sharded))
    return out


def killed_rank_job(rank: int, world_size: int, init_file: str, root: str, results: Any) -> None:
    """(a spawned process; no run_world: rank 2 dies on purpose) A DDP
    read-once load in which rank 2 is SIGKILLed as it starts the second
    exchange batch; the others report what they raised and how fast."""
    import datetime
    import signal
    import warnings

    import dcp_ext.dcp_io._read_exchange as exchange_module

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    expected = full_state()
    path = f"{root}/ddp_killed"
    dcp.save(expected, storage_writer=CheckpointWriter(path))
    dist.barrier()
    if rank == 2:
        run_batch = exchange_module.Exchange.run_batch

        def dying(self: Any, batch: int, *args: Any, **kwargs: Any) -> None:
            if batch == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            run_batch(self, batch, *args, **kwargs)

        exchange_module.Exchange.run_batch = dying  # type: ignore[method-assign]
    start = time.perf_counter()
    outcome: dict[str, Any] = {"rank": rank}
    try:
        _load(zeros_like(expected), path, config=IOConfig(read_buffer_bytes=1 << 20), exchange_timeout=30)
        outcome["error"] = None
    except BaseException:  # noqa: BLE001 - DCP's collective raises gloo's RuntimeError
        error = _READERS[-1].last_error
        outcome["error"] = type(error).__name__ if error is not None else "none recorded"
    outcome["seconds"] = time.perf_counter() - start
    outcome["exchange_id"] = _READERS[-1].last_exchange.plan.exchange_id if _READERS[-1].last_exchange else ""
    results.put(outcome)
    results.close()
    results.join_thread()
    os._exit(0)
