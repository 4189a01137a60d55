"""Crash-consistency torture: ``python -m bench.torture [--trials 200] [--seed 1] [--incremental | --concurrent]``.

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
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    raise SystemExit(main())
