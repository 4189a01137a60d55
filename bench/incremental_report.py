"""What ``python -m bench.incremental`` (issue 17) makes of its samples, apart
from the suite that takes them: :func:`summarize` (per workload and storage
kind: medians with min-max over saves 2..n, and the ratios incremental / full),
:func:`target_rows` (the issue's :data:`TARGETS` on the synthetic workload),
:func:`render` (the markdown for bench/README.md and the docs' benchmark page)
and their helpers, plus what the record and the suite share (:data:`MiB`,
:data:`SYSTEMS`, :data:`KEEP`, :func:`chain_of`). It imports nothing from
bench.incremental; bench.incremental imports from here, so
``bench.incremental.render``, ``summarize``, ``target_rows`` and ``chain_of``
resolve as before.
"""

from __future__ import annotations

import statistics
from typing import Any

MiB = 1 << 20
SYSTEMS = ("incremental", "full")
KEEP = 3
#: Targets of issue 17 (same run, 5 % of the parameters trained): (key, threshold, storage kinds).
TARGETS = {
    "bytes": ("bytes written per save, incremental / full (optimizer state included)", 0.12, ("local", "s3")),
    "save": ("save time, incremental / full, on S3", 0.25, ("s3",)),
    "stored": (f"stored bytes after the saves with keep-{KEEP}, incremental / full", 0.5, ("local", "s3")),
    "resume": ("resume time, incremental / full", 1.2, ("local", "s3")),
}


def chain_of(i: int, max_chain: int) -> int:
    """The chain length of incremental save ``i`` (0-based) in a fresh root."""
    return i % (max_chain + 1)


# -- summary and markdown ----------------------------------------------------------------------


def _stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _ratio(inc: dict[str, float] | None, full: dict[str, float] | None) -> float | None:
    if inc is None or full is None or not full["median"]:
        return None
    return inc["median"] / full["median"]


def summarize(record: dict[str, Any]) -> dict[str, Any]:
    """Per workload and storage kind: medians (min-max) over saves 2..n of every
    round, stored bytes and resume times per round, and the ratios incremental / full
    (ratio of medians, and the median of the per-save / per-round paired ratios)."""
    out: dict[str, Any] = {}
    for name, data in record["workloads"].items():
        per_kind: dict[str, Any] = {}
        for kind, rounds in data["kinds"].items():
            row: dict[str, Any] = {"systems": {}}
            for system in SYSTEMS:
                steady = [s for r in rounds for s in r["saves"][system] if s["save"] >= 1]
                row["systems"][system] = {
                    "bytes": _stats([s["data_bytes"] for s in steady]),
                    "other_bytes": _stats([s["other_bytes"] for s in steady]),
                    "seconds": _stats([s["seconds"] for s in steady]),
                    "first_seconds": _stats([r["saves"][system][0]["seconds"] for r in rounds]),
                    "stored": _stats([r["stored"][system]["stored_bytes"] for r in rounds]),
                    "chains": [s["chain"] for s in rounds[0]["saves"][system]],
                    "resume": {role: _stats([x["seconds"] for r in rounds for x in r["resumes"][system]
                                             if x["role"] == role]) for role in data["resume_tags"]},
                }
            inc, full = row["systems"]["incremental"], row["systems"]["full"]

            def paired(field: str, rounds: list[dict[str, Any]] = rounds) -> float | None:
                ratios = [a[field] / b[field] for r in rounds
                          for a, b in zip(r["saves"]["incremental"], r["saves"]["full"], strict=True)
                          if a["save"] >= 1 and b[field]]
                return statistics.median(ratios) if ratios else None

            row["ratios"] = {
                "bytes": _ratio(inc["bytes"], full["bytes"]), "bytes_paired": paired("data_bytes"),
                "save": _ratio(inc["seconds"], full["seconds"]), "save_paired": paired("seconds"),
                "stored": _ratio(inc["stored"], full["stored"]),
                "stored_paired": statistics.median(r["stored"]["incremental"]["stored_bytes"]
                                                   / r["stored"]["full"]["stored_bytes"] for r in rounds),
                **{f"resume_{role}": _ratio(inc["resume"][role], full["resume"][role])
                   for role in data["resume_tags"]},
                **{f"resume_{role}_paired": statistics.median(
                    a["seconds"] / b["seconds"] for r in rounds
                    for a, b in zip([x for x in r["resumes"]["incremental"] if x["role"] == role],
                                    [x for x in r["resumes"]["full"] if x["role"] == role], strict=True))
                   for role in data["resume_tags"]},
            }
            row["bit_exact"] = all(x["bit_exact"] for r in rounds for s in SYSTEMS for x in r["resumes"][s])
            per_kind[kind] = row
        out[name] = per_kind
    return out


