"""Many hosts: ``python -m bench.cluster`` (issue 41), on the namespace cluster of tests/support/cluster.py.

Three hosts, one rank each, every host a network namespace of its own (own
address, host name and node-local directory) on one bridge, the persistent
root a bucket on SeaweedFS in a namespace of its own; needs root. Three
parts:

* **Throughput**: the FSDP2 + Adam job of ``bench.blocking`` (``--size``
  over the world), ``--repeats`` rounds of: a save to S3
  (``CheckpointManager(s3).save``, synchronous) and its load (``resume``); a
  tiered save to each host's local tier (``local_tier=``, ``replicas=0``:
  the local root of each host) and its load from there; with 3 hosts also a
  tiered save with ``replicas=1`` (each host's files sent to its partner
  over gloo). The same world size on one host (3 ranks on host 0, one
  local tier) gives the other column. Each time is the slowest rank's, from
  a barrier to its return; GB/s per rank = the rank's state bytes / that
  time; medians over rounds (after one untimed round: the first save
  makes dcp_ext's groups and connections).
* **A host's death**: a save in which host 1's rank pauses (in
  ``write_data`` of a plain S3 save, or in the replica exchange of a tiered
  save), then host 1 is killed: loudly (its processes SIGKILLed; peers see
  their connections close) or silently (cut off first, then killed:
  peers hear nothing). Time from the kill to each survivor's error (both
  ``time.monotonic``: one kernel, one clock); the target is
  ``collective_timeout`` + 5 s. ``--timeout`` is the collective timeout.
* **A lost host's restore**: a tiered save (persisted to S3), host 1's
  local tier deleted (a replacement host), then ``resume``: with
  ``replicas=1`` host 1's files come from its partner (node 2) over gloo;
  with ``replicas=0`` host 1 reads them from S3 (the others from their
  tiers); and, for reference, every rank from S3 (no local tier). Slowest
  rank's ``resume`` time; bytes per source from the restore's reader.

Results: ``bench/results/cluster-<date>.json`` and the ``cluster`` block of bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness.machine import machine_info
from bench.harness.report import publish
from bench.harness.training import build_training, forward_backward, layer_width, optimizer_step
from dcp_ext.config import parse_size

MiB = 1 << 20
BUCKET = "bench"
VICTIM = 1


# -- rank functions (run on the cluster's hosts by Cluster.spawn) ----------------------


def _state_bytes(model: Any, optim: Any) -> int:
    import torch

    total = 0
    for param in model.parameters():
        total += param.to_local().numel() * param.element_size()
    for state in optim.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total


def _job(cfg: dict[str, Any]) -> tuple[Any, Any]:
    """This rank's FSDP2 model and Adam, after one step (Adam has its moments)."""
    import torch.distributed as dist

    model, optim, batch = build_training(dist.get_rank(), dist.get_world_size(), cfg["width"], cfg["layers"])
    forward_backward(model, batch)
    optimizer_step(optim)
    return model, optim


