"""Framework saves through dcp_ext vs the frameworks' defaults: ``python -m bench.frameworks``.

Issue 34: the torchtitan and Lightning saves of the bench model through
dcp_ext against the same frameworks with their default writers, on local disk
and on S3, in the same run, compared with the ratios of the main table.

One 2-rank gloo world (real ``torch.distributed`` processes) holds one FSDP2
model whose parameters are the main table's state dict
(``bench.harness.state``: same names, shapes, bf16, seeded random bits,
``Shard(0)`` over 2 ranks; every decoder layer and the root a ``fully_shard``
unit), and torchtitan's ``OptimizersContainer`` (AdamW, the only kind it
builds) over it, whose two moments are filled with seeded random bits too (its
``state_dict`` creates them as zeros, which any compressor would flatter).
Every framework system saves that same model and that same optimizer: about
3x the main table's bytes per save (model + 2 moments), incompressible.

Systems, each saving synchronously, as a training loop would:

* **torchtitan 0.3.0**: its stock ``CheckpointManager`` (``save(step)``,
  interval 1, ``keep_latest_k=0``): ``dcp.save(checkpoint_id=...)``, which
  picks torch's ``FileSystemWriter`` for a local path and torch's
  ``FsspecWriter`` (s3fs) for an ``s3://`` folder; vs
  ``dcp_ext.integrations.torchtitan.DcpExtCheckpointManager`` plain and with
  ``compression="zstd"`` (``storage_options`` for S3, its defaults otherwise).
  Stock torchtitan passes no options to fsspec, so for S3 the endpoint and
  credentials go into fsspec's own configuration (``fsspec.config.conf["s3"]``,
  what ``FSSPEC_S3`` in the environment sets): stock code, no patch.
* **Lightning**: one ``Trainer`` per strategy, set up once by a one-batch
  ``fit`` (manual optimization, no step taken: the model and optimizer stay
  as built), then ``trainer.save_checkpoint(path)`` per measurement (Lightning's
  ``dump_checkpoint`` + the strategy's ``save_checkpoint`` + a barrier). Stock
  ``ModelParallelStrategy`` (FSDP2; ``dcp.save`` with torch's
  ``FileSystemWriter``, then ``meta.pt`` by rank 0) vs
  ``DcpExtModelParallelStrategy``. The stock strategy turns the path into a
  ``pathlib.Path``, so ``s3://b/x`` becomes the local directory ``s3:/b/x``:
  it cannot save to S3. Its S3 row is the stock strategy with only that
  undone (the path kept a string, so torch picks ``FsspecWriter``, and
  ``meta.pt`` written with fsspec): torch's default on S3, as for the main
  table. The three Trainers share the model and torchtitan's AdamW.
* **Megatron-Core 0.16.1** (:mod:`bench.frameworks_megatron`): the same
  model and moments as a Megatron sharded state dict, saved by megatron-core's
  ``dist_checkpointing.save`` with its default ``torch_dist`` strategy (two
  CUDA calls stubbed so that it runs on CPU) vs ``DcpExtSaveShardedStrategy``
  (local) and ``dcp_ext.integrations.megatron.save`` (S3). Megatron cannot
  write to ``s3://``, so its S3 stock row is the ``torch_dist`` save to local
  disk followed by an s3fs upload of the folder (what a user does without
  dcp_ext), timed together.
* **torch_checkpointing 0.1.1** (:mod:`bench.frameworks_tc`): the same model
  and moments as a ``CheckpointManager`` payload, saved synchronously with its
  default local storage vs ``DcpExtStorageConfig`` (local, and S3 with a
  commit marker); its S3 row is held against the stock local one (the
  ceiling: the same disk the S3 server writes to) and, as same-run
  references, the stock save followed by an s3fs upload, ``dcp_ext.save`` of
  the same tensors and a raw boto3 upload of the same bytes.
* **plain DCP** (no framework): the main table's own systems
  (``bench.harness.systems``: ``CheckpointWriter`` vs ``FileSystemWriter``
  thread_count=1 locally, vs ``FsspecWriter`` on S3) on the main table's
  state (the model's parameters + its two non-tensor values): the main
  table's ratio, measured in this run.

Each round every system of a storage kind saves once, in an order rotated by
one each round and reversed every other round; the first round is an untimed
warm-up (clients, thread pools, first directories). Before every timed save
the previous save was deleted, all dirty pages written back (``sync``) and
the clean page cache dropped (when allowed), so every save starts on an idle
disk with the same free memory. A time is the slower rank's, from a barrier to
the save's return (``trainer.save_checkpoint`` ends in a barrier, torchtitan's
``save`` in DCP's collectives). GB/s = 10⁹ bytes of tensor data saved (model +
optimizer, the same for every framework system) per second. S3 is SeaweedFS
on 127.0.0.1 (``bench.harness.storage``), as in the main table.

After each local round, what a save of a framework's state pays whatever it
stores is timed apart: the framework building the state dict it hands DCP,
and ``dcp.save`` of that state dict through a writer that resolves every item
and stores nothing (DCP's planning, collectives, pickling, metadata), once
with DCP's default planner (what the stock saves pay) and once with the
planner dcp_ext's adapters use (``LayoutSavePlanner`` with DCP's plan
caching: from the second save of an unchanged structure on, no rank sends
its plan and the coordinator plans nothing). The first one's share of a
dcp_ext save says how much of a framework save no writer can speed up.

Results: ``bench/results/frameworks-<date>.json`` and the ``frameworks`` block
of bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.frameworks_megatron import megatron_systems
from bench.frameworks_report import PAIRS, REFERENCES, main_table_ratios, newest_main_table, render, summarize
from bench.frameworks_report import MAIN_TARGETS  # noqa: F401 - re-exported: the suite's constants stay importable from here
from bench.frameworks_tc import tc_systems
from bench.harness.machine import machine_info
from bench.harness.report import publish
from bench.harness.storage import storage
from dcp_ext.config import parse_size

_DROP_CACHES = "/proc/sys/vm/drop_caches"
#: The plan-cache name each framework's dcp_ext adapter plans under (``dcp_ext.integrations._planning``).
ADAPTER_PLANS = {"torchtitan": "torchtitan", "lightning": "lightning"}


# -- the model (each rank) ------------------------------------------------------------------


def build_model(spec: Any, rank: int, world: int, mesh: Any) -> Any:
    """An FSDP2 module whose parameters are the main table's state dict: the
    names and shapes of ``spec``, bf16, each rank's ``Shard(0)`` shard holding
    the bits ``bench.harness.state.build_state`` gives it."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from bench.harness.state import DTYPE, build_state, local_tensor

    with torch.device("meta"):
        root = nn.Module()
        for name, shape in spec.shapes:
            *path, leaf = name.split(".")
            module = root
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, nn.Module())
                module = getattr(module, part)
            module.register_parameter(leaf, nn.Parameter(torch.empty(shape, dtype=DTYPE)))
    for layer in root.model.layers.children():
        fully_shard(layer, mesh=mesh)
    fully_shard(root, mesh=mesh)
    root.to_empty(device="cpu")
    source = build_state(spec, rank, world, mesh)
    with torch.no_grad():
        for name, param in root.named_parameters():
            param.to_local().copy_(local_tensor(source[name]))
    return root


