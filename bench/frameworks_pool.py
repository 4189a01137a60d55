"""Pool several ``python -m bench.frameworks`` runs: ``python -m bench.frameworks_pool A.json B.json ...``.

One run of 3-5 rounds per system on 2 shared cores moves a ratio by ±10 %
from one run to the next (bench/README.md, Frameworks). This pools every
timed save of the given results files per system and storage kind and
prints, as markdown, each dcp_ext / default ratio of medians over all of
them, the median of the same-round ratios, each run's own ratio, and the
main table's ratio the rows are held against (that of the first file). Nothing
here runs a save: it reads results files only.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.frameworks_report import PAIRS, default_seconds


def pooled(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (storage kind, dcp_ext system) present in every record (a default that runs on one
    kind only taken from that kind, as ``bench.frameworks_report.summarize`` does)."""
    med = statistics.median
    rows = []
    for kind in records[0]["kinds"]:
        for ours, default in PAIRS:
            found = [(r["kinds"][kind]["seconds"].get(ours), default_seconds(r["kinds"], kind, default))
                     for r in records if kind in r["kinds"]]
            if not all(o and d for o, d in found):
                continue
            runs = [(o, d[1]) for o, d in found]
            a = [x for o, _ in runs for x in o]
            b = [x for _, d in runs for x in d]
            rows.append({
                "kind": kind, "ours": ours, "default": default, "default_kind": found[0][1][0], "n": len(a),
                "ours_s": med(a), "default_s": med(b), "ratio": med(b) / med(a),
                "paired": med(y / x for o, d in runs for x, y in zip(o, d)),
                "per_run": [med(d) / med(o) for o, d in runs],
            })
    return rows


def render(records: list[dict[str, Any]], names: list[str]) -> str:
    main = records[0].get("main_table", {})
    labels = {(kind, m["name"]): m["label"] for r in records for kind, k in r["kinds"].items() for m in k["systems"]}
    lines = [f"Pooled: {', '.join(f'`{n}`' for n in names)}; main table `{main.get('file', '?')}`, 2 ranks.", "",
             "| storage | dcp_ext / default | saves each | median s, dcp_ext / default | ratio [paired] | "
             "each run | main table | ≥ main table? |", "|---|---|---:|---:|---:|---|---:|---|"]
    for row in pooled(records):
        ref = main.get(row["kind"], {}).get("2", {}).get("ratio")
        lines.append(
            f"| {row['kind']} | {labels[row['kind'], row['ours']]} / {labels[row['default_kind'], row['default']]}"
            f"{'' if row['default_kind'] == row['kind'] else ' (' + row['default_kind'] + ')'} | {row['n']} | "
            f"{row['ours_s']:.2f} / {row['default_s']:.2f} | {row['ratio']:.2f}× [{row['paired']:.2f}] | "
            f"{', '.join(f'{x:.2f}' for x in row['per_run'])} | "
            + (f"{ref:.2f}× | {'✅' if row['ratio'] >= ref else '❌'} |" if ref else "– | – |"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)]
    if not paths:
        print(__doc__.split("\n\n")[0], file=sys.stderr)
        return 2
    records = [json.loads(p.read_text()) for p in paths]
    sizes = {p.name: r["params"]["size"] for p, r in zip(paths, records)}
    if len(set(sizes.values())) > 1:
        print(f"runs of different model sizes cannot be pooled: {sizes}", file=sys.stderr)
        return 2
    print(render(records, [p.name for p in paths]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
