"""Crash-consistency trials: kill real 2-rank saves and check what is left.

Each trial runs ``tests/support/crash_job.py`` (a real 2-process gloo job saving
``step{N}`` through ``CheckpointManager``, keep 2) and kills it at a named
crash point on one rank or all ranks, or at a random moment, or not at all.
Then, in this process (one process, no process group: a resharded load):

1. the tag ``newest`` resolves to (if any) loads bit-exact;
2. the new tag is either committed and bit-exact, or not offered at all;
3. no checkpoint was deleted except by retention after a committed save;
4. after a save that completed, no uncommitted directory or temporary file
   is left anywhere under the root, and no data file that neither a
   committed checkpoint holds nor one refers to.

In the incremental modes (``sync-incremental``, ``async-incremental``:
saves refer to earlier checkpoints' data files) also:

5. every committed tag loads bit-exact, not only ``newest`` and the new
   one: its frames may lie in files of checkpoints retention deleted;
6. every file a committed checkpoint refers to exists, after every trial;
7. a retired directory (:data:`~dcp_ext.layout.RETIRED_FILE`, no metadata)
   counts as tidy after a completed save only while it holds nothing but
   files a committed checkpoint refers to.

With a job beside it (:func:`concurrent_sequence`: the root's one rule,
``dcp_ext/root.py``, under fire), each incremental save runs while, on the
same root and from another process, ``dcp-ext compact`` rewrites a committed
tag, ``dcp-ext prune --keep 1`` deletes old ones, or a second 2-rank job
saves its own tag with the same retention; either side may be killed. Then:

8. every committed tag (whoever saved it) loads bit-exact, and every file
   a committed checkpoint refers to exists;
9. one leftover pass (as the next save runs) leaves no leftovers, and
   checks 8 hold again after it.

Used by ``tests/test_torture.py`` (a few trials) and ``bench/torture.py``
(hundreds).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Collection, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import dcp_ext
from dcp_ext._runtime.failpoints import POINTS
from dcp_ext.guard import _save_lock as save_lock
from dcp_ext.layout import DATA_SUFFIX
from dcp_ext.metadata import METADATA_FILE
from dcp_ext.layout import RETIRED_FILE, strays_marker
from dcp_ext.storage import TMP_MARK
from tests.support import REPO, forked
from tests.support.compare import state_diff
from tests.support.crash_job import KEEP, MODES, is_incremental, make_model
from tests.support.side_by_side import drive

#: The job, run as a module from the repository root.
JOB = [sys.executable, "-m", "tests.support.crash_job"]
#: How a trial's job and what runs beside it start: ``"exec"``, a fresh
#: interpreter each (``python -m tests.support.crash_job``, ``python -m
#: dcp_ext``; ``bench/torture.py``), or ``"fork"``, forked from the test's
#: fork server (tests/support/forked.py; tests/test_torture.py): the same
#: code, sessions, environment and kills, without the interpreter start and
#: ``import torch`` of each job, its ranks' fork server and each CLI (about
#: 6 s of CPU per job, 3 s per CLI).
JOB_START = "exec"
#: Seconds a job may take before the trial counts as hung.
JOB_TIMEOUT = 180


@dataclass
class TortureStats:
    """``armed``: trials with a crash planned; ``kills``: jobs that actually
    died (a crash point on rank 1 that only the coordinator reaches, such as
    ``before_newest``, never fires). ``outcomes_by_crash``: per kind of
    crash (a crash point, ``random`` or ``none``), its trials, kills,
    killed saves committed anyway and violations. Incremental modes only:
    ``referring_saves``: committed new tags that refer to earlier files;
    ``retired_seen``: trials that left at least one retired directory.
    Concurrent trials: ``beside``: what ran beside the jobs, by kind;
    ``refused``: compactions refused (a save built on the tag, or it was
    deleted meanwhile)."""

    trials: int = 0
    armed: int = 0
    kills: int = 0
    committed_despite_kill: int = 0
    violations: list[str] = field(default_factory=list)
    by_crash: dict[str, int] = field(default_factory=dict)
    outcomes_by_crash: dict[str, dict[str, int]] = field(default_factory=dict)
    referring_saves: int = 0
    retired_seen: int = 0
    beside: dict[str, int] = field(default_factory=dict)
    refused: int = 0


@dataclass(frozen=True)
class Beside:
    """What runs beside a trial's job on the same root (:func:`concurrent_sequence`).

    Attributes:
        kind: ``"compact"`` (``dcp-ext compact ROOT tag``), ``"prune"``
            (``dcp-ext prune ROOT --keep 1``) or ``"job"`` (a second 2-rank
            save of ``step{step}``).
        crash: ``"none"``, a crash point for the CLI (``mid_compact``,
            ``mid_retention``), or for ``"job"`` a crash of :func:`choose_crash`.
        tag: ``"compact"``: the tag to compact.
        step: ``"job"``: the step it saves.
        delay: Seconds after the trial's job starts.
    """

    kind: str
    crash: str = "none"
    tag: str | None = None
    step: int = 0
    delay: float = 0.0

    def describe(self) -> str:
        what = {"compact": f"compact {self.tag}", "prune": "prune --keep 1", "job": f"job step{self.step}"}[self.kind]
        return f"{what} ({self.crash}, +{self.delay:.1f}s)"


@dataclass(frozen=True)
class _JobOutcome:
    """How one job ended: its exit code, stderr tail, seconds, and whether it
    hung; and how what ran beside it ended. ``cli_error``: its stderr (all of
    it, not only the tail: a refusal names long paths) holds the ``dcp-ext:
    error:`` line of a command that refused."""

    returncode: int
    stderr: str
    seconds: float
    hung: bool
    beside: _JobOutcome | None = None
    cli_error: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def _expected(step: int, incremental: bool) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in make_model(step, incremental).state_dict().items()}


def _check_tag(manager: dcp_ext.CheckpointManager, tag: str, incremental: bool) -> str | None:
    """Load ``tag`` into a fresh model in this process; None if bit-exact."""
    step = int(tag.removeprefix("step"))
    model = make_model(10_000 + step)  # different weights everywhere: all must come from the checkpoint
    try:
        result = manager.resume(model, tag=tag)
    except Exception as err:  # noqa: BLE001 - any failure is the violation
        return f"{tag}: load failed: {type(err).__name__}: {err}"
    if result.user_content != {"step": step}:
        return f"{tag}: user_content {result.user_content!r}"
    diffs = state_diff(_expected(step, incremental), model.state_dict())
    return f"{tag}: " + "; ".join(diffs) if diffs else None


def _document(directory: Path) -> dict[str, Any]:
    """A committed directory's metadata document, read as plain JSON (a side door)."""
    document: dict[str, Any] = json.loads((directory / METADATA_FILE).read_bytes())
    return document


