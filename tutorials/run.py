"""Execute the tutorial notebooks top to bottom, as the test suite does.

    python tutorials/run.py                 # run every notebook, report pass/fail and time
    python tutorials/run.py 01_quickstart   # run the notebooks whose name contains this
    python tutorials/run.py --write         # also store the outputs in the .ipynb files

Each notebook runs in a fresh Jupyter kernel (``ipykernel``, the current
interpreter) with ``tutorials/`` as its working directory, as when it is
opened in Jupyter from there. A cell that raises fails the notebook.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
CELL_TIMEOUT_S = 300


def notebooks(filters: list[str] | None = None) -> list[Path]:
    """The tutorial notebooks, in order, optionally those whose name contains a filter."""
    found = sorted(HERE.glob("*.ipynb"))
    return [p for p in found if not filters or any(f in p.name for f in filters)]


def execute(path: Path, write: bool = False) -> nbformat.NotebookNode:
    """Run ``path`` in a new kernel; raise ``nbclient.exceptions.CellExecutionError`` on a failing cell."""
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(HERE)}},
    )
    client.execute()
    if write:
        nbformat.write(notebook, path)
    return notebook


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("filters", nargs="*")
    parser.add_argument("--write", action="store_true", help="store outputs in the notebooks")
    args = parser.parse_args()
    failed = 0
    for path in notebooks(args.filters):
        start = time.perf_counter()
        try:
            execute(path, write=args.write)
            print(f"ok      {path.name}  {time.perf_counter() - start:.1f} s")
        except Exception as err:  # report every notebook, then fail
            failed += 1
            print(f"FAILED  {path.name}  {time.perf_counter() - start:.1f} s\n{err}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
