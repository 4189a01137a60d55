"""A multi-host test cluster on one Linux machine, made of network namespaces.

``Cluster(hosts=3)`` builds, as root, with iproute2 only (no iptables, no nft,
no ``tc netem``)::

    root namespace      dcpc-<token> (10.A.B.1)   the test process's way in
                              |
    dcpc-<pid>-<token>-br     br0: ports gw, s3, h0, h1, ...   (no IP address)
                        /          |            \\
    ...-s3  eth0 10.A.B.2    ...-h0 eth0 10.A.B.10    ...-h1 eth0 10.A.B.11  ...
            weed mini (S3 on :8333)      ranks, any process

* **Bridge in a namespace of its own**, not in the root namespace: the root
  namespace keeps one veth end (``dcpc-<token>``) and nothing else, so a
  crashed test leaves no bridge there (deleting the bridge's namespace deletes
  the bridge and every veth, the root end included); bridged frames never meet
  the root namespace's iptables (``bridge-nf-call-iptables``: Docker's
  ``FORWARD DROP`` would eat them); and the port names (``h0``, ``s3``) cannot
  clash between clusters. The root link lets the test process reach every
  member (S3 readiness probes, checking objects after a run); it is the only
  reason the subnet must not clash with the root namespace's routes (chosen at
  random in 10.200-254.x.0/24, checked and reserved under a lock).
* **Names**: namespaces ``dcpc-<owner pid>-<token>-{br,s3,h0,...}`` (unique per
  cluster, and a dead owner's pid tells the next cluster to sweep them up),
  host names ``h<i>-<token>`` (``h<i>`` resolves too: each process sees a
  private ``/etc/hosts`` listing the members).
* **A process on a host** runs as ``ip netns exec NS unshare --uts -- sh -c
  'hostname ...; mount --bind ...; exec "$@"' sh ARGV``: the network namespace
  of the host, a UTS namespace with its host name, and (``ip netns exec`` makes
  a mount namespace with slave propagation, so nothing leaks to the root)
  the host's node-local directory bound at :attr:`Cluster.local_path`, the same
  path on every host, with every host's real directory hidden under a tmpfs:
  a rank sees its own node's files only, as on a real cluster. Each command
  in the chain ``exec``\\ s the next, so the ``Popen`` pid is the program's.
* **Cuts** (:meth:`Cluster.cut_link`) pin a permanent neighbour (ARP) entry
  with a MAC address nobody has, in *both* namespaces of each cut pair: frames
  leave, the bridge floods them, every port drops them; nothing answers, so a
  connect times out and an established connection stalls, with no RST and no
  ICMP error, as with a dead host. Measured alternatives: a ``blackhole`` route
  fails ``connect`` at once with EINVAL, ``unreachable`` with EHOSTUNREACH,
  ``prohibit`` with EACCES (all immediate errors, not silence); ``ip link set
  <port> down`` on the bridge side gives silence too but cuts everything, and
  the host sees NO-CARRIER. Deleting the entries restores the link; TCP's
  retransmission then carries on (measured: 0.05-0.3 s).
* **Kills** (:meth:`Cluster.kill_host`) SIGKILL every process whose network
  namespace is the host's (``ip netns pids``), tracked or not. The kernel then
  closes their sockets (FIN/RST to peers); ``silent=True`` cuts the host first,
  so peers hear nothing, as when a machine loses power.
* **Cleanup**: :meth:`Cluster.close` (also at exit and from ``with``), a
  watchdog process that reaps the cluster if its owner dies (even by SIGKILL),
  and a sweep of dead owners' namespaces before each new cluster
  (:mod:`tests.support.cluster_reaper`).

Ranks (:meth:`Cluster.spawn`) get the environment torchrun gives (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``MASTER_ADDR`` = host 0's IP, ``MASTER_PORT``) and ``GLOO_SOCKET_IFNAME=eth0``,
join a gloo group, call the target and pickle its result to the run's directory
(:mod:`tests.support.cluster_rank`). They start forked from the test suite's
fork server (torch imported once) and enter the host's namespaces themselves,
or, with ``start="exec"``, as fresh interpreters through the chain above.

Measured on 2 busy cores (load 4-6): start 3 hosts + S3 1.5-2.5 s (network
0.06-0.13 s, SeaweedFS ready 1.4-2.4 s), close 0.1-0.3 s; without S3 0.1 s
each way. A 3-rank world (start, init, all_reduce, barrier, exit): 0.4-1.0 s
forked (the first one also starts the fork server: ~5 s), 7-8 s exec'd (each
rank imports torch).

:func:`require_cluster` skips a test where namespaces cannot be made, and
fails it instead when ``CI=true``.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import ipaddress
import json
import multiprocessing
import os
import pickle
import random
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tests.support import cluster_rank
from tests.support import dist as _dist
from tests.support.cluster_reaper import (
    NETNS_PREFIX,
    Record,
    kill_netns_processes,
    netns_pids,
    process_start,
    reap,
    registry_lock,
    sweep_stale,
)
from tests.support.s3_servers import (
    REGION,
    SEAWEEDFS_ACCESS_KEY,
    SEAWEEDFS_SECRET_KEY,
    _make_boto3_client,
    find_weed_binary,
    s3_options,
)

if TYPE_CHECKING:
    from botocore.client import BaseClient as S3Client

__all__ = [
    "Availability",
    "Cluster",
    "ClusterError",
    "Host",
    "RankResult",
    "Run",
    "RunError",
    "S3Endpoint",
    "cluster_fixture",
    "require_cluster",
]

#: The interface of every member inside its namespace (``GLOO_SOCKET_IFNAME``).
IFNAME = "eth0"
S3_PORT = 8333
#: ``MASTER_PORT`` of the n-th run of a cluster is this plus n (host 0's namespace is ours alone,
#: so no other process can take it; a new port per run avoids waiting on the last run's sockets).
MASTER_PORT_BASE = 29500
#: Locally administered unicast MAC nobody has: where a cut sends its frames.
SINK_MAC = "02:dc:00:00:de:ad"
S3_START_TIMEOUT = 60.0
DEFAULT_RUN_TIMEOUT = 120.0
_REPO_ROOT = Path(__file__).resolve().parents[2]
_GATEWAY, _S3_HOST, _FIRST_HOST = 1, 2, 10
_LOG_TAIL_CHARS = 4000
_TOOLS = ("ip", "unshare", "hostname", "mount", "sh")


class ClusterError(RuntimeError):
    """The cluster could not be built, or a command on it failed."""


@dataclasses.dataclass(frozen=True)
class Availability:
    """Whether clusters can be built here; false (``bool()``) with the reason when not."""

    ok: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ok


@dataclasses.dataclass(frozen=True)
class Host:
    """One host of a cluster (picklable: a rank may receive it as an argument).

    Attributes:
        index: 0, 1, ...; host ``i`` runs ranks ``i * ranks_per_host ...``.
        name: Its host name (``socket.gethostname()`` in its processes).
        netns: Its network namespace.
        ip: Its address on the cluster network.
        local_dir: Its node-local directory as the test process sees it (its
            processes see it at :attr:`Cluster.local_path`).
    """

    index: int
    name: str
    netns: str
    ip: str
    local_dir: Path


@dataclasses.dataclass(frozen=True)
class S3Endpoint:
    """The cluster's S3 server, picklable, for the test process and ranks alike."""

    endpoint_url: str
    access_key: str
    secret_key: str
    region: str = REGION

    @property
    def ip(self) -> str:
        return self.endpoint_url.split("//", 1)[1].rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.endpoint_url.rsplit(":", 1)[1])

    def boto3_client(self, **config_kwargs: Any) -> S3Client:
        """A boto3 client that reads nothing of the user's AWS setup (``config_kwargs`` go to its Config)."""
        return _make_boto3_client(self.endpoint_url, self.access_key, self.secret_key, self.region, **config_kwargs)

    def storage_options(self) -> dict[str, Any]:
        """``s3fs.S3FileSystem`` keyword arguments (dcp_ext's ``storage_options``)."""
        return s3_options(self.endpoint_url, self.access_key, self.secret_key, self.region)


