"""Runs the scale simulator's cases, each step in a child process under time and memory limits, and its command line.

``python -m bench.scale`` (``bench/scale/__main__.py``) runs :func:`main`;
the package docstring (:mod:`bench.scale`) says what is measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from bench.harness.machine import compact_machine_info, meminfo

from .cases import SYNTHESIS, Case, load_case, profile_case, save_case
from .report import render_markdown

__all__ = [
    "Limits",
    "SYSTEMS",
    "run_case",
    "default_cases",
    "run",
    "main",
]

log = logging.getLogger("bench.scale")

BENCH = Path(__file__).resolve().parents[1]
SYSTEMS = ("dcp_ext", "torch")
DEFAULT_RANKS = (8, 64, 512, 1024, 8192)
QUICK_RANKS = (8, 64)
GiB = 1 << 30
MiB = 1 << 20


# -- running a case -------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """What one child process may take before it is killed."""

    timeout: float = 600.0
    memory_bytes: int = 16 * GiB


@dataclass(frozen=True)
class _Outcome:
    status: str  # ok, timeout, memory, error
    phase: str
    result: dict[str, Any]
    seconds: float
    sampled_rss_mib: float
    error: str = ""


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class _Messages:
    """What a child reported: its current phase, finished steps, result or error."""

    def __init__(self, case: Case, start: float) -> None:
        self.case, self.start = case, start
        self.phase, self.error = "start", ""
        self.synthesized_at = start  # the time limit counts from here
        self.result: dict[str, Any] = {}
        self.partial: dict[str, Any] = {}  # finished steps, kept in case the child does not finish

    def drain(self, receive: Any) -> None:
        try:
            while receive.poll():
                message = receive.recv()
                if "phase" in message:
                    self.phase = message["phase"]
                    log.info("%s: %s (%.0f s)", self.case.label, self.phase, time.monotonic() - self.start)
                if "step" in message:
                    if message["step"] == SYNTHESIS:
                        self.synthesized_at = time.monotonic()
                    self.partial.setdefault("seconds", {})[message["step"]] = message["seconds"]
                    self.partial.setdefault("rss_mib", {})[message["step"]] = message["rss_mib"]
                self.result = message.get("result", self.result)
                self.error = message.get("error", self.error)
        except (EOFError, OSError):
            pass  # the child closed its end: it is leaving


def _child_entry(kind: str, case: Case, workdir: Path, options: dict[str, Any], conn: Any) -> None:
    """A forked child: run one step, send its progress and result, leave."""
    def emit(**fields: Any) -> None:
        conn.send(fields)

    code = 0
    try:
        if kind == "save":
            result = save_case(case, workdir, emit)
        elif kind == "load":
            result = load_case(case, workdir, emit)
        else:
            result = profile_case(case, options["seconds"], options["top"], emit)
        conn.send({"result": result})
    except BaseException:
        conn.send({"error": traceback.format_exc()})
        code = 1
    conn.close()
    # No interpreter teardown: the parent's inherited state is not ours to finalize.
    os._exit(code)


def _run_child(kind: str, case: Case, workdir: Path, limits: Limits, options: dict[str, Any] | None = None) -> _Outcome:
    """Run one step (``save``, ``load``, ``profile``) of ``case`` in a child process.

    ``limits.timeout`` counts from the end of the plans' synthesis (the
    simulator's work, not the system's); ``limits.memory_bytes`` always.

    The child is forked from this process, which has imported torch and
    dcp_ext but runs no case itself: it starts like a fresh interpreter with
    those imports done (its peak RSS starts at its RSS when forked), without
    paying seconds of imports per step.
    """
    ctx = mp.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_entry, args=(kind, case, workdir, options or {}, send), daemon=True)
    start = time.monotonic()
    proc.start()
    send.close()
    status, peak = "ok", 0
    messages = _Messages(case, start)
    while True:
        messages.drain(receive)
        if not proc.is_alive():
            break
        peak = max(peak, _rss_bytes(proc.pid or 0))
        if time.monotonic() - messages.synthesized_at > limits.timeout:
            status = "timeout"
        elif peak > limits.memory_bytes:
            status = "memory"
        if status != "ok":
            proc.kill()
            break
        receive.poll(0.2)
    proc.join()
    messages.drain(receive)  # what arrived while it was leaving
    receive.close()
    phase, result, error = messages.phase, messages.result or messages.partial, messages.error
    if status == "ok" and (error or proc.exitcode != 0):
        status = "error"
        error = error or f"child exited with code {proc.exitcode}"
        log.error("%s: %s step failed:\n%s", case.label, kind, error)
    return _Outcome(status, phase, result, time.monotonic() - start, peak / MiB, error)


def _run_in_process(kind: str, case: Case, workdir: Path) -> _Outcome:
    """The same step in this process (tests): no limits, no isolated peak RSS."""
    def emit(**fields: Any) -> None:
        if "phase" in fields:
            log.info("%s: %s", case.label, fields["phase"])

    start = time.monotonic()
    step = save_case if kind == "save" else load_case
    try:
        result = step(case, workdir, emit)
    except Exception:
        return _Outcome("error", kind, {}, time.monotonic() - start, 0.0, traceback.format_exc())
    return _Outcome("ok", kind, result, time.monotonic() - start, 0.0)


def _failure(outcome: _Outcome, limits: Limits) -> str:
    if outcome.status == "timeout":
        return f"did not finish in {limits.timeout:g} s ({outcome.phase})"
    if outcome.status == "memory":
        return f"exceeded {limits.memory_bytes / GiB:.1f} GiB RSS ({outcome.phase})"
    return f"failed ({outcome.phase}): {outcome.error.strip().splitlines()[-1] if outcome.error else '?'}"


def run_case(case: Case, limits: Limits, isolate: bool = True) -> dict[str, Any]:
    """Measure ``case``: the save step, then (if it finished) the load step.

    Returns:
        A result row: the case's fields, ``status`` (``ok`` or why not),
        and the ``save`` and ``load`` steps' measurements.
    """
    row: dict[str, Any] = {**asdict(case), "status": "ok", "loadavg_start": round(os.getloadavg()[0], 2)}
    with tempfile.TemporaryDirectory(prefix="dcp_ext_scale_") as tmp:
        workdir = Path(tmp)
        for kind in ("save", "load"):
            outcome = _run_child(kind, case, workdir, limits) if isolate else _run_in_process(kind, case, workdir)
            row[kind] = {**outcome.result, "wall_seconds": round(outcome.seconds, 2)}
            if isolate:
                row[kind]["sampled_rss_mib"] = round(outcome.sampled_rss_mib, 1)
            if outcome.status != "ok":
                row["status"] = f"{kind}: {_failure(outcome, limits)}"
                row["error"] = outcome.error
                break
    row["loadavg_end"] = round(os.getloadavg()[0], 2)
    log.info("%s: %s", case.label, row["status"])
    return row


def default_cases(quick: bool, systems: Sequence[str] = SYSTEMS, tp: int = 1) -> list[Case]:
    """The default matrix: 8B at N in :data:`DEFAULT_RANKS` for every system,
    70B and 405B at 8,192 for dcp_ext; ``quick``: 8B at :data:`QUICK_RANKS`."""
    ranks = QUICK_RANKS if quick else DEFAULT_RANKS
    cases = [Case(s, "8B", n, tp, max(1, n // 2)) for n in ranks for s in systems]
    if not quick and "dcp_ext" in systems:
        cases += [Case("dcp_ext", model, 8192, tp, 4096) for model in ("70B", "405B")]
    return cases


def run_cases(cases: Sequence[Case], limits: Limits, isolate: bool = True, out: list[dict[str, Any]] | None = None,
              on_row: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Measure every case in order (rows appended to ``out``, ``on_row`` called
    after each); once a (system, model, tp) did not finish at some N, its
    larger N are skipped."""
    rows: list[dict[str, Any]] = [] if out is None else out
    failed: dict[tuple[str, str, int], int] = {}
    for case in cases:
        key = (case.system, case.model, case.tp)
        if key in failed and case.ranks > failed[key]:
            rows.append({**asdict(case), "status": f"skipped: did not finish at N={failed[key]}"})
            continue
        row = run_case(case, limits, isolate)
        rows.append(row)
        if on_row is not None:
            on_row(row)
        if row["status"] != "ok" and ("timeout" in row["status"] or "did not finish" in row["status"]
                                      or "exceeded" in row["status"]):
            failed[key] = case.ranks
    return rows


