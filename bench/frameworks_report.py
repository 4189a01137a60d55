"""The summary and report of ``python -m bench.frameworks``: the dcp_ext / default pairs of its ratio
table and the main-table targets they are held against (``PAIRS``, ``MAIN_TARGETS``), the newest
``python -m bench`` result and its save ratios (``newest_main_table``, ``main_table_ratios``), the
medians, GB/s and ratios of a run (``summarize``) and its markdown (``render``). Nothing here
imports torch or starts a process, so a saved ``bench/results/frameworks-<date>.json`` can be
summarized and rendered again without running anything. :mod:`bench.frameworks` re-imports these two
constants and four functions (so ``from bench.frameworks import PAIRS`` keeps working); this module
imports no suite, as bench/ has no import cycles.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

MiB = 1 << 20
BENCH = Path(__file__).resolve().parent
#: (dcp_ext system, its default): the rows of the ratio table, in order.
PAIRS = [
    ("titan_dcp_ext", "titan_stock"),
    ("titan_dcp_ext_zstd", "titan_stock"),
    ("titan_dcp_ext_auto", "titan_stock"),
    ("lightning_dcp_ext", "lightning_stock"),
    ("megatron_dcp_ext", "megatron_stock"),
    ("tc_dcp_ext", "tc_stock"),
    ("tc_dcp_ext_nofsync", "tc_stock"),
    ("dcp_ext", "dcp_torch"),
]
#: Defaults that run on one storage kind only, and the kind a dcp_ext row of another kind is held
#: against: torch_checkpointing's own storage writes local paths only, so its local save (the same disk
#: the S3 server writes to) is the ceiling of ``tc_dcp_ext`` on S3 (issue 43).
CEILINGS = {"tc_stock": "local"}
#: (dcp_ext system, reference, what the reference is): same-run references of a row beyond its pair (issue 43:
#: torch_checkpointing has no S3 backend, so its S3 row is also held against its stock save followed by an upload,
#: dcp_ext's own DCP save of the same tensors, and the S3 server's raw ceiling for those bytes).
REFERENCES = [
    ("tc_dcp_ext", "tc_stock_upload", "stock save to local disk, then an s3fs upload: what a user does without dcp_ext"),
    ("tc_dcp_ext", "tc_dcp", "dcp_ext's own DCP save (`dcp_ext.save`) of the same tensors"),
    ("tc_dcp_ext", "tc_raw", "the S3 server's raw ceiling for the same bytes (boto3 multipart)"),
]
#: The main table's target ids whose ratios these rows are held against.
MAIN_TARGETS = {"local": "local_save_torch", "s3": "s3_save_fsspec"}


def newest_main_table(results: Path = BENCH / "results") -> Path | None:
    """The newest results JSON of ``python -m bench`` (``<date>-<machine>[-<tag>].json``), full
    default runs before ``-quick`` / ``-custom`` ones of the same date, then by modification time."""
    found = [p for p in results.glob("*.json") if re.match(r"^\d{4}-\d{2}-\d{2}-[0-9a-f]{8}", p.name)]
    if not found:
        return None
    return max(found, key=lambda p: (p.name[:10], not re.search(r"-(quick|custom)\.json$", p.name),
                                     p.stat().st_mtime))


def main_table_ratios(path: Path | None) -> dict[str, Any]:
    """The main table's save ratios (dcp_ext / torch's default writer) that the
    framework rows are held against: ``{kind: {world: {ratio, paired}}}``."""
    if path is None:
        return {}
    from bench.harness.report import summarize as summarize_main

    result = json.loads(path.read_text())
    summary = result.get("summary") or summarize_main(result)
    out: dict[str, Any] = {"file": path.name, "date": result.get("date"),
                           "commit": result.get("machine", {}).get("git_commit", "?")[:7]}
    for kind, target in MAIN_TARGETS.items():
        entry = next((t for t in summary.get("targets", []) if t["id"] == target), None)
        if entry:
            out[kind] = {w: {"ratio": r["ratio"], "paired": r["paired"], "text": entry["text"]}
                         for w, r in entry["worlds"].items()}
    return out


def default_seconds(kinds: dict[str, Any], kind: str, default: str) -> tuple[str, list[float]] | None:
    """``(kind, seconds)`` of a pair's default for the rows of ``kind``: its own, else (a default that runs on
    one kind only, ``CEILINGS``) those of the kind it runs on; ``None`` if neither was run."""
    for k in (kind, CEILINGS.get(default)):
        if k in kinds and default in kinds[k]["seconds"]:
            return k, kinds[k]["seconds"][default]
    return None


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Median seconds and GB/s per system; dcp_ext / default ratios per pair
    (ratio of medians, and the median of same-round ratios; for a default of another
    kind, ``CEILINGS``, rounds of the two kinds paired by their order)."""
    med = statistics.median
    out: dict[str, Any] = {"rows": {}, "ratios": {}, "fixed": {}, "references": {}, "parts": {}}
    for kind, rec in result["kinds"].items():
        for name, parts in rec.get("parts", {}).items():
            out["parts"].setdefault(kind, {})[name] = {part: med(secs) for part, secs in parts.items()}
        for fw, secs in rec.get("prep", {}).items():
            adapter = rec.get("null_adapter", {}).get(fw)
            out["fixed"][fw] = {"prep_s": med(secs), "null_save_s": med(rec["null"][fw]),
                                "null_adapter_s": med(adapter) if adapter else None, "items": rec["items"].get(fw)}
        rows = out["rows"].setdefault(kind, {})
        for meta in rec["systems"]:
            secs = rec["seconds"][meta["name"]]
            rows[meta["name"]] = {**meta, "median_s": med(secs), "min_s": min(secs), "max_s": max(secs),
                                  "gbps": meta["bytes"] / med(secs) / 1e9, "stored": rec["stored"].get(meta["name"]),
                                  "files": rec["files"].get(meta["name"])}
    for kind, rec in result["kinds"].items():
        rows = out["rows"][kind]
        for ours, default in PAIRS:
            found = default_seconds(result["kinds"], kind, default)
            if ours in rows and found:
                (default_kind, b), a = found, rec["seconds"][ours]
                entry = {"default": default, "default_kind": default_kind, "ratio": med(b) / med(a),
                         "paired": med(y / x for x, y in zip(a, b))}
                fixed = out["fixed"].get(rows[ours]["framework"])
                if fixed:  # what the stock save pays whatever it stores: its share of the dcp_ext save
                    entry["common_s"] = fixed["prep_s"] + fixed["null_save_s"]
                    entry["common_share"] = entry["common_s"] / med(a)
                out["ratios"].setdefault(kind, {})[ours] = entry
        for ours, reference, what in REFERENCES:
            if ours in rows and reference in rows:
                a, b = rec["seconds"][ours], rec["seconds"][reference]
                out["references"].setdefault(kind, []).append({
                    "ours": ours, "reference": reference, "what": what, "ratio": med(b) / med(a),
                    "paired": med(y / x for x, y in zip(a, b))})
    return out


