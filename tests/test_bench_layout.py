"""bench/'s import rule (issue 33): ``bench.cli`` imports suites, suites import ``bench.harness``.

Read from the source with ``ast``, nothing imported: the module import graph of
bench/ (module-level and function-level imports, relative ones resolved, and
the ``"bench.module:function"`` targets that ``run_world`` imports by name)
has no cycle, no module imports ``bench.cli`` (only ``bench/__main__.py``,
which is ``python -m bench``), and no harness module imports a bench module
outside the harness.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
#: ``run_world(n, "bench.harness.worker:throughput", ...)`` imports its module by name.
_TARGET = re.compile(r"^(bench(?:\.\w+)+):\w+$")


def bench_modules(bench: Path) -> dict[str, Path]:
    """Every module under ``bench`` by dotted name (a package by its ``__init__``)."""
    modules = {}
    for path in sorted(bench.rglob("*.py")):
        parts = list(path.relative_to(bench.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _longest_module(name: str, modules: dict[str, Path]) -> str | None:
    """``name`` or its longest prefix that is a bench module (``a.b.c`` -> ``a.b``)."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The bench modules that module ``name`` (at ``path``) imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            targets = [base]
            # `from bench.harness import report` imports the module bench.harness.report.
            targets += [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = _TARGET.match(node.value)
            targets = [match.group(1)] if match else []
        for target in targets:
            module = _longest_module(target, modules) if target.split(".")[0] == "bench" else None
            if module is not None and module != name:
                found.add(module)
    return found


def import_graph(bench: Path) -> dict[str, set[str]]:
    modules = bench_modules(bench)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def cli_importers(graph: dict[str, set[str]]) -> list[str]:
    return sorted(name for name, deps in graph.items() if "bench.cli" in deps and name != "bench.__main__")


def harness_reaching_out(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Harness modules that import a bench module outside the harness (the package ``bench`` aside)."""
    inside = ("bench.harness", "bench")
    out = {}
    for name, deps in graph.items():
        if name == "bench.harness" or name.startswith("bench.harness."):
            outside = sorted(d for d in deps if d not in inside and not d.startswith("bench.harness."))
            if outside:
                out[name] = outside
    return out


def test_the_graph_sees_bench() -> None:
    graph = import_graph(BENCH)
    assert {"bench.cli", "bench.harness.machine", "bench.scale.simulator"} <= graph.keys()
    assert "bench.harness.worker" in graph["bench.cli"]  # the run_world target string
    assert "bench.replicated" in graph["bench.cli"]


def test_bench_has_no_import_cycle() -> None:
    assert cycles(import_graph(BENCH)) == []


def test_nothing_imports_bench_cli() -> None:
    assert cli_importers(import_graph(BENCH)) == []


def test_the_harness_imports_no_suite() -> None:
    assert harness_reaching_out(import_graph(BENCH)) == {}
