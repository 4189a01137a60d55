"""Several sequences of killed jobs, driven side by side.

A sequence is a generator that yields the job to run next, takes back its
outcome, checks it, and at the end returns what it found. :func:`drive`
starts the k-th job of every sequence at once and hands each outcome back
to its own sequence, so the sequences' checks all run in the calling thread,
between jobs (never two in-process loads at once), while their jobs (mostly
interpreter starts and waiting) overlap.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any, TypeVar

__all__ = ["drive"]

Job = TypeVar("Job")
Handle = TypeVar("Handle")
Outcome = TypeVar("Outcome")


def drive(
    sequences: Sequence[Generator[Job, Outcome, Any]],
    start: Callable[[Job], Handle],
    finish: Callable[[Handle], Outcome],
    abandon: Callable[[Handle], None],
) -> list[Any]:
    """Run ``sequences`` side by side; what each returns, in order.

    Args:
        sequences: The job sequences (each on its own root).
        start: Starts one job; its handle.
        finish: Waits for a started job; its outcome.
        abandon: Ends a started job whose outcome is no longer wanted (another
            job's ``finish`` raised); also called on every handle once done.
    """
    results: dict[int, Any] = {}
    pending: dict[int, Job] = {}
    for i, sequence in enumerate(sequences):
        try:
            pending[i] = next(sequence)
        except StopIteration as done:
            results[i] = done.value
    while pending:
        started = {i: start(job) for i, job in pending.items()}
        try:
            outcomes = {i: finish(handle) for i, handle in started.items()}
        finally:
            for handle in started.values():
                abandon(handle)
        pending = {}
        for i, outcome in outcomes.items():
            try:
                pending[i] = sequences[i].send(outcome)
            except StopIteration as done:
                results[i] = done.value
    return [results[i] for i in range(len(sequences))]
