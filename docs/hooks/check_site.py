"""Check every relative link and anchor of the built documentation site.

``mkdocs build --strict`` validates the links of the Markdown pages, but not
what is only in the HTML: the API pages mkdocstrings renders, the notebooks
mkdocs-jupyter renders (with their own tables of contents), the benchmark
tables the hooks generate. This script reads the built site instead: it parses
every HTML page, follows every relative ``href`` / ``src`` (``<a>``, ``<link>``,
``<img>``, ``<script>``, ``<source>``, ``<iframe>``), and checks that the target
file exists and, for ``#anchor``, that the target page has an element with that
``id`` (or an ``<a name=...>``). External URLs (with a scheme, ``//host``,
``mailto:``, ``data:``, ``javascript:``) are not fetched.

Usage (after ``mkdocs build --strict``; ``.ci/run`` runs it)::

    .venv/bin/python docs/hooks/check_site.py [SITE_DIR]

SITE_DIR defaults to ``site`` (``site_dir`` in mkdocs.yml). It prints each
broken link or anchor with the page it is on, a summary, and exits 1 if any.

It lives in docs/hooks/ with the scripts that generate the pages it checks;
mkdocs.yml excludes that directory from the site and loads only the hooks it
names, so this file is neither a page nor a hook.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlsplit

ROOT = Path(__file__).resolve().parents[2]

#: Attributes that point at another file, by tag.
LINK_ATTRS = {"a": "href", "link": "href", "img": "src", "script": "src", "source": "src", "iframe": "src"}


class _Page(HTMLParser):
    """The ids and the outgoing links of one HTML page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[tuple[str, str]] = []  # (tag, url)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if values.get("id"):
            self.ids.add(str(values["id"]))
        if tag == "a" and values.get("name"):
            self.ids.add(str(values["name"]))
        attr = LINK_ATTRS.get(tag)
        if attr and values.get(attr) is not None:
            self.links.append((tag, str(values[attr])))

    handle_startendtag = handle_starttag


@dataclass(frozen=True)
class Problem:
    page: str  # the page the link is on, relative to the site
    url: str  # the link as written
    kind: str  # "link" (no such file) or "anchor" (no such id in the file)
    target: str  # the file it resolves to, relative to the site


def _external(url: str) -> bool:
    parts = urlsplit(url)
    return bool(parts.scheme or parts.netloc) or url.startswith("//")


def _resolve(site: Path, page: Path, path: str) -> Path:
    """The file a link's path names, as a static web server would serve it."""
    base = site if path.startswith("/") else page.parent
    target = (base / unquote(path).lstrip("/")) if path else page
    if path.endswith("/") or target.is_dir():
        target = target / "index.html"
    return target


def check(site: Path) -> tuple[list[Problem], int, int]:
    """Every broken link and anchor of the site; also how many pages and links were checked."""
    site = site.resolve()
    pages: dict[Path, _Page] = {}
    for html in sorted(site.rglob("*.html")):
        parser = _Page()
        parser.feed(html.read_text(encoding="utf-8", errors="replace"))
        pages[html.resolve()] = parser
    problems: list[Problem] = []
    checked = 0
    for html, parsed in pages.items():
        rel_page = html.relative_to(site).as_posix()
        for _tag, url in parsed.links:
            url = url.strip()
            if not url or _external(url):
                continue
            checked += 1
            parts = urlsplit(url)
            target = _resolve(site, html, parts.path)
            try:
                rel_target = PurePosixPath(target.resolve().relative_to(site)).as_posix()
            except ValueError:  # outside the site
                problems.append(Problem(rel_page, url, "link", str(target)))
                continue
            if not target.is_file():
                problems.append(Problem(rel_page, url, "link", rel_target))
                continue
            fragment = unquote(parts.fragment)
            if not fragment or target.suffix != ".html":
                continue
            target_page = pages.get(target.resolve())
            if target_page is None or fragment not in target_page.ids:
                problems.append(Problem(rel_page, url, "anchor", rel_target))
    return problems, len(pages), checked


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", nargs="?", default=str(ROOT / "site"), help="the built site (default: site/)")
    args = parser.parse_args(argv)
    site = Path(args.site)
    if not (site / "index.html").is_file():
        print(f"{site}: no index.html; build the site first (mkdocs build --strict)", file=sys.stderr)
        return 2
    problems, n_pages, n_links = check(site)
    by_page: dict[str, list[Problem]] = defaultdict(list)
    for p in problems:
        by_page[p.page].append(p)
    for page, found in by_page.items():
        for p in found:
            what = "no such file" if p.kind == "link" else f"no id '{unquote(urlsplit(p.url).fragment)}' in"
            print(f"{page}: broken {p.kind} {p.url!r} ({what} {p.target})")
    links = [p for p in problems if p.kind == "link"]
    anchors = [p for p in problems if p.kind == "anchor"]
    distinct_links = {p.target for p in links}
    distinct_anchors = {(p.target, unquote(urlsplit(p.url).fragment)) for p in anchors}
    print(f"check_site: {n_pages} pages, {n_links} relative links: {len(links)} broken links "
          f"({len(distinct_links)} distinct), {len(anchors)} broken anchors ({len(distinct_anchors)} distinct)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