def _timed(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _manager(cfg: dict[str, Any], root: str, **kwargs: Any) -> Any:
    import dcp_ext

    config = dcp_ext.IOConfig.from_env(collective_timeout=cfg["collective_timeout"])
    return dcp_ext.CheckpointManager(f"{cfg['root']}/{root}", storage_options=cfg["options"], config=config,
                                     **kwargs)


def throughput_world(cfg: dict[str, Any]) -> dict[str, Any]:
    """(each rank) The throughput rounds of the module docstring: raw seconds per round."""
    import dcp_ext

    model, optim = _job(cfg)
    fresh, fresh_optim = _job(cfg)
    tier = os.path.join(cfg["local_path"], f"tp-{cfg['layout']}")
    s3 = _manager(cfg, f"tp-{cfg['layout']}-s3", retention=dcp_ext.KeepLast(1))
    local = _manager(cfg, f"tp-{cfg['layout']}-local", local_tier=tier, replicas=0, persist_every=0, keep_local=1)
    ops: list[tuple[str, Any]] = [
        ("s3_save", lambda i: s3.save(f"s{i}", model, optim)),
        ("s3_load", lambda i: s3.resume(fresh, fresh_optim, tag=f"s{i}")),
        ("local_save", lambda i: local.save(f"l{i}", model, optim)),
        ("local_load", lambda i: local.resume(fresh, fresh_optim, tag=f"l{i}")),
    ]
    replicated = None
    if cfg["layout"] == "hosts":
        replicated = _manager(cfg, "tp-replicated", local_tier=tier + "-replicated", replicas=1, persist_every=0,
                              keep_local=1)
        ops.append(("replicated_save", lambda i: replicated.save(f"r{i}", model, optim)))
    rounds = []
    from_root = 0
    for i in range(cfg["repeats"] + 1):  # round 0 warms up (groups, connections, staging): not kept
        times = {name: _timed(lambda op=op, i=i: op(i)) for name, op in ops}
        from_root += local.last_reader.store.bytes_by_source().get("root", 0)
        if i:
            rounds.append(times)
    for manager in (s3, local, replicated):
        if manager is not None:
            manager.close()
    return {"rounds": rounds, "state_bytes": _state_bytes(model, optim), "local_load_root_bytes": from_root}


def _pause_here(point: str, gate: str) -> None:
    os.environ["DCP_EXT_PAUSE_AT"], os.environ["DCP_EXT_PAUSE_FILE"] = point, gate
    from dcp_ext._runtime import failpoints

    failpoints.reload()


def death_world(cfg: dict[str, Any], kind: str, gate: str) -> dict[str, Any]:
    """(each rank) One save in which rank :data:`VICTIM` pauses (``kind``
    ``"plain"``: in ``write_data`` of an S3 save; ``"tiered"``: in the replica
    exchange of a tiered save) and is killed there by the bench; what each
    survivor raised and when (``time.monotonic``)."""
    import torch.distributed as dist

    from tests.support.cluster_tier_workers import model

    rank = dist.get_rank()
    layer = model(1, dist.get_world_size())
    name = os.path.basename(gate)  # a root and local tier per trial
    if kind == "plain":
        manager = _manager(cfg, name)
        point = "mid_data"
    else:
        manager = _manager(cfg, name, local_tier=os.path.join(cfg["local_path"], name), replicas=1, persist_every=0,
                           keep_local=1)
        point = "mid_replication"
    if rank == VICTIM:
        _pause_here(point, gate)
    try:
        manager.save("d1", layer)
    except Exception as err:  # noqa: BLE001 - the measurement
        failed = {"ok": False, "at": time.monotonic(), "type": type(err).__name__,
                  "ranks": list(getattr(err, "ranks", ())), "step": getattr(err, "step", ""), "message": str(err)[:600]}
        # Rank 0 runs the rendezvous store (env://), where the others read who is
        # alive: it stays until every survivor has its error, as torchrun's agent would.
        Path(f"{gate}.failed.{rank}").touch()
        deadline = time.monotonic() + 60
        survivors = [r for r in range(dist.get_world_size()) if r != VICTIM]
        while rank == 0 and time.monotonic() < deadline and not all(
                Path(f"{gate}.failed.{r}").exists() for r in survivors):
            time.sleep(0.05)
        return failed
    return {"ok": True, "at": time.monotonic()}


def lost_host_save(cfg: dict[str, Any], variant: str) -> int:
    """(each rank) Save tag ``r`` tiered (``variant``: ``"peers"`` with
    ``replicas=1``, ``"s3"`` with ``replicas=0``), drained to S3; this rank's state bytes."""
    model, optim = _job(cfg)
    manager = _manager(cfg, f"lost-{variant}", local_tier=os.path.join(cfg["local_path"], f"lost-{variant}"),
                       replicas=1 if variant == "peers" else 0, persist_every=0, keep_local=1)
    manager.save("r", model, optim, persist=True)
    manager.wait_for_persist()
    manager.close()
    return _state_bytes(model, optim)


def lost_host_restore(cfg: dict[str, Any], variant: str) -> dict[str, Any]:
    """(each rank) Resume tag ``r`` (``variant`` ``"all_s3"``: with no local tier,
    every rank from S3); this rank's seconds and bytes per source."""
    fresh, fresh_optim = _job(cfg)
    if variant == "all_s3":
        manager = _manager(cfg, "lost-peers")
    else:
        manager = _manager(cfg, f"lost-{variant}", local_tier=os.path.join(cfg["local_path"], f"lost-{variant}"),
                           replicas=1 if variant == "peers" else 0, persist_every=0, keep_local=1)
    seconds = _timed(lambda: manager.resume(fresh, fresh_optim, tag="r"))
    store = manager.last_reader.store
    by_source = store.bytes_by_source() if hasattr(store, "bytes_by_source") else {
        "root": store.stats.snapshot().bytes_read}
    plan = manager.last_restore_plan
    manager.close()
    return {"seconds": seconds, "by_source": by_source, "fetched": len(plan.fetches) if plan is not None else 0}


# -- the bench (test process) ----------------------------------------------------------


def _slowest(values: list[float]) -> float:
    return max(values)


def _spawn(cluster: Any, fn: Any, *args: Any, layout: str = "hosts", timeout: float = 1800) -> Any:
    hosts, per_host = ([0, 1, 2], 1) if layout == "hosts" else ([0], 3)
    # By name: run as ``python -m bench.cluster`` this module is __main__, which the ranks cannot import.
    return cluster.spawn(f"bench.cluster:{fn.__name__}", args=args, hosts=hosts, ranks_per_host=per_host, final_barrier=False, pg_timeout=300,
                         timeout=timeout)


def run_throughput(cluster: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for layout in ("hosts", "one_host"):
        ranks = _spawn(cluster, throughput_world, {**cfg, "layout": layout}, layout=layout).check()
        out[layout] = {"ranks": ranks,
                       "rounds": [{op: _slowest([r["rounds"][i][op] for r in ranks]) for op in ranks[0]["rounds"][i]}
                                  for i in range(cfg["repeats"])]}
    return out


def run_deaths(cluster: Any, cfg: dict[str, Any], trials: int) -> list[dict[str, Any]]:
    out = []
    for kind in ("plain", "tiered"):
        for silent in (False, True):
            for trial in range(trials):
                gate = Path(cluster.base_dir) / f"death-{kind}-{int(silent)}-{trial}"
                run = _spawn(cluster, death_world, cfg, kind, str(gate), timeout=300)
                deadline = time.monotonic() + 240
                while not Path(f"{gate}.reached").exists():
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"rank {VICTIM} never paused ({kind})")
                    time.sleep(0.02)
                killed_at = time.monotonic()
                cluster.kill_host(VICTIM, silent=silent)
                results = run.wait()
                if silent:
                    cluster.restore_link(VICTIM)
                survivors = [r.value for r in results if r.rank != VICTIM]
                if any(s is None or s["ok"] for s in survivors):
                    raise RuntimeError(f"a survivor did not fail: {[r.describe() for r in results]}")
                out.append({"save": kind, "silent": silent, "trial": trial,
                            "seconds": [s["at"] - killed_at for s in survivors],
                            "types": [s["type"] for s in survivors], "named": [s["ranks"] for s in survivors],
                            "steps": [s["step"] for s in survivors], "message": survivors[0]["message"]})
    return out


def run_lost_host(cluster: Any, cfg: dict[str, Any], repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for variant in ("peers", "s3"):
        state = _spawn(cluster, lost_host_save, cfg, variant).check()
        out["state_bytes"] = max(state)
        runs = []
        for _ in range(repeats):
            shutil.rmtree(cluster.hosts[VICTIM].local_dir / f"lost-{variant}", ignore_errors=True)  # a new host
            os.sync()
            runs.append(_spawn(cluster, lost_host_restore, cfg, variant).check())
        out[variant] = runs
    out["all_s3"] = [_spawn(cluster, lost_host_restore, cfg, "all_s3").check() for _ in range(repeats)]
    return out


def summarize(record: dict[str, Any]) -> dict[str, Any]:
    med = statistics.median
    tp = record["throughput"]
    state = {layout: max(r["state_bytes"] for r in tp[layout]["ranks"]) for layout in tp}
    throughput = {}
    for layout, data in tp.items():
        throughput[layout] = {op: {"seconds": med(r[op] for r in data["rounds"]),
                                   "gbps_per_rank": state[layout] / med(r[op] for r in data["rounds"]) / 1e9}
                              for op in data["rounds"][0]}
    deaths: dict[str, Any] = {}
    for d in record["deaths"]:
        key = f"{d['save']}_{'silent' if d['silent'] else 'loud'}"
        deaths.setdefault(key, []).extend(d["seconds"])
    timeout = record["params"]["collective_timeout"]
    death_summary = {key: {"max": max(v), "median": med(v), "n": len(v), "ok": max(v) <= timeout + 5.0}
                     for key, v in deaths.items()}
    lost = record["lost_host"]
    restores = {}
    for variant in ("peers", "s3", "all_s3"):
        runs = lost[variant]
        restores[variant] = {
            "seconds": med(max(r["seconds"] for r in run) for run in runs),
            "lost_host_seconds": med(run[VICTIM]["seconds"] for run in runs),
            "root_bytes": max(sum(r["by_source"].get("root", 0) for r in run) for run in runs),
            "lost_host_root_bytes": max(run[VICTIM]["by_source"].get("root", 0) for run in runs),
        }
    return {"state_bytes_per_rank": state, "throughput": throughput, "deaths": death_summary, "restores": restores,
            "lost_state_bytes": lost["state_bytes"]}


_OPS = (("s3_save", "save to S3 (synchronous)"), ("s3_load", "load from S3"),
        ("local_save", "tiered save, each host's local tier (`replicas=0`)"),
        ("local_load", "load from the local tiers"),
        ("replicated_save", "tiered save with `replicas=1` (partner copy over gloo)"))


def render(record: dict[str, Any]) -> str:
    s, m, p = record["summary"], record["machine"], record["params"]
    tp = s["throughput"]
    mib = s["state_bytes_per_rank"]["hosts"] / MiB
    timeout = p["collective_timeout"]
    lines = [
        f"Run of {record['date']} on `{m['machine_id']}`: {m['cpu_count']} × {m['cpu_model']}, "
        f"{m['ram_gib']:.1f} GiB RAM, kernel {m['kernel']}; torch {m['versions'].get('torch')}, dcp_ext "
        f"{m['versions'].get('dcp_ext')} (commit `{m['git_commit'][:12]}`{', dirty tree' if m['git_dirty'] else ''}); "
        f"load average at start/end {m['loadavg_start']} / {record['loadavg_end']}; run time "
        f"{record['runtime_seconds'] / 60:.1f} min.",
        "",
        f"3 hosts × 1 rank (network namespaces on one kernel, one bridge) against 3 ranks on one host; FSDP2 + "
        f"Adam, {mib:,.0f} MiB of state per rank; S3 = SeaweedFS in its own namespace; local tier = each "
        f"host's node-local directory (all on the machine's one disk). {p['repeats']} rounds, medians, slowest "
        f"rank. `collective_timeout` {timeout:g} s.",
        "",
        f"Command: `{record['command']}`",
        "",
        "| GB/s per rank (ms) | 3 hosts × 1 rank | 1 host × 3 ranks | 3 hosts / 1 host |",
        "|---|---:|---:|---:|",
    ]
    for op, label in _OPS:
        if op not in tp["hosts"]:
            continue
        a = tp["hosts"][op]
        b = tp["one_host"].get(op)
        cell_b = f"{b['gbps_per_rank']:.3f} ({b['seconds'] * 1e3:,.0f})" if b else "–"
        ratio = f"{a['gbps_per_rank'] / b['gbps_per_rank']:.2f}×" if b else "–"
        lines.append(f"| {label} | {a['gbps_per_rank']:.3f} ({a['seconds'] * 1e3:,.0f}) | {cell_b} | {ratio} |")
    lines += [
        "",
        f"| a host dies mid-save: kill → every survivor's error | trials × survivors | median s | max s | target ≤ "
        f"{timeout + 5:g} s (timeout + 5) |",
        "|---|---:|---:|---:|---|",
    ]
    labels = {"plain_loud": "S3 save, in `write_data`: killed (connections close)",
              "plain_silent": "S3 save, in `write_data`: cut off, then killed (silence)",
              "tiered_loud": "tiered save, in the replica exchange: killed",
              "tiered_silent": "tiered save, in the replica exchange: cut off, then killed"}
    for key, label in labels.items():
        d = s["deaths"].get(key)
        if d is not None:
            lines.append(f"| {label} | {d['n']} | {d['median']:.1f} | {d['max']:.1f} | {'✅' if d['ok'] else '❌'} |")
    types = sorted({t for d in record["deaths"] for t in d["types"]})
    lines += [
        "",
        f"Every survivor raised {', '.join(f'`{t}`' for t in types)} naming rank {VICTIM} "
        f"({'yes' if all(n == [VICTIM] for d in record['deaths'] for n in d['named']) else 'not always'}).",
        "",
        f"| restore after host {VICTIM}'s local tier was lost ({s['lost_state_bytes'] / MiB:,.0f} MiB per rank) | "
        f"`resume` ms, slowest rank | host {VICTIM}'s rank, ms | bytes read from S3, all ranks |",
        "|---|---:|---:|---:|",
    ]
    rlabels = {"peers": f"`replicas=1`: host {VICTIM}'s files from its partner over gloo",
               "s3": f"`replicas=0`: host {VICTIM} reads from S3, the others their local tiers",
               "all_s3": "every rank from S3 (no local tier)"}
    for key, label in rlabels.items():
        r = s["restores"][key]
        lines.append(f"| {label} | {r['seconds'] * 1e3:,.0f} | {r['lost_host_seconds'] * 1e3:,.0f} | "
                     f"{r['root_bytes']:,} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="192MiB", help="params + 2 Adam moments (fp32), total over the 3 ranks")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--death-trials", type=int, default=2, help="trials per kind of death")
    parser.add_argument("--timeout", type=float, default=10.0, help="collective_timeout, seconds")
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args(argv)
    from tests.support.cluster import Cluster

    available = Cluster.available()
    if not available:
        print(f"python -m bench.cluster cannot run here: {available.reason}", file=sys.stderr)
        return 2
    command = "python -m bench.cluster " + " ".join(argv if argv is not None else sys.argv[1:])
    started = time.monotonic()
    with Cluster(3) as cluster:
        assert cluster.s3 is not None
        cluster.s3.boto3_client().create_bucket(Bucket=BUCKET)
        record: dict[str, Any] = {
            "date": datetime.date.today().isoformat(), "started": time.time(), "command": command,
            "machine": machine_info(Path(cluster.base_dir)),
            "params": {"state_size": parse_size(args.size), "layers": args.layers,
                       "width": layer_width(parse_size(args.size), args.layers), "repeats": args.repeats,
                       "death_trials": args.death_trials, "collective_timeout": args.timeout, "hosts": 3,
                       "ranks_per_host": 1, "cluster_timings": dict(cluster.timings)}}
        cfg = {"width": record["params"]["width"], "layers": args.layers, "repeats": args.repeats,
               "collective_timeout": args.timeout, "options": cluster.s3.storage_options(),
               "root": f"s3://{BUCKET}", "local_path": str(cluster.local_path)}
        record["throughput"] = run_throughput(cluster, cfg)
        record["deaths"] = run_deaths(cluster, cfg, args.death_trials)
        record["lost_host"] = run_lost_host(cluster, cfg, args.repeats)
    record["runtime_seconds"] = time.monotonic() - started
    record["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    record["summary"] = summarize(record)
    publish(record, "cluster", render(record), readme=not args.no_readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