def _fill_moments(optimizers: Any, rank: int) -> None:
    """Give AdamW its state, the moments' local shards seeded random bits.

    torchtitan's ``state_dict`` would create it as zeros (which any compressor
    flatters) by a zero-lr AdamW step over every parameter: 50 s for a 128 MiB
    bf16 model on 2 busy cores. Created here as Adam creates it (``step``, two
    moments shaped like the parameter), torchtitan then finds it in place, as
    with its own bf16-state hook."""
    import torch

    from bench.harness.state import local_tensor

    gen = torch.Generator().manual_seed(77 + rank)
    for optim in optimizers.optimizers:
        for group in optim.param_groups:
            for param in group["params"]:
                state = optim.state[param]
                state["step"] = torch.tensor(0.0)
                for key in ("exp_avg", "exp_avg_sq"):
                    moment = torch.empty_like(param.detach())
                    local_tensor(moment).view(torch.int16).random_(generator=gen)
                    state[key] = moment


def _tensor_bytes(value: Any) -> int:
    """Bytes of tensor data on this rank in a (nested) state dict."""
    import torch

    from bench.harness.state import local_tensor

    if isinstance(value, torch.Tensor):
        t = local_tensor(value)
        return t.numel() * t.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if hasattr(value, "state_dict"):  # torchtitan's containers and train state (Stateful)
        return _tensor_bytes(value.state_dict())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


