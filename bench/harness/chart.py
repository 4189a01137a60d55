"""PNG charts of benchmark results: ``python -m bench.chart RESULTS.json ...``.

* ``python -m bench`` results (``bench/results/<date>-<machine>*.json``): save
  and load throughput (GB/s) as grouped bars, one panel per storage kind and
  operation (local save, local warm / cold load, S3 save, S3 load), one group
  per world size, one bar per system: dcp_ext, torch's writers/readers (the
  default, the best ``thread_count`` tried, fsspec), s3torchconnector and the
  raw ceiling. Bars are the medians of ``report.summarize`` (the numbers of the
  README tables), whiskers the min-max over rounds.
* ``python -m bench.compression`` results (``compression-<date>.json``):
  compression ratio and codec GB/s per data set, and save / load GB/s.

Each chart is written next to its JSON (same name, ``.png``). ``python -m
bench`` calls :func:`write_chart` after every run and for ``--render``.
matplotlib (the ``bench`` extra) is imported only when a chart is drawn, with
the Agg backend unless pyplot is already in use (a notebook's inline backend
stays), so the harness runs without it (:class:`ChartUnavailable`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from . import report

GiB = 1 << 30

# Bar colour and hatch per role (same role, same look, on every panel).
STYLE: dict[str, dict[str, Any]] = {
    "dcp_ext": {"color": "#1f6fb4"},
    "torch_default": {"color": "#e8873a"},
    "torch_best": {"color": "#f5c08f"},
    "torch_fsspec": {"color": "#a0522d"},
    "s3torchconnector": {"color": "#3a9a4f"},
    "raw": {"color": "#b0b0b0", "hatch": "//"},
    "raw_sdk": {"color": "#707070", "hatch": "\\\\"},
}


class ChartUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as err:
        raise ChartUnavailable(
            "matplotlib is not installed, so no PNG chart was drawn "
            "(pip install matplotlib, or the project's [bench] extra)"
        ) from err
    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")  # files only, no display; a notebook keeps its own (inline) backend
    import matplotlib.pyplot as plt

    return plt


# -- python -m bench ---------------------------------------------------------------


def _bars(summary: dict[str, Any], kind: str, world: str, threads: list[int]) -> list[tuple[str, str, dict[str, Any]]]:
    """(role, legend label, summary row) of the systems drawn for ``kind`` at ``world`` ranks;
    ``threads``: the FileSystemWriter thread counts the run tried."""
    table = summary["throughput"].get(kind, {})
    by_role: dict[str, tuple[str, dict[str, Any]]] = {}
    for name, row in table.items():
        if row["role"] in STYLE and row["role"] not in by_role:
            by_role[row["role"]] = (name, row)
    out = []
    for role in STYLE:
        if role == "torch_best":
            best = summary.get("torch_best", {}).get(world) if kind == "local" else None
            default = by_role.get("torch_default", ("", {}))[0]
            if best and best != default and best in table:
                tried = ",".join(str(t) for t in threads) or "those tried"
                picks = ", ".join(f"{b.rsplit('_t', 1)[-1]} at {w} rank{'s' if w != '1' else ''}"
                                  for w, b in sorted(summary.get("torch_best", {}).items(), key=lambda kv: int(kv[0])))
                row = dict(table[best], _threads=best.rsplit("_t", 1)[-1])
                out.append((role, f"torch FileSystemWriter/Reader, fastest-saving\nthread_count of {tried} (here {picks})", row))
            continue
        if role in by_role:
            out.append((role, by_role[role][1]["label"], by_role[role][1]))
    return out


def _title(result: dict[str, Any]) -> str:
    m = result["machine"]
    p = result["params"]
    repeats = p["repeats"]
    rounds = sorted(set(repeats.values())) if isinstance(repeats, dict) else [repeats]
    spread = ("one round, no spread shown" if rounds == [1] else
              f"median of {'/'.join(str(r) for r in rounds)} rounds, whiskers min–max")
    size = result.get("total_bytes", p["size"])
    size_text = f"{size / GiB:.3f} GiB" if size >= GiB else f"{size / 2**20:.1f} MiB"
    return (
        f"python -m bench, {result['date']}: {m['cpu_count']} × {m['cpu_model']} CPUs, "
        f"{m['ram_gib']:.1f} GiB RAM (machine {m['machine_id']}), commit {m.get('git_commit', '?')[:7]}"
        f"{' (dirty)' if m.get('git_dirty') else ''}\n"
        f"state dict {size_text} bf16 ({result.get('tensors', '?')} tensors); {spread}; "
        f"GB/s = 10⁹ bytes of tensor data / s"
    )


def _panel_title(kind: str, op: str) -> str:
    what = {"save": "save", "load_warm": "load, page cache warm", "load_cold": "load, page cache dropped"}
    where = {"local": "local disk", "s3": "S3", "az": "Azure Blob", "gcs": "GCS"}.get(kind, kind)
    return f"{where}: {what.get(op, op.replace('_', ' '))}"


def _legend_title(kind: str, result: dict[str, Any]) -> str:
    if kind == "local":
        return f"local disk ({result['machine'].get('workdir_device', '?')})"
    if kind == "gcs":
        return f"GCS: fake-gcs-server {result['machine'].get('fake_gcs_version', '?')} on 127.0.0.1"
    if kind == "az":
        return "Azure Blob: Azurite on 127.0.0.1"
    return "S3: SeaweedFS on 127.0.0.1"


def throughput_figure(result: dict[str, Any], values: bool = True) -> Any:
    """A matplotlib Figure of a ``python -m bench`` result's throughput; ``values``: print
    each median above its bar."""
    plt = _pyplot()
    summary = report.summarize(result)
    threads = result["params"].get("torch_threads", [])
    worlds = sorted(result.get("worlds", {}), key=int)
    modes = result["params"].get("load_modes", {})
    rows = [(kind, ["save", *(f"load_{m}" for m in modes.get(kind, ["warm"]))])
            for kind in ("local", "s3", "az", "gcs") if summary["throughput"].get(kind)]
    if not rows or not worlds:
        raise ValueError("the results hold no throughput samples")
    ncols = max(len(ops) for _, ops in rows)
    # One panel per (storage kind, operation), each with its own y scale (S3 saves run at
    # a tenth of page-cache loads). Each row's legend goes into its first free slot, or
    # into an extra column when the row has none.
    side = int(any(len(ops) == ncols for _, ops in rows))
    fig, axes = plt.subplots(len(rows), ncols + side, figsize=(3.7 * ncols + 3.2 * side, 3.2 * len(rows) + 0.8),
                             squeeze=False, constrained_layout=True,
                             gridspec_kw={"width_ratios": [1.0] * ncols + [0.95] * side})
    for r, (kind, ops) in enumerate(rows):
        legend: dict[str, Any] = {}
        for c in range(ncols):
            ax = axes[r][c]
            if c >= len(ops):
                ax.axis("off")
                continue
            op = ops[c]
            ymax = 0.0
            for g, world in enumerate(worlds):
                bars = [b for b in _bars(summary, kind, world, threads) if f"{op}_{world}" in b[2]]
                width = 0.8 / max(1, len(bars))
                for i, (role, label, row) in enumerate(bars):
                    cell = row[f"{op}_{world}"]
                    x = g - 0.4 + width * (i + 0.5)
                    many = len(cell["seconds"]) > 1
                    err = [[cell["gbps"] - cell["min_gbps"]], [cell["max_gbps"] - cell["gbps"]]]
                    handle = ax.bar(x, cell["gbps"], width, edgecolor="black", linewidth=0.4,
                                    yerr=err if many else None,
                                    error_kw={"elinewidth": 0.7, "capsize": 1.5}, **STYLE[role])
                    legend.setdefault(label, handle)
                    top = cell["max_gbps"] if many else cell["gbps"]
                    text = f"{cell['gbps']:.2f}" if cell["gbps"] < 10 else f"{cell['gbps']:.1f}"
                    if role == "torch_best":
                        text += f" (t={row['_threads']})"
                    if values:
                        ax.annotate(text, (x, top), xytext=(0, 2), textcoords="offset points",
                                    ha="center", va="bottom", fontsize=6, rotation=90)
                    ymax = max(ymax, top)
            ax.set_xticks(range(len(worlds)), [f"{w} rank{'s' if w != '1' else ''}" for w in worlds])
            ax.set_ylim(0, ymax * 1.3 or 1)
            ax.set_ylabel("GB/s", fontsize=8)
            ax.tick_params(labelsize=8)
            ax.set_title(_panel_title(kind, op), fontsize=8.5)
            ax.grid(axis="y", alpha=0.3)
            ax.set_axisbelow(True)
        for ax in axes[r][len(ops):]:
            ax.axis("off")
        free = axes[r][len(ops)]
        free.legend(list(legend.values()), list(legend), fontsize=7, loc="center left", frameon=False,
                    title=_legend_title(kind, result), title_fontsize=8)
    fig.suptitle(_title(result), fontsize=9)
    return fig


# -- python -m bench.compression ---------------------------------------------------


def _codec_label(codec: str) -> str:
    return codec.replace("dcp_ext zstd-1 + byte grouping, 1 MiB frames", "dcp_ext zstd-1 + byte grouping")


def _system_color(system: str, index: int) -> str:
    """The same colour for a system on local disk and on S3 (S3 bars are hatched)."""
    known = {"dcp_ext": "#1f6fb4", "dcp_ext zstd": "#7fb2de", "torch FileSystemWriter": "#e8873a",
             "torch FileSystemWriter + ZStandard": "#f5c08f"}
    return known.get(system, ["#3a9a4f", "#a0522d", "#b0b0b0"][index % 3])


def compression_figure(result: dict[str, Any]) -> Any:
    """A matplotlib Figure of a ``python -m bench.compression`` result."""
    plt = _pyplot()
    data_sets = list(dict.fromkeys(row["data"] for row in result["codecs"]))
    codecs = list(dict.fromkeys(row["codec"] for row in result["codecs"]))
    by = {(row["data"], row["codec"]): row for row in result["codecs"]}
    colors = ["#1f6fb4", "#7fb2de", "#b0b0b0", "#e8873a", "#3a9a4f", "#a0522d"]
    fig, grid = plt.subplots(2, 2, figsize=(13, 7.5), constrained_layout=True)
    axes = [grid[0][0], grid[0][1], grid[1][0], grid[1][1]]
    width = 0.8 / len(codecs)
    metrics = [("ratio (raw / stored bytes)", lambda r: r["raw"] / r["stored"]),
               ("compress GB/s of raw bytes", lambda r: r["raw"] / r["compress_s"] / 1e9),
               ("decompress GB/s of raw bytes", lambda r: r["raw"] / r["decompress_s"] / 1e9)]
    for ax, (name, value) in zip(axes, metrics):
        for i, codec in enumerate(codecs):
            for g, data in enumerate(data_sets):
                row = by.get((data, codec))
                if row is None:
                    continue
                x = g - 0.4 + width * (i + 0.5)
                v = value(row)
                ax.bar(x, v, width, color=colors[i % len(colors)], edgecolor="black", linewidth=0.4,
                       label=_codec_label(codec) if g == 0 else None)
                ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=6.5, rotation=90)
        ax.set_xticks(range(len(data_sets)), data_sets)
        ax.set_title(f"codec: {name}", fontsize=9)
        ax.margins(y=0.15)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    axes[0].set_ylim(0.9, max(r["raw"] / r["stored"] for r in result["codecs"]) * 1.12)
    axes[1].legend(fontsize=6.5, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    # Save / load throughput of whole checkpoints.
    ax = axes[3]
    ops = list(dict.fromkeys(row["op"] for row in result["save_load"]))
    systems = list(dict.fromkeys((row["storage"], row["system"]) for row in result["save_load"]))
    med = {(row["storage"], row["system"], row["op"]): row for row in result["save_load"]}
    width = 0.8 / len(systems)
    for i, (where, system) in enumerate(systems):
        for g, op in enumerate(ops):
            row = med.get((where, system, op))
            if row is None:
                continue
            x = g - 0.4 + width * (i + 0.5)
            v = row["raw"] / row["median_s"] / 1e9
            ax.bar(x, v, width, color=_system_color(system, i), edgecolor="black", linewidth=0.4,
                   hatch="//" if where == "s3" else None,
                   label=f"{where}: {system} ({row['stored'] / 2**20:.0f} MiB stored)" if op == ops[0] else None)
            ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=6.5, rotation=90)
    ax.set_xticks(range(len(ops)), ops)
    ax.set_ylabel("GB/s of raw bytes")
    ax.set_title(f"save / load of {result['save_load_raw'] / 2**20:.0f} MiB bf16 MiniLM copies "
                 f"(median of {result['repeats']})", fontsize=9)
    ax.margins(y=0.15)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.legend(fontsize=6.5, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    fig.suptitle(f"python -m bench.compression, {result['date']}: {result['cpus']} CPUs, "
                 f"zstandard {result['zstandard']}, torch {result['torch']}; codec timings best of "
                 f"{result['codec_repeats']}", fontsize=9)
    return fig


# -- files -------------------------------------------------------------------------


def figure(result: dict[str, Any]) -> Any:
    """The chart of either kind of results file."""
    if "codecs" in result and "save_load" in result:
        return compression_figure(result)
    return throughput_figure(result)


def write_chart(result: dict[str, Any], png: Path, dpi: int = 110) -> Path:
    """Draw ``result``'s chart into ``png``; raise :class:`ChartUnavailable` without matplotlib."""
    fig = figure(result)
    plt = _pyplot()
    try:
        fig.savefig(png, dpi=dpi)
    finally:
        plt.close(fig)
    return png


def chart_path(results_json: Path) -> Path:
    """Where the chart of a results file goes: next to it, ``.png`` instead of ``.json``."""
    return Path(results_json).with_suffix(".png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chart", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="results JSON files; each chart goes next to its file")
    args = parser.parse_args(argv)
    for name in args.results:
        path = Path(name)
        try:
            png = write_chart(json.loads(path.read_text()), chart_path(path))
        except ChartUnavailable as err:
            print(f"python -m bench.chart: {err}", file=sys.stderr)
            return 1
        print(f"chart written to {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