def _data_files(directory: Path) -> list[str]:
    """Data files under ``directory`` (key prefixes too), as paths relative to it."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob(f"*{DATA_SUFFIX}"))


def _stray_in(directory: Path, referenced: Collection[tuple[str, str]]) -> list[str]:
    """What a completed save should have removed from one ``*_partial`` directory.

    A committed directory may hold its own data files (its metadata's
    ``files``) and files later checkpoints refer to; a retired one only files
    a committed checkpoint refers to, and its marker; any other directory
    without metadata is an uncommitted leftover.
    """
    kept = {file for d, file in referenced if d == directory.name}
    if (directory / METADATA_FILE).exists():
        own = {entry[0] for entry in _document(directory)["files"]}
        return [f"{directory.name}/{name} (data file nobody holds or refers to)"
                for name in _data_files(directory) if name not in own | kept]
    if not (directory / RETIRED_FILE).exists():
        return [f"{directory.name} (uncommitted)"]
    if not kept:
        return [f"{directory.name} (retired, but no committed checkpoint refers to its files)"]
    present = {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}
    return [f"{directory.name}/{name} (in a retired directory, not referred to)"
            for name in sorted(present - kept - {RETIRED_FILE}) if TMP_MARK not in name]


def _leftovers(root: Path, referenced: Collection[tuple[str, str]]) -> list[str]:
    """Temporary files, uncommitted directories and unreferenced data files
    under ``root``. A temporary file directly in the root counts only once it
    is older than the stale-lock limit: until then it may be another job's
    write in flight (``newest``, a lease, a full checkpoint), which cleanup
    leaves alone."""
    stale = time.time() - float(save_lock.STALE_LOCK_SECONDS)
    found = [str(path.relative_to(root)) for path in root.rglob("*") if TMP_MARK in path.name
             and (path.parent != root or path.stat().st_mtime < stale)]
    for directory in sorted(root.glob("*_partial")):
        found.extend(_stray_in(directory, referenced))
    return found


def _missing_references(root: Path, referenced: Collection[tuple[str, str]]) -> list[str]:
    """Files committed checkpoints refer to that are not there."""
    return [f"{d}/{file} is referred to but missing" for d, file in sorted(referenced)
            if not (root / d / file).is_file()]


def _retired_dirs(root: Path) -> list[str]:
    return sorted(d.name for d in root.glob("*_partial")
                  if (d / RETIRED_FILE).exists() and not (d / METADATA_FILE).exists())


def _incremental_section(root: Path, tag: str) -> dict[str, Any]:
    """The committed ``tag``'s ``incremental`` metadata section (empty if none)."""
    section = _document(root / f"{tag}_partial").get("incremental")
    return section if isinstance(section, dict) else {}