# -- systems (each rank) ---------------------------------------------------------------------


class _System:
    """One way to save. ``save(i)`` writes save number ``i`` and returns where."""

    name = ""
    framework = ""
    label = ""
    settings = ""

    def __init__(self, kind: str, root: str) -> None:
        self.kind = kind
        self.root = f"{root}/{self.name}"  # a directory, or s3://bucket/prefix

    def save(self, i: int) -> str:
        raise NotImplementedError

    def prepare(self) -> dict[str, Any]:
        """What a save writes, built as the framework builds it before calling
        DCP (timed apart: the framework's own share of a save)."""
        raise NotImplementedError

    def before(self, i: int) -> None:
        """(all ranks, untimed) Anything save ``i`` needs first."""

    def close(self) -> None:
        """(all ranks) After the last save."""


class _Titan(_System):
    framework = "torchtitan"

    def __init__(self, kind: str, root: str, job: dict[str, Any], stock: bool, compression: str | None,
                 options: dict[str, Any] | None) -> None:
        from torchtitan.components.checkpointer import CheckpointManager

        from dcp_ext.integrations.torchtitan import DcpExtCheckpointManager

        self.name = "titan_stock" if stock else ("titan_dcp_ext_" + compression if compression else "titan_dcp_ext")
        super().__init__(kind, root)
        extra: dict[str, Any] = {}
        if stock:
            cls = CheckpointManager
            writer = "FileSystemWriter" if kind == "local" else "FsspecWriter (s3fs, options from fsspec.config)"
            self.label = "torchtitan CheckpointManager (stock)"
            self.settings = f"`dcp.save(checkpoint_id=...)` → torch {writer}, defaults"
        else:
            cls = DcpExtCheckpointManager
            extra = {"compression": compression, "storage_options": dict(options or {})}
            self.label = "dcp_ext DcpExtCheckpointManager" + (f' compression="{compression}"' if compression else "")
            self.settings = "dcp_ext CheckpointWriter defaults" + (f" + {compression}" if compression else "")
        self.manager = cls.Config(enable=True, folder=self.root, interval=1, keep_latest_k=0, **extra).build(
            dataloader=None, model_parts=[job["model"]], optimizers=job["optimizers"],
            lr_schedulers=job["schedulers"], states={"train_state": job["train_state"]}, sd_adapter=None)

    def save(self, i: int) -> str:
        assert self.manager.save(i) is True
        return f"{self.root}/step-{i}"

    def prepare(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict_saver import _stateful_to_state_dict

        # torchtitan's save flattens its states, then dcp.save calls each Stateful's state_dict.
        return dict(_stateful_to_state_dict(self.manager._flattened_model_states_sd()))


class _Lightning(_System):
    framework = "lightning"

    def __init__(self, kind: str, root: str, trainer: Any, stock: bool) -> None:
        self.name = "lightning_stock" if stock else "lightning_dcp_ext"
        super().__init__(kind, root)
        self.trainer = trainer
        if stock:
            self.label = "Lightning ModelParallelStrategy (stock)" + (
                "" if kind == "local" else ", path kept a string")
            self.settings = ("`dcp.save` → torch FileSystemWriter, defaults; `meta.pt` by rank 0" if kind == "local"
                             else "`dcp.save` → torch FsspecWriter (s3fs), defaults; `meta.pt` by rank 0 via fsspec")
        else:
            self.label = "dcp_ext DcpExtModelParallelStrategy"
            self.settings = "dcp_ext CheckpointWriter defaults; `meta.pt` before the commit"

    def save(self, i: int) -> str:
        path = f"{self.root}/save-{i}.ckpt"
        self.trainer.save_checkpoint(path, weights_only=False)  # Lightning's default, said out loud
        return path

    def prepare(self) -> dict[str, Any]:
        checkpoint = self.trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        # What both strategies hand DCP (the rest goes into meta.pt).
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        return state


class _Plain(_System):
    """A main-table system (``bench.harness.systems``) on the main table's state."""

    framework = "dcp"

    def __init__(self, kind: str, root: str, system: Any, ctx: Any, state: dict[str, Any], ours: bool) -> None:
        self.name = "dcp_ext" if ours else "dcp_torch"
        super().__init__(kind, root)
        self.system, self.ctx, self._state = system, ctx, state
        self.label = "plain DCP: " + system.label
        self.settings = system.describe(ctx.params)

    def _loc(self, i: int) -> str:
        loc = f"{self.root}/save-{i}"
        return loc if self.kind == "local" else loc.split("/", 3)[3]  # systems take the key under the bucket

    def save(self, i: int) -> str:
        self.system.save(self.ctx, self._state, self._loc(i))
        return f"{self.root}/save-{i}"

    def prepare(self) -> dict[str, Any]:
        return self._state


def _null_writer() -> Any:
    """A DCP ``StorageWriter`` that resolves every item (tensors as the planner
    hands them over, other values pickled) and stores nothing: a save through
    it costs what every writer pays for this state (flattening, planning,
    collectives, pickling, metadata), and counts the items."""
    import io

    import torch
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
    from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
    from torch.futures import Future

    class NullWriter(StorageWriter):
        def __init__(self) -> None:
            self.items = {"tensors": 0, "other": 0}

        def reset(self, checkpoint_id: Any = None) -> None:
            pass

        def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            pass

        def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
            return plan

        def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
            return plans

        def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
            results = []
            for item in plan.items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    assert isinstance(data, io.BytesIO)
                    size = len(data.getbuffer())
                    self.items["other"] += 1
                else:
                    assert isinstance(data, torch.Tensor)
                    size = data.numel() * data.element_size()
                    self.items["tensors"] += 1
                results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=None))
            future: Future[list[WriteResult]] = Future()
            future.set_result(results)
            return future

        def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
            pass

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return False

    return NullWriter()


