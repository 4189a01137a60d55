"""Count the API reference entries that show a signature and no description.

Reads the built site's API pages (``site/api/*/index.html``, rendered by
mkdocstrings from the docstrings): an entry is a ``div.doc-object`` (module,
class, function, method, attribute); it has a description when its
``div.doc-contents``, less the entries nested in it, the class's "Bases:" line
and the summary tables of its members (Classes / Functions / Methods), has any
text left.

Usage (after ``mkdocs build``)::

    .venv/bin/python docs/hooks/api_coverage.py [SITE_DIR] [--list] [--max N]

prints the count per page and in all; ``--list`` names every undocumented
entry; ``--max N`` exits 1 when more than N are undocumented. It needs
BeautifulSoup, which the ``docs`` extra brings (through mkdocs-jupyter).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bs4 import BeautifulSoup, Tag

ROOT = Path(__file__).resolve().parents[2]
#: Section titles of mkdocstrings' member summaries (``summary:`` in mkdocs.yml), not docstring text.
SUMMARY_TITLES = {"Classes:", "Functions:", "Methods:", "Modules:"}


def _own_contents(obj: Tag) -> Tag | None:
    for child in obj.find_all("div", recursive=False):
        if "doc-contents" in (child.get("class") or []):
            return child
    return None


def _has_description(contents: Tag) -> bool:
    contents = BeautifulSoup(str(contents), "html.parser")
    for div in contents.select("div.doc-children, div.doc-object"):
        div.decompose()
    for bases in contents.select(".doc-class-bases"):
        bases.decompose()
    for title in contents.select("span.doc-section-title"):
        if title.get_text(strip=True) in SUMMARY_TITLES:
            paragraph = title.find_parent("p")
            table = paragraph.find_next_sibling("table") if paragraph else None
            if table is not None:
                table.decompose()
            (paragraph or title).decompose()
    return bool(contents.get_text(strip=True))


def undocumented(site: Path) -> dict[str, list[str]]:
    """``{API page: [identifiers of the entries without a description]}``."""
    out: dict[str, list[str]] = {}
    for page in sorted((site / "api").glob("*/index.html")):
        soup = BeautifulSoup(page.read_text(encoding="utf-8"), "html.parser")
        missing: list[str] = []
        for obj in soup.select("div.doc-object"):
            heading = obj.find(["h1", "h2", "h3", "h4", "h5", "h6"], class_="doc-heading")
            contents = _own_contents(obj)
            if heading is None or contents is None:
                continue
            if not _has_description(contents):
                missing.append(str(heading.get("id") or heading.get_text(strip=True)))
        out[page.parent.name] = missing
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", nargs="?", default=str(ROOT / "site"))
    parser.add_argument("--list", action="store_true", help="name every undocumented entry")
    parser.add_argument("--max", type=int, default=None, help="fail when more are undocumented")
    args = parser.parse_args(argv)
    found = undocumented(Path(args.site))
    if not found:
        print(f"{args.site}: no API pages; build the site first", file=sys.stderr)
        return 2
    total = 0
    for page, names in found.items():
        total += len(names)
        if names:
            print(f"api/{page}: {len(names)} without description")
            if args.list:
                for name in names:
                    print(f"    {name}")
    print(f"api_coverage: {total} API entries without description")
    return 1 if args.max is not None and total > args.max else 0


if __name__ == "__main__":
    sys.exit(main())
