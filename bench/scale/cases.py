"""The measured steps of one scale-simulator case (each run in a fresh process), and the case itself.

:func:`save_case` is the coordinator of an N-rank save: it receives every
rank's synthesized local plan (:mod:`bench.scale.plans`), runs the global
planning, gets the ranks' write results and encodes the metadata.
:func:`load_case` is one rank of an M-rank load of that checkpoint: it decodes
the metadata and plans its reads. :func:`profile_case` runs the coordinator's
planning under ``cProfile``. Systems:

* ``dcp_ext``: ``LayoutSavePlanner`` (as ``CheckpointManager`` sets it up),
  :class:`dcp_ext.CheckpointWriter`'s metadata (through the adapter in
  :mod:`bench.scale.adapter`), also torch's interop pickle and ``partition.json``
  that a dcp_ext save writes, and ``LayoutLoadPlanner``; Python's cyclic
  GC paused in the steps dcp_ext pauses it in (``dcp_ext._runtime.gc_paused``);
* ``torch``: ``DefaultSavePlanner``, ``FileSystemWriter``'s pickled
  ``Metadata`` and ``DefaultLoadPlanner``, with the GC running (stock DCP).

Every step's wall time is measured on one thread (``torch.set_num_threads(1)``),
and the process's peak RSS (``ru_maxrss``) after each step.
"""

from __future__ import annotations

import contextlib
import cProfile
import gc
import json
import math
import os
import pickle
import pstats
import resource
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from .adapter import (
    EncodedMetadata,
    attach_dcp_ext_indexes,
    collect_dcp_ext,
    decode_dcp_ext,
    encode_dcp_ext,
)
from .fast import packed_results, sent_plans
from .plans import (
    Layout,
    finish_plans,
    load_state_dict,
    rank_save_plan,
    torch_write_results,
)
from .shapes import MODELS

__all__ = ["SYNTHESIS", "Case", "Emit", "save_case", "load_case", "profile_case", "peak_rss_mib"]

#: The step in which the simulator builds the ranks' plans (not timed against the limit).
SYNTHESIS = "synthesize plans"


# -- the case -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One measured configuration.

    Attributes:
        system: ``dcp_ext`` or ``torch``.
        model: A key of :data:`bench.scale.shapes.MODELS`.
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


#: Reports progress to the parent: ``emit(phase="global plan")`` when a step
#: starts, ``emit(step="global plan", seconds=..., rss_mib=...)`` when it ended.
Emit = Callable[..., None]

_GLOBAL_FILE = "global.bin"
_INDEX_FILE = "indexes.bin"
_PARTITION_FILE = "partition.json"
_TORCH_FILE = "torch.metadata"

#: Steps faster than this are repeated (``Case.repeats``) and the fastest run kept.
_REPEAT_BELOW = 10.0

_T = TypeVar("_T")


