"""The report side of ``python -m bench.hf_export`` (issue 18), apart from the suite that runs the
exports: the ``--profile`` instrumentation each rank installs around dcp_ext's export and the
figures it hands back (:data:`PHASE_TARGETS`, ``_Phases``, ``_top_functions``), the parent's
untimed bit-for-bit check of every exported folder (:func:`verify_output`), and what the record
becomes: per mode and system the medians, GB/s, RSS, ratios and issue 18's targets
(:func:`summarize`, :data:`SPEED_TARGETS`, :data:`RSS_HEADROOM`) and the markdown of
bench/README.md's ``hf-export`` and ``hf-export-profile`` blocks (:func:`render`,
:func:`render_profile`, the row names of :data:`LABELS`), plus the constants the suite shares
(:data:`MiB`, :data:`WORLD`, :data:`TAG`). A saved ``bench/results/hf-export-<date>.json`` can be
summarized and rendered again from here without running anything. It imports nothing from
bench.hf_export; bench.hf_export imports from here, so ``bench.hf_export.render`` and the other
names it uses resolve as before.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

MiB = 1 << 20
WORLD = 2
TAG = "bench"
LABELS = {
    ("live", "dcp_ext_nowb"): "experiment: dcp_ext `save_hf`, `sync_file_range` writeback off",
    ("live", "today_nowb"): "experiment: today's `save_full`, `sync_file_range` writeback off",
    ("checkpoint", "dcp_ext_nowb"): "experiment: dcp_ext `export_hf`, `sync_file_range` writeback off",
    ("checkpoint", "today_nowb"): "experiment: today's `CheckpointManager.export`, `sync_file_range` writeback off",
    ("live", "dcp_ext"): "dcp_ext `save_hf`",
    ("live", "torch"): "torch `dcp.save` + `HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)`",
    ("live", "torch_every_rank"): "torch `dcp.save` + `HuggingFaceStorageWriter(save_distributed=True)`, then "
                                  "`consolidate_safetensors_files_on_every_rank`",
    ("live", "today"): "today: `dcp_ext.full.save_full` (one file, all-gather per tensor)",
    ("live", "raw"): "raw ceiling (not an HF folder): each rank `os.write`s its own shards (half of every tensor) to one file "
                     "+ fsync, no exchange",
    ("checkpoint", "dcp_ext"): "dcp_ext `export_hf` (2 ranks)",
    ("checkpoint", "torch"): "torch: `dcp.load` (dcp_ext `CheckpointReader`) + `dcp.save` + "
                             "`HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)`",
    ("checkpoint", "today"): "today: `CheckpointManager.export` (1 process, one file)",
}
#: Targets of issue 18 (same run): (key, text, threshold).
SPEED_TARGETS = (
    ("today", "dcp_ext / today's single-file export, GB/s", 2.0),
    ("torch", "dcp_ext / torch's HuggingFaceStorageWriter (+ consolidation), GB/s", 1.0),
)
RSS_HEADROOM = 256 * MiB


# -- profiling (``--profile``) ----------------------------------------------------------------------

#: What ``--profile`` times in dcp_ext's export (wrapped in the rank's process only; dcp_ext is not changed).
#: Nested: ``put`` includes the writes, ``close`` the commit (fsync, rename); ``_assemble`` the receives
#: posted and column blocks copied. Absent names are skipped.
PHASE_TARGETS = (
    # The modules as they are since aa793fd (the profiles of earlier commits are in results/).
    ("dcp_ext.hf._sources", None, "_any_failed"),
    ("dcp_ext.hf._sink", "FileSink", "open"),
    ("dcp_ext.hf._sink", "FileSink", "put"),
    ("dcp_ext.hf._sink", "FileSink", "close"),
    ("dcp_ext.hf._sources", "LiveState", "__init__"),
    ("dcp_ext.hf._sources", "LiveState", "plan"),
    ("dcp_ext.hf._sources", "LiveState", "run"),
    ("dcp_ext.hf._sources", "LiveState", "_reserve"),
    ("dcp_ext.hf._sources", "LiveState", "_assemble"),
    ("dcp_ext.hf._sources", "LiveState", "_send_buffer"),
    ("dcp_ext.hf._sources", "StoredState", "__init__"),
    ("dcp_ext.hf._sources", "StoredState", "read"),
    ("dcp_ext.hf._sources", "StoredState", "run"),
    ("dcp_ext.full._checksums", "ChecksumRecorder", "add"),
    ("dcp_ext.hf._export", None, "_make_plan"),
    ("dcp_ext.hf._export", None, "_prepare_folder"),
    ("dcp_ext.hf._export", None, "_finish_folder"),
    ("dcp_ext.storage.local", "_LocalWriter", "write"),
    ("dcp_ext.storage.local", "_LocalWriter", "commit"),
    ("dcp_ext.full._write", None, "stream_full_checkpoint"),
    ("dcp_ext.full._export", None, "export_partial"),
)


class _TimedWork:
    """A ``Work`` whose ``wait`` is timed as the phase ``exchange wait``."""

    def __init__(self, work: Any, phases: _Phases) -> None:
        self._work, self._phases = work, phases

    def wait(self) -> Any:
        t0 = time.perf_counter()
        try:
            return self._work.wait()
        finally:
            self._phases.add("exchange wait (isend/irecv)", time.perf_counter() - t0)


class _Phases:
    """Wall seconds and calls per wrapped function of :data:`PHASE_TARGETS` on this rank."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._saved: list[tuple[Any, str, Any]] = []

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.calls[name] = self.calls.get(name, 0) + 1

    def _wrap(self, name: str, fn: Any) -> Any:
        import functools

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - t0)

        return timed

    def install(self) -> None:
        import importlib

        for module_name, cls, attr in PHASE_TARGETS:
            try:
                owner = importlib.import_module(module_name)
                if cls is not None:
                    owner = getattr(owner, cls)
                original = getattr(owner, attr)
            except (ImportError, AttributeError):
                continue
            self._saved.append((owner, attr, original))
            setattr(owner, attr, self._wrap(f"{cls + '.' if cls else ''}{attr}", original))
        for name in ("dcp_ext.hf._export", "dcp_ext.hf._sources"):
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            for attr in ("_isend", "_irecv"):
                original = getattr(module, attr, None)
                if original is None:
                    continue
                self._saved.append((module, attr, original))
                setattr(module, attr, lambda *a, _f=original, **k: _TimedWork(_f(*a, **k), self))

    def uninstall(self) -> None:
        for owner, attr, original in reversed(self._saved):
            setattr(owner, attr, original)
        self._saved.clear()

    def report(self) -> dict[str, dict[str, float]]:
        return {k: {"seconds": v, "calls": self.calls[k]} for k, v in sorted(self.seconds.items())}


