"""Client-side adaptive rate limiting of S3 requests, one limiter per key prefix.

S3 serves a bounded request rate per partition of a bucket's key space (about
3,500 PUT/COPY/POST/DELETE and 5,500 GET/HEAD per second per prefix) and
answers beyond it with ``503 SlowDown`` until it has repartitioned. Retrying
with backoff alone keeps every thread of every rank sending at the throttled
prefix: each retry is another refused request, and the rate of refusals, not
of useful work, sets the pace.

:class:`AdaptiveRateLimiter` is modelled on the AWS SDKs' client-side rate
limiter (the ``adaptive`` retry mode; botocore's ``ClientRateLimiter``, a
token bucket whose rate a throttle cuts and success raises again):

* it costs nothing until a request to its prefix is throttled;
* on a throttle it paces requests to ``beta`` times the rate the prefix
  accepted from this client over the last ``window`` seconds. botocore cuts
  from the rate the client *sent*, which after a burst is far above what the
  server takes, so it needs several cuts, each with its own throttled
  requests, to come down. But several ranks share a prefix, and which of
  them the server happened to accept in the first tenth of a second is luck:
  a rank cut from its accepted rate alone can start near zero and finish
  last. So the cut is also never below ``beta * sent_share`` times the rate
  it sent;
* it cuts only when that lowers the pace, and not for requests sent before
  the last cut (TCP's one reduction per loss event): when several ranks share
  a prefix, each one's throttles caused by the others' excess do not compound
  into a crawl;
* after a cut the allowed rate grows by ``growth`` times the rate it was cut
  from per second (back to it in about ``(1 - beta) / growth`` = 0.6 s by
  default), and faster the longer no throttle comes: the growth is
  multiplied by ``1 + (t / probe)**2`` at ``t`` seconds after the cut (the
  convex part of CUBIC, which the SDKs' limiter uses). Independent limiters
  sharing a prefix do not share it evenly, so one rank is often left last,
  alone and slow; this way it (or a prefix that S3 has split) is used at full
  speed within a second or two, where linear growth took several.

``python -m bench.s3_request_rate --simulate`` (threads, no servers: 4
clients of 8 threads, 65 requests of 15 ms each, retried with the default
backoff, against 100 requests/s token buckets), five runs each:

* one bucket shared (2.6 s at the full rate): 2.7-3.2 s and 9-17 % of
  requests throttled; without a limiter 3.9-6.0 s and 57-60 % throttled (and
  in a real save the bounded retry policy gives up on some request); cutting
  from the rate sent alone 2.6-3.3 s but 32-39 % throttled; from the
  accepted rate alone 2.6-3.4 s and 11-14 % (over ten runs: median 3.35 s
  against 2.86 s, the starved client's crawl back);
* a bucket each (0.65 s): 0.62-0.68 s and 8.5-9 % throttled, all in the
  first burst; without a limiter 0.7-1.2 s and 36-38 %.

Paced requests go ``1 / rate`` apart, at the rate of the moment they go (a
request that waited through a cut does not go at the old pace), never in a
burst. :class:`PrefixRateLimiters` holds the limiters of one store, keyed
by prefix (the key up to its last ``/``): a throttled prefix does not slow the
others.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["AdaptiveRateLimiter", "LimiterStats", "PrefixRateLimiters", "key_prefix_of"]

log = logging.getLogger("dcp_ext.s3")


@dataclass(frozen=True)
class LimiterStats:
    """What one limiter saw.

    Attributes:
        requests: Requests that asked to go (attempts, retries included).
        throttles: Requests the server throttled.
        cuts: Times the allowed rate was cut.
        rate: The allowed rate now (requests per second), ``None`` before any throttle.
        waited: Seconds requests spent waiting to go, in total.
    """

    requests: int
    throttles: int
    cuts: int
    rate: float | None
    waited: float


class AdaptiveRateLimiter:
    """AIMD pacing of the requests to one key prefix (see the module docstring).

    Thread-safe; call :meth:`acquire` before each attempt and then either
    :meth:`succeeded` or :meth:`throttled` with the time it returned (other
    failures need no call).

    Args:
        beta: Factor of the accepted rate that a throttle cuts to.
        sent_share: A cut is from at least this share of the rate sent.
        growth: After a cut the rate grows by this share of the rate it was
            cut from, per second...
        probe: ... times ``1 + (t / probe)**2``, ``t`` seconds after the cut.
        window: Seconds over which the accepted rate is measured.
        min_rate: The rate is never cut below this (requests per second).
        clock: Monotonic seconds (injectable for tests).
        sleep: Sleeps that many seconds (injectable for tests).
    """

    # The accepted rate is measured over at least this long, so that the few
    # successes of a prefix's first fraction of a second are not read as a huge rate.
    _MIN_SPAN = 0.1

    def __init__(
        self,
        *,
        beta: float = 0.7,
        sent_share: float = 0.5,
        growth: float = 0.5,
        probe: float = 0.5,
        window: float = 1.0,
        min_rate: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        name: str = "",
    ) -> None:
        if not 0 < beta < 1 or not 0 <= sent_share <= 1 or growth < 0 or probe <= 0 or window <= 0 or min_rate <= 0:
            raise ValueError(
                f"invalid limiter settings beta={beta} sent_share={sent_share} growth={growth} "
                f"probe={probe} window={window} min_rate={min_rate}"
            )
        self.beta, self.sent_share, self.growth, self.probe = beta, sent_share, growth, probe
        self.window, self.min_rate = window, min_rate
        self.name = name
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._first: float | None = None  # when the first request asked to go
        self._cut_rate: float | None = None  # rate set by the last cut (None: never throttled)
        self._slope = 0.0  # growth of the rate after the cut, per second
        self._cut_at = -math.inf
        self._last = -math.inf  # when the last request went
        self._sent: deque[float] = deque()  # send times within the window
        self._accepted: deque[float] = deque()  # success times within the window
        self._requests = self._throttles = self._cuts = 0
        self._waited = 0.0

    def _rate(self, now: float) -> float | None:
        if self._cut_rate is None:
            return None
        t = now - self._cut_at
        return self._cut_rate + self._slope * t * (1.0 + (t / self.probe) ** 2)

    def _trim(self, now: float) -> None:
        horizon = now - self.window
        for times in (self._sent, self._accepted):
            while times and times[0] < horizon:
                times.popleft()

    def acquire(self) -> float:
        """Wait until a request may go; returns its send time (pass it on)."""
        asked = None
        while True:
            with self._lock:
                now = self._clock()
                if asked is None:
                    asked = now
                    self._requests += 1
                    if self._first is None:
                        self._first = now
                rate = self._rate(now)
                # The spacing is that of the rate now, not of when the request
                # asked: requests queued before a cut must not go at the old pace.
                wait = 0.0 if rate is None else self._last + 1.0 / rate - now
                if wait <= 0:
                    self._last = now
                    self._sent.append(now)
                    self._trim(now)
                    self._waited += now - asked
                    return now
            self._sleep(wait)

    def succeeded(self, sent: float) -> None:
        """A request sent at ``sent`` got through."""
        with self._lock:
            now = self._clock()
            self._accepted.append(now)
            self._trim(now)

    def throttled(self, sent: float) -> bool:
        """A request sent at ``sent`` was throttled; returns whether the rate was cut."""
        with self._lock:
            now = self._clock()
            self._throttles += 1
            if sent < self._cut_at:
                return False  # sent before the last cut: part of the event already answered
            self._trim(now)
            span = max(min(self.window, now - (self._first if self._first is not None else now)), self._MIN_SPAN)
            basis = max(len(self._accepted), self.sent_share * len(self._sent)) / span
            target = max(self.min_rate, self.beta * basis)
            current = self._rate(now)
            if current is not None and current <= target:
                return False  # already slower than a cut would make it
            first = current is None
            self._cut_rate, self._slope = target, self.growth * max(basis, self.min_rate)
            self._cut_at = now
            self._last = max(self._last, now)  # the next request waits a full interval
            self._cuts += 1
            rate = self._cut_rate
        if first:
            log.info("S3 is throttling requests to %s (SlowDown): pacing them to %.0f/s", self.name or "a prefix", rate)
        else:
            log.debug("S3 throttled %s again: pacing to %.1f/s", self.name or "a prefix", rate)
        return True

    def stats(self) -> LimiterStats:
        with self._lock:
            return LimiterStats(self._requests, self._throttles, self._cuts, self._rate(self._clock()), self._waited)


def key_prefix_of(key: str) -> str:
    """The prefix S3 partitions ``key`` under, as the limiters count it: up to its last ``/``."""
    return key.rpartition("/")[0]


class PrefixRateLimiters:
    """The :class:`AdaptiveRateLimiter` of each key prefix of one store, made on first use.

    Args:
        label: Prepended to prefixes in log messages (``s3://bucket/``).
        **settings: Passed to every :class:`AdaptiveRateLimiter`.
    """

    def __init__(self, label: str = "", **settings: object) -> None:
        self._label = label
        self._settings = settings
        self._lock = threading.Lock()
        self._limiters: dict[str, AdaptiveRateLimiter] = {}

    def for_key(self, key: str) -> AdaptiveRateLimiter:
        """The limiter of ``key``'s prefix."""
        prefix = key_prefix_of(key)
        with self._lock:
            limiter = self._limiters.get(prefix)
            if limiter is None:
                limiter = self._limiters[prefix] = AdaptiveRateLimiter(
                    name=f"{self._label}{prefix}/", **self._settings  # type: ignore[arg-type]
                )
            return limiter

    def stats(self) -> dict[str, LimiterStats]:
        """Each prefix's :class:`LimiterStats`."""
        with self._lock:
            limiters = dict(self._limiters)
        return {prefix: limiter.stats() for prefix, limiter in sorted(limiters.items())}
