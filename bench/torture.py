"""Crash-consistency torture: ``python -m bench.torture [--trials 200] [--seed 1]``.

Runs the trials of ``tests/support/crash_torture.py`` (real 2-rank saves killed at a
random crash point on one or all ranks, or at a random moment, or not at all;
then bit-exact checks of what is left) and writes
``bench/results/torture-<date>.json`` with every trial's line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
import time
from pathlib import Path

from tests.support.crash_torture import run_trials

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dcp_ext_torture_") as root:
        stats = run_trials(Path(root), args.trials, seed=args.seed, log=log)
    result = {
        "date": datetime.date.today().isoformat(), "trials": stats.trials, "armed": stats.armed,
        "kills": stats.kills,
        "committed_despite_kill": stats.committed_despite_kill, "by_crash": stats.by_crash,
        "violations": stats.violations, "seconds": time.monotonic() - started, "log": lines,
    }
    out = ROOT / "bench" / "results" / f"torture-{result['date']}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"{stats.trials} trials, {stats.armed} with a crash planned, {stats.kills} jobs killed "
          f"({stats.by_crash}), "
          f"{stats.committed_despite_kill} killed saves committed anyway, "
          f"{len(stats.violations)} violations; {out}")
    return 1 if stats.violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
