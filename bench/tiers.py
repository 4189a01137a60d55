"""Tiered checkpoints: ``python -m bench.tiers``.

Two gloo ranks play two nodes (``DCP_EXT_NODE_RANK`` = rank), each with its
own local-tier directory under ``--workdir``; the persistent root is a
bucket on SeaweedFS on 127.0.0.1 (started as ``python -m bench`` starts it).
The state is the FSDP2 model + Adam of ``bench.blocking`` (``--state-size``
over both ranks, default 1 GiB).

Saves, ``--saves`` rounds (default 4), each after one training step, the two
systems in alternating order:

* **direct**: ``CheckpointManager(s3_root).save(...)`` (synchronous): the
  time the call takes is the time training is stopped and the time until
  the checkpoint is safe in S3;
* **tiered**: ``CheckpointManager(s3_root2, local_tier=node_dir,
  replicas=1).save(..., async_save=True)``: *blocked* is the call, *local
  commit* the time from the call until ``handle.result()`` (committed and
  replicated in both nodes' local tiers), waited for right away. The last
  round's save is also persisted (drained to S3); its drain time is shown.

Restores of the last tiered tag into a fresh model and optimizer, ``--restores``
rounds (default 3) in alternating order, page cache as left by the saves:

* **local tier**: ``tiered.resume()``;
* **S3**: ``CheckpointManager(s3_root2).resume(tag=...)`` (no local tier);
* **partner replica**: node 1's tier is deleted first, then ``tiered.resume()``:
  node 1's files come back from node 0 over the process group.

Every time is the slower rank's; medians over rounds (the first save round
apart: it allocates the staging buffers). Bytes read from S3 are counted by
the restore's reader (``bytes_by_source``).

Results: ``bench/results/tiers-<date>.json`` and the ``tiers`` block of bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.blocking import MiB, build_training, forward_backward, layer_width, optimizer_step, storage
from bench.cli import machine_info
from bench.report import publish
from dcp_ext.config import parse_size
from tests.support.dist import run_world


def _timed(fn: Any) -> tuple[float, Any]:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def tiers_world(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """(each rank) The saves and restores of the module docstring; raw times."""
    import torch.distributed as dist

    import dcp_ext

    os.environ[dcp_ext.nodes.NODE_RANK_ENV] = str(rank)
    node_dir = os.path.join(cfg["workdir"], f"node{rank}")
    model, optim, batch = build_training(rank, world_size, cfg["width"], cfg["layers"])
    forward_backward(model, batch)
    optimizer_step(optim)
    group = dist.new_group(backend="gloo")
    options = cfg["options"]
    direct = dcp_ext.CheckpointManager(cfg["direct_root"], storage_options=options, process_group=group)
    tiered = dcp_ext.CheckpointManager(cfg["tiered_root"], storage_options=options, process_group=group,
                                       local_tier=node_dir, persist_every=0, keep_local=2, replicas=1)
    out: dict[str, Any] = {"rank": rank, "saves": [], "restores": []}
    last = cfg["saves"] - 1
    for i in range(cfg["saves"]):
        forward_backward(model, batch)
        optimizer_step(optim)
        record: dict[str, Any] = {}
        order = ["direct", "tiered"] if i % 2 == 0 else ["tiered", "direct"]
        for system in order:
            if system == "direct":
                record["direct"], _ = _timed(lambda tag=f"d{i}": direct.save(tag, model, optim))
                continue
            dist.barrier()
            start = time.perf_counter()
            handle = tiered.save(f"t{i}", model, optim, async_save=True, persist=i == last)
            record["blocked"] = time.perf_counter() - start
            handle.staging_completion.result()
            handle.result()
            record["local_commit"] = time.perf_counter() - start
            if handle.persist_completion is not None:
                handle.persist_completion.result()
                record["persisted"] = time.perf_counter() - start
        out["saves"].append(record)
    tag = f"t{last}"
    plain = dcp_ext.CheckpointManager(cfg["tiered_root"], storage_options=options, process_group=group)
    fresh, fresh_optim, _ = build_training(rank, world_size, cfg["width"], cfg["layers"])
    forward_backward(fresh, batch)
    optimizer_step(fresh_optim)
    for r in range(cfg["restores"]):
        record = {}
        order = ["local", "s3", "replica"] if r % 2 == 0 else ["replica", "s3", "local"]
        for source in order:
            if source == "replica":
                dist.barrier()
                if rank == 1:
                    shutil.rmtree(node_dir)
            manager = plain if source == "s3" else tiered
            wanted = tag if source == "s3" else None
            seconds, result = _timed(lambda m=manager, t=wanted: m.resume(fresh, fresh_optim, tag=t))
            assert result.tag == tag, (source, result.tag)
            record[source] = seconds
            record[f"{source}_bytes"] = manager.last_reader.store.stats.snapshot().bytes_read
            by_source = getattr(manager.last_reader.store, "bytes_by_source", None)
            record[f"{source}_root_bytes"] = by_source().get("root", 0) if by_source else record[f"{source}_bytes"]
        out["restores"].append(record)
    direct.close()
    tiered.close()
    plain.close()
    out["state_bytes"] = sum(t.numel() * t.element_size() for t in _local_tensors(model, optim))
    return out


def _local_tensors(model: Any, optim: Any) -> list[Any]:
    from tests.support.dist_workers import app_state, local_leaves

    import torch

    return [v for v in local_leaves(app_state(model, optim)).values() if isinstance(v, torch.Tensor)]


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Slower rank per round; medians over rounds (saves: rounds 2..n)."""
    med = statistics.median
    saves = [{k: max(r["saves"][i].get(k, 0.0) for r in ranks) for k in ranks[0]["saves"][i]}
             for i in range(len(ranks[0]["saves"]))]
    restores = [{k: max(r["restores"][i][k] for r in ranks) for k in ranks[0]["restores"][i]}
                for i in range(len(ranks[0]["restores"]))]
    steady = saves[1:] or saves
    return {
        "saves": saves, "restores": restores,
        "direct": med(s["direct"] for s in steady), "blocked": med(s["blocked"] for s in steady),
        "local_commit": med(s["local_commit"] for s in steady),
        "persisted": saves[-1].get("persisted"),
        **{src: med(r[src] for r in restores) for src in ("local", "s3", "replica")},
        **{f"{src}_root_bytes": max(r[f"{src}_root_bytes"] for r in restores) for src in ("local", "replica")},
        "state_bytes": max(r["state_bytes"] for r in ranks),
    }


