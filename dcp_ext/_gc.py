"""Pausing Python's cyclic garbage collector around checkpoint work.

Loading metadata and planning allocate hundreds of thousands of small objects
(one per stored chunk and frame). In a training process that already holds
millions of objects, that allocation triggers full collections: measured on a
1 GiB, 2,496-tensor checkpoint, a whole ``dcp_ext.load`` took 0.35 s with the
collector running and 0.18 s with it paused. Reference counting still frees
everything that is not in a cycle; the collector runs again on exit.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["gc_paused"]

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic collector inside the block (nesting and threads
    share one pause; it ends when the last block exits)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
