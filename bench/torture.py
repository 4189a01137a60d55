"""Crash-consistency torture: ``python -m bench.torture [--trials 200] [--seed 1] [--incremental]``.

Runs the trials of ``tests/support/crash_torture.py`` (real 2-rank saves killed at a
random crash point on one or all ranks, or at a random moment, or not at all;
then bit-exact checks of what is left) and writes
``bench/results/torture-<date>.json`` with every trial's line.

``--incremental`` runs the jobs with ``CheckpointManager(incremental=True)``
(mode ``sync-incremental`` of ``tests/support/crash_job.py``: a short
``max_chain``, a model most of whose weights stay the same from step to
step), adds the checks of kept tags and retired directories, and writes
``bench/results/torture-incremental-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
import time
from pathlib import Path

from tests.support.crash_torture import TortureStats, run_trials

ROOT = Path(__file__).resolve().parent.parent


def _summary(stats: TortureStats, incremental: bool) -> str:
    """One line of figures for the console."""
    line = (f"{stats.trials} trials, {stats.armed} with a crash planned, {stats.kills} jobs killed "
            f"({stats.by_crash}), {stats.committed_despite_kill} killed saves committed anyway, "
            f"{len(stats.violations)} violations")
    if incremental:
        line += (f"; {stats.referring_saves} committed saves referred to earlier files, "
                 f"{stats.retired_seen} trials left a retired directory")
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--incremental", action="store_true",
                        help="save with incremental=True (mode sync-incremental of tests/support/crash_job.py)")
    args = parser.parse_args(argv)
    mode = "sync-incremental" if args.incremental else "sync"
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dcp_ext_torture_") as root:
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
    name = f"torture-incremental-{result['date']}.json" if args.incremental else f"torture-{result['date']}.json"
    out = ROOT / "bench" / "results" / name
    out.write_text(json.dumps(result, indent=1))
    print(f"{_summary(stats, args.incremental)}; {out}")
    return 1 if stats.violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
