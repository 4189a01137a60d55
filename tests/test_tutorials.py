"""Every tutorial notebook runs top to bottom in a fresh kernel (nbclient).

The notebooks check their own results with ``assert`` (bit-exact loads,
files present, ratios in range), so a notebook that runs is a notebook whose
claims held. A notebook without any ``assert`` fails here: it could not fail.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("tutorials_run", ROOT / "tutorials" / "run.py")
assert _spec and _spec.loader
run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run)

NOTEBOOKS = run.notebooks()


def test_the_five_tutorials_are_there() -> None:
    names = [p.stem for p in NOTEBOOKS]
    assert len(names) == 5, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_tutorial_runs(path: Path) -> None:
    notebook = run.execute(path)
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert any("assert " in c.source for c in code), f"{path.name} checks nothing"
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
