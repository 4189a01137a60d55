"""Markdown for ``python -m bench.scale``'s results: the tables and growth exponents.

Rows and profiles are the plain dicts :func:`bench.scale.simulator.run_case` and
:func:`bench.scale.simulator.run_profiles` return (and the results JSON holds), so a
saved run can be rendered again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["render_table", "render_extras", "render_collectives", "growth", "render_profiles", "render_markdown"]

MiB = 1 << 20


def _fmt_s(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.3f}" if value < 1 else f"{value:.2f}" if value < 100 else f"{value:.0f}"


def _fmt_bytes(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value / MiB:,.1f} MiB" if value >= MiB else f"{value / 1024:,.1f} KiB"


def _steps(row: dict[str, Any], kind: str) -> dict[str, Any]:
    return dict(row.get(kind, {}).get("seconds", {}))


_COLUMNS = ("model", "ranks", "chunks", "system", "plan s", "plan CPU s", "encode s", "metadata bytes", "B/chunk",
            "index bytes", "B/frame", "decode s", "peak RSS MiB", "load plan s", "load RSS MiB")


def _cells(row: dict[str, Any]) -> list[str]:
    save, load = row.get("save", {}), row.get("load", {})
    chunks = save.get("chunks")
    global_bytes, index_bytes, frames = save.get("global_bytes"), save.get("index_bytes"), save.get("frames")
    ranks = f"{row['ranks']:,}" + (f" (tp {row['tp']})" if row.get("tp", 1) > 1 else "")
    cells = [row["model"], ranks, f"{chunks:,}" if chunks else "–", row["system"]]
    if "global_bytes" not in save:
        plan = _steps(row, "save").get("global plan")
        status = row["status"] if plan is None else f"{_fmt_s(plan)} ({row['status']})"
        rss = save.get("sampled_rss_mib")
        tail = ["–"] * (len(_COLUMNS) - len(cells) - 4)
        return cells + [status] + tail + [f"≥ {rss:,.0f}" if rss else "–", "–", "–"]
    per_frame = "–"
    if index_bytes and frames:
        per_frame = f"{index_bytes / frames:.1f}"
    cells += [
        _fmt_s(_steps(row, "save").get("global plan")),
        _fmt_s(row["save"].get("cpu_seconds", {}).get("global plan")),
        _fmt_s(_steps(row, "save").get("encode")),
        _fmt_bytes(global_bytes),
        f"{global_bytes / chunks:.0f}" if chunks else "–",
        _fmt_bytes(index_bytes) if index_bytes else "0",
        per_frame,
        _fmt_s(_steps(row, "load").get("decode")) if load.get("seconds") else row["status"],
        f"{save.get('peak_rss_mib', 0):,.0f}",
        _fmt_s(_steps(row, "load").get("load plan")),
        f"{load['peak_rss_mib']:,.0f}" if "peak_rss_mib" in load else "–",
    ]
    return cells


def render_table(rows: Sequence[dict[str, Any]]) -> str:
    """The main markdown table: one line per case."""
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "|".join("---:" if c not in ("model", "system") else "---"
                                                               for c in _COLUMNS) + "|"]
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in rows]
    return "\n".join(lines)


def render_extras(rows: Sequence[dict[str, Any]]) -> str:
    """What else a dcp_ext save's coordinator writes and a loading rank reads."""
    head = ("model", "ranks", "write items", "frames", "data files", "interop .metadata", "interop pickle s",
            "partition.json", "partition encode s", "partition decode s", "read items", "files read",
            "index bytes read", "index decode s")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for row in rows:
        save, load = row.get("save", {}), row.get("load", {})
        if row["system"] != "dcp_ext" or "interop_bytes" not in save:
            continue
        lines.append("| " + " | ".join([
            row["model"], f"{row['ranks']:,}", f"{save['write_items']:,}", f"{save['frames']:,}",
            f"{save['files']:,}", _fmt_bytes(save["interop_bytes"]) if save["interop_bytes"] else "not written",
            _fmt_s(_steps(row, "save").get("interop pickle")),
            _fmt_bytes(save["partition_bytes"]), _fmt_s(_steps(row, "save").get("partition encode")),
            _fmt_s(_steps(row, "load").get("partition decode")),
            f"{load['read_items']:,}" if "read_items" in load else "–",
            f"{load['files_read']:,}" if "files_read" in load else "–",
            _fmt_bytes(load["index_bytes_read"]) if load.get("index_bytes_read") else "0",
            _fmt_s(_steps(row, "load").get("index decode")),
        ]) + " |")
    return "\n".join(lines)


