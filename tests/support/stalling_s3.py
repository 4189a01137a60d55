"""S3 endpoints that stop answering, for the timeout tests (127.0.0.1, free ports).

* :class:`SilentEndpoint`: a TCP server that accepts every connection, reads
  what the client sends, and never answers; or, with ``first_bytes``, sends
  those bytes once a request's head has arrived and then nothing more (a
  server that stalls in the middle of its answer).
* :class:`StallingProxy`: a proxy in front of a real S3 server that forwards
  every request except those its ``stall`` predicate selects: those it does
  not forward, answers with the first bytes of a response and then stalls.

Both record when each connection or request came, so tests can count the
client's attempts. Stalled connections are held until the context exits.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

__all__ = ["SilentEndpoint", "StallingProxy", "FIRST_BYTES"]

#: What a stalling server sends before it stops: a status line and one header,
#: no end of headers (the client waits for the rest).
FIRST_BYTES = b"HTTP/1.1 200 OK\r\nx-amz-request-id: stalled\r\n"


class SilentEndpoint:
    """Accept connections on 127.0.0.1 and never answer (see the module docstring).

    Attributes:
        connections: ``time.monotonic()`` of each accepted connection.
        requests: The first line of each request received.
    """

    def __init__(self, first_bytes: bytes = b"") -> None:
        self.first_bytes = first_bytes
        self.connections: list[float] = []
        self.requests: list[str] = []
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._sockets: list[socket.socket] = []
        self._server = socket.create_server(("127.0.0.1", 0), backlog=64)
        self._server.settimeout(0.2)
        self.endpoint_url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self._thread = threading.Thread(target=self._accept, daemon=True, name="silent-s3-accept")

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.connections.append(time.monotonic())
                self._sockets.append(conn)
            threading.Thread(target=self._hold, args=(conn,), daemon=True, name="silent-s3-conn").start()

    def _hold(self, conn: socket.socket) -> None:
        """Read (so the client's sends never block) and, once, send the first bytes."""
        conn.settimeout(0.2)
        received = b""
        answered = False
        while not self._closing.is_set():
            try:
                data = conn.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return  # the client gave up and closed
            if not answered:
                received += data
                if b"\r\n\r\n" in received:
                    answered = True
                    with self._lock:
                        self.requests.append(received.split(b"\r\n", 1)[0].decode("latin-1"))
                    if self.first_bytes:
                        try:
                            conn.sendall(self.first_bytes)
                        except OSError:
                            return

    def __enter__(self) -> SilentEndpoint:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing.set()
        self._thread.join(timeout=5)
        self._server.close()
        with self._lock:
            for conn in self._sockets:
                conn.close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass

    def _handle(self) -> None:
        proxy = self.server.owner
        length = int(self.headers.get("Content-Length", 0) or 0)
        body = self.rfile.read(length) if length else b""
        stalled = proxy.stall(self.command, self.path)
        with proxy.lock:
            proxy.log.append((time.monotonic(), self.command, self.path, stalled))
        if stalled:
            # Never forwarded: the server does nothing for this request.
            self.wfile.write(FIRST_BYTES)
            self.wfile.flush()
            proxy.closing.wait()
            self.close_connection = True
            return
        upstream = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
            upstream.request(self.command, self.path, body=body, headers=headers)
            response = upstream.getresponse()
            payload = response.read()
        finally:
            upstream.close()
        self.send_response(response.status)
        for key, value in response.getheaders():
            if key.lower() not in ("connection", "transfer-encoding", "content-length"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    owner: StallingProxy


class StallingProxy:
    """A proxy to ``upstream`` that stalls the requests ``stall(method, path)`` selects.

    Attributes:
        stall: The predicate; replace it between phases of a test.
        log: ``(time.monotonic(), method, path, stalled)`` of every request.
    """

    def __init__(self, upstream: str, stall: Callable[[str, str], bool] = lambda method, path: False) -> None:
        parts = urlsplit(upstream)
        self.upstream_host = parts.hostname or "127.0.0.1"
        self.upstream_port = parts.port or 80
        self.stall = stall
        self.log: list[tuple[float, str, str, bool]] = []
        self.lock = threading.Lock()
        self.closing = threading.Event()
        self._server = _ProxyServer(("127.0.0.1", 0), _Handler)
        self._server.owner = self
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="stalling-proxy")

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stalled(self) -> list[tuple[float, str, str, bool]]:
        with self.lock:
            return [entry for entry in self.log if entry[3]]

    def __enter__(self) -> StallingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.closing.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
