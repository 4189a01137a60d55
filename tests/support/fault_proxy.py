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

Every request and every injected fault is recorded, so tests can assert how
many attempts a client made.
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

__all__ = ["FaultProxy", "FaultPlan", "RequestLog"]

FAULTS = ("slowdown", "internal", "reset", "truncate", "delay")

_ERROR_BODY = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
    "<Message>{message}</Message><RequestId>fault-proxy</RequestId></Error>"
)


@dataclass(frozen=True)
class RequestLog:
    """One request seen by the proxy and the fault (if any) it got."""

    method: str
    path: str
    fault: str | None


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


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length", 0) or 0)
        body = self.rfile.read(length) if length else b""
        proxy = self.server.owner
        fault = proxy.decide(self.command, self.path)
        if fault == "reset":
            # SO_LINGER with zero timeout makes close() send RST.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()
            return
        if fault in ("slowdown", "internal"):
            status, code = (503, "SlowDown") if fault == "slowdown" else (500, "InternalError")
            payload = _ERROR_BODY.format(code=code, message=f"injected {fault}").encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)
            return
        upstream = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection",)}
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
    ``plan`` can be replaced between phases of a test.
    """

    def __init__(self, upstream: str, plan: FaultPlan | None = None) -> None:
        parts = urlsplit(upstream)
        self.upstream_host = parts.hostname or "127.0.0.1"
        self.upstream_port = parts.port or 80
        self.plan = plan or FaultPlan()
        self.log: list[RequestLog] = []
        self._lock = threading.Lock()
        self._server = _ProxyServer(("127.0.0.1", 0), _Handler)
        self._server.owner = self
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def decide(self, method: str, path: str) -> str | None:
        with self._lock:
            fault = self.plan.choose(method, path)
            self.log.append(RequestLog(method, path, fault))
            return fault

    def faults(self) -> list[RequestLog]:
        with self._lock:
            return [entry for entry in self.log if entry.fault]

    def reset_log(self) -> None:
        with self._lock:
            self.log.clear()

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
