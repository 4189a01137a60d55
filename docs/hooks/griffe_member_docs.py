"""Griffe extension of the docs build: a description for members documented elsewhere.

Three kinds of API entries would show a signature and nothing else, though their
meaning is written down:

* a constant or attribute documented by a ``#:`` comment on the lines above it or
  at the end of its line (the Sphinx convention dcp_ext uses for them), which
  griffe does not read;
* a field or attribute that its class (or module) describes in its docstring's
  ``Attributes:`` or ``Args:`` section, not in a docstring of its own (the
  usual Google style for dataclasses);
* a method that overrides a documented method of a base class
  (``LocalStore.read_file`` implements ``Store.read_file``,
  ``CheckpointWriter.storage_meta`` torch's ``StorageWriter.storage_meta``):
  Python's own ``help()`` shows the base's docstring there
  (``inspect.getdoc``), the generator did not.

After the package is loaded, this extension gives each such member (one that
has no docstring of its own) its ``#:`` comment, else the description from its
class's section, else the docstring of the nearest base-class member of the
same name: in dcp_ext as griffe sees it, else (a base from torch or another
package griffe does not load) from the class as the build has imported it, as
``inspect.getdoc`` finds it. A member with a docstring of its own keeps it.
The source files are not changed. It runs before ``griffe_sphinx_roles``
(mkdocs.yml lists it first), which then rewrites the Sphinx roles of what was
copied, as of any docstring.

``docs/hooks/api_coverage.py`` counts the entries of the built API pages that
are still without a description.
"""

from __future__ import annotations

import inspect
import logging
import sys
from typing import Any

import griffe

_SECTIONS = (
    griffe.DocstringSectionKind.attributes,
    griffe.DocstringSectionKind.parameters,
    griffe.DocstringSectionKind.other_parameters,
)


def _documented(obj: griffe.Object | griffe.Alias) -> bool:
    return obj.docstring is not None and bool(obj.docstring.value.strip())


def _drop(record: logging.LogRecord) -> bool:
    return False


def _described(owner: griffe.Object) -> dict[str, str]:
    """``{name: description}`` of the owner's docstring sections that describe its members."""
    if not _documented(owner):
        return {}
    assert owner.docstring is not None
    # Parsed again (and warned about) when the page is rendered: quiet here. griffe's
    # logger is mkdocstrings' adapter in a build, a plain logger elsewhere.
    target = griffe.logger._logger
    target = getattr(target, "logger", target)
    target.addFilter(_drop)
    try:
        sections = owner.docstring.parse()
    finally:
        target.removeFilter(_drop)
    out: dict[str, str] = {}
    for kind in _SECTIONS:  # Attributes first: they describe the member itself
        for section in sections:
            if section.kind is kind:
                for item in section.value:
                    name, text = getattr(item, "name", ""), getattr(item, "description", "")
                    if name and text and text.strip():
                        out.setdefault(name, text)
    return out


def _doc_comment(member: griffe.Object) -> str:
    """The ``#:`` comment block right above ``member``'s first line, or at the end of that line
    (Sphinx's attribute doc comments)."""
    if member.lineno is None or member.filepath is None or isinstance(member.filepath, list):
        return ""
    try:
        lines = member.lines_collection[member.filepath]
    except KeyError:
        return ""
    block: list[str] = []
    index = member.lineno - 2  # the line above, 0-based
    while index >= 0 and lines[index].lstrip().startswith("#:"):
        block.insert(0, lines[index].lstrip()[2:].removeprefix(" "))
        index -= 1
    if not block and member.is_attribute:  # ``x = 1  #: what x is``, on the line itself
        _, mark, text = lines[member.lineno - 1].partition("  #: ")
        if mark:
            block.append(text)
    return "\n".join(block).strip()


def _runtime_doc(owner: griffe.Object, name: str) -> str:
    """The docstring ``inspect.getdoc`` finds for a method or property ``name`` of ``owner``
    in a base class; empty if nothing is found or ``owner``'s module is not imported yet.

    Only modules the build imported already are read (``api_pages`` imports dcp_ext and its
    public modules): importing a framework adapter here would import the framework.
    """
    module = sys.modules.get(owner.module.path)
    cls = getattr(module, owner.name, None) if module is not None else None
    if not inspect.isclass(cls):
        return ""
    for base in getattr(cls, "__mro__", ())[1:]:
        raw = vars(base).get(name)
        if raw is None:
            continue
        if isinstance(raw, (classmethod, staticmethod)):
            raw = raw.__func__
        if not isinstance(raw, property) and not inspect.isfunction(raw):
            return ""  # a data attribute: its type's docstring says nothing of it
        paragraphs = inspect.cleandoc(raw.__doc__ or "").split("\n\n")
        return "\n\n".join(p for p in paragraphs if not p.startswith("TODO"))  # torch's notes to itself
    return ""


def _give(member: griffe.Object, text: str, like: griffe.Docstring) -> None:
    member.docstring = griffe.Docstring(
        text, parent=member, parser=like.parser, parser_options=like.parser_options,
    )


class MemberDocs(griffe.Extension):
    """Describe undocumented members from their owner's docstring or their base class."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        owners: list[griffe.Object] = []
        seen: set[str] = set()

        def walk(obj: griffe.Object) -> None:
            if obj.path in seen:
                return
            seen.add(obj.path)
            if obj.is_class or obj.is_module:
                owners.append(obj)
            for member in obj.members.values():
                if not member.is_alias:
                    walk(member)  # type: ignore[arg-type]

        walk(pkg)
        like = pkg.docstring
        # 1. From a ``#:`` comment above or beside the member.
        for owner in owners:
            for member in owner.members.values():
                if member.is_alias or _documented(member) or like is None:
                    continue
                comment = _doc_comment(member)  # type: ignore[arg-type]
                if comment:
                    _give(member, comment, like)  # type: ignore[arg-type]
        # 2. From the owner's Attributes / Args sections.
        for owner in owners:
            described = _described(owner)
            for name, member in owner.members.items():
                if member.is_alias or _documented(member) or name not in described:
                    continue
                assert owner.docstring is not None
                _give(member, described[name], owner.docstring)  # type: ignore[arg-type]
        # 3. From the nearest documented member of the same name in a base class.
        for owner in owners:
            if not owner.is_class:
                continue
            try:
                bases = owner.mro()  # type: ignore[attr-defined]
            except Exception:  # an inheritance cycle griffe cannot linearize
                continue
            for name, member in owner.members.items():
                if member.is_alias or _documented(member):
                    continue
                for base in bases:
                    inherited = base.members.get(name)
                    if inherited is not None and not inherited.is_alias and _documented(inherited):
                        _give(member, inherited.docstring.value, inherited.docstring)  # type: ignore[arg-type, union-attr]
                        break
        # 4. From a base class griffe did not load (torch's ``StorageWriter``...), at run time.
        for owner in owners:
            if not owner.is_class or like is None:
                continue
            for name, member in owner.members.items():
                if member.is_alias or _documented(member) or not (member.is_function or "property" in member.labels):
                    continue
                doc = _runtime_doc(owner, name)
                if doc:
                    _give(member, doc, like)  # type: ignore[arg-type]