def _lightning_trainers(model: Any, optimizer: Any, options: dict[str, Any] | None) -> dict[str, Any]:
    """One set-up ``Trainer`` per strategy: stock, stock with the path kept a
    string (for S3), and dcp_ext's; each ran a one-batch ``fit`` that changes nothing."""
    import io

    import lightning.pytorch as L
    import torch
    import torch.distributed.checkpoint as dcp
    from lightning.pytorch.strategies import ModelParallelStrategy

    from dcp_ext.integrations.lightning import DcpExtModelParallelStrategy

    class BenchModule(L.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = model  # already FSDP2-sharded: configure_model has nothing to do
            self.automatic_optimization = False

        def configure_model(self) -> None:
            pass

        def training_step(self, batch: Any, batch_idx: int) -> None:
            return None

        def configure_optimizers(self) -> Any:
            return optimizer

        def train_dataloader(self) -> Any:
            data = torch.utils.data.TensorDataset(torch.zeros(2, 1))
            return torch.utils.data.DataLoader(data, batch_size=1)

    class StringPathModelParallelStrategy(ModelParallelStrategy):  # type: ignore[misc]
        """The stock strategy's distributed save with the path kept a string (for S3)."""

        def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
            import fsspec

            url = str(self.broadcast(str(filepath)))
            state = {"state_dict": checkpoint.pop("state_dict")}
            state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
            dcp.save(state, checkpoint_id=url)  # a URL: torch picks FsspecWriter
            if self.global_rank == 0:
                buffer = io.BytesIO()
                torch.save(checkpoint, buffer)
                with fsspec.open(f"{url}/meta.pt", "wb") as f:
                    f.write(buffer.getvalue())

    strategies = {
        "stock": ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        "stock_s3": StringPathModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        "dcp_ext": DcpExtModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                               storage_options=dict(options or {})),
    }
    trainers = {}
    for key, strategy in strategies.items():
        os.environ["WORLD_SIZE"] = "2"  # LightningEnvironment.teardown removes it after each fit
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1,
                            limit_train_batches=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0)
        trainer.fit(BenchModule())
        trainers[key] = trainer
    return trainers