def target_rows(record: dict[str, Any], summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets on the synthetic workload (5 % trained), per storage kind."""
    rows = []
    if "synthetic" not in summary:
        return rows
    for key, (label, threshold, kinds) in TARGETS.items():
        for kind in kinds:
            row = summary["synthetic"].get(kind)
            if row is None:
                continue
            roles = ["newest", "deepest"] if key == "resume" else [None]
            for role in roles:
                field = key if role is None else f"resume_{role}"
                if field not in row["ratios"]:
                    continue
                value = row["ratios"][field]
                paired = row["ratios"].get(f"{field}_paired")
                what = label if role is None else f"{label} ({'newest tag' if role == 'newest' else 'deepest kept chain'})"
                rows.append({"target": what, "kind": kind, "threshold": threshold, "value": value,
                             "paired": paired, "met": value is not None and value <= threshold})
    return rows


def _mib(stats: dict[str, float] | None) -> str:
    if stats is None:
        return "–"
    if stats["min"] == stats["max"]:
        return f"{stats['median'] / MiB:,.1f}"
    return f"{stats['median'] / MiB:,.1f} <sub>({stats['min'] / MiB:,.1f}–{stats['max'] / MiB:,.1f})</sub>"


def _sec(stats: dict[str, float] | None) -> str:
    if stats is None:
        return "–"
    return f"{stats['median']:.2f} <sub>({stats['min']:.2f}–{stats['max']:.2f})</sub>"


def _x(value: float | None, paired: float | None = None) -> str:
    if value is None:
        return "–"
    return f"**{value:.3f}×**" + ("" if paired is None else f" [{paired:.3f}]")


def render(record: dict[str, Any]) -> str:
    """Markdown: conditions, one table per workload, the targets."""
    summary = record["summary"]
    p, m = record["params"], record["machine"]
    lines = [
        f"Run of {record['date']} on `{m['machine_id']}`: {m['cpu_count']} × {m['cpu_model']}, {m['ram_gib']:.1f} GiB "
        f"RAM; torch {m['versions'].get('torch')}, dcp_ext commit `{m['git_commit'][:12]}`"
        f"{' (dirty tree)' if m['git_dirty'] else ''}, SeaweedFS {m.get('seaweedfs_version', '–')}; "
        f"{p['rounds']} round(s), {p['saves']} saves per system and round, keep {KEEP}, "
        f"`max_chain={p['max_chain']}`; run time {record['runtime_seconds'] / 60:.1f} min; load average at "
        f"start/end {m['loadavg_start']} / {record['loadavg_end']} (other jobs shared the 2 cores).",
        "",
        f"Command: `{record['command']}`",
        "",
        "Per save: median (min–max) over saves 2..n of every round (the first save is a full one in both systems); "
        "bytes = data files of the new tag (frame indexes included); times in seconds, slower rank. Stored: every "
        f"file under the root after the last save. Resume: the newest tag (save {p['saves']}: chain "
        f"{chain_of(p['saves'] - 1, p['max_chain'])}"
        + (", i.e. a new chain's full save" if chain_of(p["saves"] - 1, p["max_chain"]) == 0 else "")
        + ") and, if another, the kept tag with the longest chain of references, into a "
        "fresh FSDP2 model + Adam, warm page cache; every resume compared bit for bit. Ratios: incremental / full, "
        "ratio of medians [median of same-save / same-round ratios].",
    ]
    for name, per_kind in summary.items():
        facts = record["workloads"][name]["facts"]
        tags = record["workloads"][name]["resume_tags"]
        if name == "minilm":
            title = (f"MiniLM-L6 (real weights), LoRA rank {facts['lora_rank']} on query/value + "
                     f"{facts['classes']}-class head")
        else:
            title = (f"synthetic: {facts['blocks']} blocks of width {facts['width']}, LoRA rank {facts['lora_rank']} "
                     "on all 6 linears")
        lines += [
            "", f"#### {title}", "",
            f"{facts['params'] / 1e6:,.1f} M fp32 parameters, {facts['trainable_share']:.2%} trainable; state "
            f"{facts['state_bytes'] / MiB:,.1f} MiB (parameters {facts['param_bytes'] / MiB:,.1f} MiB + Adam moments "
            f"{facts['optim_bytes'] / MiB:,.1f} MiB); the trained parameters and their moments are "
            f"**{facts['changed_share']:.3f}** of the state (the least any save of a step must write).",
            "",
            "| storage | system | bytes written per save (MiB) | save (s) | first save (s) | stored after "
            f"{p['saves']} saves (MiB) | resume newest (s) | "
            + ("resume deepest chain (s) | " if "deepest" in tags else "") + "bit-exact |",
            "|---|---|---:|---:|---:|---:|---:|" + ("---:|" if "deepest" in tags else "") + "---|",
        ]
        for kind, row in per_kind.items():
            for system in SYSTEMS:
                s = row["systems"][system]
                lines.append(
                    f"| {kind} | {system} | {_mib(s['bytes'])} | {_sec(s['seconds'])} | {_sec(s['first_seconds'])} | "
                    f"{_mib(s['stored'])} | {_sec(s['resume']['newest'])} | "
                    + (f"{_sec(s['resume']['deepest'])} | " if "deepest" in tags else "")
                    + ("yes" if row["bit_exact"] else "**NO**") + " |")
            r = row["ratios"]
            lines.append(
                f"| {kind} | incremental / full | {_x(r['bytes'], r['bytes_paired'])} | {_x(r['save'], r['save_paired'])} "
                f"| | {_x(r['stored'], r['stored_paired'])} | {_x(r['resume_newest'], r['resume_newest_paired'])} | "
                + (f"{_x(r['resume_deepest'], r['resume_deepest_paired'])} | " if "deepest" in tags else "") + " |")
    targets = record["targets"]
    if targets:
        lines += ["", "Targets of issue 17 (synthetic workload, 5 % of the parameters trained; same run):", "",
                  "| target | storage | threshold | measured | met |", "|---|---|---:|---:|---|"]
        for t in targets:
            lines.append(f"| {t['target']} | {t['kind']} | ≤ {t['threshold']}× | {_x(t['value'], t['paired'])} | "
                         f"{'✅' if t['met'] else '❌'} |")
    return "\n".join(lines)
