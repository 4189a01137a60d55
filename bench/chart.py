"""``python -m bench.chart RESULTS.json ...``: draw the PNG chart of benchmark results next to each file.

The charts are drawn by :mod:`bench.harness.chart` (its docstring says what
each shows); this module is the command, and keeps ``from bench import
chart`` (tutorials/04_compression_and_performance.ipynb) working.
"""

from __future__ import annotations

from bench.harness.chart import (
    ChartUnavailable,
    chart_path,
    compression_figure,
    figure,
    main,
    throughput_figure,
    write_chart,
)

__all__ = ["ChartUnavailable", "chart_path", "compression_figure", "figure", "main", "throughput_figure",
           "write_chart"]

if __name__ == "__main__":
    raise SystemExit(main())
