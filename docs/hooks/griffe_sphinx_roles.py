"""Griffe extension of the docs build: Sphinx markup in dcp_ext's docstrings, as Markdown.

dcp_ext's docstrings are Google style, but cross-references are written as
Sphinx roles (:class:`Store`, :func:`~dcp_ext.verify`, :meth:`CheckpointManager.save`)
and literal blocks are introduced with ``::``. mkdocstrings renders Markdown,
where those would show as ``:class:<code>Store</code>`` and a stray ``::``.
Before any docstring is parsed, this extension turns each role into inline code
that links to the object's page in the API reference when the object is rendered
there under a public path (``dcp_ext.X`` or ``dcp_ext.<public module>.X``), and a
trailing ``::`` into ``:``. Links are "optional" autorefs: a role naming something
that is not rendered (a private helper, an inherited method) stays plain code and
never fails the strict build. The source files are not changed.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

# The public modules rendered in the API reference (docs/hooks/api_pages.py).
PUBLIC_MODULES = ("storage", "metadata", "planners", "layout", "config", "errors")

_ROLE = re.compile(r":(?:py:)?(class|func|meth|mod|attr|data|exc|obj):`(?P<body>[^`]+)`")
_LITERAL = re.compile(r"(?m)^(?P<text>.*\S)?::[ \t]*$")


def _public_names(pkg: griffe.Module) -> dict[str, str]:
    """Short name -> the public identifier it is rendered under."""
    names: dict[str, str] = {}
    for name in pkg.exports or ():
        names[str(name)] = f"{pkg.path}.{name}"
    for module in PUBLIC_MODULES:
        if module not in pkg.members:
            continue
        names.setdefault(module, f"{pkg.path}.{module}")
        for name in pkg[module].exports or ():
            names.setdefault(str(name), f"{pkg.path}.{module}.{name}")
    return names


def _identifier(target: str, pkg_path: str, names: dict[str, str]) -> str | None:
    """The rendered identifier a role target most likely means, or None."""
    parts = [p for p in target.split(".") if p]
    if parts and parts[0] == pkg_path:
        if len(parts) == 1:
            return pkg_path
        if len(parts) >= 2 and parts[1] in PUBLIC_MODULES and len(parts) == 2:
            return f"{pkg_path}.{parts[1]}"
        parts = parts[1:]
    for i, part in enumerate(parts):
        if part in names and part not in PUBLIC_MODULES:
            rest = parts[i + 1:]
            if any(p.startswith("_") for p in rest):
                return None
            return ".".join([names[part], *rest])
    return None


def rewrite(text: str, pkg_path: str, names: dict[str, str]) -> str:
    """``text`` with its Sphinx roles and ``::`` turned into Markdown."""

    def role(match: re.Match[str]) -> str:
        body = match["body"].strip()
        short = body.startswith("~")
        target = body.lstrip("~!").lstrip(".")
        # :func:`title <target>` form
        explicit = re.fullmatch(r"(?P<title>.+?)\s*<(?P<target>[^>]+)>", target)
        if explicit:
            title, target = explicit["title"], explicit["target"]
        else:
            title = target.rsplit(".", 1)[-1] if short else target
        identifier = _identifier(target, pkg_path, names)
        code = f"<code>{title}</code>"
        if identifier is None:
            return code
        return f'<autoref identifier="{identifier}" optional>{code}</autoref>'

    text = _ROLE.sub(role, text)

    def literal(match: re.Match[str]) -> str:
        head = match["text"]
        return "" if head is None else f"{head}:"

    return _LITERAL.sub(literal, text)


class SphinxRoles(griffe.Extension):
    """Rewrite every docstring of the package once it is loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        names = _public_names(pkg)
        seen: set[str] = set()

        def walk(obj: griffe.Object) -> None:
            if obj.path in seen:
                return
            seen.add(obj.path)
            if obj.docstring is not None:
                obj.docstring.value = rewrite(obj.docstring.value, pkg.path, names)
            for member in obj.members.values():
                if not member.is_alias:
                    walk(member)  # type: ignore[arg-type]

        walk(pkg)
