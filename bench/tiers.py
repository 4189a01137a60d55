"""Tiered checkpoints: ``python -m bench.tiers``.

Two gloo ranks play two nodes (``DCP_EXT_NODE_RANK`` = rank), each with its
own local-tier directory, in two tiers measured side by side: a **disk
tier** under ``--workdir`` and a **memory tier** under ``--memory-dir``
(``/dev/shm``). The persistent root is a bucket on SeaweedFS on 127.0.0.1
(started as ``python -m bench`` starts it; it writes to the same disk as the
disk tier). The state is the FSDP2 model + Adam of ``bench.blocking``
(``--state-size`` over both ranks, default 1 GiB).

Saves, ``--saves`` rounds (default 4), each after one training step, the
systems in rotating order:

* **direct**: ``CheckpointManager(s3_root).save(...)`` (synchronous): the
  time the call takes is the time training is stopped and the time until
  the checkpoint is safe in S3;
* **tiered** (per tier): ``CheckpointManager(s3_root_t, local_tier=node_dir,
  replicas=1).save(..., async_save=True)``: *blocked* is the call, *local
  commit* the time from the call until ``handle.result()`` (committed and
  replicated in both nodes' local tiers), waited for right away. The last
  round's save is also persisted (drained to S3); its drain time is shown.

Restores of the last tiered tag into a fresh model and optimizer, ``--restores``
rounds (default 3) in rotating order, each after the page cache was dropped
(a restarted job on a replaced node starts cold; the memory tier, in tmpfs,
is not dropped):

* **S3**: ``CheckpointManager(s3_root_disk).resume(tag=...)`` (no local tier);
* **local tiers** (per tier): ``tiered.resume()``;
* **partner replica** (per tier): node 1's tier is deleted first, then
  ``tiered.resume()``: node 1's files come back from node 0 over the process
  group (and are written into node 1's tier again) before the load.

Before each timed save and restore all dirty pages are written back
(``os.sync()``), so that no system pays for the writeback of the one before
it; the clean page cache is also dropped (when the bench runs as root), so
that every save finds the same free memory and every restore reads cold (on a 24 GiB
machine the tiers, the S3 server's files and the page cache otherwise
compete for it, and whoever comes later pays for reclaim). Direct saves
keep 2 tags in S3, as each local tier does (``keep_local=2``). Every time is the slower rank's; medians over rounds (the first save round
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

from bench.harness.machine import machine_info
from bench.harness.report import publish
from bench.harness.storage import storage
from bench.harness.training import build_training, forward_backward, layer_width, optimizer_step
from dcp_ext.config import parse_size
from tests.support.dist import run_world

MiB = 1 << 20
_DROP_CACHES = "/proc/sys/vm/drop_caches"


def can_drop_caches() -> bool:
    return os.access(_DROP_CACHES, os.W_OK)


def _settle(drop: bool = False) -> None:
    """(all ranks) Write back every dirty page (the last system's files, the
    S3 server's) before the next timed step, so each starts on an idle disk;
    with ``drop``, also drop the clean page cache (where allowed), so each
    save finds the same free memory."""
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        os.sync()
        if drop and can_drop_caches():
            with open(_DROP_CACHES, "w") as f:
                f.write("1\n")
    dist.barrier()


def _timed(fn: Any, drop: bool = False) -> tuple[float, Any]:
    _settle(drop)
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def tiers_world(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """(each rank) The saves and restores of the module docstring; raw times."""
    import torch.distributed as dist

    import dcp_ext

    os.environ[dcp_ext._runtime.nodes.NODE_RANK_ENV] = str(rank)
    model, optim, batch = build_training(rank, world_size, cfg["width"], cfg["layers"])
    forward_backward(model, batch)
    optimizer_step(optim)
    group = dist.new_group(backend="gloo")
    options = cfg["options"]
    # The same retention everywhere: two tags in S3 (direct) and in each local tier.
    direct = dcp_ext.CheckpointManager(cfg["direct_root"], storage_options=options, process_group=group,
                                       retention=dcp_ext.KeepLast(2))
    tiers = list(cfg["tiers"])  # e.g. ["disk", "memory"]
    node_dirs = {t: os.path.join(cfg["tiers"][t], f"node{rank}") for t in tiers}
    tiered = {t: dcp_ext.CheckpointManager(f"{cfg['tiered_root']}-{t}", storage_options=options, process_group=group,
                                           local_tier=node_dirs[t], persist_every=0, keep_local=2, replicas=1)
              for t in tiers}
    out: dict[str, Any] = {"rank": rank, "saves": [], "restores": []}
    last = cfg["saves"] - 1
    systems = ["direct", *tiers]
    for i in range(cfg["saves"]):
        forward_backward(model, batch)
        optimizer_step(optim)
        record: dict[str, Any] = {}
        for system in systems[i % len(systems):] + systems[:i % len(systems)]:  # rotate the order
            if system == "direct":
                record["direct"], _ = _timed(lambda tag=f"d{i}": direct.save(tag, model, optim), drop=True)
                continue
            _settle(drop=True)
            start = time.perf_counter()
            handle = tiered[system].save(f"t{i}", model, optim, async_save=True, persist=i == last)
            record[f"{system}_blocked"] = time.perf_counter() - start
            handle.staging_completion.result()
            handle.result()
            record[f"{system}_local_commit"] = time.perf_counter() - start
            if handle.persist_completion is not None:
                handle.persist_completion.result()
                record[f"{system}_persisted"] = time.perf_counter() - start
        out["saves"].append(record)
    tag = f"t{last}"
    plain = dcp_ext.CheckpointManager(f"{cfg['tiered_root']}-{tiers[0]}", storage_options=options,
                                      process_group=group)
    fresh, fresh_optim, _ = build_training(rank, world_size, cfg["width"], cfg["layers"])
    forward_backward(fresh, batch)
    optimizer_step(fresh_optim)
    sources = ["s3", *(f"{t}_{kind}" for t in tiers for kind in ("local", "replica"))]
    for r in range(cfg["restores"]):
        record = {}
        for source in sources[r % len(sources):] + sources[:r % len(sources)]:
            tier, _, kind = source.partition("_")
            if kind == "replica":
                dist.barrier()
                if rank == 1:
                    shutil.rmtree(node_dirs[tier])
            manager = plain if source == "s3" else tiered[tier]
            wanted = tag if source == "s3" else None
            seconds, result = _timed(lambda m=manager, t=wanted: m.resume(fresh, fresh_optim, tag=t), drop=True)
            assert result.tag == tag, (source, result.tag)
            record[source] = seconds
            record[f"{source}_bytes"] = manager.last_reader.store.stats.snapshot().bytes_read
            by_source = getattr(manager.last_reader.store, "bytes_by_source", None)
            record[f"{source}_root_bytes"] = by_source().get("root", 0) if by_source else record[f"{source}_bytes"]
        out["restores"].append(record)
    direct.close()
    for manager in tiered.values():
        manager.close()
    plain.close()
    out["state_bytes"] = sum(t.numel() * t.element_size() for t in _local_tensors(model, optim))
    dist.barrier()
    return out


def _local_tensors(model: Any, optim: Any) -> list[Any]:
    from tests.support.dist_workers import app_state, local_leaves

    import torch

    return [v for v in local_leaves(app_state(model, optim)).values() if isinstance(v, torch.Tensor)]


def summarize(ranks: list[dict[str, Any]], tiers: list[str]) -> dict[str, Any]:
    """Slower rank per round; medians over rounds (saves: rounds 2..n)."""
    med = statistics.median
    saves = [{k: max(r["saves"][i].get(k, 0.0) for r in ranks) for k in ranks[0]["saves"][i]}
             for i in range(len(ranks[0]["saves"]))]
    restores = [{k: max(r["restores"][i][k] for r in ranks) for k in ranks[0]["restores"][i]}
                for i in range(len(ranks[0]["restores"]))]
    steady = saves[1:] or saves
    out: dict[str, Any] = {"saves": saves, "restores": restores, "direct": med(s["direct"] for s in steady),
                           "s3": med(r["s3"] for r in restores),
                           "state_bytes": max(r["state_bytes"] for r in ranks)}
    for t in tiers:
        out[t] = {
            "blocked": med(s[f"{t}_blocked"] for s in steady),
            "local_commit": med(s[f"{t}_local_commit"] for s in steady),
            "persisted": saves[-1].get(f"{t}_persisted"),
            **{kind: med(r[f"{t}_{kind}"] for r in restores) for kind in ("local", "replica")},
            **{f"{kind}_root_bytes": max(r[f"{t}_{kind}_root_bytes"] for r in restores)
               for kind in ("local", "replica")},
        }
    return out


_TIER_TITLES = {"disk": "disk tier", "memory": "memory tier (`/dev/shm`)"}


def render(record: dict[str, Any]) -> str:
    s, m, p = record["summary"], record["machine"], record["params"]
    tiers = p["tiers"]
    ms = lambda x: f"{x * 1e3:,.0f}" if x else "–"  # noqa: E731
    head = " | ".join(_TIER_TITLES[t] for t in tiers)
    row = lambda label, key: f"| {label} | " + " | ".join(ms(s[t][key]) for t in tiers) + " |"  # noqa: E731
    lines = [
        f"Run of {record['date']} on `{m['machine_id']}`: {m['cpu_count']} × {m['cpu_model']}, "
        f"{m['ram_gib']:.1f} GiB RAM; torch {m['versions'].get('torch')}, dcp_ext {m['versions'].get('dcp_ext')} "
        f"(commit `{m['git_commit'][:12]}`{', dirty tree' if m['git_dirty'] else ''}); load average at start/end "
        f"{m['loadavg_start']} / {record['loadavg_end']}; run time {record['runtime_seconds'] / 60:.1f} min.",
        "",
        f"2 ranks as 2 simulated nodes, FSDP2 + Adam, {s['state_bytes'] / MiB:,.0f} MiB of state per rank, "
        f"`replicas=1`; local tiers on the disk (`{m.get('workdir_device', '?')}`, the disk SeaweedFS "
        f"also writes to) and in `/dev/shm`; persistent root on SeaweedFS (127.0.0.1). {p['saves']} save "
        f"rounds, {p['restores']} restore rounds, order rotated, `sync` before each"
        f"{' and the page cache dropped (restores read cold)' if p.get('drop_caches') else ''}; times are the slower rank's, medians "
        f"(saves: rounds 2..n). A direct S3 save takes **{ms(s['direct'])} ms** (`save`, synchronous: "
        f"training stopped until committed in S3); a restore from S3 **{ms(s['s3'])} ms**.",
        "",
        f"Command: `{record['command']}`",
        "",
        f"| ms | {head} |",
        "|---|" + "---:|" * len(tiers),
        row("tiered save: blocked (`save(async_save=True)` call)", "blocked"),
        row("tiered save: until committed and replicated in both local tiers", "local_commit"),
        row("tiered save: until drained to S3 (last round, `persist=True`)", "persisted"),
        row("restore from the local tiers", "local"),
        row("restore after node 1's tier was deleted (node 0's replicas sent over gloo)", "replica"),
        "",
        f"| target | threshold | {head} |",
        "|---|---|" + "---|" * len(tiers),
    ]
    targets = [
        ("blocked per save / direct S3 save", lambda t: s[t]["blocked"] / s["direct"], 0.1, "≤"),
        ("local commit (incl. replica) / direct S3 save", lambda t: s[t]["local_commit"] / s["direct"], 0.25, "≤"),
        ("restore: from S3 / from the local tiers", lambda t: s["s3"] / s[t]["local"], 4.0, "≥"),
        ("restore: from S3 / from the partner replica", lambda t: s["s3"] / s[t]["replica"], 2.0, "≥"),
    ]
    for label, value, threshold, op in targets:
        cells = []
        for t in tiers:
            v = value(t)
            ok = v <= threshold if op == "≤" else v >= threshold
            cells.append(f"{v:.3f}× {'✅' if ok else '❌'}")
        lines.append(f"| {label} | {op} {threshold}× | " + " | ".join(cells) + " |")
    for kind, label in (("local", "local tiers"), ("replica", "partner replica")):
        cells = [f"{s[t][f'{kind}_root_bytes']:,} {'✅' if s[t][f'{kind}_root_bytes'] == 0 else '❌'}" for t in tiers]
        lines.append(f"| bytes read from S3, restore from the {label} | 0 | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tiers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-size", default="1GiB", help="params + 2 Adam moments (fp32), total over 2 ranks")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--restores", type=int, default=3)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--memory-dir", default="/dev/shm",
                        help="where the memory tier lives ('' to measure the disk tier only)")
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args(argv)
    width = layer_width(parse_size(args.state_size), args.layers)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dcp_ext_tiers_")).resolve()
    owned = args.workdir is None
    tier_dirs = {"disk": str(workdir / "tiers")}
    memory_dir = Path(tempfile.mkdtemp(prefix="dcp_ext_tiers_", dir=args.memory_dir)) if args.memory_dir else None
    if memory_dir is not None:
        tier_dirs["memory"] = str(memory_dir)
    command = "python -m bench.tiers " + " ".join(argv if argv is not None else sys.argv[1:])
    started = time.monotonic()
    record: dict[str, Any] = {"date": datetime.date.today().isoformat(), "command": command,
                              "machine": machine_info(workdir),
                              "params": {"state_size": parse_size(args.state_size), "layers": args.layers,
                                         "width": width, "saves": args.saves, "restores": args.restores,
                                         "tiers": list(tier_dirs), "drop_caches": can_drop_caches()}}
    try:
        with storage("s3", workdir, "tiers") as (root, options):
            cfg = {"width": width, "layers": args.layers, "saves": args.saves, "restores": args.restores,
                   "tiers": tier_dirs, "options": options,
                   "direct_root": f"{root}/direct", "tiered_root": f"{root}/tiered"}
            ranks = run_world(2, tiers_world, cfg, timeout=3600, collective_timeout=3600)
    finally:
        if owned:
            shutil.rmtree(workdir, ignore_errors=True)
        if memory_dir is not None:
            shutil.rmtree(memory_dir, ignore_errors=True)
    record["ranks"] = ranks
    record["summary"] = summarize(ranks, list(tier_dirs))
    record["runtime_seconds"] = time.monotonic() - started
    record["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    publish(record, "tiers", render(record), readme=not args.no_readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