def _tally(stats: TortureStats, kind: str, *, killed: bool, committed_despite_kill: bool, violations: int) -> None:
    """Count one trial of crash ``kind`` in ``stats.outcomes_by_crash``."""
    outcome = stats.outcomes_by_crash.setdefault(
        kind, {"trials": 0, "kills": 0, "committed_despite_kill": 0, "violations": 0})
    outcome["trials"] += 1
    outcome["kills"] += killed
    outcome["committed_despite_kill"] += committed_despite_kill
    outcome["violations"] += violations


def choose_crash(rng: random.Random) -> str:
    roll = rng.random()
    who = rng.choice(["0", "1", "all"])
    if roll < 0.15:
        return "none"
    if roll < 0.75:
        return f"{who}:{rng.choice(POINTS)}"
    return f"{who}:random:{rng.uniform(0.0, 0.25):.3f}"


def _run_job(root: Path, step: int, crash: str, mode: str) -> _JobOutcome:
    """Run the 2-rank job saving ``step{step}`` and wait for it (killing it if it hangs)."""
    return _finish_job(_start_job((root, step, crash, mode)))


_Started = tuple[Any, float, "tuple[Any, float] | None"]  # subprocess.Popen or forked.Forked


def _start_job(job: tuple[Any, ...]) -> _Started:
    """Start the 2-rank job ``(root, step, crash, mode[, beside])`` saving
    ``step{step}``, and what runs beside it; the processes and when they started."""
    root, step, crash, mode = job[:4]
    beside: Beside | None = job[4] if len(job) > 4 else None
    argv = [str(Path(root).resolve()), str(step), crash, mode]
    if JOB_START == "fork":
        main: Any = forked.start("tests.support.crash_torture:forked_job", argv, cwd=REPO)
    else:
        main = subprocess.Popen([*JOB, *argv], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True)
    started = time.monotonic()
    other = None
    if beside is not None:
        env = dict(os.environ)
        if beside.kind == "job":
            target, args = "tests.support.crash_torture:forked_job", [argv[0], str(beside.step), beside.crash, mode]
            command = [*JOB, *args]
        else:
            args = [beside.kind, argv[0]] + ([beside.tag or ""] if beside.kind == "compact" else ["--keep", "1"])
            target, command = "dcp_ext.cli:main", [sys.executable, "-m", "dcp_ext", *args]
            if beside.crash != "none":
                env["DCP_EXT_CRASH_AT"] = beside.crash
        if JOB_START == "fork":
            other = (forked.start(target, args, env=env, cwd=REPO, delay=beside.delay), started)
        else:
            delayed = ["sh", "-c", 'sleep "$0"; exec "$@"', f"{beside.delay:.2f}", *command]
            other = (subprocess.Popen(delayed, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      start_new_session=True), started)
    return main, started, other


def forked_job(argv: list[str]) -> None:
    """``python -m tests.support.crash_job ARGV`` in a process forked from the
    test's fork server (:data:`JOB_START` ``"fork"``): torch is imported
    already, so the two ranks fork from this process, in its process group
    (a kill of ``all`` still takes the job and both ranks)."""
    from tests.support import dist
    from tests.support.crash_job import job

    dist.START_METHOD = "fork"
    dist.run_world(2, job, argv[0], int(argv[1]), argv[2], argv[3], timeout=120.0)


