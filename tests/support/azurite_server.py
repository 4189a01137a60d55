"""Azurite, Microsoft's Azure Storage emulator, on 127.0.0.1 for tests and benchmarks.

Azurite is a Node package. :func:`azurite_binary` finds ``azurite-blob`` in
the project-local ``tests/.node/node_modules/.bin`` (git-ignored) and, when it
is missing, installs it there once per machine::

    npm install --prefer-offline --no-audit --no-fund azurite@3.35.0 --prefix tests/.node

under a file lock, because the suite's two pytest workers may both need it
at once (14 s with npm's cache warm, about 30 s cold; 186 MB). Set
``DCP_EXT_AZURITE_BLOB`` to use another ``azurite-blob`` instead.

:func:`start_azurite` runs the blob service alone on a port the kernel picks, with its
data on disk under the given directory (Azurite's in-memory mode caps data at
half the RAM and releases deleted data late), and returns an
:class:`AzuriteServer`: its endpoint, the well-known development account,
``storage_options`` for dcp_ext and adlfs, a side door (:meth:`AzuriteServer.request`,
a small Shared Key client independent of dcp_ext's), :meth:`AzuriteServer.stop`
and :meth:`AzuriteServer.restart` (same port and data: what was committed
before a stop is there again).

Self-contained (no imports from ``dcp_ext``), like ``tests.support.s3_servers``,
so benchmarks can use it.
"""

from __future__ import annotations

import base64
import contextlib
import email.utils
import fcntl
import hashlib
import hmac
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import urllib3

from tests.support import REPO

__all__ = [
    "AZURITE_VERSION", "ACCOUNT", "KEY", "NODE_DIR", "AzuriteServer", "AzuriteError", "azurite_binary",
    "install_command", "sign", "start_azurite", "serving",
]

AZURITE_VERSION = "3.35.0"
#: The development account every Azurite knows.
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
#: Where the suite installs Azurite (git-ignored).
NODE_DIR = REPO / "tests" / ".node"
HOST = "127.0.0.1"
START_TIMEOUT = 30.0
INSTALL_TIMEOUT = 600.0
_API_VERSION = "2021-12-02"


class AzuriteError(RuntimeError):
    """Azurite could not be installed or started."""


def install_command(prefix: Path = NODE_DIR) -> list[str]:
    """The npm command that installs Azurite under ``prefix``."""
    return ["npm", "install", "--prefer-offline", "--no-audit", "--no-fund", f"azurite@{AZURITE_VERSION}",
            "--prefix", str(prefix)]


def _installed(prefix: Path) -> Path | None:
    binary = prefix / "node_modules" / ".bin" / "azurite-blob"
    package = prefix / "node_modules" / "azurite" / "package.json"
    try:
        version = json.loads(package.read_text()).get("version")
    except (OSError, ValueError):
        return None
    return binary if version == AZURITE_VERSION and os.access(binary, os.X_OK) else None