def _top_functions(profiler: Any, count: int = 40) -> list[dict[str, Any]]:
    """The ``count`` functions with the most own time (cProfile, main thread of this rank)."""
    import pstats

    stats = pstats.Stats(profiler)
    rows = []
    for (file, line, func), (_, calls, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{os.path.basename(file)}:{line}({func})", "calls": calls, "own": own,
                     "cumulative": cumulative})
    rows.sort(key=lambda r: -r["own"])
    return rows[:count]


# -- verification (parent, untimed) ---------------------------------------------------------------


def verify_output(dest: str, spec: Any, expected: dict[str, Any]) -> dict[str, Any]:
    """Compare every tensor of the HF folder ``dest`` with ``expected`` bit for bit; raise on a difference."""
    import torch
    from safetensors import safe_open

    index = os.path.join(dest, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
    else:
        files = [n for n in os.listdir(dest) if n.endswith(".safetensors")]
        if len(files) != 1:
            raise AssertionError(f"{dest}: no index and {len(files)} safetensors files")
        with safe_open(os.path.join(dest, files[0]), "pt") as f:
            weight_map = dict.fromkeys(f.keys(), files[0])
    if set(weight_map) != set(expected):
        raise AssertionError(f"{dest}: keys differ: missing {sorted(set(expected) - set(weight_map))[:5]}, "
                             f"extra {sorted(set(weight_map) - set(expected))[:5]}")
    by_file: dict[str, list[str]] = {}
    for key, file in weight_map.items():
        by_file.setdefault(file, []).append(key)
    for file, keys in sorted(by_file.items()):
        with safe_open(os.path.join(dest, file), "pt") as f:
            if set(f.keys()) != set(keys):
                raise AssertionError(f"{dest}/{file}: holds {len(list(f.keys()))} keys, the index names {len(keys)}")
            for key in keys:
                got = f.get_tensor(key)
                want = expected[key]
                if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(
                        got.view(torch.int16), want.view(torch.int16)):
                    raise AssertionError(f"{dest}/{file}: tensor {key!r} differs from the state")
    return {"tensors": len(weight_map), "files": len(by_file)}


# -- summary and markdown ---------------------------------------------------------------------------


def _stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(record: dict[str, Any]) -> dict[str, Any]:
    """Per mode and system: seconds, GB/s, peak RSS above baseline per rank (medians, min-max), ratios, targets."""
    nbytes = record["model"]["tensor_bytes"]
    largest = record["model"]["largest_tensor_bytes"]
    out: dict[str, Any] = {}
    for mode in record["params"]["modes"]:
        rows: dict[str, Any] = {}
        for system in record["params"]["systems"][mode]:
            mine = [s for s in record["samples"] if s["mode"] == mode and s["system"] == system]
            if not mine:
                continue
            secs = _stats([s["seconds"] for s in mine])
            assert secs is not None
            world = mine[0]["world"]
            rows[system] = {
                "seconds": secs,
                "gbps": nbytes / secs["median"] / 1e9,
                "gbps_min": nbytes / secs["max"] / 1e9,
                "gbps_max": nbytes / secs["min"] / 1e9,
                "rss_above": [_stats([(s["ranks"][k]["rss_peak"] - s["ranks"][k]["rss_baseline"]) for s in mine])
                              for k in range(world)],
                "rss_baseline": [_stats([s["ranks"][k]["rss_baseline"] for s in mine]) for k in range(world)],
                "cpu": [_stats([s["ranks"][k].get("cpu_user", 0.0) + s["ranks"][k].get("cpu_system", 0.0)
                                for s in mine]) for k in range(world)],
                "bytes_written": statistics.median(s["bytes_written"] for s in mine),
                "files_written": statistics.median(s["files_written"] for s in mine),
                "verified": [s["verified"] for s in mine if "verified" in s],
            }
        ratios: dict[str, Any] = {}
        if "dcp_ext" in rows:
            rounds = sorted({s["round"] for s in record["samples"]})

            def secs_of(system: str, rnd: int, mode: str = mode) -> float | None:
                for s in record["samples"]:
                    if s["mode"] == mode and s["system"] == system and s["round"] == rnd:
                        return float(s["seconds"])
                return None

            for other in rows:
                if other == "dcp_ext":
                    continue
                pairs = [(secs_of("dcp_ext", r), secs_of(other, r)) for r in rounds]
                paired = [b / a for a, b in pairs if a and b]
                ratios[other] = {"ratio": rows[other]["seconds"]["median"] / rows["dcp_ext"]["seconds"]["median"],
                                 "paired": statistics.median(paired) if paired else None}
        targets = []
        for key, text, threshold in SPEED_TARGETS:
            if key in ratios:
                value = ratios[key]["ratio"]
                targets.append({"target": text, "threshold": threshold, "value": value,
                                "paired": ratios[key]["paired"], "met": value >= threshold})
        if "dcp_ext" in rows:
            limit = largest + RSS_HEADROOM
            worst = max(r["median"] for r in rows["dcp_ext"]["rss_above"] if r is not None)
            worst_max = max(r["max"] for r in rows["dcp_ext"]["rss_above"] if r is not None)
            targets.append({"target": "dcp_ext peak RSS per rank above the state <= largest tensor + 256 MiB",
                            "threshold_bytes": limit, "value_bytes": worst, "max_bytes": worst_max,
                            "met": worst <= limit})
        out[mode] = {"systems": rows, "ratios": ratios, "targets": targets}
    return out


def _sec(s: dict[str, float]) -> str:
    return f"{s['median']:.2f} <sub>({s['min']:.2f}–{s['max']:.2f})</sub>"


def _mib(s: dict[str, float] | None) -> str:
    if s is None:
        return "–"
    return f"{s['median'] / MiB:,.0f} <sub>({s['min'] / MiB:,.0f}–{s['max'] / MiB:,.0f})</sub>"


def render(record: dict[str, Any]) -> str:
    """Markdown for bench/README.md's ``hf-export`` block."""
    m, p, model = record["machine"], record["params"], record["model"]
    summary = record["summary"]
    lines = [
        f"Run of {record['date']} on `{m['machine_id']}`: {m['cpu_count']} × {m['cpu_model']}, {m['ram_gib']:.1f} GiB "
        f"RAM, local disk `{m['workdir_device']}` (ext4); torch {m['versions'].get('torch')}, dcp_ext commit "
        f"`{m['git_commit'][:12]}`{' (dirty tree)' if m['git_dirty'] else ''}; {p['rounds']} round(s), "
        f"{WORLD} FSDP2 gloo ranks on CPU; run time {record['runtime_seconds'] / 60:.1f} min.",
        "",
        f"Load average (1, 5, 15 min) at start {m['loadavg_start']}, at end {record['loadavg_end']}; "
        f"before each measurement {_load_range(record)} (other agents shared the 2 cores). "
        f"`uptime` at start: `{record['uptime_start']}`; at end: `{record['uptime_end']}`.",
        "",
        f"Command: `{record['command']}`",
        "",
        f"Model: {model['tensors']} bf16 tensors, {model['tensor_bytes'] / MiB:,.1f} MiB "
        f"({model['tensor_bytes'] / 1e9:.3f} GB; {model['rank_bytes'] / MiB:,.0f} MiB per rank), largest tensor "
        f"{model['largest_tensor_bytes'] / MiB:.1f} MiB; `max_shard_size=\"{p['max_shard_size']}\"` "
        f"(HF's rule, tensors in order: {model['files_at_max_shard_size']} weights files; dcp_ext splits the same way "
        "and torch gets that split as its `fqn_to_index_mapping`; today's paths write one safetensors file; \"files\" below "
        "counts every file written, index and torch's `sharded/` included). "
        "Every measurement in a fresh world after an untimed warm-up on a 4 MiB model; `os.sync()` between "
        "measurements; every system's time includes fsync of its outputs (torch's consolidated files are fsynced by "
        "the harness, timed); from a checkpoint the source is in the page cache for every system. Median "
        "(min–max) of the rounds; GB/s = tensor bytes / seconds (slowest rank, barrier to return). RSS: peak above "
        "the rank's RSS right before the call (which includes the state it holds), sampled every 10 ms. CPU s: "
        "user + system time of the rank's process during the call (all its threads; the kernel's writeback "
        "threads not included). Ratios: ratio of medians [median of same-round ratios].",
    ]
    if "checkpoint" in summary and "setup" in record:
        s = record["setup"]
        lines += ["", f"The partial checkpoint (`CheckpointManager.save`, 2 ranks): {s['partial_bytes'] / MiB:,.1f} "
                      f"MiB in {s['partial_files']} files, saved in {s[TAG]['seconds']:.2f} s."]
    titles = {"live": "From live 2-rank training state", "checkpoint": "From a 2-rank FSDP2 partial checkpoint on disk"}
    for mode, data in summary.items():
        rows = data["systems"]
        lines += ["", f"#### {titles[mode]}", "",
                  "| system | s | GB/s | peak RSS above baseline, rank 0 (MiB) | rank 1 (MiB) | "
                  "CPU s, rank 0 / rank 1 | bytes written (MiB) | files | output bit-exact |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for system, row in rows.items():
            gbps = (f"{row['gbps']:.3f} <sub>({row['gbps_min']:.2f}–{row['gbps_max']:.2f})</sub>")
            checked = row["verified"]
            lines.append(
                f"| {LABELS[(mode, system)]} | {_sec(row['seconds'])} | {gbps} | {_mib(row['rss_above'][0])} | "
                f"{_mib(row['rss_above'][1]) if len(row['rss_above']) > 1 else '– (1 process)'} | "
                + " / ".join(f"{c['median']:.2f}" for c in row["cpu"] if c is not None) + " | "
                f"{row['bytes_written'] / MiB:,.0f} | {row['files_written']:.0f} | "
                + ("n/a (not HF)" if system == "raw" else f"yes ({len(checked)} checked)" if checked
                   else "not checked") + " |")
        if data["ratios"]:
            lines += ["", "Ratios of GB/s, same run (ratio of medians [median of same-round ratios]): " + "; ".join(
                f"dcp_ext / {system}: **{r['ratio']:.2f}×**"
                + (f" [{r['paired']:.2f}]" if r["paired"] is not None else "")
                for system, r in data["ratios"].items()) + "."]
        if data["targets"]:
            lines += ["", "| target | threshold | measured | met |", "|---|---:|---:|---|"]
            for t in data["targets"]:
                if "threshold_bytes" in t:
                    lines.append(f"| {t['target']} | ≤ {t['threshold_bytes'] / MiB:,.0f} MiB | "
                                 f"{t['value_bytes'] / MiB:,.0f} MiB (worst rank's median; max "
                                 f"{t['max_bytes'] / MiB:,.0f}) | {'✅' if t['met'] else '❌'} |")
                else:
                    paired = "" if t["paired"] is None else f" [{t['paired']:.2f}]"
                    lines.append(f"| {t['target']} | ≥ {t['threshold']}× | **{t['value']:.2f}×**{paired} | "
                                 f"{'✅' if t['met'] else '❌'} |")
    return "\n".join(lines)


def render_profile(record: dict[str, Any]) -> str:
    """Markdown of a ``--profile`` run: per measurement, each rank's phase seconds and top own-time functions."""
    m = record["machine"]
    lines = [
        f"Profile run of {record['date']} (`{record['command']}`), dcp_ext commit `{m['git_commit'][:12]}`; load "
        f"average at start {m['loadavg_start']}, at end {record['loadavg_end']}. Times carry the instrumentation's "
        "overhead (cProfile on the main thread of every rank). Phases are nested: `_FileSink.put` includes "
        "`_LocalWriter.write` (page-cache writes, `sync_file_range` every 32 MiB), `_FileSink.close` the commit "
        "(fsync, rename); `_LiveState._assemble` includes the copy of the rank's own half into the assembled "
        "tensor; `exchange wait` is the time in `wait()` of the isend/irecv; `_any_failed` is the all-reduce that "
        "ends every step.",
    ]
    for s in record["samples"]:
        ranks = s["ranks"]
        names = sorted({k for r in ranks for k in r.get("phases", {})})
        lines += ["", f"**{s['mode']} / {s['system']}**: {s['seconds']:.2f} s (slowest rank), load "
                      f"{s['loadavg_before'][0]:.2f}", "",
                  "| phase | " + " | ".join(f"rank {r['rank']} s (calls)" for r in ranks) + " |",
                  "|---|" + "---:|" * len(ranks)]
        lines.append("| whole call | " + " | ".join(f"{r['seconds']:.3f}" for r in ranks) + " |")
        for name in names:
            cells = []
            for r in ranks:
                v = r.get("phases", {}).get(name)
                cells.append("–" if v is None else f"{v['seconds']:.3f} ({v['calls']})")
            lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
        for r in ranks:
            top = ", ".join(f"`{f['function']}` {f['own']:.3f} s" for f in r.get("profile", [])[:6])
            lines.append(f"\nrank {r['rank']}, most own time (cProfile): {top}")
    return "\n".join(lines)


def _load_range(record: dict[str, Any]) -> str:
    loads = [s["loadavg_before"][0] for s in record.get("samples", [])]
    if not loads:
        return "–"
    return f"1-min {min(loads):.2f}–{max(loads):.2f} (median {statistics.median(loads):.2f})"