def _settle(rank: int, drop: bool) -> None:
    """(all ranks) Write back every dirty page and (``drop``) drop the clean page cache."""
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        os.sync()
        if drop:
            with open(_DROP_CACHES, "w") as f:
                f.write("1\n")
    dist.barrier()


def _slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _stored(ctx: Any, kind: str, where: str) -> tuple[int, list[str]]:
    """(rank 0) Bytes stored at ``where`` and the names there that are not shards."""
    if kind == "local":
        sizes = {os.path.relpath(os.path.join(d, n), where): os.path.getsize(os.path.join(d, n))
                 for d, _, names in os.walk(where) for n in names}
    else:
        prefix = where.split("/", 3)[3].rstrip("/") + "/"
        sizes = {}
        pages = ctx.boto3().get_paginator("list_objects_v2").paginate(Bucket=ctx.bucket, Prefix=prefix)
        for page in pages:
            sizes.update({o["Key"][len(prefix):]: o["Size"] for o in page.get("Contents", [])})
    return sum(sizes.values()), sorted(n for n in sizes if not n.endswith(".distcp"))


def _remove(ctx: Any, kind: str, where: str) -> None:
    if kind == "local":
        shutil.rmtree(where, ignore_errors=True)
    else:
        ctx.delete_prefix(where.split("/", 3)[3])


