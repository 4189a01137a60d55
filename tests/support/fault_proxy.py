"""A fault-injecting HTTP proxy for S3 tests, in front of a real S3 server.

The proxy listens on 127.0.0.1 (free port), forwards every request to the
upstream endpoint, and for the requests a :class:`FaultPlan` selects, answers
with a fault instead (or after) forwarding:

* ``"slowdown"``: HTTP 503 with S3's ``SlowDown`` error body;
* ``"internal"``: HTTP 500 ``InternalError``;
* ``"reset"``: the connection is reset (RST) before any response;
* ``"truncate"``: the upstream response with its full ``Content-Length`` header
  but only half of the body, then the connection closes;
* ``"delay"``: the upstream response, ``delay`` seconds late.

Every request (with its headers) and every injected fault is recorded, so
tests can assert how many attempts a client made and what it asked for.

``serialize`` (a predicate on method, path and headers) makes the proxy
forward the requests it selects one at a time, under one lock: in front of a
server whose conditional write is check-then-write (moto's ``If-None-Match``),
it supplies the atomicity a real object store has, so a race tests the
client's side of the protocol.

With a :class:`PrefixRateLimit` the proxy also enforces a request rate per
key prefix, as S3 does per partition: each prefix (the bucket and the key up
to its last ``/``; for a listing, the listed prefix up to its last ``/``) has
a token bucket of ``rate`` requests per second, and a request that finds it
empty gets S3's ``503 SlowDown`` without reaching the server (recorded as
fault ``"throttle"``). :meth:`FaultProxy.prefix_stats` counts requests and
throttles per prefix.
"""

from __future__ import annotations

import contextlib
import http.client
import random
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["FaultProxy", "FaultPlan", "PrefixRateLimit", "PrefixStats", "RequestLog", "prefix_of"]

FAULTS = ("slowdown", "internal", "reset", "truncate", "delay")

_ERROR_BODY = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
    "<Message>{message}</Message><RequestId>fault-proxy</RequestId></Error>"
)


@dataclass(frozen=True)
class RequestLog:
    """One request seen by the proxy, the fault (if any) it got, and when (``time.monotonic()``)."""

    method: str
    path: str
    fault: str | None
    at: float = 0.0
    headers: tuple[tuple[str, str], ...] = ()

    def header(self, name: str) -> str | None:
        """The value of header ``name`` (case-insensitive), or ``None``."""
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)


@dataclass
class FaultPlan:
    """Which requests get which fault.

    Attributes:
        rate: Share of matching requests that get a fault (0..1).
        faults: Faults to inject, in turn.
        match: Predicate on (method, path-with-query); default: every request.
        limit: At most this many faults in total (``None``: no limit).
        delay: Seconds for the ``"delay"`` fault.
        seed: Seed of the random choices, for repeatable runs.
    """

    rate: float = 0.0
    faults: tuple[str, ...] = ("slowdown",)
    match: Callable[[str, str], bool] = lambda method, path: True
    limit: int | None = None
    delay: float = 0.5
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)
    _injected: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        unknown = set(self.faults) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}")
        self._rng = random.Random(self.seed)

    def choose(self, method: str, path: str) -> str | None:
        if not self.match(method, path):
            return None
        if self.limit is not None and self._injected >= self.limit:
            return None
        if self._rng.random() >= self.rate:
            return None
        self._injected += 1
        # In turn rather than at random: every kind shows up once there have
        # been as many faults as kinds, whatever order concurrent requests take.
        return self.faults[(self._injected - 1) % len(self.faults)]


@dataclass(frozen=True)
class PrefixRateLimit:
    """A request rate per key prefix, enforced like S3's per-partition limit.

    Attributes:
        rate: Requests per second each prefix accepts.
        burst: Requests a prefix accepts at once after being idle (the token
            bucket's size); ``None``: a tenth of a second's worth (at least 1).
    """

    rate: float
    burst: float | None = None

    @property
    def capacity(self) -> float:
        return self.burst if self.burst is not None else max(1.0, self.rate / 10)


@dataclass
class PrefixStats:
    """What the proxy saw of one prefix: requests (throttled ones included) and throttles."""

    requests: int = 0
    throttled: int = 0


def prefix_of(method: str, path: str) -> str:
    """The key prefix a path-style request counts against: ``bucket/a/b`` for
    ``/bucket/a/b/c``; for a request on the bucket itself (a listing), the
    bucket and its ``prefix`` parameter up to the last ``/``."""
    parts = urlsplit(path)
    bucket, _, key = unquote(parts.path).lstrip("/").partition("/")
    if not key:
        key = parse_qs(parts.query).get("prefix", [""])[0]
    head = key.rpartition("/")[0]
    return f"{bucket}/{head}" if head else bucket


