"""Plan-caching torture: one 2-rank job saves in turn under one plan cache name
while dtypes, shapes and key sets change, saves are refused and the ranks
disagree, and the job may be killed (issue 40).

``python -m tests.support.plan_cache_torture ROOT SEED CRASH`` (from the
repository root) is one trial's job: 2 gloo ranks (forked from one fork
server) run :data:`SAVES` saves of :func:`spec` ``(SEED, k)`` each, every one
with ``LayoutSavePlanner(enable_plan_caching=True)`` under one cache name,
through ``dcp_ext.save`` (as the adapters call it) or stock ``dcp.save``,
and log each outcome (``ROOT/log.jsonl``, rank 0). CRASH is ``none`` or
``K:{rank|all}:{point}`` (SIGKILL at crash point ``point`` of save ``K``) or
``K:{rank|all}:random:{seconds}``.

:func:`check_trial` then checks, in the test process: every save that logged
a commit loads bit-exact, with the dtypes it was saved in, through
``dcp_ext.load``, ``load_whole``, ``verify`` and (uncompressed) torch's own
reader; every save that was meant to be refused or to fail was, with the
typed error expected; no save failed with an untyped error; no directory is
committed that no logged (or killed) save could have committed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent.parent
#: Saves per trial, all in one process under one plan cache name.
SAVES = 5
DTYPES = ("float32", "bfloat16", "float16", "float64", "int32")
POINTS = ("before_data", "mid_data", "after_data", "before_metadata")
JOB_TIMEOUT = 180.0


@dataclasses.dataclass(frozen=True)
class SaveSpec:
    """One save of a trial, a pure function of (seed, k).

    Attributes:
        k: Its place in the trial.
        path: Directory name under the trial's root (a refusal reuses an earlier one).
        dtype: Dtype of every tensor.
        rows: Rows of the sharded tensor (its shape changes with it).
        extra: Whether the state has an extra key.
        stock: Saved with stock ``dcp.save`` + ``CheckpointWriter`` (else ``dcp_ext.save``).
        compression: ``None`` or ``"zstd"``.
        refused: Saved to an earlier save's directory: must fail with ``CheckpointExistsError``.
        mixed: Rank 1 saves the replicated tensor in another dtype: must fail with ``PlanMismatchError``.
    """

    k: int
    path: str
    dtype: str
    rows: int
    extra: bool
    stock: bool
    compression: str | None
    refused: bool
    mixed: bool

    @property
    def fails(self) -> bool:
        return self.refused or self.mixed


def spec(seed: int, k: int) -> SaveSpec:
    rng = random.Random(seed * 1000 + k)
    refused = k > 0 and rng.random() < 0.2
    mixed = not refused and rng.random() < 0.1
    return SaveSpec(
        k=k, path=f"s{rng.randrange(k)}" if refused else f"s{k}", dtype=rng.choice(DTYPES),
        rows=rng.choice((8, 8, 12)), extra=rng.random() < 0.3, stock=rng.random() < 0.4,
        compression=rng.choice((None, "zstd")), refused=refused, mixed=mixed,
    )


def expected_state(seed: int, s: SaveSpec, rank: int | None = None) -> dict[str, Any]:
    """The state save ``s`` holds: the full tensors (``rank=None``) or what ``rank`` passes to the save."""
    import torch

    dtype = getattr(torch, s.dtype)
    gen = torch.Generator().manual_seed(seed * 7919 + s.k)
    state: dict[str, Any] = {
        "sharded": (torch.randn(s.rows, 6, generator=gen) * 100).to(dtype),
        "replicated": (torch.randn(5, generator=gen) * 100).to(dtype),
        "own0": torch.arange(4, dtype=torch.float32).to(dtype) + s.k,
        "own1": torch.arange(4, dtype=torch.float32).to(dtype) - s.k,
    }
    if s.extra:
        state["extra"] = torch.full((3,), float(s.k)).to(dtype)
    if rank is None:
        return state
    if s.mixed and rank == 1:
        state["replicated"] = state["replicated"].to(torch.float64 if s.dtype != "float64" else torch.float32)
    state.pop(f"own{1 - rank}")
    return state


def job(rank: int, world_size: int, root: str, seed: int, crash: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import dcp_ext
    from tests.support.crash_job import _arm

    mesh = init_device_mesh("cpu", (world_size,))
    crash_at, _, how = crash.partition(":")
    log = open(f"{root}/log.jsonl", "a") if rank == 0 else None
    for k in range(SAVES):
        s = spec(seed, k)
        state = expected_state(seed, s, rank)
        state["sharded"] = distribute_tensor(state["sharded"], mesh, [Shard(0)])
        if crash != "none" and int(crash_at) == k:
            _arm(rank, how)
        planner = dcp_ext.LayoutSavePlanner(enable_plan_caching=True, plan_cache_name="torture")
        path = f"{root}/{s.path}"
        try:
            if s.stock:
                writer = dcp_ext.CheckpointWriter(path, compression=s.compression)
                dcp.save(state, storage_writer=writer, planner=planner)
            else:
                dcp_ext.save(state, path, planner=planner, compression=s.compression)
            outcome = "committed"
        except BaseException as exc:  # noqa: BLE001 - stock DCP raises CheckpointException
            error = dcp_ext.unwrap_checkpoint_exception(exc)
            kind = "typed" if isinstance(error, dcp_ext.DcpExtError) else "untyped"
            outcome = f"{kind}:{type(error).__name__}:{str(error)[:200]}"
        if log is not None:
            log.write(json.dumps({"k": k, "outcome": outcome}) + "\n")
            log.flush()
            os.fsync(log.fileno())
        dist.barrier()


def choose_crash(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.3:
        return "none"
    k, who = rng.randrange(SAVES), rng.choice(["0", "1", "all"])
    if roll < 0.8:
        return f"{k}:{who}:{rng.choice(POINTS)}"
    return f"{k}:{who}:random:{rng.uniform(0.0, 0.3):.3f}"


@dataclasses.dataclass
class TrialResult:
    seed: int
    crash: str
    exit_code: int
    seconds: float
    logged: int
    committed: int
    refused: int
    violations: list[str]


def run_trial(root: Path, seed: int, crash: str) -> TrialResult:
    """Run one trial's job in ``root`` (created) and check what it left."""
    root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    job_proc = subprocess.Popen([sys.executable, "-m", "tests.support.plan_cache_torture", str(root), str(seed), crash],
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _, err = job_proc.communicate(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(job_proc.pid, 9)
        _, err = job_proc.communicate()
        return TrialResult(seed, crash, -9, time.monotonic() - started, 0, 0, 0, [f"job hung: {err[-300:]!r}"])
    result = check_trial(root, seed, crash)
    result.exit_code, result.seconds = job_proc.returncode, time.monotonic() - started
    if crash == "none" and job_proc.returncode != 0:
        result.violations.append(f"job without a crash exited {job_proc.returncode}: {err.decode()[-500:]}")
    return result


def check_trial(root: Path, seed: int, crash: str) -> TrialResult:
    """The checks of the module docstring."""
    import torch
    import torch.distributed.checkpoint as dcp

    import dcp_ext
    from dcp_ext.metadata import METADATA_FILE
    from dcp_ext.root import verify
    from dcp_ext.whole_state import load_whole

    log_file = root / "log.jsonl"
    logged = [json.loads(line) for line in log_file.read_text().splitlines()] if log_file.exists() else []
    violations: list[str] = []
    owner: dict[str, SaveSpec] = {}  # directory -> the save whose state it must hold
    committed = refused = 0
    armed = int(crash.partition(":")[0]) if crash != "none" else SAVES  # saves from here on may be killed
    for entry in logged:
        s = spec(seed, entry["k"])
        outcome: str = entry["outcome"]
        if s.k >= armed and outcome != "committed":
            continue  # a rank was killed in it (or its crash point fired in it): any failure is the kill's
        if outcome.startswith("untyped"):
            violations.append(f"save {s.k}: untyped error {outcome}")
        if s.refused and s.path in owner:
            refused += 1
            if not outcome.startswith("typed:CheckpointExistsError"):
                violations.append(f"save {s.k} to {s.path} (committed by save {owner[s.path].k}) was not refused: "
                                  f"{outcome}")
        elif s.mixed:
            if not outcome.startswith(("typed:GlobalPlanError", "typed:PlanMismatchError")):
                violations.append(f"save {s.k} with the ranks' dtypes disagreeing: {outcome}")
        elif outcome == "committed":
            owner[s.path] = s
            committed += 1
        else:
            violations.append(f"save {s.k} failed without a reason: {outcome}")
    done = {entry["k"] for entry in logged}
    unlogged = [k for k in range(SAVES) if k not in done]
    if unlogged:  # the job died in this save: it may have committed before it died
        s = spec(seed, unlogged[0])
        if not s.mixed and (root / s.path / METADATA_FILE).exists():
            owner.setdefault(s.path, s)
    for directory in sorted(p.name for p in root.iterdir() if p.is_dir()):
        if (root / directory / METADATA_FILE).exists() and directory not in owner:
            violations.append(f"{directory} is committed, but no save that targeted it committed")
    for directory, s in sorted(owner.items()):
        path = str(root / directory)
        if not (root / directory / METADATA_FILE).exists():
            violations.append(f"save {s.k} logged a commit but {directory} holds no metadata")
            continue
        want = expected_state(seed, s)
        try:
            back = {key: torch.zeros_like(value) for key, value in want.items()}
            dcp_ext.load(back, path)
            whole = load_whole(path)
            report = verify(path)
        except BaseException as exc:  # noqa: BLE001 - any failure to load a committed save is a violation
            violations.append(f"save {s.k} ({directory}) does not load: {type(exc).__name__}: {exc}")
            continue
        for key, value in want.items():
            for how, got in (("dcp_ext.load", back[key]), ("load_whole", whole.get(key))):
                if not isinstance(got, torch.Tensor) or got.dtype != value.dtype or not torch.equal(got, value):
                    violations.append(f"save {s.k} ({directory}): {how} gives wrong {key!r} "
                                      f"({getattr(got, 'dtype', None)} vs {value.dtype})")
        if not report.ok:
            violations.append(f"save {s.k} ({directory}): verify found {report.problems[:2]}")
        if s.compression is None:
            stock = {key: torch.zeros_like(value) for key, value in want.items()}
            dcp.load(stock, storage_reader=dcp_ext.CheckpointReader(path))
            bad = [key for key in want if stock[key].dtype != want[key].dtype or not torch.equal(stock[key], want[key])]
            if bad:
                violations.append(f"save {s.k} ({directory}): torch's reader gives wrong {bad}")
    return TrialResult(seed, crash, 0, 0.0, len(logged), committed, refused, violations)


def run_trials(root: Path, trials: int, seed: int = 0, log: Any = print) -> list[TrialResult]:
    """``trials`` trials, each in ``root/t{n}``, crashes chosen from ``seed``."""
    rng = random.Random(seed)
    results = []
    for n in range(trials):
        trial_seed = seed * 100_000 + n
        crash = choose_crash(rng)
        result = run_trial(root / f"t{n}", trial_seed, crash)
        results.append(result)
        log(f"trial {n} seed {trial_seed} crash {crash}: exit {result.exit_code}, {result.logged} saves logged, "
            f"{result.committed} committed, {result.refused} refusals, {len(result.violations)} violations "
            f"({result.seconds:.1f} s)" + "".join(f"\n  - {v}" for v in result.violations))
    return results


if __name__ == "__main__":
    from tests.support import dist
    from tests.support.dist import run_world

    dist.START_METHOD = "forkserver"
    run_world(2, job, sys.argv[1], int(sys.argv[2]), sys.argv[3], timeout=JOB_TIMEOUT)