def peak_rss_mib() -> float:
    """This process's peak resident set size so far (``ru_maxrss``, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@contextlib.contextmanager
def _gc_policy(case: Case) -> Iterator[None]:
    """The cyclic GC as the system runs it (``case.gc == "system"``), or forced on/off."""
    paused = case.gc == "off" or (case.gc == "system" and case.system == "dcp_ext")
    was = gc.isenabled()
    if paused:
        gc.disable()
    else:
        gc.enable()
    try:
        yield
    finally:
        if was:
            gc.enable()
        else:
            gc.disable()


class _Clock:
    """Wall time, CPU time (this process's, which a busy machine inflates
    less) and peak RSS after each named step.

    :meth:`timed` runs a step up to ``repeats`` times while one run takes
    under :data:`_REPEAT_BELOW` seconds and keeps the fastest (the machine may
    be shared); every sample is kept in :attr:`samples`.
    """

    def __init__(self, emit: Emit, case: Case) -> None:
        self.emit = emit
        self.case = case
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}
        self.samples: dict[str, list[float]] = {}
        self.rss: dict[str, float] = {}

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        self.emit(phase=name)
        start, cpu = time.perf_counter(), time.process_time()
        yield
        self.seconds[name] = time.perf_counter() - start
        self.cpu_seconds[name] = time.process_time() - cpu
        self.samples[name] = [round(self.seconds[name], 4)]
        self.rss[name] = peak_rss_mib()
        self.emit(step=name, seconds=self.seconds[name], rss_mib=self.rss[name])

    def timed(self, name: str, fn: Callable[[], _T]) -> _T:
        """``fn()`` under the case's GC policy, timed; its last result."""
        self.emit(phase=name)
        samples: list[float] = []
        cpu_samples: list[float] = []
        result: _T | None = None
        while True:
            result = None  # the previous run's result is freed before the next
            with _gc_policy(self.case):
                start, cpu = time.perf_counter(), time.process_time()
                result = fn()
                samples.append(time.perf_counter() - start)
                cpu_samples.append(time.process_time() - cpu)
            if len(samples) >= self.case.repeats or samples[-1] >= _REPEAT_BELOW:
                break
        self.seconds[name] = min(samples)
        self.cpu_seconds[name] = min(cpu_samples)
        self.samples[name] = [round(x, 4) for x in samples]
        self.rss[name] = peak_rss_mib()
        self.emit(step=name, seconds=self.seconds[name], rss_mib=self.rss[name])
        return result