@dataclasses.dataclass(frozen=True)
class RankResult:
    """How one rank of a run ended.

    Attributes:
        rank: Its global rank.
        host: The host it ran on.
        exit_code: The process's exit code (negative: killed by that signal;
            see :mod:`tests.support.cluster_rank` for the others).
        value: What the target returned (``None`` if it raised or never returned).
        error: The traceback of what the target raised, or why there is no result.
        exc_type: The qualified name of the exception it raised.
        timed_out: The run's deadline passed and the rank was killed.
        log: Its stdout and stderr.
        timeline: ``time.time()`` when the rank's bootstrap started (``main``), joined
            the process group, imported and returned from the target (one
            machine, one clock: comparable between ranks and with the test process).
    """

    rank: int
    host: Host
    exit_code: int | None
    value: Any
    error: str | None
    exc_type: str | None
    timed_out: bool
    log: Path
    timeline: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.error is None

    def log_tail(self, max_chars: int = _LOG_TAIL_CHARS) -> str:
        return _tail(self.log, max_chars)

    def describe(self) -> str:
        state = "timed out" if self.timed_out else f"exit code {self.exit_code}"
        text = f"rank {self.rank} on {self.host.name} ({self.host.ip}): {state}"
        if self.error:
            text += f"\n{self.error.rstrip()}"
        tail = self.log_tail(1500).strip()
        if tail:
            text += f"\n--- tail of {self.log} ---\n{tail}"
        return text


class RunError(ClusterError):
    """A rank of a run failed, timed out or left no result."""

    def __init__(self, results: Sequence[RankResult]) -> None:
        self.results = tuple(results)
        failed = [r for r in results if not r.ok]
        super().__init__(f"{len(failed)} of {len(results)} ranks failed:\n" + "\n\n".join(r.describe() for r in failed))


class _ForkedProcess:
    """A rank forked from the fork server, seen through the part of ``Popen`` a run uses."""

    def __init__(self, process: Any) -> None:
        self._process = process
        self.pid: int = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode  # type: ignore[no-any-return]

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired("forked rank", timeout or 0.0)
        return self._process.exitcode  # type: ignore[no-any-return]