def render(record: dict[str, Any]) -> str:
    s, m, p, main = record["summary"], record["machine"], record["params"], record["main_table"]
    titles = {"local": f"local disk (`{m.get('workdir_device', '?')}`)", "s3": "S3 (SeaweedFS, 127.0.0.1)"}
    lines = [
        f"Run of {record['date']} on `{m['machine_id']}`: {m['cpu_count']} × {m['cpu_model']}, {m['ram_gib']:.1f} GiB "
        f"RAM; torch {m['versions'].get('torch')}, torchtitan {record['versions'].get('torchtitan')}, lightning "
        f"{record['versions'].get('lightning')}"
        + (f", megatron-core {record['versions']['megatron-core']}" if "megatron-core" in record["versions"] else "")
        + (f", torch_checkpointing {record['versions']['torch_checkpointing']}"
           if "torch_checkpointing" in record["versions"] else "")
        + f", dcp_ext {m['versions'].get('dcp_ext')} (commit "
        f"`{m['git_commit'][:12]}`{', dirty tree' if m['git_dirty'] else ''}); load average at start/end "
        f"{m['loadavg_start']} / {record['loadavg_end']}; run time {record['runtime_seconds'] / 60:.1f} min.",
        "",
        f"2 gloo ranks, FSDP2; the model is the main table's state dict at {p['size'] / MiB:,.0f} MiB "
        f"({p['layers']} layers, bf16, random bits), with AdamW's two moments (random bits) the framework "
        f"saves hold {record['framework_bytes'] / MiB:,.0f} MiB of tensors; plain DCP rows save the model "
        f"alone. Timed rounds per system: {', '.join(f'{k} {v}' for k, v in p['rounds'].items())}, after a warm-up round; order rotated and reversed every other "
        f"round, `sync`{' + page cache dropped' if p['drop_caches'] else ''} before each save; median seconds "
        "(min–max) of the slower rank.",
        "",
        f"Command: `{record['command']}`",
        "",
        "| storage | system | settings | save s, median (min–max) | GB/s | stored MiB |",
        "|---|---|---|---:|---:|---:|",
    ]
    for kind, rows in s["rows"].items():
        for row in rows.values():
            stored = f"{row['stored'] / MiB:,.0f}" if row.get("stored") is not None else "–"
            lines.append(f"| {titles[kind]} | {row['label']} | {row['settings']} | {row['median_s']:.2f} "
                         f"({row['min_s']:.2f}–{row['max_s']:.2f}) | {row['gbps']:.3f} | {stored} |")
    main_head = f"main table `{main['file']}`, 2 ranks" if main else "main table"
    lines += [
        "",
        f"| storage | dcp_ext / default (save throughput) | this run: ratio [paired] | what the stock save pays "
        f"storing nothing (table below), share of the dcp_ext save | plain DCP, this run | {main_head} | "
        f"≥ main table? |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for kind, ratios in s["ratios"].items():
        plain = ratios.get("dcp_ext")
        ref = main.get(kind, {}).get("2") if main else None
        for ours, r in ratios.items():
            row, default_kind = s["rows"][kind], r.get("default_kind", kind)
            default = s["rows"][default_kind][r["default"]]["label"] + (
                "" if default_kind == kind else f" on {titles[default_kind]}")
            cells = [f"{r['ratio']:.2f}× [{r['paired']:.2f}]",
                     f"{r['common_s']:.2f} s = {r['common_share']:.0%}" if "common_s" in r else "–",
                     f"{plain['ratio']:.2f}×" if plain else "–",
                     f"{ref['ratio']:.2f}×" if ref else "–",
                     ("✅" if r["ratio"] >= ref["ratio"] else "❌") if ref else "–"]
            lines.append(f"| {titles[kind]} | {row[ours]['label']} / {default} | "
                         + " | ".join(cells) + " |")
    if s.get("references"):
        lines += ["", "Same-run references (save throughput ratio, row / reference; > 1: the row is faster):", "",
                  "| storage | row / reference | reference is | ratio [paired] |", "|---|---|---|---:|"]
        for kind, entries in s["references"].items():
            for e in entries:
                rows = s["rows"][kind]
                lines.append(f"| {titles[kind]} | {rows[e['ours']]['label']} / {rows[e['reference']]['label']} | "
                             f"{e['what']} | {e['ratio']:.2f}× [{e['paired']:.2f}] |")
    if s.get("parts"):
        lines += ["", "Parts of the saves above (median seconds, slower rank): `save_preprocess` is Megatron's "
                  "(sharding validation with `validate_access_integrity`'s all-gather; both Megatron rows call it "
                  "before any byte is written); the S3 stock row's local save and upload.", "",
                  "| storage | system | part | median s | share of the row's median save |", "|---|---|---|---:|---:|"]
        for kind, systems in s["parts"].items():
            for name, parts in systems.items():
                row = s["rows"][kind][name]
                for part, secs in parts.items():
                    lines.append(f"| {titles[kind]} | {row['label']} | `{part}` | {secs:.2f} | "
                                 f"{secs / row['median_s']:.0%} |")
    if s["fixed"]:
        built = {"torchtitan": " (flatten + each `Stateful`'s `state_dict` + `gc.collect(1)`)",
                 "lightning": " (`dump_checkpoint`)", "dcp": ""}
        lines += ["", "What a save of the same state pays whatever it stores (measured in the local rounds, "
                  "median, slower rank): the framework building the state dict it hands DCP, and `dcp.save` of "
                  "it through a writer that resolves every item (pickling non-tensors) and stores nothing "
                  "(planning, collectives, metadata), with DCP's default planner (the stock saves) and with the "
                  "planner dcp_ext's adapters use (`LayoutSavePlanner` with DCP's plan caching, warm from their "
                  "saves: an unchanged plan is neither sent nor planned again).", "",
                  "| state | DCP write items (all ranks): tensors / other values | built by the framework, s | "
                  "`dcp.save` storing nothing, DCP's default planner, s | the same, dcp_ext adapters' planner, s |",
                  "|---|---:|---:|---:|---:|"]
        names = {"torchtitan": "torchtitan", "lightning": "Lightning", "dcp": "plain DCP (model only)"}
        for fw, f in s["fixed"].items():
            items = f["items"] or {}
            lines.append(f"| {names.get(fw, fw)} | {items.get('tensors', '?'):,} / {items.get('other', '?'):,} | "
                         f"{f['prep_s']:.2f}{built.get(fw, '')} | {f['null_save_s']:.2f} | "
                         + (f"{f['null_adapter_s']:.2f} |" if f.get("null_adapter_s") is not None else "– |"))
    return "\n".join(lines)