def frameworks_world(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """(each rank) Every system of every storage kind, ``rounds`` timed saves
    each after a warm-up, interleaved; the slower rank's seconds."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    import logging
    import warnings

    import lightning.pytorch  # noqa: F401 - it sets its loggers' levels on import: quiet them after

    warnings.filterwarnings("ignore")
    for noisy in ("lightning", "lightning.pytorch", "lightning.fabric", "torchtitan", "root"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    import fsspec
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig

    from bench.harness.state import DTYPE, NON_TENSOR, make_spec
    from bench.harness.systems import Ctx, DcpExt, TorchFileSystem, TorchFsspec
    from dcp_ext import IOConfig
    from dcp_ext.integrations._planning import save_planner
    from tests.support.torchtitan_workers import TrainState

    options = cfg["options"]
    if options:
        fsspec.config.conf["s3"] = dict(options)  # how stock torchtitan/torch reach SeaweedFS (= FSSPEC_S3)
    t0 = time.perf_counter()
    spec = make_spec(int(cfg["size"]), int(cfg["layers"]))
    mesh = init_device_mesh("cpu", (world_size,))
    model = build_model(spec, rank, world_size, mesh)
    phases = {"model": time.perf_counter() - t0}
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 1e-4, "weight_decay": 0.1})],
        implementation="for-loop",
    ).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_type="cosine").build(
        optimizers=optimizers, training_steps=1000)
    _fill_moments(optimizers, rank)
    phases["optimizer"] = time.perf_counter() - t0 - sum(phases.values())
    job = {"model": model, "optimizers": optimizers, "schedulers": schedulers, "train_state": TrainState()}
    plain_state = {**dict(model.named_parameters()), **NON_TENSOR}  # the main table's state dict
    trainers = _lightning_trainers(model, optimizers.optimizers[0], options)
    for param in model.parameters():
        assert param.dtype == DTYPE, param.dtype  # Lightning left the model as built
    phases["lightning"] = time.perf_counter() - t0 - sum(phases.values())
    setup_seconds = time.perf_counter() - t0
    if rank == 0:
        print("  set up in " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()), flush=True)
    ctx = Ctx(rank, world_size, {"s3_concurrency": cfg["s3_concurrency"]}, cfg["workdir"], cfg["s3"])

    def systems(kind: str) -> list[Any]:  # _System and the systems of bench.frameworks_megatron / _tc
        root = os.path.join(cfg["workdir"], "local") if kind == "local" else cfg["s3_root"]
        staging = os.path.join(cfg["workdir"], "staging")  # S3 stock rows of frameworks without an S3 path
        opts = options if kind == "s3" else None
        found: list[Any] = [
            _Titan(kind, root, job, stock=True, compression=None, options=None),
            _Titan(kind, root, job, stock=False, compression=None, options=opts),
            _Titan(kind, root, job, stock=False, compression="zstd", options=opts),
            _Titan(kind, root, job, stock=False, compression="auto", options=opts),
            _Lightning(kind, root, trainers["stock" if kind == "local" else "stock_s3"], stock=True),
            _Lightning(kind, root, trainers["dcp_ext"], stock=False),
            _Plain(kind, root, TorchFileSystem(1) if kind == "local" else TorchFsspec("s3"), ctx, plain_state,
                   ours=False),
            _Plain(kind, root, DcpExt(kind), ctx, plain_state, ours=True),
            # Megatron-Core and torch_checkpointing: their own saves write local paths only; on S3 their
            # stock rows save locally, then upload (bench.frameworks_megatron, bench.frameworks_tc).
            *megatron_systems(kind, root, job, opts, staging),
            *tc_systems(kind, root, job, opts, ctx, staging),
        ]
        return [s for s in found if s.name in cfg["systems"]]

    out: dict[str, Any] = {"setup_seconds": setup_seconds, "kinds": {}}
    step = 0
    for kind in cfg["kinds"]:
        found = systems(kind)
        nbytes = {s.name: _summed(_tensor_bytes(s.prepare())) for s in found}
        record: dict[str, Any] = {
            "systems": [{"name": s.name, "framework": s.framework, "label": s.label, "settings": s.settings,
                         "bytes": nbytes[s.name]} for s in found],
            "seconds": {s.name: [] for s in found}, "order": [], "stored": {}, "files": {}, "prep": {}, "null": {}, "null_adapter": {},
            "parts": {},
            "items": {},
        }
        # One system per framework: its own share of a save is the same for stock and dcp_ext.
        firsts = {s.framework: s for s in reversed(found) if getattr(s, "fixed_costs", True)}
        for r in range(cfg["rounds"][kind] + 1):  # round 0: warm-up, untimed
            order = found[r % len(found):] + found[:r % len(found)]
            if r % 2:
                order.reverse()
            if r:
                record["order"].append([s.name for s in order])
            for system in order:
                step += 1
                system.before(step)
                _settle(rank, cfg["drop_caches"])
                start = time.perf_counter()
                where = system.save(step)
                seconds = _slowest(time.perf_counter() - start)
                parts = system.parts() if hasattr(system, "parts") else {}
                for part in sorted(parts):  # the same names on every rank: the slower rank's
                    slowest = _slowest(parts[part])
                    if r:
                        record["parts"].setdefault(system.name, {}).setdefault(part, []).append(slowest)
                dist.barrier()
                if hasattr(system, "after"):  # untimed: torch_checkpointing's rows load their first save back
                    system.after(step, where)
                    dist.barrier()
                if rank == 0:
                    record["stored"][system.name], record["files"][system.name] = _stored(ctx, kind, where)
                    _remove(ctx, kind, where)
                    if r:
                        print(f"  {kind} round {r} {system.name}: {seconds:.3f} s", flush=True)
                if r:
                    record["seconds"][system.name].append(seconds)
            for framework, system in sorted(firsts.items()) if r and kind == "local" else ():
                _settle(rank, False)
                start = time.perf_counter()
                state = system.prepare()
                if framework == "torchtitan":
                    gc.collect(1)  # its synchronous save's GarbageCollection.collect
                record["prep"].setdefault(framework, []).append(_slowest(time.perf_counter() - start))
                _settle(rank, False)
                writer = _null_writer()
                start = time.perf_counter()
                dcp.save(state, storage_writer=writer)
                record["null"].setdefault(framework, []).append(_slowest(time.perf_counter() - start))
                record["items"][framework] = {k: _summed(v) for k, v in writer.items.items()}
                if framework in ADAPTER_PLANS:
                    # The same, planned as dcp_ext's adapters plan (their plan cache warm from their saves).
                    _settle(rank, False)
                    start = time.perf_counter()
                    dcp.save(state, storage_writer=_null_writer(),
                             planner=save_planner(ADAPTER_PLANS[framework], IOConfig()))
                    record["null_adapter"].setdefault(framework, []).append(_slowest(time.perf_counter() - start))
                del state
        for system in found:
            system.close()
        out["kinds"][kind] = record
    dist.barrier()
    return out


def _summed(n: int) -> int:
    import torch
    import torch.distributed as dist

    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


# -- command ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.frameworks", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="the default: a 128MiB model (framework saves 384MiB with AdamW's moments), 3 local "
                        "and 3 S3 rounds (about 5 min on 2 busy cores)")
    p.add_argument("--full", action="store_true",
                   help="the main table's full size: a 1GiB model (framework saves 3GiB), 5 rounds each")
    p.add_argument("--size", default=None, help="model size (the main table's state dict), total over 2 ranks")
    p.add_argument("--layers", type=int, default=32, help="decoder layers of the bench model")
    p.add_argument("--rounds", type=int, default=None, help="timed S3 rounds per system (after a warm-up round)")
    p.add_argument("--local-rounds", type=int, default=None,
                   help="timed local rounds per system (after a warm-up round) [default 3; --full: 5]")
    p.add_argument("--only", choices=["local", "s3"], help="one storage kind only")
    p.add_argument("--systems", default=",".join(dict.fromkeys([n for pair in PAIRS for n in pair]
                                                               + [n for _, n, _ in REFERENCES])),
                   help="systems to run, comma separated")
    p.add_argument("--s3-concurrency", type=int, default=4,
                   help="max_concurrency of the plain-DCP dcp_ext row on S3 (as the main table)")
    p.add_argument("--workdir", default=None, help="scratch directory on the disk under test (default: a temp dir)")
    p.add_argument("--no-drop-caches", action="store_true", help="only sync before each save")
    p.add_argument("--no-readme", action="store_true", help="leave bench/README.md alone")
    p.add_argument("--out", default=None, help="results JSON (default bench/results/frameworks-<date>.json)")
    return p


def main(argv: list[str] | None = None) -> int:
    import contextlib
    from importlib import metadata

    from bench.harness.world import run_world

    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the S3 server and ranks on a kill too
    size = parse_size(args.size or ("1GiB" if args.full else "128MiB"))
    rounds = {"local": args.local_rounds or (5 if args.full else 3), "s3": args.rounds or (5 if args.full else 3)}
    kinds = [args.only] if args.only else ["local", "s3"]
    owned = args.workdir is None
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dcp_ext_frameworks_")).resolve()
    drop = not args.no_drop_caches and os.access(_DROP_CACHES, os.W_OK)
    command = "python -m bench.frameworks " + " ".join(argv if argv is not None else sys.argv[1:])
    started = time.monotonic()
    main_json = newest_main_table()
    record: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "command": command.strip(), "machine": machine_info(workdir),
        "versions": {pkg: metadata.version(pkg)
                     for pkg in ("torchtitan", "lightning", "megatron-core", "torch_checkpointing")},
        "params": {"size": size, "layers": args.layers, "rounds": rounds, "kinds": kinds,
                   "drop_caches": drop, "s3_concurrency": args.s3_concurrency},
        "main_table": main_table_ratios(main_json),
    }
    print(f"{command}\nworkdir {workdir}; main table {main_json}", flush=True)
    try:
        with contextlib.ExitStack() as stack:
            s3_root, options, s3info = None, None, None
            if "s3" in kinds:
                s3_root, options = stack.enter_context(storage("s3", workdir, "frameworks"))
                client = options["client_kwargs"]
                s3info = {"endpoint_url": client["endpoint_url"], "region": client["region_name"],
                          "access_key": options["key"], "secret_key": options["secret"],
                          "bucket": s3_root.split("/")[2]}
            cfg = {"size": size, "layers": args.layers, "rounds": rounds, "kinds": kinds, "drop_caches": drop,
                   "systems": args.systems.split(","), "workdir": str(workdir), "options": options,
                   "s3": s3info, "s3_root": s3_root, "s3_concurrency": args.s3_concurrency}
            result = run_world(2, "bench.frameworks:frameworks_world", cfg, timeout=3600)
    finally:
        if owned:
            shutil.rmtree(workdir, ignore_errors=True)
    record.update(result)
    record["framework_bytes"] = next(
        (s["bytes"] for k in result["kinds"].values() for s in k["systems"] if s["framework"] != "dcp"), 0)
    record["summary"] = summarize(record)
    record["runtime_seconds"] = time.monotonic() - started
    record["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    markdown = render(record)
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))
        print(markdown)
        print(f"results written to {args.out}")
    else:
        publish(record, "frameworks", markdown, readme=not args.no_readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