@dataclasses.dataclass
class _Rank:
    rank: int
    host: Host
    process: subprocess.Popen[bytes] | _ForkedProcess
    log: Path


class Run:
    """The ranks of one :meth:`Cluster.spawn`, running until :meth:`wait`."""

    def __init__(self, run_dir: Path, ranks: list[_Rank], timeout: float) -> None:
        self.run_dir = run_dir
        self._ranks = ranks
        self._deadline = time.monotonic() + timeout
        self._results: list[RankResult] | None = None

    @property
    def pids(self) -> dict[int, int]:
        """The pid of each rank."""
        return {r.rank: r.process.pid for r in self._ranks}

    def wait(self, timeout: float | None = None) -> list[RankResult]:
        """Wait for every rank (up to ``timeout`` seconds, else until the run's
        deadline), SIGKILL the process group of any rank still running, and
        return the results in rank order."""
        if self._results is not None:
            return self._results
        deadline = self._deadline if timeout is None else time.monotonic() + timeout
        timed_out: set[int] = set()
        for r in self._ranks:
            try:
                r.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out.add(r.rank)
                _kill_group(r.process.pid)
                r.process.wait()
        self._results = [self._result(r, r.rank in timed_out) for r in self._ranks]
        return self._results

    def check(self, timeout: float | None = None) -> list[Any]:
        """:meth:`wait`, then each rank's value, or :class:`RunError` naming every failed rank."""
        results = self.wait(timeout)
        if not all(r.ok for r in results):
            raise RunError(results)
        return [r.value for r in results]

    def _result(self, r: _Rank, timed_out: bool) -> RankResult:
        path = self.run_dir / f"rank{r.rank}.pkl"
        code = r.process.returncode
        try:
            doc = pickle.loads(path.read_bytes())
        except FileNotFoundError:
            doc = {"value": None, "exc_type": None,
                   "error": f"no result (exit code {code}{', killed at the deadline' if timed_out else ''})"}
        return RankResult(r.rank, r.host, code, doc["value"], doc["error"], doc["exc_type"], timed_out, r.log,
                          doc.get("timeline", {}))


@dataclasses.dataclass(frozen=True)
class _Member:
    """One end of the cluster network: a host, the S3 server or the root link."""

    name: str
    netns: str | None  # None: the root namespace
    ifname: str
    ip: str


