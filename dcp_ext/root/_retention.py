"""Retention: which committed partial checkpoints to keep.

A policy is a pure function over the committed checkpoints (oldest first)
that returns the tags to keep; deletion is a separate step
(:meth:`dcp_ext.root.CheckpointRoot.apply_retention`). Policies compose with
``|`` (keep what any of them keeps)::

    KeepLast(3) | KeepEvery(1000) | KeepMatching(r"best.*")

keeps the three newest, every checkpoint whose step is a multiple of 1000,
and any tag starting with ``best``. ``save(num_kept_partial_checkpoints=N)``
is ``KeepLast(N)``. The ``newest`` target is never deleted, whatever the policy.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ..layout import TagInfo

__all__ = ["RetentionPolicy", "KeepLast", "KeepEvery", "KeepMatching", "KeepAny", "select_for_deletion"]


@runtime_checkable
class RetentionPolicy(Protocol):
    """Decides which committed checkpoints to keep."""

    def keep(self, committed: Sequence[TagInfo]) -> set[str]:
        """The tags to keep among ``committed`` (oldest first)."""
        ...


class _Composable:
    def __or__(self, other: RetentionPolicy) -> KeepAny:
        return KeepAny((self, other))  # type: ignore[arg-type]


@dataclass(frozen=True)
class KeepLast(_Composable):
    """Keep the ``n`` most recently committed checkpoints."""

    n: int
    """How many of the newest checkpoints to keep (at least 1)."""

    def __post_init__(self) -> None:
        """Check ``n``.

        Raises:
            ValueError: ``n`` is not an integer of at least 1.
        """
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"KeepLast needs n >= 1, got {self.n!r}")

    def keep(self, committed: Sequence[TagInfo]) -> set[str]:
        """The ``n`` tags of ``committed`` that committed last (ties broken by tag)."""
        newest_first = sorted(committed, key=lambda t: (t.committed_at, t.tag), reverse=True)
        return {t.tag for t in newest_first[: self.n]}


@dataclass(frozen=True)
class KeepEvery(_Composable):
    """Keep checkpoints whose step is a multiple of ``steps``.

    The step is the last run of digits in the tag (``step1000`` -> 1000,
    ``epoch3-step500`` -> 500); tags without digits are not kept by this policy.
    """

    steps: int
    """The step interval (at least 1)."""

    def __post_init__(self) -> None:
        """Check ``steps``.

        Raises:
            ValueError: ``steps`` is not an integer of at least 1.
        """
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"KeepEvery needs steps >= 1, got {self.steps!r}")

    def keep(self, committed: Sequence[TagInfo]) -> set[str]:
        """The tags of ``committed`` whose step (the last run of digits) is a multiple of
        ``steps``."""
        kept = set()
        for info in committed:
            digits = re.findall(r"\d+", info.tag)
            if digits and int(digits[-1]) % self.steps == 0:
                kept.add(info.tag)
        return kept


@dataclass(frozen=True)
class KeepMatching(_Composable):
    """Keep checkpoints whose whole tag matches the regular expression ``pattern``."""

    pattern: str
    """A regular expression that a tag must match whole (``re.fullmatch``)."""

    def __post_init__(self) -> None:
        """Check that ``pattern`` compiles.

        Raises:
            ValueError: ``pattern`` is not a valid regular expression.
        """
        try:
            re.compile(self.pattern)
        except re.error as err:
            raise ValueError(f"KeepMatching: invalid pattern {self.pattern!r}: {err}") from err

    def keep(self, committed: Sequence[TagInfo]) -> set[str]:
        """The tags of ``committed`` that ``pattern`` matches whole."""
        rule = re.compile(self.pattern)
        return {t.tag for t in committed if rule.fullmatch(t.tag)}


@dataclass(frozen=True)
class KeepAny(_Composable):
    """Keep what any of ``policies`` keeps."""

    policies: tuple[RetentionPolicy, ...]
    """The policies combined (``KeepLast(3) | KeepEvery(1000)`` builds one)."""

    def keep(self, committed: Sequence[TagInfo]) -> set[str]:
        """The tags of ``committed`` that any of ``policies`` keeps."""
        kept: set[str] = set()
        for policy in self.policies:
            kept |= policy.keep(committed)
        return kept


def select_for_deletion(
    committed: Sequence[TagInfo], policy: RetentionPolicy, protect: Collection[str] = ()
) -> list[str]:
    """The committed tags ``policy`` does not keep, oldest first.

    Tags in ``protect`` (the ``newest`` target, the checkpoint just saved)
    are never selected.
    """
    kept = policy.keep(committed) | set(protect)
    ordered = sorted(committed, key=lambda t: (t.committed_at, t.tag))
    return [t.tag for t in ordered if t.tag not in kept]