def render_collectives(rows: Sequence[dict[str, Any]]) -> str:
    """What DCP's collectives around planning and commit carry and cost (one process:
    pickling on the ranks untimed, unpickling timed), and the coordinator's whole
    share of a save's blocking time: gather plans + plan + gather results + encode
    + pickle the metadata it broadcasts."""
    head = ("model", "ranks", "system", "plans gathered", "unpickle s", "answers", "results gathered",
            "unpickle s", "metadata broadcast", "pickle s", "unpickle s (each rank)", "coordinator total s")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---", "---:", "---"] + ["---:"] * (len(head) - 3)) + "|"]
    for row in rows:
        save = row.get("save", {})
        if "gathered_plan_bytes" not in save or "broadcast_bytes" not in save:
            continue
        steps = _steps(row, "save")
        parts = ("gather plans", "global plan", "gather results", "encode", "broadcast pickle")
        total = sum(steps.get(p, 0.0) for p in parts)
        lines.append("| " + " | ".join([
            row["model"], f"{row['ranks']:,}", row["system"],
            _fmt_bytes(save["gathered_plan_bytes"]), _fmt_s(steps.get("gather plans")),
            _fmt_bytes(save.get("answer_bytes")), _fmt_bytes(save.get("gathered_result_bytes")),
            _fmt_s(steps.get("gather results")), _fmt_bytes(save["broadcast_bytes"]),
            _fmt_s(steps.get("broadcast pickle")), _fmt_s(steps.get("broadcast unpickle")), _fmt_s(total),
        ]) + " |")
    return "\n".join(lines)


def growth(rows: Sequence[dict[str, Any]], kind: str, step: str) -> list[tuple[str, int, int, float]]:
    """Growth exponents of one step between consecutive N of each (system, model):
    ``(system, N1, N2, log(t2 / t1) / log(N2 / N1))``."""
    out = []
    series: dict[tuple[str, str, int], list[tuple[int, float]]] = {}
    for row in rows:
        seconds = _steps(row, kind).get(step)
        if seconds:
            series.setdefault((row["system"], row["model"], row.get("tp", 1)), []).append((row["ranks"], seconds))
    for (system, _, _), points in series.items():
        points.sort()
        for (n1, t1), (n2, t2) in zip(points, points[1:]):
            if t1 > 0.01 and n2 > n1:
                out.append((system, n1, n2, math.log(t2 / t1) / math.log(n2 / n1)))
    return out


def render_profiles(profiles: Sequence[dict[str, Any]]) -> str:
    """Top functions per profile, then per-function growth exponents between
    consecutive N of one system (``>=`` where the larger run was cut off)."""
    parts = []
    for p in profiles:
        title = f"#### {p['system']} {p['model']} N={p['ranks']:,}: "
        if "top" not in p:
            parts.append(title + p["status"])
            continue
        done = "finished" if p["finished"] else "stopped (time limit)"
        parts.append(title + f"{done} after {p['seconds']:.1f} s under cProfile\n")
        parts.append("| function | calls | tottime s | cumtime s |\n|---|---:|---:|---:|")
        parts += [f"| `{r['function']}` | {r['calls']:,} | {r['tottime']:.2f} | {r['cumtime']:.2f} |" for r in p["top"]]
        parts.append("")
    by_system: dict[str, list[dict[str, Any]]] = {}
    for p in profiles:
        if "cumtime" in p:
            by_system.setdefault(p["system"], []).append(p)
    for system, runs in by_system.items():
        runs.sort(key=lambda p: p["ranks"])
        for small, large in zip(runs, runs[1:]):
            ratio = math.log(large["ranks"] / small["ranks"])
            rows = []
            for name in (r["function"] for r in large["top"]):
                t1, t2 = small["cumtime"].get(name), large["cumtime"].get(name)
                if t1 and t2 and t1 >= 0.05:
                    bound = "" if large["finished"] else ">= "
                    rows.append(f"| `{name}` | {t1:.2f} | {t2:.2f} | {bound}{math.log(t2 / t1) / ratio:.2f} |")
            if rows:
                parts.append(f"#### {system}: growth N={small['ranks']:,} -> {large['ranks']:,} (cumulative time)\n")
                parts.append("| function | s at small N | s at large N | exponent |\n|---|---:|---:|---:|")
                parts += rows + [""]
    return "\n".join(parts)


def render_markdown(rows: Sequence[dict[str, Any]], profiles: Sequence[dict[str, Any]] = ()) -> str:
    """The whole report: both tables, planning-time growth, then the profiles."""
    sections = [render_table(rows), "", render_extras(rows), "", render_collectives(rows), ""]
    exponents = growth(rows, "save", "global plan")
    if exponents:
        sections.append("Growth of the coordinator's planning time (wall), t ~ N^k:\n")
        sections += [f"* {system}: N={n1:,} -> {n2:,}: k = {k:.2f}" for system, n1, n2, k in exponents]
        sections.append("")
    if profiles:
        sections.append(render_profiles(profiles))
    return "\n".join(sections)