def render(record: dict[str, Any]) -> str:
    s, m, p = record["summary"], record["machine"], record["params"]
    ms = lambda x: f"{x * 1e3:,.0f}"  # noqa: E731
    targets = [
        ("blocked per save, tiered async / direct S3 save", s["blocked"] / s["direct"], 0.1, "≤"),
        ("local commit (incl. replica), tiered / direct S3 save", s["local_commit"] / s["direct"], 0.25, "≤"),
        ("restore from S3 / from the local tier", s["s3"] / s["local"], 4.0, "≥"),
        ("restore from S3 / from the partner replica (node 1 wiped)", s["s3"] / s["replica"], 2.0, "≥"),
    ]
    lines = [
        f"Run of {record['date']} on `{m['machine_id']}`: {m['cpu_count']} × {m['cpu_model']}, "
        f"{m['ram_gib']:.1f} GiB RAM; torch {m['versions'].get('torch')}, dcp_ext {m['versions'].get('dcp_ext')} "
        f"(commit `{m['git_commit'][:12]}`{', dirty tree' if m['git_dirty'] else ''}); load average at start/end "
        f"{m['loadavg_start']} / {record['loadavg_end']}; run time {record['runtime_seconds'] / 60:.1f} min.",
        "",
        f"2 ranks as 2 simulated nodes (one local-tier directory each, on `{m.get('workdir_device', '?')}`), "
        f"FSDP2 + Adam, {s['state_bytes'] / MiB:,.0f} MiB of state per rank; persistent root on SeaweedFS "
        f"(127.0.0.1). {p['saves']} save rounds, {p['restores']} restore rounds, alternating order; times are the "
        f"slower rank's, medians (saves: rounds 2..n).",
        "",
        f"Command: `{record['command']}`",
        "",
        "| | ms |",
        "|---|---:|",
        f"| direct S3 save (`save`, synchronous: training stopped until committed in S3) | {ms(s['direct'])} |",
        f"| tiered save: blocked (`save(async_save=True)` call) | {ms(s['blocked'])} |",
        f"| tiered save: until committed and replicated in both local tiers | {ms(s['local_commit'])} |",
        f"| tiered save: until drained to S3 (last round, `persist=True`) | "
        f"{ms(s['persisted']) if s['persisted'] else '–'} |",
        f"| restore from the local tiers | {ms(s['local'])} |",
        f"| restore from S3 | {ms(s['s3'])} |",
        f"| restore after node 1's tier was deleted (node 0's replicas sent over gloo) | {ms(s['replica'])} |",
        "",
        "| target | measured | threshold | met |",
        "|---|---|---|---|",
    ]
    for label, value, threshold, op in targets:
        ok = value <= threshold if op == "≤" else value >= threshold
        lines.append(f"| {label} | {value:.3f}× | {op} {threshold}× | {'✅' if ok else '❌'} |")
    for src, label in (("local", "local tier"), ("replica", "partner replica")):
        lines.append(f"| bytes read from S3, restore from the {label} | {s[f'{src}_root_bytes']:,} | 0 | "
                     f"{'✅' if s[f'{src}_root_bytes'] == 0 else '❌'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tiers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-size", default="1GiB", help="params + 2 Adam moments (fp32), total over 2 ranks")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--restores", type=int, default=3)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args(argv)
    width = layer_width(parse_size(args.state_size), args.layers)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dcp_ext_tiers_")).resolve()
    owned = args.workdir is None
    command = "python -m bench.tiers " + " ".join(argv if argv is not None else sys.argv[1:])
    started = time.monotonic()
    record: dict[str, Any] = {"date": datetime.date.today().isoformat(), "command": command,
                              "machine": machine_info(workdir),
                              "params": {"state_size": parse_size(args.state_size), "layers": args.layers,
                                         "width": width, "saves": args.saves, "restores": args.restores}}
    try:
        with storage("s3", workdir, "tiers") as (root, options):
            cfg = {"width": width, "layers": args.layers, "saves": args.saves, "restores": args.restores,
                   "workdir": str(workdir / "tiers"), "options": options,
                   "direct_root": f"{root}/direct", "tiered_root": f"{root}/tiered"}
            ranks = run_world(2, tiers_world, cfg, timeout=3600, collective_timeout=3600)
    finally:
        if owned:
            shutil.rmtree(workdir, ignore_errors=True)
    record["ranks"] = ranks
    record["summary"] = summarize(ranks)
    record["runtime_seconds"] = time.monotonic() - started
    record["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    publish(record, "tiers", render(record), readme=not args.no_readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
