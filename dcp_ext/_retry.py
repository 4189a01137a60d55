"""Bounded retries with exponential backoff and full jitter."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from .config import RetryPolicy

__all__ = ["retry_sync", "backoff_delay"]

log = logging.getLogger("dcp_ext.retry")

T = TypeVar("T")


def backoff_delay(policy: RetryPolicy, attempt: int) -> float:
    """Seconds to sleep after failed attempt number ``attempt`` (from 1)."""
    ceiling = min(policy.max_delay, policy.base_delay * (2 ** (attempt - 1)))
    return random.uniform(0.0, ceiling)


def retry_sync(
    fn: Callable[[], T],
    policy: RetryPolicy,
    is_transient: Callable[[BaseException], bool],
    what: str,
) -> T:
    """Call ``fn`` until it succeeds, a non-transient error, or attempts run out."""
    attempt = 1
    while True:
        try:
            return fn()
        except Exception as err:
            if attempt >= policy.max_attempts or not is_transient(err):
                raise
            delay = backoff_delay(policy, attempt)
            log.warning(
                "%s: transient error (attempt %d/%d), retrying in %.2fs: %s",
                what, attempt, policy.max_attempts, delay, err,
            )
            time.sleep(delay)
            attempt += 1