def azurite_binary(prefix: Path = NODE_DIR) -> Path:
    """``azurite-blob``: ``$DCP_EXT_AZURITE_BLOB``, else the one under
    ``prefix``, installed there first if missing (once: under a lock that
    other processes wait on).

    Raises:
        AzuriteError: npm is missing or the install failed.
    """
    given = os.environ.get("DCP_EXT_AZURITE_BLOB")
    if given:
        return Path(given)
    found = _installed(prefix)
    if found is not None:
        return found
    prefix.mkdir(parents=True, exist_ok=True)
    with open(prefix / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second worker waits here for the first one's install
        found = _installed(prefix)
        if found is not None:
            return found
        if shutil.which("npm") is None:
            raise AzuriteError(f"Azurite {AZURITE_VERSION} is not installed under {prefix} and npm is not on PATH: "
                               f"install Node.js 18+ and npm, or set DCP_EXT_AZURITE_BLOB to an azurite-blob")
        started = time.monotonic()
        run = subprocess.run(install_command(prefix), cwd=prefix, capture_output=True, text=True,
                             timeout=INSTALL_TIMEOUT)
        found = _installed(prefix)
        if run.returncode != 0 or found is None:
            raise AzuriteError(f"{' '.join(install_command(prefix))} failed (exit {run.returncode}):\n"
                               f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
        (prefix / "install-seconds.txt").write_text(f"{time.monotonic() - started:.1f}\n")
        return found


@dataclass(eq=False)
class AzuriteServer:
    """A running ``azurite-blob`` (its process is ours: :meth:`stop` it)."""

    port: int
    data_dir: Path
    log_path: Path
    process: subprocess.Popen[bytes] = field(repr=False)
    startup_seconds: float = 0.0
    _http: urllib3.PoolManager = field(default_factory=lambda: urllib3.PoolManager(maxsize=8, retries=False),
                                       repr=False)

    @property
    def endpoint(self) -> str:
        """The Blob endpoint (path style: the account is the first path segment)."""
        return f"http://{HOST}:{self.port}/{ACCOUNT}"

    @property
    def connection_string(self) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
                f"BlobEndpoint={self.endpoint};")

    def storage_options(self) -> dict[str, Any]:
        """adlfs-style ``storage_options`` (dcp_ext and adlfs alike)."""
        return {"connection_string": self.connection_string}

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    # -- side door ----------------------------------------------------------
    def request(self, method: str, container: str, blob: str = "", query: dict[str, str] | None = None,
                headers: dict[str, str] | None = None, body: bytes | None = None) -> urllib3.BaseHTTPResponse:
        """One signed request, body read; any status is returned."""
        path = f"/{ACCOUNT}/{container}" + (f"/{urllib.parse.quote(blob, safe='/~')}" if blob else "")
        url = f"http://{HOST}:{self.port}{path}"
        if query:
            url += "?" + urllib.parse.urlencode(query, quote_via=urllib.parse.quote)
        sent = {"x-ms-version": _API_VERSION, "x-ms-date": email.utils.formatdate(usegmt=True), **(headers or {})}
        sent["Content-Length"] = str(len(body)) if body is not None else "0"
        sent["Authorization"] = sign(method, url, sent)
        return self._http.request(method, url, body=body, headers=sent, timeout=urllib3.Timeout(connect=5, read=60))

    def create_container(self, name: str) -> str:
        status = self.request("PUT", name, query={"restype": "container"}).status
        if status not in (201, 409):
            raise AzuriteError(f"creating container {name!r}: HTTP {status}")
        return name

    def blob_names(self, container: str, prefix: str = "", uncommitted: bool = False) -> list[str]:
        """Every blob under ``prefix`` (with ``uncommitted``: blobs that hold only staged blocks too)."""
        names: list[str] = []
        marker = ""
        while True:
            query = {"restype": "container", "comp": "list", "prefix": prefix}
            if uncommitted:
                query["include"] = "uncommittedblobs"
            if marker:
                query["marker"] = marker
            text = self.request("GET", container, query=query).data.decode()
            names += re.findall(r"<Blob><Name>([^<]*)</Name>", text)
            found = re.search(r"<NextMarker>([^<]+)</NextMarker>", text)
            if not found:
                return names
            marker = found.group(1)

    def get_blob(self, container: str, blob: str) -> bytes | None:
        response = self.request("GET", container, blob)
        return bytes(response.data) if response.status == 200 else None

    def committed_blocks(self, container: str, blob: str) -> int:
        """How many blocks the committed blob is made of (1 for a single Put Blob: Azurite lists none)."""
        text = self.request("GET", container, blob, query={"comp": "blocklist", "blocklisttype": "committed"}).data
        return max(1, len(re.findall(rb"<Block>", text)))

    # -- life ----------------------------------------------------------------
    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM (SIGKILL after ``grace``) and reap; idempotent. The data stays."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
        self.process.wait()
        self._http.clear()

    def restart(self) -> None:
        """Start again on the same port with the same data."""
        self.stop()
        process, _, seconds = _spawn_and_wait(azurite_binary(), self.port, self.data_dir, self.log_path)
        self.process, self.startup_seconds = process, seconds

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def __enter__(self) -> AzuriteServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def sign(method: str, url: str, headers: dict[str, str]) -> str:
    """The Shared Key ``Authorization`` header of a request for the development account."""
    parts = urllib.parse.urlsplit(url)
    h = {k.lower(): v for k, v in headers.items()}
    length = "" if h.get("content-length") == "0" else h.get("content-length", "")
    names = ("content-encoding", "content-language", "", "content-md5", "content-type", "date", "if-modified-since",
             "if-match", "if-none-match", "if-unmodified-since", "range")
    standard = [length if n == "" else ("" if n == "date" else h.get(n, "")) for n in names]
    canonical = "".join(f"{k}:{h[k].strip()}\n" for k in sorted(h) if k.startswith("x-ms-"))
    resource = f"/{ACCOUNT}{parts.path}"
    query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
    resource += "".join(f"\n{k.lower()}:{','.join(sorted(query[k]))}" for k in sorted(query, key=str.lower))
    text = f"{method}\n" + "\n".join(standard) + "\n" + canonical + resource
    signature = base64.b64encode(hmac.new(base64.b64decode(KEY), text.encode(), hashlib.sha256).digest()).decode()
    return f"SharedKey {ACCOUNT}:{signature}"


#: Azurite's line once it listens (``--blobPort 0``: the port the kernel gave it).
_LISTENING_RE = re.compile(rf"successfully listens on http://{re.escape(HOST)}:(\d+)")


def _spawn_and_wait(binary: Path, port: int, data_dir: Path, log_path: Path) -> tuple[subprocess.Popen[bytes], int,
                                                                                     float]:
    """Start Azurite on ``port`` (0: one the kernel picks) and wait for its "listens" line: the
    port is read from this process's own log, so no other process can be mistaken for it."""
    cmd = [str(binary), "--blobHost", HOST, "--blobPort", str(port), "--location", str(data_dir), "--silent",
           "--skipApiVersionCheck", "--loose", "--disableTelemetry"]
    started = time.monotonic()
    with open(log_path, "ab") as log:
        log.write(f"\n=== {time.strftime('%H:%M:%S')} {' '.join(cmd)}\n".encode())
        log.flush()
        offset = log.tell()
        process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   cwd=data_dir, start_new_session=True)
    deadline = started + START_TIMEOUT
    while True:
        with open(log_path, "rb") as log:
            log.seek(offset)
            found = _LISTENING_RE.search(log.read().decode(errors="replace"))
        if found:
            return process, int(found.group(1)), time.monotonic() - started
        if process.poll() is not None or time.monotonic() > deadline:
            if process.poll() is None:
                process.kill()
            process.wait()
            tail = log_path.read_text(errors="replace")[-3000:]
            raise AzuriteError(f"azurite-blob {'exited' if process.returncode else 'did not start'}:\n{tail}")
        time.sleep(0.02)


def start_azurite(workdir: str | os.PathLike[str]) -> AzuriteServer:
    """Start ``azurite-blob`` on a port the kernel picks, with its data under ``workdir/data``.

    Raises:
        AzuriteError: It could not be installed or did not start within :data:`START_TIMEOUT` s.
    """
    binary = azurite_binary()
    root = Path(workdir)
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    log_path = root / "azurite.log"
    process, port, seconds = _spawn_and_wait(binary, 0, data, log_path)
    return AzuriteServer(port, data, log_path, process, seconds)


@contextlib.contextmanager
def serving(workdir: str | os.PathLike[str], container: str | None = None) -> Iterator[AzuriteServer]:
    """Azurite with ``container`` created, stopped on exit."""
    server = start_azurite(workdir)
    try:
        if container is not None:
            server.create_container(container)
        yield server
    finally:
        server.stop()
