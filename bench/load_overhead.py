"""Where a load's fixed cost goes: ``python -m bench.load_overhead``.

Issue 42: a load pays, besides moving its bytes, a cost per read item (the
metadata, DCP's planning, dcp_ext's frame indexes and read preparation). This
saves the bench's state dict (:mod:`bench.harness.state`: 355 bf16 tensors and
2 non-tensor values) of ``--size`` bytes to one store (``local``, ``memory``,
or ``gcs`` / ``az`` on an emulator started here, as ``python -m bench`` does),
then times in this one process, ``--rounds`` times, each stage of a load on
its own and whole ``dcp.load`` loads:

* ``decode_metadata``: dcp_ext's metadata document, already read, decoded;
* ``read_metadata``: the reader's ``read_metadata`` (the read and the decode);
* ``create_local_plan``: torch's ``DefaultLoadPlanner`` planning the load;
* ``stateful_checks``: ``dcp.load``'s two ``isinstance(value, Stateful)`` passes;
* ``attach_frame_indexes``: reading the data files' frame indexes;
* ``prepare``: every read item turned into byte reads;
* ``dcp.load``: a whole load (destination zeroed first, untimed), checked bit
  for bit after the last round.

With ``--baseline DIR`` every stage also runs with another copy of dcp_ext,
the package ``dcp_ext_baseline`` in ``DIR`` (e.g. ``git archive HEAD dcp_ext |
tar -x -C DIR && mv DIR/dcp_ext DIR/dcp_ext_baseline``: its imports are all
relative), alternating with this one round by round. Prints the minimum and the
median of each stage (ms) and the 1-minute load average before and after: on a
shared host only the minimum and side-by-side comparisons mean much.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.stateful import Stateful

import dcp_ext
from dcp_ext.config import parse_size

from .harness.state import build_state, make_spec, reset_dest, verify

_DOCUMENT = "dcp_ext.metadata.json"


@contextmanager
def store_url(kind: str, workdir: str) -> Iterator[tuple[str, dict[str, Any] | None]]:
    """A checkpoint URL on ``kind`` and its storage options (emulators stopped on exit)."""
    if kind == "local":
        yield os.path.join(workdir, "ckpt"), None
    elif kind == "memory":
        yield "memory://load_overhead/ckpt", None
    elif kind == "gcs":
        from tests.support.gcs_server import start_fake_gcs

        with start_fake_gcs() as server:
            yield f"gs://{server.create_bucket('bench')}/ckpt", server.storage_options()
    elif kind == "az":
        from tests.support.azurite_server import serving

        with serving(workdir, "bench") as server:
            yield "az://bench/ckpt", server.storage_options()
    else:
        raise ValueError(f"unknown store {kind!r}")


def stages(package: ModuleType, url: str, options: dict[str, Any] | None,
           dest: dict[str, Any]) -> dict[str, Callable[[], float | None]]:
    """Each stage of a load with ``package`` (a copy of dcp_ext), as calls
    returning their own time when they time only a part of themselves."""
    decode = importlib.import_module(package.__name__ + ".metadata.decode").decode_metadata
    document = package.CheckpointReader(url, storage_options=options).store.read_file(_DOCUMENT)

    def reader() -> Any:
        return package.CheckpointReader(url, storage_options=options, max_concurrency=4)

    def planned() -> tuple[Any, DefaultLoadPlanner, Any]:
        r = reader()
        metadata = r.read_metadata()
        r.set_up_storage_reader(metadata, True)
        planner = DefaultLoadPlanner()
        planner.set_up_planner(dest, metadata, True)
        return r, planner, planner.create_local_plan()

    def timed(part: Callable[[Any, DefaultLoadPlanner, Any], object], attach: bool) -> Callable[[], float]:
        def run() -> float:
            r, planner, plan = planned()
            if attach:
                r._reads.attach_frame_indexes(plan.items)
            start = time.perf_counter()
            part(r, planner, plan)
            return time.perf_counter() - start
        return run

    def whole(call: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            call()
        return run

    _, planner, _ = planned()
    return {
        "decode_metadata": whole(lambda: decode(document, _DOCUMENT)),
        "read_metadata": whole(lambda: reader().read_metadata()),
        "create_local_plan": whole(planner.create_local_plan),
        "stateful_checks": whole(lambda: [isinstance(v, Stateful) for _ in range(2) for v in dest.values()]),
        "attach_frame_indexes": timed(lambda r, p, plan: r._reads.attach_frame_indexes(plan.items), False),
        "prepare": timed(lambda r, p, plan: [r._reads.prepare(item, p) for item in plan.items], True),
        "dcp.load": whole(lambda: dcp.load(dest, storage_reader=reader())),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="16MiB", help="state dict size (default 16MiB: the fixed cost dominates)")
    parser.add_argument("--store", default="local", choices=("local", "memory", "gcs", "az"))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--baseline", help="directory holding a dcp_ext_baseline package to compare with")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    packages: dict[str, ModuleType] = {"this": dcp_ext}
    if args.baseline:
        sys.path.insert(0, args.baseline)
        packages = {"baseline": importlib.import_module("dcp_ext_baseline"), **packages}
    spec = make_spec(parse_size(args.size))
    source, dest = build_state(spec, 0, 1), build_state(spec, 0, 1, fill=False)
    with tempfile.TemporaryDirectory(prefix="load_overhead_") as workdir, store_url(args.store, workdir) as (url, opts):
        dcp.save(source, storage_writer=dcp_ext.CheckpointWriter(url, storage_options=opts, max_concurrency=4))
        runs = {name: stages(package, url, opts, dest) for name, package in packages.items()}
        times: dict[tuple[str, str], list[float]] = {}
        before = os.getloadavg()[0]
        for round_ in range(args.rounds):
            order = list(runs) if round_ % 2 == 0 else list(reversed(runs))
            for stage in runs["this"]:
                for name in order:
                    reset_dest(dest)
                    start = time.perf_counter()
                    own = runs[name][stage]()
                    elapsed = own if isinstance(own, float) else time.perf_counter() - start
                    times.setdefault((stage, name), []).append(elapsed)
        verify(source, dest)
    items = spec.count + 2
    print(f"{args.store}, {args.size}: {spec.count} tensors + 2 values, {args.rounds} rounds, "
          f"load average {before:.2f} -> {os.getloadavg()[0]:.2f}; ms, min / median (us per read item)")
    for stage in runs["this"]:
        cells = []
        for name in packages:
            values = times[(stage, name)]
            cells.append(f"{name} {min(values) * 1e3:7.2f} / {statistics.median(values) * 1e3:7.2f} "
                         f"({min(values) * 1e6 / items:5.1f})")
        print(f"  {stage:22s} " + "   ".join(cells))


if __name__ == "__main__":
    main()
