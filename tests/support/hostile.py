"""A pickle that would run a shell command: restricted unpicklers must refuse it.

Unpickling :class:`RunsCode` calls ``os.system("touch MARKER")``; a test
feeds it to a reader and then checks that it raised and that ``MARKER`` was
never created.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

__all__ = ["RunsCode", "code_running_pickle"]


class RunsCode:
    """A value whose unpickling runs ``touch marker``."""

    def __init__(self, marker: str | os.PathLike[str]) -> None:
        self.marker = Path(marker)

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def code_running_pickle(marker: str | os.PathLike[str]) -> bytes:
    """The pickled bytes of :class:`RunsCode` (``marker``)."""
    return pickle.dumps(RunsCode(marker))
