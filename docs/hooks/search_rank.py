"""Rank the built site's pages for search queries exactly as the site's search box does.

mkdocs-material searches in a web worker (``assets/javascripts/workers/search.*.min.js``):
lunr over ``search/search_index.json`` (title boost 1000, each section's ``boost``), then
material's own re-scoring and grouping of sections by page. This script runs that same
worker file under node, feeds it the built index and prints, for each query, the pages in
the order the search box lists them, with their best section's score and the page's boost.

Usage (after ``mkdocs build``; needs ``node``)::

    .venv/bin/python docs/hooks/search_rank.py [--site SITE_DIR] [--top N]
        [--expect QUERY=PREFIX ...] [QUERY ...]

Default queries: ``S3`` and ``safetensors export`` (issue 43). ``--expect "S3=guides/"``
fails (exit 1) unless the first page for ``S3`` whose path starts with ``guides/`` is
listed above every ``benchmarks/`` page. Without node it prints the boost of each page
in the index instead (what ``docs/hooks/site.py`` applied) and exits 2.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Loads material's search worker in a sandbox with the message API it expects, sets it up
#: with the index (as the page does: ``{config, docs, options}``) and asks each query.
_HARNESS = r"""
const fs = require("fs"), path = require("path"), vm = require("vm");
const [site, ...queries] = process.argv.slice(2);
const dir = path.join(site, "assets/javascripts/workers");
const worker = fs.readdirSync(dir).find(f => /^search\..*\.min\.js$/.test(f));
let listener = null; const posted = [];
const ctx = { console, setTimeout, clearTimeout };
ctx.self = ctx; ctx.globalThis = ctx;
ctx.addEventListener = (type, fn) => { if (type === "message") listener = fn; };
ctx.postMessage = msg => posted.push(msg);
vm.createContext(ctx);
vm.runInContext(fs.readFileSync(path.join(dir, worker), "utf8"), ctx);
const index = JSON.parse(fs.readFileSync(path.join(site, "search/search_index.json"), "utf8"));
(async () => {
  // SearchMessageType: SETUP 0, READY 1, QUERY 2, RESULT 3
  await listener({ data: { type: 0, data: { ...index, options: { suggest: false } } } });
  const out = {};
  for (const q of queries) {
    posted.length = 0;
    await listener({ data: { type: 2, data: q } });
    const result = posted.find(m => m.type === 3);
    out[q] = result.data.items.map(group => ({
      page: group[0].location.split("#")[0],
      score: Math.max(...group.map(item => item.score)),
    }));
  }
  process.stdout.write(JSON.stringify(out));
})().catch(err => { console.error(err); process.exit(1); });
"""


def boosts(site: Path) -> dict[str, float]:
    """The ``boost`` of each page in the built index (1.0: none)."""
    index = json.loads((site / "search" / "search_index.json").read_text(encoding="utf-8"))
    out: dict[str, float] = defaultdict(lambda: 1.0)
    for doc in index["docs"]:
        out[doc["location"].split("#")[0]] = float(doc.get("boost", 1.0))
    return out


def rank(site: Path, queries: list[str]) -> dict[str, list[dict[str, object]]]:
    """``{query: [{page, score}, ...]}`` in the search box's order (needs node)."""
    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        raise FileNotFoundError("node")
    with tempfile.NamedTemporaryFile("w", suffix=".js", delete=False) as f:
        f.write(_HARNESS)
    try:
        done = subprocess.run([node, f.name, str(site), *queries], capture_output=True, text=True,
                              timeout=120, check=True)
    finally:
        Path(f.name).unlink()
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("queries", nargs="*", default=["S3", "safetensors export"])
    parser.add_argument("--site", default=str(ROOT / "site"))
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--expect", action="append", default=[], metavar="QUERY=PREFIX",
                        help="the first PREFIX page must rank above every benchmarks/ page")
    args = parser.parse_args(argv)
    site = Path(args.site)
    expectations = [e.split("=", 1) for e in args.expect]
    queries = list(dict.fromkeys([*args.queries, *(q for q, _ in expectations)]))
    weights = boosts(site)
    try:
        ranked = rank(site, queries)
    except FileNotFoundError:
        print("node not found: the boosts in the index instead", file=sys.stderr)
        for page, boost in sorted(weights.items()):
            if boost != 1.0:
                print(f"  boost {boost:g}  {page}")
        return 2
    for query in queries:
        print(f"{query!r}:")
        for n, hit in enumerate(ranked[query][: args.top], 1):
            print(f"  {n:2}. {hit['score']:10.1f}  boost {weights[str(hit['page'])]:g}  {hit['page']}")
    failed = False
    for query, prefix in expectations:
        pages = [str(hit["page"]) for hit in ranked[query]]
        first = next((i for i, p in enumerate(pages) if p.startswith(prefix)), None)
        bench = next((i for i, p in enumerate(pages) if p.startswith("benchmarks/")), None)
        ok = first is not None and (bench is None or first < bench)
        failed |= not ok
        print(f"expect {query!r}: a {prefix} page above the benchmark pages: {'ok' if ok else 'NO'}"
              f" ({prefix} at {None if first is None else first + 1}, first benchmark at"
              f" {None if bench is None else bench + 1})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
