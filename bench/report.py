"""The harness's results report under the name tutorials/04 imports (``from bench import chart, report``).

Medians, ratios, target verdicts and markdown of a ``python -m bench``
result live in :mod:`bench.harness.report`, which suites import; this module
only keeps the tutorial's ``report.summarize`` working.
"""

from __future__ import annotations

from bench.harness.report import publish, render, summarize, update_readme

__all__ = ["publish", "render", "summarize", "update_readme"]
