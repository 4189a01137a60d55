"""Crash-consistency torture: ``python -m bench.torture [--trials 200] [--seed 1] [--incremental | --concurrent | --plan-caching]``.

Runs the trials of ``tests/support/crash_torture.py`` (real 2-rank saves killed at a
random crash point on one or all ranks, or at a random moment, or not at all;
then bit-exact checks of what is left) and writes
``bench/results/torture-<date>.json`` with every trial's line.

``--incremental`` runs the jobs with ``CheckpointManager(incremental=True)``
(mode ``sync-incremental`` of ``tests/support/crash_job.py``: a short
``max_chain``, a model most of whose weights stay the same from step to
step), adds the checks of kept tags and retired directories, and writes
``bench/results/torture-incremental-<date>.json``.

``--concurrent`` runs incremental saves with something else on the same
root at the same time, from another process: ``dcp-ext compact`` of a
committed tag, ``dcp-ext prune --keep 1``, or a second 2-rank job saving its
own tag; either side may be killed. Every committed tag must load bit-exact
and every referenced file exist after each trial and after one leftover pass
(:func:`tests.support.crash_torture.concurrent_sequence`); it writes
``bench/results/torture-concurrent-<date>.json``.

``--plan-caching`` runs the trials of ``tests/support/plan_cache_torture.py``
(issue 40): one 2-rank job per trial saves five times under one plan cache
name while dtypes (fp32, bf16, fp16, fp64, int32), shapes and key sets
change, some saves are refused or the ranks disagree, through
``dcp_ext.save`` and stock ``dcp.save``, raw and zstd, and the job may be
killed at a crash point or a random moment of a random save. Every
committed save must load bit-exact in its own dtypes through every reader,
every refusal must be the typed one expected, no error untyped; it writes
``bench/results/torture-plan-caching-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
import time
from pathlib import Path

from tests.support.crash_torture import TortureStats, concurrent_sequence, run_side_by_side, run_trials

ROOT = Path(__file__).resolve().parent.parent


def _summary(stats: TortureStats, incremental: bool) -> str:
    """One line of figures for the console."""
    line = (f"{stats.trials} trials, {stats.armed} with a crash planned, {stats.kills} jobs killed "
            f"({stats.by_crash}), {stats.committed_despite_kill} killed saves committed anyway, "
            f"{len(stats.violations)} violations")
    if incremental:
        line += (f"; {stats.referring_saves} committed saves referred to earlier files, "
                 f"{stats.retired_seen} trials left a retired directory")
    if stats.beside:
        line += f"; beside the jobs: {stats.beside}, {stats.refused} compactions refused"
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--incremental", action="store_true",
                        help="save with incremental=True (mode sync-incremental of tests/support/crash_job.py)")
    parser.add_argument("--concurrent", action="store_true",
                        help="incremental saves with compact, prune or a second job on the same root at once")
    parser.add_argument("--plan-caching", action="store_true",
                        help="saves under one plan cache name with dtype, shape and key changes, refusals and kills")
    args = parser.parse_args(argv)
    if args.plan_caching:
        return _plan_caching(args.trials, args.seed)
    mode = "concurrent" if args.concurrent else "sync-incremental" if args.incremental else "sync"
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dcp_ext_torture_") as root:
        if args.concurrent:
            stats = run_side_by_side(concurrent_sequence(Path(root), args.trials, seed=args.seed, log=log))[0]
        else:
            stats = run_trials(Path(root), args.trials, seed=args.seed, log=log, mode=mode)
    result = {
        "date": datetime.date.today().isoformat(), "mode": mode, "seed": args.seed, "trials": stats.trials,
        "armed": stats.armed, "kills": stats.kills,
        "committed_despite_kill": stats.committed_despite_kill, "by_crash": stats.by_crash,
        "outcomes_by_crash": stats.outcomes_by_crash,
        "violations": stats.violations, "seconds": time.monotonic() - started, "log": lines,
    }
    if args.incremental:
        result |= {"referring_saves": stats.referring_saves, "retired_seen": stats.retired_seen}
    if args.concurrent:
        result |= {"beside": stats.beside, "compactions_refused": stats.refused}
    name = {"sync": "torture", "sync-incremental": "torture-incremental", "concurrent": "torture-concurrent"}[mode]
    name = f"{name}-{result['date']}.json"
    out = ROOT / "bench" / "results" / name
    out.write_text(json.dumps(result, indent=1))
    print(f"{_summary(stats, args.incremental)}; {out}")
    return 1 if stats.violations else 0


def _plan_caching(trials: int, seed: int) -> int:
    """``--plan-caching``: the trials of tests/support/plan_cache_torture.py."""
    from tests.support.plan_cache_torture import run_trials as run_plan_cache_trials

    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dcp_ext_torture_plans_") as root:
        results = run_plan_cache_trials(Path(root), trials, seed=seed, log=log)
    violations = [f"trial {n}: {v}" for n, r in enumerate(results) for v in r.violations]
    killed = sum(1 for r in results if r.crash != "none")
    result = {
        "date": datetime.date.today().isoformat(), "mode": "plan-caching", "seed": seed, "trials": len(results),
        "with_kill": killed, "saves_logged": sum(r.logged for r in results),
        "committed": sum(r.committed for r in results), "refusals": sum(r.refused for r in results),
        "violations": violations, "seconds": time.monotonic() - started, "log": lines,
    }
    out = ROOT / "bench" / "results" / f"torture-plan-caching-{result['date']}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"{len(results)} trials, {killed} with a kill armed, {result['saves_logged']} saves logged, "
          f"{result['committed']} committed and checked, {result['refusals']} refusals, "
          f"{len(violations)} violations; {out}")
    return 1 if violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