class Cluster:
    """N hosts, an S3 server and a bridge, each host a network namespace (see the module docstring).

    Use as ``with Cluster(3) as cluster:`` (or :meth:`start` / :meth:`close`).

    Args:
        hosts: How many hosts (at least 1; tests use 3).
        s3: Start SeaweedFS in a namespace of its own (:attr:`s3`).
        base_dir: Where the cluster's directory goes (default: the temp dir).
    """

    def __init__(self, hosts: int = 3, *, s3: bool = True, base_dir: str | os.PathLike[str] | None = None) -> None:
        if not 1 <= hosts <= 200:
            raise ValueError(f"hosts must be 1..200, not {hosts}")
        self._n_hosts = hosts
        self._want_s3 = s3
        self._parent_dir = Path(base_dir) if base_dir is not None else Path(tempfile.gettempdir())
        self.token = secrets.token_hex(3)
        self.cluster_id = f"{NETNS_PREFIX}-{os.getpid()}-{self.token}"
        self.base_dir = self._parent_dir / self.cluster_id
        #: The node-local directory of whichever host a process runs on.
        self.local_path = self.base_dir / "local"
        self.hosts: tuple[Host, ...] = ()
        self.s3: S3Endpoint | None = None
        #: SeaweedFS's output.
        self.s3_log: Path | None = None
        self.subnet: ipaddress.IPv4Network | None = None
        #: Seconds each phase of :meth:`start` and :meth:`close` took.
        self.timings: dict[str, float] = {}
        self._members: dict[str, _Member] = {}
        self._bridge_ns = f"{self.cluster_id}-br"
        self._root_link = f"dcpc-{self.token}"
        self._record: Record | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        # Every process started, by namespace: one that is still entering its namespace is not
        # in it yet, and a kill by namespace alone would miss it.
        self._processes: list[tuple[str, subprocess.Popen[bytes] | _ForkedProcess]] = []
        self._cuts: dict[frozenset[str], set[str]] = {}  # cut pair -> hosts whose cut_link made it
        self._runs = 0
        self._started = False
        self._closed = False

    # ------------------------------------------------------------------ availability

    @staticmethod
    def available(s3: bool = True) -> Availability:
        """Whether this machine can build clusters (root, iproute2, veth and bridge
        support; the ``weed`` binary when ``s3``). Probed once per process."""
        return _availability(s3)

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> Cluster:
        """Build the network, start S3, return ``self``; on failure remove what was made and raise."""
        if self._started:
            return self
        self._started = True
        availability = self.available(self._want_s3)
        if not availability:
            raise ClusterError(f"cannot build a cluster here: {availability.reason}")
        t0 = time.monotonic()
        sweep_stale()
        atexit.register(self.close)
        try:
            self._plan_and_register()
            self._start_watchdog()
            self._build_network()
            self.timings["network"] = time.monotonic() - t0
            if self._want_s3:
                t1 = time.monotonic()
                self._start_s3()
                self.timings["s3"] = time.monotonic() - t1
        except BaseException:
            self.close()
            raise
        self.timings["start"] = time.monotonic() - t0
        return self

    def close(self) -> None:
        """Kill every process on the cluster and remove every namespace, link and
        directory it made. Idempotent; never raises for a part already gone."""
        if self._closed or not self._started:
            return
        self._closed = True
        t0 = time.monotonic()
        atexit.unregister(self.close)
        self._kill_tracked(None)
        if self._record is not None:
            reap(self._record)
        self._kill_tracked(None)
        if self._watchdog is not None:
            with contextlib.suppress(OSError):
                assert self._watchdog.stdin is not None
                self._watchdog.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._watchdog.wait(timeout=5)
        self.timings["close"] = time.monotonic() - t0

    @property
    def netns_names(self) -> tuple[str, ...]:
        """Every namespace of the cluster (bridge, S3, hosts)."""
        return self._record.netns if self._record is not None else ()

    @property
    def root_link(self) -> str:
        """The name of the cluster's veth end in the root namespace."""
        return self._root_link

    def _plan_and_register(self) -> None:
        netns = [self._bridge_ns] + ([f"{self.cluster_id}-s3"] if self._want_s3 else [])
        netns += [f"{self.cluster_id}-h{i}" for i in range(self._n_hosts)]
        self._record = Record(self.cluster_id, os.getpid(), process_start(os.getpid()), str(self.base_dir),
                              tuple(netns), self._root_link)
        self._record.write()  # first: whatever exists after this, a reaper knows of
        self.base_dir.mkdir(mode=0o755, parents=True)

    def _start_watchdog(self) -> None:
        assert self._record is not None
        self._watchdog = subprocess.Popen(
            [sys.executable, "-m", "tests.support.cluster_reaper", str(self._record.path)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            cwd=_REPO_ROOT, env=_with_pythonpath(dict(os.environ)), start_new_session=True)

    def _build_network(self) -> None:
        assert self._record is not None
        with registry_lock():  # the subnet and the root link name must not clash with another cluster's
            self.subnet = _free_subnet()
            _ip(None, [f"netns add {ns}" for ns in self._record.netns])
            net = self.subnet.network_address
            _ip(None, [f"link add name {self._root_link} type veth peer name gw netns {self._bridge_ns}",
                       f"link set {self._root_link} addrgenmode none",
                       f"addr add {net + _GATEWAY}/24 dev {self._root_link}",
                       f"link set {self._root_link} up"])
        self._members["gw"] = _Member("gw", None, self._root_link, str(net + _GATEWAY))
        if self._want_s3:
            self._members["s3"] = _Member("s3", f"{self.cluster_id}-s3", IFNAME, str(net + _S3_HOST))
        hosts = []
        for i in range(self._n_hosts):
            member = _Member(f"h{i}", f"{self.cluster_id}-h{i}", IFNAME, str(net + _FIRST_HOST + i))
            self._members[member.name] = member
            local_dir = self.base_dir / "hosts" / f"h{i}"
            local_dir.mkdir(parents=True)
            assert member.netns is not None
            hosts.append(Host(i, f"h{i}-{self.token}", member.netns, member.ip, local_dir))
        self.hosts = tuple(hosts)
        self.local_path.mkdir()
        bridge = ["link set lo up", "link add name br0 type bridge", "link set br0 addrgenmode none",
                  "link set br0 up", "link set gw addrgenmode none", "link set gw master br0 up"]
        for m in self._members.values():
            if m.netns is None:
                continue
            bridge += [f"link add name {m.name} type veth peer name {IFNAME} netns {m.netns}",
                       f"link set {m.name} addrgenmode none", f"link set {m.name} master br0 up"]
        _ip(self._bridge_ns, bridge)
        for m in self._members.values():
            if m.netns is not None:
                _ip(m.netns, ["link set lo up", f"link set {IFNAME} addrgenmode none",
                              f"addr add {m.ip}/24 dev {IFNAME}", f"link set {IFNAME} up"])
        lines = ["127.0.0.1\tlocalhost", f"{self._members['gw'].ip}\tgw"]
        if self._want_s3:
            lines.append(f"{self._members['s3'].ip}\ts3-{self.token} s3")
        lines += [f"{h.ip}\t{h.name} h{h.index}" for h in self.hosts]
        # TCPStore looks up its clients' names by their IPv4-mapped IPv6 address; without these the
        # lookup falls through to DNS, unreachable here, and every rank logs a warning.
        lines += [f"::ffff:{h.ip}\t{h.name}" for h in self.hosts]
        (self.base_dir / "etc_hosts").write_text("\n".join(lines) + "\n")

    def _start_s3(self) -> None:
        member = self._members["s3"]
        assert member.netns is not None
        s3_dir = self.base_dir / "s3"
        (s3_dir / "data").mkdir(parents=True)
        # Every port is free in a namespace of its own, but weed puts unix sockets in /tmp under
        # names made of port numbers, and /tmp is shared between namespaces: the server gets a
        # private /tmp (s3tmp), with its own directory bound inside it at /tmp/s3 (its real path
        # may be under /tmp, which the private one hides).
        private_tmp = self.base_dir / "s3tmp"
        (private_tmp / "s3").mkdir(parents=True)
        config = s3_dir / "identities.json"
        config.write_text(json.dumps({"identities": [{
            "name": "dcp_ext_test",
            "credentials": [{"accessKey": SEAWEEDFS_ACCESS_KEY, "secretKey": SEAWEEDFS_SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        weed = find_weed_binary()
        if Path("/tmp") in Path(weed).resolve().parents:  # hidden by the private /tmp (a checkout under /tmp)
            inside = s3_dir / "weed"
            try:
                os.link(Path(weed).resolve(), inside)
            except OSError:
                shutil.copy2(Path(weed).resolve(), inside)
            weed = "/tmp/s3/weed"
        argv = [str(weed), "mini", "-dir=/tmp/s3/data", f"-ip={member.ip}", "-ip.bind=0.0.0.0",
                f"-s3.port={S3_PORT}", "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0",
                "-s3.port.lance=0", "-master.telemetry=false", "-master.volumeSizeLimitMB=64",
                "-master.volumePreallocate=false", "-volume.preStopSeconds=0", "-s3.config=/tmp/s3/identities.json"]
        env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": "/tmp/s3", "TMPDIR": "/tmp"}
        self.s3 = S3Endpoint(f"http://{member.ip}:{S3_PORT}", SEAWEEDFS_ACCESS_KEY, SEAWEEDFS_SECRET_KEY)
        self.s3_log = s3_dir / "weed.log"
        process = self._popen(member.netns, f"s3-{self.token}",
                              [(s3_dir, private_tmp / "s3"), (private_tmp, Path("/tmp"))], [], argv, env,
                              self.s3_log, cwd=Path("/"))
        _wait_s3_ready(self.s3, process, self.s3_log, time.monotonic() + S3_START_TIMEOUT)

    # ------------------------------------------------------------------ processes

    def popen(self, host: Host | int, argv: Sequence[str], *, env: dict[str, str] | None = None,
              log: Path | None = None, cwd: Path | None = None, capture: bool = False) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``host`` (its network, host name and node-local
        directory), stdout and stderr to ``log`` (default: a file in the cluster
        directory) or, with ``capture``, to pipes. The process leads a session
        of its own; :meth:`kill_host` and :meth:`close` kill it."""
        host = self._host(host)
        if log is None and not capture:
            log = self.base_dir / "logs" / f"{host.name}-{len(self._processes)}.log"
        return self._popen(host.netns, host.name, self._host_binds(host), [self.base_dir / "hosts"], argv,
                           dict(os.environ) if env is None else env, log, cwd)

    def check_output(self, host: Host | int, argv: Sequence[str], *, timeout: float = 30.0,
                     env: dict[str, str] | None = None) -> str:
        """Run ``argv`` on ``host`` and return its stdout; :class:`ClusterError` if it fails or outlives ``timeout``."""
        host = self._host(host)
        process = self.popen(host, argv, env=env, capture=True)
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(process.pid)
            process.communicate()
            raise ClusterError(f"{list(argv)} on {host.name} did not end within {timeout} s") from None
        if process.returncode != 0:
            raise ClusterError(f"{list(argv)} on {host.name} exited with {process.returncode}: "
                               f"{err.decode(errors='replace')[-2000:]}")
        return out.decode(errors="replace")

    def spawn(self, target: Callable[..., Any] | str, *, args: Sequence[Any] = (),
              kwargs: dict[str, Any] | None = None, ranks_per_host: int = 1, hosts: Iterable[int] | None = None,
              env: dict[str, str | None] | None = None, init_process_group: bool = True,
              pg_timeout: float | None = None, final_barrier: bool = True,
              timeout: float = DEFAULT_RUN_TIMEOUT, start: str = "fork") -> Run:
        """Start ``target(*args, **kwargs)`` as the ranks of one world spread over the hosts.

        Ranks are numbered host by host (host ``hosts[0]`` runs ranks
        ``0..ranks_per_host-1``); ``MASTER_ADDR`` is the IP of the first host.
        With ``init_process_group`` each rank joins a gloo group (``env://``,
        ``pg_timeout`` seconds, torch's default when ``None``) before the call
        and passes a barrier after it. ``env`` adds variables (``None``
        removes one) to the test process's environment; ``OMP_NUM_THREADS``
        defaults to 1. :meth:`Run.wait` is bounded by ``timeout`` seconds.

        Args:
            target: A module-level function (a ``"module:function"`` string works too).
            start: ``"fork"``: fork each rank from the fork server of
                ``tests/support/dist.py`` (torch imported once), and let it enter
                the host's namespaces itself (:func:`tests.support.cluster_rank.enter_host`);
                ``"exec"``: a fresh interpreter per rank through ``ip netns exec``
                (:meth:`popen`), as a real launch, paying ``import torch`` per rank
                (measured: a 3-rank world ~1 s forked, 7-11 s exec'd on 2 busy cores).
        """
        if start not in ("fork", "exec"):
            raise ValueError(f"start must be 'fork' or 'exec', not {start!r}")
        spec_target = target if isinstance(target, str) else _qualified_name(target)
        chosen = [self._host(i) for i in (range(len(self.hosts)) if hosts is None else hosts)]
        if not chosen or ranks_per_host < 1:
            raise ValueError("a run needs at least one host and one rank per host")
        run_dir = self.base_dir / "runs" / f"{self._runs:03d}"
        run_dir.mkdir(parents=True)
        master_port = MASTER_PORT_BASE + self._runs
        self._runs += 1
        spec = {"target": spec_target, "args": tuple(args), "kwargs": dict(kwargs or {}),
                "init_process_group": init_process_group, "pg_timeout": pg_timeout,
                "final_barrier": final_barrier, "run_dir": str(run_dir)}
        (run_dir / "spec.pkl").write_bytes(pickle.dumps(spec))
        world = len(chosen) * ranks_per_host
        ranks: list[_Rank] = []
        base_env = {k: v for k, v in os.environ.items() if k not in _RANK_ENV}
        base_env.setdefault("OMP_NUM_THREADS", "1")
        try:
            for node, host in enumerate(chosen):
                for local in range(ranks_per_host):
                    rank = node * ranks_per_host + local
                    rank_env = {**base_env, **self.rank_env(host), "RANK": str(rank), "WORLD_SIZE": str(world),
                                "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(ranks_per_host),
                                "GROUP_RANK": str(node), "MASTER_ADDR": chosen[0].ip,
                                "MASTER_PORT": str(master_port)}
                    for key, value in (env or {}).items():
                        if value is None:
                            rank_env.pop(key, None)
                        else:
                            rank_env[key] = value
                    log = run_dir / f"rank{rank}.log"
                    spec_path = str(run_dir / "spec.pkl")
                    process: subprocess.Popen[bytes] | _ForkedProcess
                    if start == "exec":
                        process = self.popen(host, [sys.executable, "-m", "tests.support.cluster_rank", spec_path],
                                             env=_with_pythonpath(rank_env), log=log, cwd=_REPO_ROOT)
                    else:
                        process = self._fork(host, _with_pythonpath(rank_env), log, spec_path)
                    ranks.append(_Rank(rank, host, process, log))
        except BaseException:
            for r in ranks:
                _kill_group(r.process.pid)
            raise
        return Run(run_dir, ranks, timeout)

    def _fork(self, host: Host, environ: dict[str, str], log: Path, spec_path: str) -> _ForkedProcess:
        if self._closed:
            raise ClusterError("the cluster is closed")
        entry = {"netns": host.netns, "hostname": host.name,
                 "binds": [(str(src), str(dst)) for src, dst in self._host_binds(host)],
                 "hide": [str(self.base_dir / "hosts")]}
        process = _fork_context().Process(target=cluster_rank.run_forked,
                                          args=(entry, environ, str(_REPO_ROOT), str(log), spec_path), daemon=False)
        process.start()
        forked = _ForkedProcess(process)
        self._processes.append((host.netns, forked))
        return forked

    def _host_binds(self, host: Host) -> list[tuple[Path, Path]]:
        return [(host.local_dir, self.local_path), (self.base_dir / "etc_hosts", Path("/etc/hosts"))]

    def run(self, target: Callable[..., Any] | str, **options: Any) -> list[Any]:
        """:meth:`spawn` and :meth:`Run.check`: every rank's return value, or :class:`RunError`."""
        return self.spawn(target, **options).check()

    def rank_env(self, host: Host | int) -> dict[str, str]:
        """The variables every process of ``host`` started by :meth:`spawn` gets
        besides torchrun's (the interface for gloo, where S3 and the node-local directory are)."""
        host = self._host(host)
        env = {"GLOO_SOCKET_IFNAME": IFNAME, "TP_SOCKET_IFNAME": IFNAME, "DCP_CLUSTER_HOST": host.name,
               "DCP_CLUSTER_HOST_INDEX": str(host.index), "DCP_CLUSTER_HOST_IP": host.ip,
               "DCP_CLUSTER_LOCAL_DIR": str(self.local_path)}
        if self.s3 is not None:
            env["DCP_CLUSTER_S3_ENDPOINT"] = self.s3.endpoint_url
        return env

    def pids(self, host: Host | int) -> list[int]:
        """Every process on ``host`` (in its network namespace), tracked or not."""
        return netns_pids(self._host(host).netns)

    # ------------------------------------------------------------------ faults

    def kill_host(self, host: Host | int, *, silent: bool = False) -> list[int]:
        """SIGKILL every process on ``host``; returns their pids.

        The kernel closes a killed process's sockets, so its peers get FIN or
        RST, as when a process crashes. ``silent=True`` first cuts the host off
        (:meth:`cut_link` ``"all"``, left in place), so its peers hear nothing,
        as when a machine loses power.
        """
        host = self._host(host)
        if silent:
            self.cut_link(host, "all")
        present = netns_pids(host.netns)
        killed = self._kill_tracked(host.netns)  # by session: those still entering the namespace too
        killed += kill_netns_processes(host.netns)
        killed += self._kill_tracked(host.netns)
        return sorted(set(present + killed))

    def _kill_tracked(self, netns: str | None) -> list[int]:
        """SIGKILL and reap the processes this cluster started (in ``netns``, or all)."""
        killed = []
        for where, process in self._processes:
            if netns is not None and where != netns:
                continue
            if process.poll() is None:
                _kill_group(process.pid)
                killed.append(process.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)
        return killed

    def cut_link(self, host: Host | int, to: str = "all") -> None:
        """Let no packet pass between ``host`` and ``to`` ("s3", "hosts": every
        other host, "all": those and the test process's root link), in either
        direction, without a reset or an error: senders see silence (TCP retries,
        connects time out). Cuts add up; :meth:`restore_link` undoes them."""
        host = self._host(host)
        if to == "s3":
            if "s3" not in self._members:
                raise ValueError("this cluster has no S3 server")
            peers = ["s3"]
        elif to == "hosts":
            peers = [f"h{h.index}" for h in self.hosts if h.index != host.index]
        elif to == "all":
            peers = [name for name in self._members if name != f"h{host.index}"]
        else:
            raise ValueError(f"cut_link(to=...) must be 's3', 'hosts' or 'all', not {to!r}")
        me = f"h{host.index}"
        new = []
        for peer in peers:
            pair = frozenset((me, peer))
            if pair not in self._cuts:
                new.append(pair)
            self._cuts.setdefault(pair, set()).add(me)
        self._set_neighbours(new, "replace", f"lladdr {SINK_MAC} nud permanent")

    def restore_link(self, host: Host | int) -> None:
        """Undo every :meth:`cut_link` of ``host`` (cuts other hosts made stay)."""
        me = f"h{self._host(host).index}"
        gone = []
        for pair, owners in list(self._cuts.items()):
            owners.discard(me)
            if not owners:
                del self._cuts[pair]
                gone.append(pair)
        self._set_neighbours(gone, "del", "")

    def _set_neighbours(self, pairs: Iterable[frozenset[str]], verb: str, tail: str) -> None:
        by_ns: dict[str | None, list[str]] = {}
        for pair in pairs:
            a, b = (self._members[name] for name in sorted(pair))
            for here, there in ((a, b), (b, a)):
                by_ns.setdefault(here.netns, []).append(f"neigh {verb} {there.ip} dev {here.ifname} {tail}".rstrip())
        for netns, lines in by_ns.items():
            _ip(netns, lines, force=verb == "del")  # a deleted entry may already be gone (never resolved)

    # ------------------------------------------------------------------ helpers

    def _host(self, host: Host | int) -> Host:
        if not self.hosts:
            raise ClusterError("the cluster is not started")
        return self.hosts[host] if isinstance(host, int) else self.hosts[host.index]

    def _popen(self, netns: str, hostname: str, binds: list[tuple[Path, Path]], hide: list[Path],
               argv: Sequence[str], env: dict[str, str], log: Path | None,
               cwd: Path | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` in ``netns`` with a UTS namespace named ``hostname``, ``binds``
        mounted and ``hide`` covered by an empty tmpfs; output to ``log``, or pipes if ``None``."""
        if self._closed:
            raise ClusterError("the cluster is closed")
        steps = [f"hostname {shlex.quote(hostname)}"]
        steps += [f"mount --rbind {shlex.quote(str(src))} {shlex.quote(str(dst))}" for src, dst in binds]
        steps += [f"mount -t tmpfs -o size=64k,mode=0755 dcpc-hidden {shlex.quote(str(d))}" for d in hide]
        steps.append('exec "$@"')
        command = ["ip", "netns", "exec", netns, "unshare", "--uts", "--", "sh", "-c", " && ".join(steps), "sh",
                   *argv]
        with contextlib.ExitStack() as stack:
            if log is None:
                out: Any = subprocess.PIPE
                err: Any = subprocess.PIPE
            else:
                log.parent.mkdir(parents=True, exist_ok=True)
                out, err = stack.enter_context(open(log, "ab")), subprocess.STDOUT
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                                       cwd=cwd or self.base_dir, start_new_session=True)
        self._processes.append((netns, process))
        return process


_RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
             "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "DCP_EXT_NODE_RANK")


def require_cluster(s3: bool = True) -> None:
    """Skip the calling test where clusters cannot be built; fail it instead when ``CI=true``
    (a CI machine that cannot run these tests is misconfigured, not exempt)."""
    availability = Cluster.available(s3)
    if availability:
        return
    import pytest  # here, not at the top: every rank imports this module, and pytest costs ~1 s there

    if os.environ.get("CI", "").strip().lower() == "true":
        pytest.fail(f"CI=true but the namespace cluster cannot run: {availability.reason}", pytrace=False)
    pytest.skip(availability.reason)


def cluster_fixture(hosts: int = 3, *, s3: bool = True,
                    scope: Literal["session", "package", "module", "class", "function"] = "module") -> Any:
    """A pytest fixture yielding a started :class:`Cluster` (after :func:`require_cluster`):
    ``cluster = cluster_fixture(3)`` at module level makes ``cluster`` a fixture of that module."""
    import pytest

    @pytest.fixture(scope=scope)
    def cluster() -> Iterator[Cluster]:
        require_cluster(s3)
        with Cluster(hosts, s3=s3) as started:
            yield started

    return cluster


_AVAILABILITY: dict[bool, Availability] = {}


def _availability(s3: bool) -> Availability:
    if s3 not in _AVAILABILITY:
        _AVAILABILITY[s3] = _probe(s3)
    return _AVAILABILITY[s3]


def _probe(s3: bool) -> Availability:
    if not sys.platform.startswith("linux"):
        return Availability(False, f"network namespaces need Linux, not {sys.platform}")
    if os.geteuid() != 0:
        return Availability(False, "network namespaces need root (euid 0)")
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        return Availability(False, f"missing tools: {', '.join(missing)} (iproute2, util-linux, hostname)")
    if s3:
        try:
            find_weed_binary()
        except FileNotFoundError as exc:
            return Availability(False, str(exc))
    name = f"{NETNS_PREFIX}-{os.getpid()}-{secrets.token_hex(3)}-probe"
    try:
        _ip(None, [f"netns add {name}"])
        _ip(name, ["link add name probe0 type bridge", "link add name probe1 type veth peer name probe2",
                   "link set probe1 master probe0", "link set lo up"])
        subprocess.run(["ip", "netns", "exec", name, "unshare", "--uts", "--", "hostname", "probe"], check=True,
                       capture_output=True, timeout=10)
    except (ClusterError, subprocess.SubprocessError, OSError) as exc:
        return Availability(False, f"cannot make a namespace with a bridge and a veth pair: {exc}")
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
    return Availability(True, "")


def _ip(netns: str | None, lines: Sequence[str], *, force: bool = False) -> None:
    """Run ``ip`` commands (one process per namespace: ``ip -n NS -batch -``)."""
    if not lines:
        return
    argv = ["ip"] + ([] if netns is None else ["-n", netns]) + (["-force"] if force else []) + ["-batch", "-"]
    done = subprocess.run(argv, input="\n".join(lines) + "\n", capture_output=True, text=True, check=False)
    if done.returncode != 0 and not force:
        raise ClusterError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}\n"
                           f"commands: {list(lines)}")


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.200.0.0-10.254.255.0 that overlaps no address or route of the root namespace.
    The caller holds :func:`registry_lock` until the subnet's address is added."""
    taken = []
    for argv in (["ip", "-4", "-o", "addr", "show"], ["ip", "-4", "route", "show", "table", "all"]):
        out = subprocess.run(argv, capture_output=True, text=True, check=False).stdout
        for token in out.split():
            with contextlib.suppress(ValueError):
                if any(c.isdigit() for c in token) and "." in token:
                    net = ipaddress.ip_network(token, strict=False)
                    if net.prefixlen > 0:
                        taken.append(net)
    rng = random.Random(secrets.randbits(64))
    for _ in range(1000):
        candidate = ipaddress.IPv4Network(f"10.{rng.randint(200, 254)}.{rng.randint(0, 255)}.0/24")
        if not any(candidate.overlaps(net) for net in taken):
            return candidate
    raise ClusterError("no free 10.200-254.x.0/24 subnet in the root namespace")


def _wait_s3_ready(s3: S3Endpoint, process: subprocess.Popen[bytes], log: Path, deadline: float) -> None:
    """Poll (from the root namespace, through the root link) until a bucket create/put/get/delete works."""
    import botocore.exceptions

    client = s3.boto3_client(connect_timeout=1, read_timeout=5, retries={"max_attempts": 1})
    bucket = "cluster-probe"
    last: BaseException | None = None
    while True:
        if process.poll() is not None or time.monotonic() > deadline:
            state = f"exited with {process.returncode}" if process.poll() is not None else "not ready in time"
            raise ClusterError(f"SeaweedFS in the cluster {state}; last probe error: {last!r}\n"
                               f"--- tail of {log} ---\n{_tail(log, _LOG_TAIL_CHARS)}")
        try:
            with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                client.create_bucket(Bucket=bucket)
            client.put_object(Bucket=bucket, Key="probe", Body=b"probe")
            if client.get_object(Bucket=bucket, Key="probe")["Body"].read() != b"probe":
                raise ClusterError("the S3 probe read back other bytes")
            client.delete_object(Bucket=bucket, Key="probe")
            client.delete_bucket(Bucket=bucket)
            return
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, ClusterError) as exc:
            last = exc
            time.sleep(0.1)


def _fork_context() -> Any:
    """The fork server ranks fork from: the test suite's (``tests/support/dist.py``), torch preloaded."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_dist.FORKSERVER_PRELOAD)
    return ctx


def _kill_group(pid: int) -> None:
    """SIGKILL the session ``pid`` leads (a rank and anything it started), or ``pid`` alone
    if it has not made its session yet."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _qualified_name(target: Callable[..., Any]) -> str:
    module, qualname = getattr(target, "__module__", None), getattr(target, "__qualname__", "")
    if not module or module == "__main__" or "<locals>" in qualname:
        raise ValueError(f"{target!r} is not importable by name; pass a module-level function")
    return f"{module}:{qualname}"


def _with_pythonpath(env: dict[str, str]) -> dict[str, str]:
    paths = [str(_REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**env, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


def _tail(path: Path, max_chars: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_chars))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
