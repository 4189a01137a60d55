"""The ``<!-- example:NAME -->`` code blocks of README.md and the docs, run as written.

A block marked this way promises to run as it stands (the other snippets
are only compiled, ``tests/test_demo_and_readme.py``); :func:`run_examples`
runs several in fresh interpreters at once, each in a directory of its own.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

__all__ = ["ROOT", "example", "run_examples"]

ROOT = Path(__file__).resolve().parent.parent.parent


def example(page: str, name: str) -> str:
    """The code of block ``name`` on ``page`` (relative to the repository)."""
    text = (ROOT / page).read_text()
    match = re.search(rf"<!-- example:{re.escape(name)} -->\n```python\n(.+?)```\n<!-- /example:{re.escape(name)} -->",
                      text, re.S)
    assert match, f"{page} lacks the example:{name} block"
    return match.group(1)


def run_examples(blocks: dict[tuple[str, str], Path], timeout: float = 300) -> dict[tuple[str, str], str]:
    """Run each ``(page, name)`` block with ``python -c`` in its directory, all at once.

    Returns:
        The stderr of each block that failed (empty if all ran).
    """
    procs = {}
    for (page, name), cwd in blocks.items():
        cwd.mkdir(parents=True, exist_ok=True)
        procs[page, name] = subprocess.Popen([sys.executable, "-c", example(page, name)], cwd=cwd, text=True,
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    failed = {}
    for key, proc in procs.items():
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            err = f"timed out after {timeout} s\n{err}"
        if proc.returncode != 0:
            failed[key] = err[-3000:]
    return failed
