"""Bounded retries with exponential backoff and full jitter."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from ..config import RetryPolicy

__all__ = ["retry_sync", "backoff_delay", "PACED_ATTEMPTS_FACTOR"]

log = logging.getLogger("dcp_ext.retry")

T = TypeVar("T")


def backoff_delay(policy: RetryPolicy, attempt: int) -> float:
    """Seconds to sleep after failed attempt number ``attempt`` (from 1)."""
    ceiling = min(policy.max_delay, policy.base_delay * (2 ** (attempt - 1)))
    return random.uniform(0.0, ceiling)


#: A request that a rate limiter paces may be throttled this many times
#: ``max_attempts`` before the error is raised.
PACED_ATTEMPTS_FACTOR = 4


def retry_sync(
    fn: Callable[[], T],
    policy: RetryPolicy,
    is_transient: Callable[[BaseException], bool],
    what: str,
    paced: Callable[[BaseException], bool] | None = None,
    deadline: float | None = None,
    attempt_seconds: float = 0.0,
) -> T:
    """Call ``fn`` until it succeeds, a non-transient error, or attempts run out.

    With a ``deadline`` (seconds from the first attempt) no attempt starts,
    and no backoff sleeps, unless the attempt would end before the deadline
    even if it took ``attempt_seconds`` (its worst case: the connect and
    read timeouts of an endpoint that never answers); then the last error is
    raised. The first attempt always runs. Without it an endpoint that
    accepted connections and never answered held a save for over 700 s:
    six attempts of botocore's 60 s read timeout, then the next request's
    (issue 32).

    Errors that ``paced`` accepts (throttling, when ``fn`` waits for a rate
    limiter that slows down on it: :mod:`dcp_ext.storage._rate_limit`) are
    retried differently. The limiter already spaces the attempts, so the
    delay before the next one stays at most ``base_delay`` instead of
    doubling: exponential backoff on top of pacing made the few unlucky
    requests of a throttled save sleep for seconds at its end, holding up the
    file they belong to. A throttled request may be retried up to
    :data:`PACED_ATTEMPTS_FACTOR` times ``max_attempts`` times (other errors
    keep their own count): when a prefix is shared by many ranks, a request
    refused several times in a row is bad luck, not a reason to fail the
    save. Those retries are logged at debug level (a busy save meets them by
    the hundred; the limiter logs when it starts pacing), others as warnings.
    """
    attempt = throttled = 1
    start = time.monotonic()
    while True:
        try:
            return fn()
        except Exception as err:
            if not is_transient(err):
                raise
            throttle = paced is not None and paced(err)
            if throttle:
                if throttled >= policy.max_attempts * PACED_ATTEMPTS_FACTOR:
                    raise
                delay = random.uniform(0.0, policy.base_delay)
            else:
                if attempt >= policy.max_attempts:
                    raise
                delay = backoff_delay(policy, attempt)
            if deadline is not None and time.monotonic() - start + delay + attempt_seconds > deadline:
                log.warning("%s: not retrying (%.3g s into the request, another attempt could end after its "
                            "%.3g s deadline): %s", what, time.monotonic() - start, deadline, err)
                raise
            if throttle:
                log.debug("%s: throttled (%d), retrying in %.2fs: %s", what, throttled, delay, err)
                throttled += 1
            else:
                log.warning(
                    "%s: transient error (attempt %d/%d), retrying in %.2fs: %s",
                    what, attempt, policy.max_attempts, delay, err,
                )
                attempt += 1
            time.sleep(delay)