def _kill_group(job: Any) -> None:
    """SIGKILL a started job's process group (it leads its own session)."""
    if isinstance(job, forked.Forked):
        job.kill()
    else:
        os.killpg(job.pid, signal.SIGKILL)


def _finish_job(run: _Started) -> _JobOutcome:
    """Wait for a started job (and what runs beside it)."""
    main, started, other = run
    outcome = _wait(main, started)
    if other is None:
        return outcome
    return dataclasses.replace(outcome, beside=_wait(*other))


def _wait(job: Any, started: float) -> _JobOutcome:
    """Wait for a started process, at most :data:`JOB_TIMEOUT` seconds after it
    started (then kill its process group: it hung)."""
    hung = False
    try:
        _, err = job.communicate(timeout=max(1.0, JOB_TIMEOUT - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        _kill_group(job)
        _, err = job.communicate()
        hung = True
    text = err.decode(errors="replace")
    return _JobOutcome(job.returncode, text[-500:], time.monotonic() - started, hung,
                       cli_error="dcp-ext: error:" in text)


def _check_loads(manager: dcp_ext.CheckpointManager, tag: str, before: list[str], after: list[str],
                 newest: str | None, incremental: bool) -> list[str]:
    """Checks 1, 2 and 5: what must load bit-exact does."""
    problems = []
    if newest is not None:
        problem = _check_tag(manager, newest, incremental)
        if problem:
            problems.append(f"newest {problem}")
    elif before:
        problems.append(f"nothing loadable after the trial; before: {before}")
    if incremental:  # frames of any kept tag may lie in files retention retired
        others = [t for t in after if t != newest]
    else:
        others = [tag] if tag in after and tag != newest else []
    problems.extend(p for p in (_check_tag(manager, t, incremental) for t in others) if p)
    return problems


def _check_tags(tag: str, before: list[str], after: list[str]) -> list[str]:
    """Check 3: tags appear only by a commit and vanish only by retention after one."""
    problems = []
    if tag in after:
        kept = set((before + [tag])[-KEEP:])
        if not kept <= set(after):
            problems.append(f"retention deleted too much: before {before}, after {after}")
    elif set(after) != set(before):
        problems.append(f"tags changed without a commit: before {before}, after {after}")
    if set(after) - set(before) - {tag}:
        problems.append(f"unexpected tags {sorted(set(after) - set(before) - {tag})}")
    return problems


def _check_files(manager: dcp_ext.CheckpointManager, root: Path, completed: bool) -> list[str]:
    """Checks 4, 6 and 7: referenced files exist; a completed save left nothing stray."""
    try:
        referenced = manager.checkpoints.referenced_files()
    except Exception as err:  # noqa: BLE001 - an unreadable committed metadata is the violation
        return [f"referenced files unknown: {type(err).__name__}: {err}"]
    problems = _missing_references(root, referenced)
    if completed:
        left = _leftovers(root, referenced)
        if left:
            problems.append(f"leftovers after a completed save: {left}")
    return problems


def run_trials(root: Path, trials: int, seed: int = 0, crashes: list[str] | None = None,
               log: Any = None, mode: str = "sync", first_step: int = 0) -> TortureStats:
    """Run ``trials`` trials (or one per entry of ``crashes``) under ``root``,
    with saves of ``mode`` (one of :data:`~tests.support.crash_job.MODES`),
    numbering steps after ``first_step``."""
    return run_side_by_side(trial_sequence(root, trials, seed, crashes, log, mode, first_step))[0]


def run_side_by_side(*sequences: Generator[tuple[Any, ...], _JobOutcome, TortureStats]) -> list[TortureStats]:
    """Drive several :func:`trial_sequence` s (each on its own root) with
    :func:`tests.support.side_by_side.drive`: the k-th jobs of all of them run
    at once, each sequence's checks run here between its jobs. Their stats, in order."""
    return drive(sequences, _start_job, _finish_job, _abandon_job)


def _abandon_job(run: _Started) -> None:
    """Kill a started job's process group (and what ran beside it) if it
    still runs (a side-by-side job failed)."""
    for job in (run[0], run[2][0] if run[2] is not None else None):
        if job is not None and job.poll() is None:
            _kill_group(job)
            job.communicate()


def trial_sequence(root: Path, trials: int, seed: int = 0, crashes: list[str] | None = None,
                   log: Any = None, mode: str = "sync",
                   first_step: int = 0) -> Generator[tuple[Path, int, str, str], _JobOutcome, TortureStats]:
    """:func:`run_trials` as a sequence: yields each job to run as ``(root,
    step, crash, mode)``, takes back its outcome, checks it; returns the stats."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    incremental = is_incremental(mode)
    rng = random.Random(seed)
    stats = TortureStats()
    manager = dcp_ext.CheckpointManager(root)
    plan = crashes if crashes is not None else [choose_crash(rng) for _ in range(trials)]
    step = first_step
    for crash in plan:
        step += 1
        tag = f"step{step}"
        before = manager.tags()
        job = yield Path(root), step, crash, mode
        stats.trials += 1
        kind = crash.split(":")[1] if crash != "none" else "none"
        stats.by_crash[kind] = stats.by_crash.get(kind, 0) + 1
        problems = [f"job hung for {JOB_TIMEOUT} s"] if job.hung else []
        if crash == "none" and not job.ok:
            problems.append(f"uncrashed save failed: {job.stderr}")
        if crash != "none":
            stats.armed += 1
        if not job.ok:
            stats.kills += 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            after = manager.tags()
            newest = manager.read_newest()
        committed = tag in after
        if committed and not job.ok:
            stats.committed_despite_kill += 1
        problems += _check_loads(manager, tag, before, after, newest, incremental)
        problems += _check_tags(tag, before, after)
        problems += _check_files(manager, Path(root), job.ok)
        stats.violations.extend(f"trial {step} ({crash}): {problem}" for problem in problems)
        _tally(stats, kind, killed=not job.ok, committed_despite_kill=committed and not job.ok,
               violations=len(problems))
        detail = ""
        if incremental:
            section = _incremental_section(Path(root), tag) if committed else {}
            stats.referring_saves += bool(section.get("references"))
            retired = _retired_dirs(Path(root))
            stats.retired_seen += bool(retired)
            detail = f" chain={section.get('chain')} retired={retired}"
        if log is not None:
            log(f"trial {step:>4} {crash:<24} exit {job.returncode:>4} {job.seconds:5.1f}s "
                f"committed={committed} newest={newest} tags={after}{detail} "
                + ("OK" if not problems else "VIOLATION " + "; ".join(problems)))
    return stats


def choose_beside(rng: random.Random, committed: list[str], step: int) -> Beside:
    """A random thing to run beside the save of ``step{step}``."""
    kind = rng.choice(["compact", "prune", "job"])
    delay = rng.uniform(0.0, 2.5)  # the save's interpreter start, planning, data, commit, retention
    if kind == "compact" and committed:
        return Beside("compact", rng.choice(["none", "none", "mid_compact"]), tag=rng.choice(committed), delay=delay)
    if kind == "job":
        return Beside("job", choose_crash(rng), step=BESIDE_STEPS + step, delay=delay)
    return Beside("prune", rng.choice(["none", "none", "mid_retention"]), delay=delay)


#: A second job's steps start here (its tags are ``step{BESIDE_STEPS + n}``).
BESIDE_STEPS = 1000


def _beside_problems(beside: Beside, outcome: _JobOutcome | None) -> list[str]:
    """How what ran beside may not end: it may be killed where planned, and
    ``compact`` may refuse (the tag is being saved on, or was deleted)."""
    if outcome is None:
        return ["nothing ran beside the job"]
    if outcome.hung:
        return [f"{beside.describe()} hung for {JOB_TIMEOUT} s"]
    if outcome.ok or beside.crash != "none":
        return []  # a planned kill: the CLI dies by SIGKILL, a job's other rank exits 1
    if beside.kind == "compact" and outcome.returncode == 2 and outcome.cli_error:
        return []  # refused: a save builds on it, or retention deleted it meanwhile
    return [f"{beside.describe()} failed: exit {outcome.returncode}: {outcome.stderr}"]


def _stale_markers(root: Path, referenced: Collection[tuple[str, str]]) -> list[str]:
    """Strays markers left by a cleanup pass: one may stay only while its
    committed directory holds data files its metadata does not name that
    another checkpoint refers to."""
    stale = []
    for directory in sorted(root.glob("*_partial")):
        marker = root / strays_marker(directory.name.removesuffix("_partial"))
        if not marker.exists():
            continue
        own = {e[0] for e in _document(directory)["files"]} if (directory / METADATA_FILE).exists() else set()
        kept = {file for d, file in referenced if d == directory.name}
        if not (set(_data_files(directory)) - own) & kept:
            stale.append(f"{marker.name} (nothing left for it to mark)")
    return stale + [f"{p.name} (its directory is gone)" for p in root.glob(".dcp_ext.strays.*")
                    if not (root / (p.name.removeprefix(".dcp_ext.strays.").removesuffix(".json") + "_partial")).exists()]


def _all_load(manager: dcp_ext.CheckpointManager, root: Path, when: str) -> list[str]:
    """Check 8: every committed tag loads bit-exact; every referenced file exists."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tags = manager.tags()
    problems = [f"{when}: {p}" for p in (_check_tag(manager, tag, True) for tag in tags) if p]
    try:
        referenced = manager.checkpoints.referenced_files()
    except Exception as err:  # noqa: BLE001 - an unreadable committed metadata is the violation
        return problems + [f"{when}: referenced files unknown: {type(err).__name__}: {err}"]
    return problems + [f"{when}: {p}" for p in _missing_references(root, referenced)]


def concurrent_sequence(root: Path, trials: int, seed: int = 0, plan: list[tuple[str, Beside]] | None = None,
                        log: Any = None) -> Generator[tuple[Any, ...], _JobOutcome, TortureStats]:
    """Trials of incremental saves with something beside each on the same
    root (checks 8 and 9 of the module docstring), as a sequence for
    :func:`run_side_by_side`. ``plan``: ``(crash, beside)`` per trial
    (default: ``trials`` random ones)."""
    rng = random.Random(seed)
    stats = TortureStats()
    manager = dcp_ext.CheckpointManager(root)
    step = 0
    for k in range(len(plan) if plan is not None else trials):
        step += 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            committed = manager.tags()
        crash, beside = plan[k] if plan is not None else (choose_crash(rng), choose_beside(rng, committed, step))
        job = yield Path(root), step, crash, "sync-incremental", beside
        stats.trials += 1
        kind = crash.split(":")[1] if crash != "none" else "none"
        stats.by_crash[kind] = stats.by_crash.get(kind, 0) + 1
        stats.beside[beside.kind] = stats.beside.get(beside.kind, 0) + 1
        stats.armed += crash != "none"
        stats.kills += not job.ok
        problems = [f"job hung for {JOB_TIMEOUT} s"] if job.hung else []
        if crash == "none" and not job.ok:
            problems.append(f"uncrashed save failed: {job.stderr}")
        problems += _beside_problems(beside, job.beside)
        if job.beside is not None and beside.kind == "compact" and job.beside.returncode == 2:
            stats.refused += 1
        problems += _all_load(manager, Path(root), "after the trial")
        # Check 9: the next save's leftover pass (every process of the trial has ended).
        try:
            manager.checkpoints.remove_leftovers()
            referenced = manager.checkpoints.referenced_files()
            left = _leftovers(Path(root), referenced)
            left += _stale_markers(Path(root), referenced)
        except Exception as err:  # noqa: BLE001 - a cleanup that fails is the violation
            left = [f"cleanup failed: {type(err).__name__}: {err}"]
        if left:
            problems.append(f"leftovers after a cleanup pass: {left}")
        problems += _all_load(manager, Path(root), "after the cleanup pass")
        stats.violations.extend(f"trial {step} ({crash} | {beside.describe()}): {p}" for p in problems)
        _tally(stats, kind, killed=not job.ok, committed_despite_kill=False, violations=len(problems))
        if log is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                after, newest = manager.tags(), manager.read_newest()
            beside_exit = job.beside.returncode if job.beside is not None else None
            log(f"trial {step:>4} {crash:<24} exit {job.returncode:>4} | {beside.describe():<40} exit {beside_exit} "
                f"{job.seconds:5.1f}s newest={newest} tags={after} "
                + ("OK" if not problems else "VIOLATION " + "; ".join(problems)))
    return stats
