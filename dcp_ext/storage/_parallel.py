"""Run one call per item on a bounded thread pool, failing as one: :func:`run_each`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["run_each"]

T = TypeVar("T")


def run_each(call: Callable[[T], object], items: Sequence[T], workers: int, thread_name_prefix: str) -> None:
    """``call(item)`` for every item, on at most ``workers`` threads (in the
    calling thread when that is one). The first failure is raised, after the
    calls not yet started are cancelled (those running finish first)."""
    workers = min(workers, len(items))
    if workers <= 1:
        for item in items:
            call(item)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix=thread_name_prefix) as pool:
        futures = [pool.submit(call, item) for item in items]
        try:
            for future in futures:
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise
