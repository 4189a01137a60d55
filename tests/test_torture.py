"""Crash consistency: real 2-rank saves killed at every crash point and at a
random moment (see support/crash_torture.py; ``python -m bench.torture`` runs hundreds)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import crash_torture
from tests.support.crash_torture import Beside, concurrent_sequence, run_side_by_side, trial_sequence


def test_killed_saves_never_lose_or_corrupt_a_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three sequences of killed 2-rank jobs, their k-th jobs side by side (each
    on its own root; every check after every trial, in this process).

    Async saves (async_save=True): the job mutates every parameter right
    after staging_completion, and the kill lands in the background upload
    while the training thread waits on the handle.

    Every crash point once, with incremental=True (the writer, commit and
    retention code of every save, plus references: max_chain=2 and a model
    that changes little per step, so step2 and step3 refer to step1's file),
    in an order that gives retention something to delete (keep 2):
    mid_retention dies retiring step1 (its files stay for step2 and step3);
    then kills in the data and metadata phases, and a clean save that must
    remove every leftover but keep the retired files still referred to
    (random-time kills: ``python -m bench.torture --incremental``, 18 of the
    60 trials of bench/results/torture-incremental-2026-11-27.json). Every
    kept tag must load bit-exact after every trial. (Plain sync saves are
    crash-tested by bench.torture; the crash points are the same code.)

    Each job (and each ``dcp-ext`` command beside one) is a process of its
    own, in its own session, forked from the suite's fork server instead of
    a fresh interpreter (``crash_torture.JOB_START``; bench.torture execs).
    """
    monkeypatch.setattr(crash_torture, "JOB_START", "fork")
    async_crashes = ["none", "0:mid_data", "all:before_metadata", "0:before_newest", "none"]
    crashes = [
        "none", "0:before_newest", "0:mid_retention", "1:before_data", "0:mid_data", "all:after_data",
        "0:before_metadata", "none",
    ]
    # A third sequence runs something else on its root during each save (the
    # root's one rule): prune, compact (of the tag the save builds on, and one
    # killed after writing its new file), and a second 2-rank job. The delays
    # put each in its job's save: a forked job's ranks save from about 0.3 s
    # to 0.6 s after it starts (measured, 3 jobs at a time; the other job's
    # save runs about 0.4 s after its start), so that the compaction of step2
    # runs into its crash point instead of finding step2 already pruned.
    concurrent_plan = [
        ("none", Beside("prune", delay=0.2)),
        ("none", Beside("compact", tag="step1", delay=0.3)),
        ("0:mid_data", Beside("job", step=1003, delay=0.2)),
        ("none", Beside("compact", "mid_compact", tag="step2", delay=0.3)),
        ("none", Beside("prune", "mid_retention", delay=0.3)),
        ("none", Beside("job", "all:before_metadata", step=1006, delay=0.1)),
    ]
    async_lines: list[str] = []
    lines: list[str] = []
    concurrent_lines: list[str] = []
    for name in ("async", "incremental", "concurrent"):
        (tmp_path / name).mkdir()
    async_stats, stats, concurrent = run_side_by_side(
        trial_sequence(tmp_path / "async", 0, crashes=async_crashes, log=async_lines.append, mode="async"),
        trial_sequence(tmp_path / "incremental", 0, crashes=crashes, log=lines.append, mode="sync-incremental"),
        concurrent_sequence(tmp_path / "concurrent", 0, plan=concurrent_plan, log=concurrent_lines.append),
    )
    assert concurrent.trials == len(concurrent_plan) and concurrent.violations == [], "\n".join(concurrent_lines)
    assert concurrent.beside == {"prune": 2, "compact": 2, "job": 2}, concurrent.beside
    assert async_stats.trials == len(async_crashes) and async_stats.kills == 3, "\n".join(async_lines)
    assert async_stats.violations == [], "\n".join(async_lines)
    # before_newest: committed, newest not moved
    assert async_stats.committed_despite_kill >= 1, "\n".join(async_lines)

    # The six crash points always fire.
    assert stats.trials == len(crashes) and stats.armed == 6 and stats.kills == 6, "\n".join(lines)
    assert stats.violations == [], "\n".join(lines)
    assert stats.committed_despite_kill >= 2, "\n".join(lines)  # before_newest, mid_retention
    # The harness really exercised references and retired directories.
    assert stats.referring_saves >= 3 and stats.retired_seen >= 1, "\n".join(lines)
