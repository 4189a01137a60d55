"""``python -m bench.scale``: the scale simulator of issue 16, in one process per case.

For a Llama-style model (:mod:`bench.model_shapes`) saved by N ranks (FSDP2,
optionally x TP) with Adam state, it synthesizes what the coordinator of a
``dcp.save`` receives, every rank's local ``SavePlan``, without tensor data
(:mod:`bench.scale_plans`), runs the real planners and metadata encoders and
decoders on it and measures (:mod:`bench.scale_cases`):

* the coordinator's global planning (``create_global_plan``) and metadata
  encoding time, the metadata's bytes (the global document, and per-data-file
  indexes separately), and the coordinator's peak RSS;
* one rank of a resharded load (N -> M, default M = N / 2): metadata decode
  time, its load planning time (``create_local_plan``) and its peak RSS;

for dcp_ext (``LayoutSavePlanner``, its JSON metadata, ``LayoutLoadPlanner``)
and for torch DCP (``DefaultSavePlanner``, pickled ``Metadata``,
``DefaultLoadPlanner``) as the baseline. Every save and every load runs in a
fresh child process (so its ``ru_maxrss`` is its own), on one thread, killed
after ``--timeout`` seconds or above ``--memory-limit``. ``--profile`` runs
the coordinator's planning under ``cProfile`` at the given N.

Every call into dcp_ext's metadata format goes through the adapter below
(:func:`finish_data_file`, :func:`encode_dcp_ext`, :func:`decode_dcp_ext`,
:func:`attach_dcp_ext_indexes`),
which follows the version dcp_ext's writer writes: change it, and nothing
else, when the format changes.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from dcp_ext.metadata import StoredItem

from .scale_report import render_markdown

__all__ = [
    "EncodedMetadata",
    "finish_data_file",
    "pack_rank_results",
    "collect_dcp_ext",
    "encode_dcp_ext",
    "decode_dcp_ext",
    "attach_dcp_ext_indexes",
    "metadata_version",
    "Case",
    "Limits",
    "SYSTEMS",
    "run_case",
    "default_cases",
    "run",
    "main",
]

log = logging.getLogger("bench.scale")

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
SYSTEMS = ("dcp_ext", "torch")
DEFAULT_RANKS = (8, 64, 512, 1024, 8192)
QUICK_RANKS = (8, 64)
#: The step in which the simulator builds the ranks' plans (not timed against the limit).
SYNTHESIS = "synthesize plans"
GiB = 1 << 30
MiB = 1 << 20


# -- the adapter: the only calls into dcp_ext's metadata format ---------------------------
#
# Version 3 (dcp_ext's default since commit dfeb22b): each data file ends with a
# binary frame index, and the JSON document holds a compact chunk table and
# where each index lies. Version 2: one JSON document with every frame's
# checksum. These functions write what dcp_ext's writer writes by default
# (``IOConfig().metadata_version``), split as the save splits the work: each
# rank finishes its data files (finish_data_file), the coordinator encodes the
# document (encode_dcp_ext), every loading rank decodes it (decode_dcp_ext) and
# reads the indexes of the files it reads (attach_dcp_ext_indexes). They also
# run against a dcp_ext from before version 3 (its modules are imported only
# when version 3 is written).


@dataclass(frozen=True)
class EncodedMetadata:
    """A checkpoint's encoded dcp_ext metadata.

    Attributes:
        global_bytes: The document every loading rank reads (``dcp_ext.metadata.json``).
        file_indexes: Per data file, the index only the ranks reading that
            file need (none for metadata version 2).
    """

    global_bytes: bytes
    file_indexes: dict[str, bytes] = field(default_factory=dict)


def metadata_version() -> int:
    """The metadata version dcp_ext's writer writes by default."""
    from dcp_ext.config import IOConfig
    from dcp_ext.metadata import document

    return int(getattr(IOConfig(), "metadata_version", document.FORMAT_VERSION))


def finish_data_file(name: str, items: list[StoredItem]) -> tuple[list[StoredItem], bytes]:
    """(each rank, ``CheckpointWriter`` at the end of each data file) The items
    as the writer reports them to the coordinator, and what it appends to the
    file after them.

    Args:
        name: The data file.
        items: Its items in file order, each with every frame's checksum (as
            ``FrameEncoder`` makes them).

    Returns:
        Version 3: the items without frame tables, pointing at the file's
        frame index, and that index (``writer._append_frame_index``).
        Version 2: the items as given, and nothing.
    """
    if metadata_version() < 3:
        return items, b""
    import xxhash

    from dcp_ext.metadata.document import FrameIndexRef
    from dcp_ext.metadata.frame_index import encode_frame_index

    index = encode_frame_index(items)
    end = items[-1].offset + items[-1].length if items else 0
    ref = FrameIndexRef(end, len(index), xxhash.xxh3_64_intdigest(index))
    return [replace(item, frame_lengths=(), checksums=(), indexed=True, frame_index=ref) for item in items], index


def pack_rank_results(positions: list[int], stored: list[StoredItem]) -> list[Any]:
    """(each rank, ``CheckpointWriter.write_data``) The rank's write results
    packed into one, as it reports them with metadata version 3."""
    if metadata_version() < 3:
        raise ValueError("packed write results need metadata version 3")
    from dcp_ext.write_results import pack_results

    return pack_results(positions, stored)


