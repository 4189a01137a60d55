"""Every tutorial notebook runs top to bottom in a fresh kernel (nbclient).

The notebooks check their own results with ``assert`` (bit-exact loads,
files present, ratios in range), so a notebook that runs is a notebook whose
claims held. A notebook without any ``assert`` fails here: it could not fail.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import multiprocessing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("tutorials_run", ROOT / "tutorials" / "run.py")
assert _spec and _spec.loader
run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run)

NOTEBOOKS = run.notebooks()
#: Slowest first (measured here), so the two at a time finish close together.
_SLOWEST_FIRST = ["02", "04", "03", "05", "06", "01"]
#: The notebooks in the order they run, which is also the order of their
#: tests: each test waits for its own notebook only, so ``--durations``
#: shows what each one adds (the first test also waits for the kernels'
#: start, the last for the end of the notebook beside it).
IN_RUN_ORDER = sorted(NOTEBOOKS, key=lambda p: next((i for i, k in enumerate(_SLOWEST_FIRST) if p.name.startswith(k)), 99))


def _execute(path: str) -> Any:
    """(a pool process) Run one notebook; its executed cells."""
    return run.execute(Path(path))


@pytest.fixture(scope="module")
def executed() -> Iterator[dict[str, concurrent.futures.Future[Any]]]:
    """Every notebook, two at a time, each in its own process and kernel.

    A notebook spends much of its time waiting (kernel start, imports,
    subprocesses, rendezvous), so two at a time take ~40% less wall time
    on 2 cores than one after another.
    """
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield {p.stem: pool.submit(_execute, str(p)) for p in IN_RUN_ORDER}


def test_the_six_tutorials_are_there() -> None:
    names = [p.stem for p in NOTEBOOKS]
    assert len(names) == 6, names


@pytest.mark.parametrize("path", IN_RUN_ORDER, ids=lambda p: p.stem)
def test_tutorial_runs(path: Path, executed: dict[str, concurrent.futures.Future[Any]]) -> None:
    notebook = executed[path.stem].result()
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert any("assert " in c.source for c in code), f"{path.name} checks nothing"
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