# -- profiling -------------------------------------------------------------------------------


def run_profiles(model: str, ranks: Sequence[int], systems: Sequence[str], limits: Limits, seconds: float,
                 top: int = 15, out: list[dict[str, Any]] | None = None,
                 on_profile: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """``cProfile`` of the coordinator's ``create_global_plan`` at each N (each in a fresh process)."""
    profiles: list[dict[str, Any]] = [] if out is None else out
    for system in systems:
        for n in ranks:
            case = Case(system, model, n)
            with tempfile.TemporaryDirectory(prefix="dcp_ext_scale_") as tmp:
                # The child's own alarm stops the profile after `seconds`.
                budget = replace(limits, timeout=max(limits.timeout, seconds + 60))
                outcome = _run_child("profile", case, Path(tmp), budget, {"seconds": seconds, "top": top})
            entry = {"system": system, "model": model, "ranks": n, "status": outcome.status, **outcome.result}
            if outcome.status != "ok":
                entry["status"] = _failure(outcome, budget)
            profiles.append(entry)
            if on_profile is not None:
                on_profile(entry)
    return profiles


# -- CLI -----------------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _default_memory_limit() -> float:
    """16 GiB, or 70 % of the memory available now if that is less (GiB): the
    machine may be shared, and the kernel's OOM killer picks its own victim."""
    available = meminfo("MemAvailable")
    return min(16.0, 0.7 * available / GiB) if available else 16.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.scale",
        description="Scale simulator: coordinator planning, metadata size and decode, and resharded load "
                    "planning of dcp_ext vs torch DCP for N synthesized ranks (no tensor data).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help=f"8B at N in {QUICK_RANKS}, both systems, no profile")
    p.add_argument("--model", type=_str_list, default=None, help="models, comma separated (8B, 70B, 405B, tiny)")
    p.add_argument("--ranks", type=_int_list, default=None, help="world sizes N, comma separated")
    p.add_argument("--systems", type=_str_list, default=list(SYSTEMS), help="dcp_ext and/or torch")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of the save (mesh (N/tp, tp))")
    p.add_argument("--reshard-to", type=int, default=None, help="ranks M of the measured load [default N/2]")
    p.add_argument("--load-rank", type=int, default=0, help="the loading rank whose planning is measured")
    p.add_argument("--gc", choices=("system", "on", "off"), default="system",
                   help="cyclic GC during measured steps: as each system runs it (dcp_ext pauses it, "
                        "torch does not), or forced")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of each measured step that takes under 10 s; the fastest is reported")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per save/load process before it is killed")
    p.add_argument("--memory-limit", type=float, default=None,
                   help="GiB of RSS per process before it is killed [default: 16, or 70%% of available memory]")
    p.add_argument("--profile", type=_int_list, default=None,
                   help="N values at which to cProfile the coordinator's planning [full default run: 1024,8192]")
    p.add_argument("--profile-systems", type=_str_list, default=list(SYSTEMS))
    p.add_argument("--profile-seconds", type=float, default=300.0, help="stop each profiled planning after this")
    p.add_argument("--json", nargs="?", const="", default=None, metavar="PATH",
                   help="write results as JSON [bench/results/scale-<date>.json; always for full default runs]")
    p.add_argument("--note", default="", help="free text stored in the JSON (e.g. which dcp_ext was measured)")
    p.add_argument("--in-process", action="store_true", help="no subprocesses (tests): no limits, shared peak RSS")
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run what ``args`` asks for; print and return the report (``markdown``
    plus every row and profile)."""
    default_run = not args.quick and args.model is None and args.ranks is None
    memory = args.memory_limit if args.memory_limit is not None else _default_memory_limit()
    limits = Limits(args.timeout, int(memory * GiB))
    if args.model is None and args.ranks is None:
        cases = default_cases(args.quick, args.systems, args.tp)
    else:
        ranks = args.ranks or (QUICK_RANKS if args.quick else DEFAULT_RANKS)
        cases = [Case(s, m, n, args.tp, 1) for m in (args.model or ["8B"]) for n in ranks for s in args.systems]
    cases = [replace(c, reshard_to=args.reshard_to or max(1, c.ranks // 2), load_rank=args.load_rank, gc=args.gc,
                     repeats=args.repeats) for c in cases]
    log.info("%d cases, %.0f s and %.1f GiB per process", len(cases), limits.timeout, memory)
    torch.set_num_threads(1)  # the forked children inherit it
    path = None
    if args.json is not None or default_run:
        path = Path(args.json) if args.json else _default_json(args.quick)
    rows: list[dict[str, Any]] = []
    profiles: list[dict[str, Any]] = []
    report: dict[str, Any] = {"kind": "bench.scale", "note": args.note, "argv": sys.argv[1:],
                              "started": time.time(), "limits": asdict(limits), "rows": rows, "profiles": profiles}
    if path is not None:
        report["machine"] = compact_machine_info()

    def save(_: object = None) -> None:
        """Write what is done so far: a run stopped half-way keeps its rows."""
        report["seconds"] = round(time.time() - report["started"], 1)
        report["markdown"] = render_markdown(rows, profiles)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report, indent=1) + "\n")

    run_cases(cases, limits, isolate=not args.in_process, out=rows, on_row=save)
    profile_ranks = args.profile if args.profile is not None else ([1024, 8192] if default_run else [])
    if profile_ranks:
        run_profiles("8B" if args.model is None else args.model[0], profile_ranks, args.profile_systems,
                     limits, args.profile_seconds, out=profiles, on_profile=save)
    report["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    save()
    print(report["markdown"])
    if path is not None:
        log.info("results written to %s", path)
        report["json_path"] = str(path)
    return report


def _default_json(quick: bool) -> Path:
    date = datetime.date.today().isoformat()
    return BENCH / "results" / f"scale-{date}{'-quick' if quick else ''}.json"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    report = run(args)
    # Cases that ran out of time or memory are results; a step that raised is not.
    return 1 if any("failed" in r["status"] for r in report["rows"]) else 0