def collect_dcp_ext(metadata: Metadata, results: list[list[Any]]) -> Any:
    """(coordinator, ``CheckpointWriter.finish``) Where every chunk went."""
    from dcp_ext.write_results import collect_stored

    return collect_stored(metadata, results)


def encode_dcp_ext(metadata: Metadata, items: Any, world_size: int) -> bytes:
    """(coordinator, ``CheckpointWriter.finish``) The metadata document for the
    writers' results (``items``, each as :func:`finish_data_file` returned it)."""
    from dcp_ext.metadata import encode_metadata

    if metadata_version() < 3:
        return encode_metadata(metadata, items, world_size=world_size)
    return encode_metadata(metadata, items, world_size=world_size, version=metadata_version())


def decode_dcp_ext(encoded: EncodedMetadata) -> Any:
    """(every loading rank, ``CheckpointReader.read_metadata``) The global
    document decoded: a ``DecodedMetadata`` whose ``.metadata`` is DCP's."""
    from dcp_ext.metadata import METADATA_FILE, decode_metadata

    return decode_metadata(encoded.global_bytes, METADATA_FILE)


def attach_dcp_ext_indexes(decoded: Any, encoded: EncodedMetadata, names: set[str]) -> int:
    """(a loading rank, before reading) The frame indexes of the files ``names``
    read and attached to their items; returns their bytes (``0`` for version 2)."""
    refs = getattr(decoded, "frame_indexes", None)
    if not refs:
        return 0
    from dcp_ext.metadata.frame_index import attach_frame_indexes

    attach_frame_indexes(decoded.metadata.storage_data, names, refs, lambda name, ref: encoded.file_indexes[name],
                         str, 1)
    return sum(len(encoded.file_indexes[name]) for name in names)


# -- cases -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One measured configuration.

    Attributes:
        system: ``dcp_ext`` or ``torch``.
        model: A key of :data:`bench.model_shapes.MODELS`.
        ranks: Ranks that save (N).
        tp: Tensor-parallel degree of the save (``1``: FSDP2 alone).
        reshard_to: Ranks of the load (M; FSDP2 alone).
        load_rank: The loading rank whose planning is measured.
        gc: ``system`` (each system's own choice), ``on`` or ``off``.
        repeats: Runs of each step under 10 s; the fastest counts.
    """

    system: str
    model: str
    ranks: int
    tp: int = 1
    reshard_to: int = 1
    load_rank: int = 0
    gc: str = "system"
    repeats: int = 3

    @property
    def label(self) -> str:
        tp = f" x tp{self.tp}" if self.tp > 1 else ""
        return f"{self.model} {self.system} N={self.ranks}{tp}"


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
    from . import scale_cases

    def emit(**fields: Any) -> None:
        conn.send(fields)

    code = 0
    try:
        if kind == "save":
            result = scale_cases.save_case(case, workdir, emit)
        elif kind == "load":
            result = scale_cases.load_case(case, workdir, emit)
        else:
            result = scale_cases.profile_case(case, options["seconds"], options["top"], emit)
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
    from . import scale_cases  # noqa: F401  (imported once, before forking)

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
    from . import scale_cases

    def emit(**fields: Any) -> None:
        if "phase" in fields:
            log.info("%s: %s", case.label, fields["phase"])

    start = time.monotonic()
    step = scale_cases.save_case if kind == "save" else scale_cases.load_case
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


def _meminfo(field_name: str) -> int:
    """A ``/proc/meminfo`` field in bytes (0 if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _default_memory_limit() -> float:
    """16 GiB, or 70 % of the memory available now if that is less (GiB): the
    machine may be shared, and the kernel's OOM killer picks its own victim."""
    available = _meminfo("MemAvailable")
    return min(16.0, 0.7 * available / GiB) if available else 16.0


def _git(*cmd: str) -> str:
    try:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info() -> dict[str, Any]:
    """What the numbers depend on: CPU, memory, versions, and the code measured
    (the commit, and a digest of uncommitted changes to dcp_ext/)."""
    import hashlib
    import platform

    cpu = "?"
    with contextlib.suppress(OSError):
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "?")
    import dcp_ext

    diff = _git("diff", "HEAD", "--", "dcp_ext")
    return {
        "dcp_ext_path": str(Path(dcp_ext.__file__).parent),
        "cpu_count": os.cpu_count(), "cpu_model": cpu, "ram_gib": round(_meminfo("MemTotal") / GiB, 1),
        "kernel": platform.release(), "python": platform.python_version(), "torch": torch.__version__,
        "git_commit": _git("rev-parse", "HEAD"),
        "dcp_ext_uncommitted_diff_sha1": hashlib.sha1(diff.encode()).hexdigest()[:12] if diff else None,
        "dcp_ext_uncommitted_files": _git("diff", "HEAD", "--name-only", "--", "dcp_ext").split(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


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
        report["machine"] = machine_info()

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


if __name__ == "__main__":
    # Run as bench.scale, not __main__, so bench.scale_cases shares this module's classes
    # (forked children unpickle nothing, but one copy of the module is simpler to reason about).
    from bench.scale import main as _main

    raise SystemExit(_main())
