"""MkDocs hooks of the dcp_ext documentation site (``hooks:`` in mkdocs.yml).

What the build adds to the Markdown files in docs/:

* the API reference pages, generated from the public names (``api_pages.py``);
* the notebooks of ``tutorials/`` and its README, served from where they are
  (rendered by mkdocs-jupyter with their stored outputs, never executed);
* benchmark tables and charts, generated from ``bench/results/*.json``
  (``bench_pages.py``) where a page has ``<!-- bench:SUITE -->``;
* blocks of the repository's README.md where a page has
  ``<!-- readme:NAME -->`` (the ``<!-- NAME -->`` ... ``<!-- /NAME -->`` block,
  verbatim: the set-up commands stay the ones CI runs);
* the repository's ARCHITECTURE.md, when it exists, in place of the text between
  ``<!-- include:ARCHITECTURE.md -->`` and ``<!-- /include:ARCHITECTURE.md -->``;
* a search boost for each part of the site (:data:`SEARCH_BOOST`): the guides
  rank above the benchmark pages that mention the same words (issue 43: "S3"
  and "safetensors export" found benchmark pages first);
* on the notebooks' pages, a table of contents that matches the headings
  (mkdocs-jupyter builds it from the Markdown with inline code removed, so a
  heading holding code got a cut title and an anchor no heading has), and
  links that work on the site (a notebook links to repository files relative
  to tutorials/: a page of the site becomes a link to that page, any other
  file its path as code, as ARCHITECTURE.md's links are).

Anything missing (a README block, a results file, a renderer that fails on
its JSON) is logged as a warning, so ``mkdocs build --strict`` fails on it.
"""

from __future__ import annotations

import html as html_lib
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page
from mkdocs.structure.toc import AnchorLink
from mkdocs.utils import get_relative_url

HOOKS = Path(__file__).resolve().parent
ROOT = HOOKS.parents[1]
RESULTS = ROOT / "bench" / "results"
ARCHITECTURE = ROOT / "ARCHITECTURE.md"