@contextlib.contextmanager
def _gc_off_between_steps() -> Iterator[None]:
    """The cyclic GC off outside the measured steps (building millions of
    plan objects is the simulator's cost, not a system's), restored after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _synthesize(case: Case, clock: _Clock) -> tuple[Any, Layout, list[Any]]:
    """Every rank's local plan as the coordinator receives it: dcp_ext's
    compact plans, torch's ``WriteItem`` lists (the GC is off: this is not
    part of any system's cost)."""
    torch.set_num_threads(1)
    shape, layout = MODELS[case.model], Layout(case.ranks, case.tp)
    every = max(1, layout.ranks // 16)
    with clock.step(SYNTHESIS):
        if case.system == "dcp_ext":
            plans = sent_plans(shape, layout)  # = rank_sent_plan of every rank, at array speed
        else:
            plans = []
            for rank in range(layout.ranks):
                if rank and rank % every == 0:  # where it stopped, if memory runs out
                    clock.emit(phase=f"{SYNTHESIS}: {rank:,} of {layout.ranks:,} ranks")
                plans.append(rank_save_plan(shape, layout, rank))
    # Untimed: move the plans to the oldest generation, as a long-lived
    # coordinator's unpickled plans would be, before the GC policy applies.
    gc.collect()
    return shape, layout, plans


def _dcp_ext_save_planner(layout: Layout) -> Any:
    """``LayoutSavePlanner`` as ``CheckpointManager`` creates it (a named
    ``(dp, tp)`` mesh with TP; the default process group otherwise)."""
    from dcp_ext.layout import MeshInfo
    from dcp_ext.planners import LayoutSavePlanner

    mesh = None
    if layout.tp > 1:
        mesh = MeshInfo((layout.dp, layout.tp), ("dp", "tp"), tuple(range(layout.ranks)))
    return LayoutSavePlanner(mesh, None)


def _torch_pickle_limit() -> float:
    """Up to how many chunks an uncompressed dcp_ext save also writes torch's
    pickle (``IOConfig.torch_metadata_chunks``; always before it existed)."""
    from dcp_ext.config import IOConfig

    return float(getattr(IOConfig(), "torch_metadata_chunks", math.inf))


def _chunks(metadata: Metadata) -> int:
    return sum(len(md.chunks) for md in metadata.state_dict_metadata.values() if isinstance(md, TensorStorageMetadata))


def _storage_meta(case: Case) -> StorageMeta:
    return StorageMeta(checkpoint_id=f"/checkpoints/{case.model}-{case.ranks}/step100_partial", save_id="0" * 32)


def _gathered(clock: _Clock, step: str, objects: list[Any]) -> tuple[list[Any], int]:
    """What DCP's ``gather_object`` hands the coordinator: each rank's object
    pickled on its rank (untimed), all unpickled on the coordinator (timed
    as ``step``). Returns the objects and the bytes gathered."""
    blobs = [pickle.dumps(o) for o in objects]
    objects.clear()
    size = sum(map(len, blobs))
    back = clock.timed(step, lambda: [pickle.loads(b) for b in blobs])
    blobs.clear()
    return back, size


def _broadcast(clock: _Clock, metadata: Metadata) -> tuple[int, float]:
    """DCP's ``all_reduce`` after the commit: the coordinator pickles the
    metadata ``dcp.save`` returns and every rank unpickles it (both timed).
    Returns the bytes broadcast and the coordinator's peak RSS before the
    unpickle, which another rank does, not the coordinator."""
    blob = clock.timed("broadcast pickle", lambda: pickle.dumps(metadata))
    peak = peak_rss_mib()
    clock.timed("broadcast unpickle", lambda: pickle.loads(blob))
    return len(blob), peak


def _save_case(case: Case, workdir: Path, emit: Emit) -> dict[str, Any]:
    clock = _Clock(emit, case)
    shape, layout, plans = _synthesize(case, clock)
    out: dict[str, Any] = {"write_items": sum(len(p.planner_data) if not p.items else len(p.items) for p in plans)}
    if case.system == "dcp_ext":
        from dcp_ext.metadata import to_torch_metadata

        plans, out["gathered_plan_bytes"] = _gathered(clock, "gather plans", plans)
        planner = _dcp_ext_save_planner(layout)
        global_plans, metadata = clock.timed("global plan", lambda: planner.create_global_plan(plans))
        out["answer_bytes"] = sum(len(pickle.dumps(answer)) for answer in global_plans)
        # The ranks' side (not timed): finish their plans, write, report
        # (bench.scale.fast: the bytes the ranks' writers would send, at array
        # speed, from what they sent: the same bytes as the gathered plans).
        clock.emit(phase="ranks write (untimed)")
        written = packed_results(shape, layout, plans, global_plans)
        del plans, global_plans  # the coordinator dropped the gathered plans after planning (as in dcp.save)
        results, out["gathered_result_bytes"] = _gathered(clock, "gather results", written.results)

        writers = metadata.storage_data  # which rank wrote each chunk (the planner's), replaced by finish

        def finish() -> tuple[Any, bytes]:
            # CheckpointWriter.finish: where every chunk went, then the document (repeatable).
            metadata.storage_data = writers
            items = collect_dcp_ext(metadata, results)
            metadata.storage_data = items
            metadata.storage_meta = _storage_meta(case)
            return items, encode_dcp_ext(metadata, items, case.ranks)

        items, global_bytes = clock.timed("encode", finish)
        interop = b""
        if len(items) <= _torch_pickle_limit():  # as CheckpointWriter.finish decides
            interop = clock.timed("interop pickle", lambda: to_torch_metadata(metadata, items))
        partition = clock.timed(
            "partition encode", lambda: planner.partition.to_json() if planner.partition is not None else b""
        )
        out.update(
            frames=written.frames,
            data_bytes=int(items.rows[:, 4].sum()),
            files=len(items.files),
            interop_bytes=len(interop),
            partition_bytes=len(partition),
            global_bytes=len(global_bytes),
            index_bytes=sum(len(b) for b in written.file_indexes.values()),
        )
        del interop
        out["broadcast_bytes"], out["coordinator_peak_rss_mib"] = _broadcast(clock, metadata)
        _write_encoded(workdir, EncodedMetadata(global_bytes, written.file_indexes))
        (workdir / _PARTITION_FILE).write_bytes(partition)
    else:
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        plans, out["gathered_plan_bytes"] = _gathered(clock, "gather plans", plans)
        global_plans, metadata = clock.timed("global plan", lambda: DefaultSavePlanner().create_global_plan(plans))
        out["answer_bytes"] = sum(len(pickle.dumps(answer)) for answer in global_plans)
        # The ranks' side (not timed), from the gathered plans (the same as each rank's own).
        final = finish_plans(DefaultSavePlanner, plans, global_plans)
        results = torch_write_results(shape, final)
        del plans, global_plans, final
        results, out["gathered_result_bytes"] = _gathered(clock, "gather results", results)

        def finish_torch() -> tuple[dict[Any, Any], bytes]:
            # FileSystemWriter.finish: storage data keyed by item, then pickle.dump.
            storage: dict[Any, Any] = {}
            for rank_results in results:
                storage.update({r.index: r.storage_data for r in rank_results})
            metadata.storage_data = storage
            metadata.storage_meta = _storage_meta(case)
            return storage, pickle.dumps(metadata)

        storage, blob = clock.timed("encode", finish_torch)
        (workdir / _TORCH_FILE).write_bytes(blob)
        out["broadcast_bytes"], out["coordinator_peak_rss_mib"] = _broadcast(clock, metadata)
        out.update(global_bytes=len(blob), index_bytes=0,
                   files=len({info.relative_path for info in storage.values()}))
    out.update(chunks=_chunks(metadata), seconds=clock.seconds, cpu_seconds=clock.cpu_seconds,
               samples=clock.samples, rss_mib=clock.rss, peak_rss_mib=peak_rss_mib())
    # The process's peak includes one rank's unpickle of the broadcast, done here last.
    out["peak_rss_mib"] = out.get("coordinator_peak_rss_mib", out["peak_rss_mib"])
    return out


def _write_encoded(workdir: Path, encoded: EncodedMetadata) -> None:
    (workdir / _GLOBAL_FILE).write_bytes(encoded.global_bytes)
    names = list(encoded.file_indexes)
    header = json.dumps([[n, len(encoded.file_indexes[n])] for n in names]).encode() + b"\n"
    with open(workdir / _INDEX_FILE, "wb") as f:
        f.write(header)
        for name in names:
            f.write(encoded.file_indexes[name])


def _read_encoded(workdir: Path) -> EncodedMetadata:
    global_bytes = (workdir / _GLOBAL_FILE).read_bytes()
    indexes: dict[str, bytes] = {}
    with open(workdir / _INDEX_FILE, "rb") as f:
        for name, length in json.loads(f.readline()):
            indexes[name] = f.read(length)
    return EncodedMetadata(global_bytes, indexes)


@contextlib.contextmanager
def _fake_world(rank: int, world_size: int) -> Iterator[Any]:
    """A 1-D device mesh of ``world_size`` ranks in this one process, as ``rank``
    (torch's ``fake`` process group: no peers, collectives do nothing)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def _load_case(case: Case, workdir: Path, emit: Emit) -> dict[str, Any]:
    torch.set_num_threads(1)
    clock = _Clock(emit, case)
    shape = MODELS[case.model]
    target = Layout(case.reshard_to)
    partition = None
    if case.system == "dcp_ext":
        from dcp_ext.layout import Partition

        encoded = _read_encoded(workdir)
        decoded = clock.timed("decode", lambda: decode_dcp_ext(encoded))
        metadata = decoded.metadata
        raw = (workdir / _PARTITION_FILE).read_bytes()
        partition = clock.timed("partition decode", lambda: Partition.from_json(raw, _PARTITION_FILE) if raw else None)
        del raw
    else:
        blob = (workdir / _TORCH_FILE).read_bytes()
        metadata = clock.timed("decode", lambda: pickle.loads(blob))  # FileSystemReader.read_metadata
        del blob
    with _fake_world(case.load_rank, target.ranks) as mesh:
        state = load_state_dict(shape, target, mesh)
        if case.system == "dcp_ext":
            from dcp_ext.planners import LayoutLoadPlanner

            # As CheckpointManager.load sets it up.
            planner: Any = LayoutLoadPlanner(
                True, partition=partition, world_size=target.ranks, mesh=None,
                optional_prefixes=[f"optimizer.state.{fqn}." for fqn in state["optimizer"]["state"]],
            )
        else:
            from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

            planner = DefaultLoadPlanner()

        def plan_reads() -> Any:
            planner.set_up_planner(state, metadata, case.load_rank == 0)
            return planner.create_local_plan()

        plan = clock.timed("load plan", plan_reads)
    out: dict[str, Any] = {"read_items": len(plan.items)}
    if case.system == "dcp_ext":
        # The frame indexes of the files this rank reads (metadata version 3).
        storage = metadata.storage_data
        names = {storage[item.storage_index].relative_path for item in plan.items}
        with _gc_policy(case), clock.step("index decode"):
            out["index_bytes_read"] = attach_dcp_ext_indexes(decoded, encoded, names)
        out["files_read"] = len(names)
    out.update(seconds=clock.seconds, cpu_seconds=clock.cpu_seconds, samples=clock.samples, rss_mib=clock.rss,
               peak_rss_mib=peak_rss_mib())
    return out


class _ProfileTimeUp(Exception):
    """Raised in the profiled planning when its time is up."""


def _profile_case(case: Case, seconds: float, top: int, emit: Emit) -> dict[str, Any]:
    clock = _Clock(emit, case)
    _, layout, plans = _synthesize(case, clock)
    if case.system == "dcp_ext":
        planner = _dcp_ext_save_planner(layout)
    else:
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        planner = DefaultSavePlanner()

    def time_up(signum: int, frame: Any) -> None:
        raise _ProfileTimeUp

    previous = signal.signal(signal.SIGALRM, time_up)
    profiler = cProfile.Profile()
    finished = True
    emit(phase="profiled global plan")
    start = time.perf_counter()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        with _gc_policy(case):
            profiler.enable()
            try:
                planner.create_global_plan(plans)
            finally:
                profiler.disable()
    except _ProfileTimeUp:
        finished = False
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    elapsed = time.perf_counter() - start
    stats = pstats.Stats(profiler)
    rows = []
    for (filename, line, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{_short(filename)}:{line}({name})", "calls": ncalls,
                     "tottime": round(tottime, 4), "cumtime": round(cumtime, 4)})
    rows.sort(key=lambda r: -r["cumtime"])
    return {"finished": finished, "seconds": elapsed, "top": rows[:top],
            "cumtime": {r["function"]: r["cumtime"] for r in rows if r["cumtime"] >= 0.001}}


def _short(filename: str) -> str:
    """``torch/distributed/...`` or ``dcp_ext/...`` instead of an absolute path."""
    for marker in ("site-packages" + os.sep, str(Path(__file__).resolve().parents[2]) + os.sep):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


def save_case(case: Case, workdir: Path, emit: Emit) -> dict[str, Any]:
    """(coordinator of ``case.ranks`` ranks) Global planning and metadata; writes
    the encoded metadata under ``workdir`` for :func:`load_case`."""
    with _gc_off_between_steps():
        return _save_case(case, workdir, emit)


def load_case(case: Case, workdir: Path, emit: Emit) -> dict[str, Any]:
    """(one rank of ``case.reshard_to`` ranks) Decode the metadata :func:`save_case`
    wrote and plan this rank's reads of the resharded load."""
    with _gc_off_between_steps():
        return _load_case(case, workdir, emit)


def profile_case(case: Case, seconds: float, top: int, emit: Emit) -> dict[str, Any]:
    """The coordinator's ``create_global_plan`` under ``cProfile``, stopped after
    ``seconds``: the ``top`` functions by cumulative time, and the cumulative
    time of every function (for growth exponents across N)."""
    with _gc_off_between_steps():
        return _profile_case(case, seconds, top, emit)