class _TokenBuckets:
    """One token bucket per prefix (callers hold the proxy's lock)."""

    def __init__(self, limit: PrefixRateLimit) -> None:
        self.limit = limit
        self._buckets: dict[str, tuple[float, float]] = {}  # prefix -> (tokens, when)

    def take(self, prefix: str, now: float) -> bool:
        capacity = self.limit.capacity
        tokens, when = self._buckets.get(prefix, (capacity, now))
        tokens = min(capacity, tokens + (now - when) * self.limit.rate)
        allowed = tokens >= 1.0
        self._buckets[prefix] = (tokens - 1.0 if allowed else tokens, now)
        return allowed


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length", 0) or 0)
        body = self.rfile.read(length) if length else b""
        proxy = self.server.owner
        fault = proxy.decide(self.command, self.path, tuple(self.headers.items()))
        if fault == "reset":
            # SO_LINGER with zero timeout makes close() send RST.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()
            return
        if fault in ("slowdown", "internal", "throttle"):
            status, code = (500, "InternalError") if fault == "internal" else (503, "SlowDown")
            message = "Please reduce your request rate." if fault == "throttle" else f"injected {fault}"
            payload = _ERROR_BODY.format(code=code, message=message).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection",)}
        serialized = proxy.serialize is not None and proxy.serialize(self.command, self.path, headers)
        with proxy.serial_lock if serialized else contextlib.nullcontext():
            upstream = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=60)
            try:
                upstream.request(self.command, self.path, body=body, headers=headers)
                response = upstream.getresponse()
                payload = response.read()
                response_headers = response.getheaders()
                status = response.status
            finally:
                upstream.close()
        if fault == "delay":
            time.sleep(proxy.plan.delay)
        self.send_response(status)
        for key, value in response_headers:
            if key.lower() not in ("connection", "transfer-encoding", "content-length"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command == "HEAD":
            return
        if fault == "truncate" and len(payload) > 1:
            self.wfile.write(payload[: len(payload) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(payload)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    owner: FaultProxy


class FaultProxy:
    """Run a fault-injecting proxy to ``upstream`` (an ``http://host:port`` URL).

    Use as a context manager; ``endpoint_url`` is the address clients use.
    ``plan`` can be replaced between phases of a test, and so can
    ``rate_limit`` (a :class:`PrefixRateLimit`, or ``None`` for no limit).
    """

    def __init__(
        self, upstream: str, plan: FaultPlan | None = None, rate_limit: PrefixRateLimit | None = None,
        serialize: Callable[[str, str, dict[str, str]], bool] | None = None,
    ) -> None:
        parts = urlsplit(upstream)
        self.upstream_host = parts.hostname or "127.0.0.1"
        self.upstream_port = parts.port or 80
        self.plan = plan or FaultPlan()
        self.rate_limit = rate_limit
        self.serialize = serialize
        self.serial_lock = threading.Lock()
        self.log: list[RequestLog] = []
        self._stats: dict[str, PrefixStats] = {}
        self._buckets: _TokenBuckets | None = None
        self._lock = threading.Lock()
        self._server = _ProxyServer(("127.0.0.1", 0), _Handler)
        self._server.owner = self
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def decide(self, method: str, path: str, headers: tuple[tuple[str, str], ...] = ()) -> str | None:
        prefix = prefix_of(method, path)
        with self._lock:
            stats = self._stats.setdefault(prefix, PrefixStats())
            stats.requests += 1
            fault = None
            if self.rate_limit is not None:
                if self._buckets is None or self._buckets.limit != self.rate_limit:
                    self._buckets = _TokenBuckets(self.rate_limit)
                if not self._buckets.take(prefix, time.monotonic()):
                    fault = "throttle"
                    stats.throttled += 1
            if fault is None:
                fault = self.plan.choose(method, path)
            self.log.append(RequestLog(method, path, fault, time.monotonic(), headers))
            return fault

    def prefix_stats(self) -> dict[str, PrefixStats]:
        """Requests and throttles per prefix since the start (or :meth:`reset_log`)."""
        with self._lock:
            return {prefix: PrefixStats(s.requests, s.throttled) for prefix, s in sorted(self._stats.items())}

    def faults(self) -> list[RequestLog]:
        with self._lock:
            return [entry for entry in self.log if entry.fault]

    def reset_log(self) -> None:
        with self._lock:
            self.log.clear()
            self._stats.clear()

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
