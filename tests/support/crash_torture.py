"""Crash-consistency trials: kill real 2-rank saves and check what is left.

Each trial runs ``tests/support/crash_job.py`` (a real 2-process gloo job saving
``step{N}`` through ``CheckpointManager``, keep 2) and kills it at a named
crash point on one rank or all ranks, or at a random moment, or not at all.
Then, in this process (one process, no process group: a resharded load):

1. the tag ``newest`` resolves to (if any) loads bit-exact;
2. the new tag is either committed and bit-exact, or not offered at all;
3. no checkpoint was deleted except by retention after a committed save;
4. after a save that completed, no uncommitted directory or temporary file
   is left anywhere under the root.

Used by ``tests/test_torture.py`` (a few trials) and ``bench/torture.py``
(hundreds).
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import dcp_ext
from dcp_ext._failpoints import POINTS
from dcp_ext.storage import TMP_MARK
from tests.support import REPO
from tests.support.compare import state_diff
from tests.support.crash_job import KEEP, make_model

#: The job, run as a module from the repository root.
JOB = [sys.executable, "-m", "tests.support.crash_job"]


@dataclass
class TortureStats:
    """``armed``: trials with a crash planned; ``kills``: jobs that actually
    died (a crash point on rank 1 that only the coordinator reaches, such as
    ``before_newest``, never fires)."""

    trials: int = 0
    armed: int = 0
    kills: int = 0
    committed_despite_kill: int = 0
    violations: list[str] = field(default_factory=list)
    by_crash: dict[str, int] = field(default_factory=dict)


def _expected(step: int) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in make_model(step).state_dict().items()}


def _check_tag(manager: dcp_ext.CheckpointManager, tag: str) -> str | None:
    """Load ``tag`` into a fresh model in this process; None if bit-exact."""
    step = int(tag.removeprefix("step"))
    model = make_model(10_000 + step)  # different weights: all must come from the checkpoint
    try:
        result = manager.resume(model, tag=tag)
    except Exception as err:  # noqa: BLE001 - any failure is the violation
        return f"{tag}: load failed: {type(err).__name__}: {err}"
    if result.user_content != {"step": step}:
        return f"{tag}: user_content {result.user_content!r}"
    diffs = state_diff(_expected(step), model.state_dict())
    return f"{tag}: " + "; ".join(diffs) if diffs else None


def _leftovers(root: Path) -> list[str]:
    found = []
    for path in root.rglob("*"):
        if TMP_MARK in path.name:
            found.append(str(path.relative_to(root)))
    for directory in root.glob("*_partial"):
        if not (directory / "dcp_ext.metadata.json").exists():
            found.append(f"{directory.name} (uncommitted)")
    return found


def choose_crash(rng: random.Random) -> str:
    roll = rng.random()
    who = rng.choice(["0", "1", "all"])
    if roll < 0.15:
        return "none"
    if roll < 0.75:
        return f"{who}:{rng.choice(POINTS)}"
    return f"{who}:random:{rng.uniform(0.0, 0.25):.3f}"


def run_trials(root: Path, trials: int, seed: int = 0, crashes: list[str] | None = None,
               log: Any = None, mode: str = "sync", first_step: int = 0) -> TortureStats:
    """Run ``trials`` trials (or one per entry of ``crashes``) under ``root``,
    with ``sync`` or ``async`` saves, numbering steps after ``first_step``."""
    rng = random.Random(seed)
    stats = TortureStats()
    manager = dcp_ext.CheckpointManager(root)
    plan = crashes if crashes is not None else [choose_crash(rng) for _ in range(trials)]
    step = first_step
    for crash in plan:
        step += 1
        tag = f"step{step}"
        before = manager.tags()
        started = time.monotonic()
        job = subprocess.Popen([*JOB, str(Path(root).resolve()), str(step), crash, mode], cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        try:
            _, err = job.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            import os

            os.killpg(job.pid, signal.SIGKILL)
            _, err = job.communicate()
            stats.violations.append(f"trial {step} ({crash}): job hung for 180 s")
        elapsed = time.monotonic() - started
        ok = job.returncode == 0
        stats.trials += 1
        kind = crash.split(":")[1] if crash != "none" else "none"
        stats.by_crash[kind] = stats.by_crash.get(kind, 0) + 1
        if crash == "none" and not ok:
            stats.violations.append(f"trial {step}: uncrashed save failed: {err.decode()[-500:]}")
        if crash != "none":
            stats.armed += 1
        if not ok:
            stats.kills += 1
        problems: list[str] = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            after = manager.tags()
            newest = manager.read_newest()
        if newest is not None:
            problem = _check_tag(manager, newest)
            if problem:
                problems.append(f"newest {problem}")
        elif before:
            problems.append(f"nothing loadable after the trial; before: {before}")
        if tag in after:
            if not ok:
                stats.committed_despite_kill += 1
            if tag != newest:
                problem = _check_tag(manager, tag)
                if problem:
                    problems.append(problem)
            kept = set((before + [tag])[-KEEP:])
            if not kept <= set(after):
                problems.append(f"retention deleted too much: before {before}, after {after}")
        elif set(after) != set(before):
            problems.append(f"tags changed without a commit: before {before}, after {after}")
        if set(after) - set(before) - {tag}:
            problems.append(f"unexpected tags {sorted(set(after) - set(before) - {tag})}")
        if ok:
            left = _leftovers(root)
            if left:
                problems.append(f"leftovers after a completed save: {left}")
        for problem in problems:
            stats.violations.append(f"trial {step} ({crash}): {problem}")
        if log is not None:
            log(f"trial {step:>4} {crash:<24} exit {job.returncode:>4} {elapsed:5.1f}s "
                f"committed={tag in after} newest={newest} tags={after} "
                + ("OK" if not problems else "VIOLATION " + "; ".join(problems)))
    return stats