for _path in (str(ROOT), str(HOOKS)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import api_pages  # noqa: E402
import bench_pages  # noqa: E402

log = logging.getLogger("mkdocs.plugins.dcp_ext")

_BENCH = re.compile(r"<!-- bench:(?P<slug>[\w-]+) -->")
_README = re.compile(r"<!-- readme:(?P<name>[\w:.-]+) -->")
_INCLUDE = re.compile(r"<!-- include:ARCHITECTURE\.md -->\n.*?<!-- /include:ARCHITECTURE\.md -->", re.S)
_LINK = re.compile(r"(?P<bang>!?)\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?P<title>\s+\"[^\"]*\")?\)")

_state: dict[str, Any] = {}

#: mkdocs-material's ``search: boost:`` of the pages under each docs path (a page's own front
#: matter wins): lunr multiplies a section's score by it. The guides are what a search should
#: find first; the benchmark pages repeat every feature's name in their titles and tables, so
#: without this "safetensors export" found two benchmark pages before the Hugging Face guide.
#: Check with ``docs/hooks/search_rank.py`` (material's own search, run on the built index).
SEARCH_BOOST: dict[str, float] = {
    "guides/": 2.0,
    "getting-started.md": 2.0,
    "benchmarks/": 0.5,
}


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    # mkdocs restores sys.path after loading a hook; bench.* and dcp_ext are imported later.
    for path in (str(ROOT), str(HOOKS)):
        if path not in sys.path:
            sys.path.insert(0, path)
    # The API section of the navigation comes from api_pages (one entry per page).
    for item in config.nav or []:
        if isinstance(item, dict) and "API reference" in item:
            item["API reference"] = api_pages.nav()
    return config


@event_priority(50)  # before mkdocs-jupyter's on_files, which must see the notebooks
def on_files(files: Files, config: MkDocsConfig) -> Files:
    # Tutorials: the notebooks and their README, from tutorials/ itself.
    tutorials = ROOT / "tutorials"
    for path in sorted(tutorials.glob("*.ipynb")) + [tutorials / "README.md"]:
        if path.exists():
            files.append(File(f"tutorials/{path.name}", src_dir=str(ROOT), dest_dir=config.site_dir,
                              use_directory_urls=config.use_directory_urls))
    # API reference.
    pages = api_pages.build()
    for path, text in pages.items():
        files.append(File.generated(config, path, content=text))
    if "api/other.md" in pages:
        for item in config.nav or []:
            if isinstance(item, dict) and "API reference" in item:
                item["API reference"].append({api_pages.OTHER.title: "api/other.md"})
    # Benchmarks: every suite's tables now, so that its charts are files of the site.
    ctx = bench_pages.Context()
    rendered: dict[str, str] = {}
    for suite in bench_pages.SUITES:
        try:
            rendered[suite.slug] = bench_pages.render(suite.slug, RESULTS, ctx)
        except Exception as err:  # a results file its renderer no longer reads
            log.warning("benchmark '%s' could not be rendered from %s: %s: %s",
                        suite.slug, RESULTS, type(err).__name__, err)
            rendered[suite.slug] = f'!!! failure\n    `{suite.command}`: no table ({type(err).__name__}: {err})\n'
    for special, fn in (("headline", bench_pages.headline), ("suites", bench_pages.suites_table)):
        try:
            rendered[special] = fn(RESULTS)
        except Exception as err:
            log.warning("benchmark %s table could not be generated: %s: %s", special, type(err).__name__, err)
            rendered[special] = ""
    for path, png in ctx.charts.items():
        files.append(File.generated(config, path, content=png))
    _state["bench"] = rendered
    # Images ARCHITECTURE.md shows, served from where they are in the repository.
    if ARCHITECTURE.exists():
        for match in _LINK.finditer(ARCHITECTURE.read_text(encoding="utf-8")):
            target = match["target"].split("#", 1)[0]
            if match["bang"] and _is_relative(target) and (ROOT / target).is_file() and not files.get_file_from_path(target):
                files.append(File(target, src_dir=str(ROOT), dest_dir=config.site_dir,
                                  use_directory_urls=config.use_directory_urls))
    return files


def _is_relative(target: str) -> bool:
    return bool(target) and "://" not in target and not target.startswith(("#", "/", "mailto:"))


def _readme_block(name: str, page: Page) -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(rf"<!-- {re.escape(name)} -->\n(?P<body>.*?)<!-- /{re.escape(name)} -->", text, re.S)
    if not match:
        log.warning("%s: README.md has no <!-- %s --> block to include", page.file.src_uri, name)
        return f"(README.md has no `{name}` block)"
    return match["body"].rstrip("\n")


def _architecture(files: Files) -> str:
    """ARCHITECTURE.md made to fit the page: its title dropped (the page has one), headings
    nested under the page's, links to repository files as code (they are not pages)."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    lines = text.splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    fence = False
    nested: list[str] = []
    deeper = any(line.startswith("# ") for line in lines)
    for line in lines:
        if line.lstrip().startswith(("```", "~~~")):
            fence = not fence
        if not fence and deeper and re.match(r"#{1,5} ", line):
            line = "#" + line
        nested.append(line)
    body = "\n".join(nested)

    def link(match: re.Match[str]) -> str:
        target = match["target"]
        path = target.split("#", 1)[0]
        if not _is_relative(target) or (path and files.get_file_from_path(path)):
            return match[0]
        if not path:  # an anchor of ARCHITECTURE.md itself: kept if the heading exists
            return match[0]
        text = match["text"]
        if match["bang"]:
            return f"*{text or path}*"
        return text if "`" in text or text == path else f"{text} (`{path}`)"

    return _LINK.sub(link, body)


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    rendered: dict[str, str] = _state.get("bench", {})

    def bench(match: re.Match[str]) -> str:
        slug = match["slug"]
        if slug not in rendered:
            log.warning("%s: unknown benchmark marker '%s' (known: %s)", page.file.src_uri, slug,
                        ", ".join(sorted(rendered)))
            return ""
        return rendered[slug]

    for prefix, boost in SEARCH_BOOST.items():
        if page.file.src_uri.startswith(prefix):
            search = page.meta.setdefault("search", {})
            if isinstance(search, dict):
                search.setdefault("boost", boost)
            break
    markdown = _BENCH.sub(bench, markdown)
    markdown = _README.sub(lambda m: _readme_block(m["name"], page), markdown)
    if ARCHITECTURE.exists() and "<!-- include:ARCHITECTURE.md -->" in markdown:
        content = _architecture(files)
        markdown = _INCLUDE.sub(lambda m: "<!-- from ARCHITECTURE.md -->\n" + content + "\n", markdown)
    return markdown


# The notebooks' pages (mkdocs-jupyter): table of contents and links.

_HEADING = re.compile(r'<h(?P<level>[1-6])\b[^>]*?\bid="(?P<id>[^"]*)"[^>]*>(?P<body>.*?)</h(?P=level)>', re.S)
_ANCHOR_LINK = re.compile(r'<a\b[^>]*\bclass="anchor-link"[^>]*>.*?</a>', re.S)
_CODE = re.compile(r"<code\b[^>]*>.*?</code>", re.S)
_TAG = re.compile(r"<[^>]+>")
_HREF = re.compile(r'<a href="(?P<href>[^"]*)">(?P<text>.*?)</a>', re.S)


def _toc_slug(text: str) -> str:
    """The anchor Python-Markdown's toc extension gives a heading's text (its default slugify)."""
    from markdown.extensions.toc import slugify

    return str(slugify(text, "-"))


def _notebook_toc(html: str, page: Page) -> None:
    """Give each entry of a notebook's table of contents the id and the title of its heading.

    mkdocs-jupyter makes the entries from the notebook's Markdown with inline code
    removed (``## 2. Save with `dcp.save` `` -> ``2-save-with``) while nbconvert's
    heading ids keep the code's text (``2-save-with-dcpsave``): the entries are
    matched to the headings in order, by level and by their code-less text.
    """
    headings = [
        (int(m["level"]), m["id"], _ANCHOR_LINK.sub("", m["body"])) for m in _HEADING.finditer(html)
    ]
    position = 0

    def fix(items: list[AnchorLink]) -> None:
        nonlocal position
        for item in items:
            for i in range(position, len(headings)):
                level, ident, body = headings[i]
                if level != item.level:
                    continue
                codeless = _toc_slug(html_lib.unescape(_TAG.sub("", _CODE.sub("", body))))
                if ident == item.id or re.sub(r"_\d+$", "", item.id) == codeless:
                    item.id = ident
                    item.title = _TAG.sub("", body).strip()
                    position = i + 1
                    break
            else:
                log.warning("%s: table-of-contents entry '%s' (#%s) matches no heading",
                            page.file.src_uri, item.title, item.id)
            fix(item.children)

    fix(list(page.toc))


def _notebook_links(html: str, page: Page, files: Files) -> str:
    """A notebook's relative links, made to work on the site.

    A notebook links to repository files relative to its own directory (right in
    Jupyter and on a code host). A link to a file that is also on the site (a page
    of docs/, another notebook) becomes a link to it; a link to any other file of
    the repository becomes its path as code, as links of ARCHITECTURE.md do; a link
    to nothing is a warning, so the strict build fails on it.
    """
    source_dir = Path(page.file.abs_src_path or "").parent
    docs_dir = ROOT / "docs"

    def link(match: re.Match[str]) -> str:
        href, text = html_lib.unescape(match["href"]), match["text"]
        if not _is_relative(href):
            return match[0]
        path, _, fragment = href.partition("#")
        target = Path(os.path.normpath(source_dir / path))
        try:
            repo_path = target.relative_to(ROOT).as_posix()
        except ValueError:
            log.warning("%s: link '%s' leaves the repository", page.file.src_uri, href)
            return match[0]
        site_path = target.relative_to(docs_dir).as_posix() if target.is_relative_to(docs_dir) else repo_path
        file = files.get_file_from_path(site_path)
        if file is not None and file.url is not None:
            url = get_relative_url(file.url, page.url) + (f"#{fragment}" if fragment else "")
            return f'<a href="{html_lib.escape(url)}">{text}</a>'
        if not target.exists():
            log.warning("%s: link '%s' names no file of the repository (%s)", page.file.src_uri, href, repo_path)
            return match[0]
        code = f"<code>{html_lib.escape(repo_path)}</code>"
        plain = html_lib.unescape(_TAG.sub("", text)).strip()
        return code if plain in (repo_path, path) else f"{text} ({code})"

    return _HREF.sub(link, html)


def on_page_content(html: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    if page.file.src_uri.endswith(".ipynb"):
        _notebook_toc(html, page)
        html = _notebook_links(html, page, files)
    return html
