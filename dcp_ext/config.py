"""Tunables for storage I/O, in one place.

Defaults suit most users: one writer stream per rank, 16 MiB S3 parts with 8 in
flight (about 128 MiB of upload buffers per rank), ranged reads merged when
closer than 1 MiB, reads split into 16 MiB requests with 16 in flight.

Every field can also be set from the environment (``DCP_EXT_PART_SIZE=8MiB``,
``DCP_EXT_MAX_CONCURRENCY=4``, ...), which is handy on a cluster where the code
cannot change; explicit arguments win over the environment.

When to change them:

* ``part_size``: larger parts (32-64 MiB) help on fast links to S3 with few
  ranks; S3 needs at least 5 MiB and allows at most 10,000 parts per object, so
  files bigger than ``10_000 * part_size`` raise the part size automatically.
* ``max_concurrency``: requests in flight per rank. Raise it when one rank must
  saturate a fast network link; lower it (and ``part_size``) to cap memory.
* ``files_per_rank``: split one rank's shard into several files written by
  parallel threads. Helps on parallel file systems (Lustre/FSx) where one
  stream is limited by a single object storage target.
* ``coalesce_gap``: ranged reads closer than this are fetched in one request.
  Object stores charge per request, so this is larger for S3 than for disk.
* ``key_prefixes``: when hundreds of ranks save to one S3 bucket and S3
  answers ``503 SlowDown``, deal the data files out over this many key
  prefixes (256 suits thousands of ranks); S3 serves about 3,500 writes and
  5,500 reads per second per prefix.
* ``s3_connect_timeout``, ``s3_read_timeout``, ``s3_request_deadline``: how
  long an S3 request may wait. The defaults (5 s, 20 s, 60 s) fail a dead
  endpoint within a minute (botocore's own 60 s read timeout and our six
  attempts held a save for over 700 s, issue 32); raise the read timeout and
  the deadline for an endpoint that is slow to answer (a busy gateway, a
  server far away), lower them to fail over sooner.
* ``heartbeat_interval``, ``heartbeat_timeout``, ``clock_skew_tolerance``:
  a save in flight renews its lock and lease every ``heartbeat_interval``
  (15 s); a record not renewed for ``heartbeat_timeout`` (180 s) counts as
  dead on every host, so a crashed host holds up the next save, pruning and
  compaction of its checkpoints that long. Lower the timeout for faster
  takeover on reliable storage; keep it well above the interval plus the
  storage's worst request time (``s3_request_deadline``), or a slow renewal
  makes a live save look dead. ``clock_skew_tolerance`` (60 s) is how far in
  the future another host's times are believed (:mod:`dcp_ext.guard._liveness`).
* ``collective_timeout``: how long a rank of a save or load waits for the
  others at one step before the survivors raise ``RankFailedError`` naming
  the ranks and hosts that did not come (600 s). Set it above the longest a
  rank may take to write or read its share; lower it to fail over sooner.
* ``background_cpu_share``: how much of a busy core an asynchronous save's
  background threads (staging copy, upload, writes, encoding) may take from
  training (Linux: a nice value per thread; idle cores they use in full).
  Lower it when training is CPU-bound and the save has time to spare before
  the next one; raise it (``1.0``: training's priority) when the next save
  waits for the previous upload. See the tuning guide for the measurements.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass

__all__ = ["IOConfig", "RetryPolicy", "parse_size"]

_KIB = 1024
_MIB = 1024 * 1024
_GIB = 1024 * 1024 * 1024

_SIZE_FIELDS = frozenset(
    {"part_size", "read_request_size", "coalesce_gap", "read_buffer_bytes", "frame_size"}
)
_SECONDS_FIELDS = frozenset({
    "s3_connect_timeout", "s3_read_timeout", "s3_request_deadline",
    "heartbeat_interval", "heartbeat_timeout", "clock_skew_tolerance", "collective_timeout",
})
_FRACTION_FIELDS = frozenset({"background_cpu_share"})

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": _KIB,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": _MIB,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": _GIB,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}


def parse_size(value: int | str) -> int:
    """Parse a byte count such as ``16777216``, ``"16MiB"`` or ``"8 MB"``.

    Raises:
        ValueError: ``value`` is not a non-negative size.
    """
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return value
    match = _SIZE_RE.match(str(value))
    unit = (match.group(2) or "").lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(f"cannot parse size {value!r}: use bytes or e.g. '16MiB'")
    return int(float(match.group(1)) * _UNITS[unit])


def _parse_seconds(raw: str, variable: str) -> float:
    try:
        return float(raw)
    except ValueError as err:
        raise ValueError(f"{variable}={raw!r} is not a number of seconds") from err


def _parse_fraction(raw: str, variable: str) -> float:
    try:
        return float(raw)
    except ValueError as err:
        raise ValueError(f"{variable}={raw!r} is not a number between 0 and 1") from err


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff with full jitter for transient storage errors.

    Attempt ``n`` (from 1) that fails transiently sleeps a random time in
    ``[0, min(max_delay, base_delay * 2**(n-1))]`` before the next one; after
    ``max_attempts`` attempts the last error is raised.

    Attributes:
        max_attempts: Attempts per request, including the first one.
        base_delay: Seconds of the first backoff ceiling.
        max_delay: Upper bound of any single backoff, seconds.
    """

    max_attempts: int = 6
    base_delay: float = 0.1
    max_delay: float = 4.0

    def __post_init__(self) -> None:
        """Check the fields.

        Raises:
            ValueError: ``max_attempts`` is below 1 or a delay is negative.
        """
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.base_delay < 0 or self.max_delay < 0:
            raise ValueError("retry delays must be >= 0")


@dataclass(frozen=True)
class IOConfig:
    """How a writer or reader moves bytes. All sizes in bytes.

    Attributes:
        part_size: Bytes per S3 multipart part / per streamed write buffer.
        max_concurrency: Requests (parts or ranged reads) in flight per rank.
        read_request_size: Largest single ranged read; bigger ranges are split
            into parallel requests of this size.
        coalesce_gap: Merge ranged reads whose gap is below this many bytes.
            ``None`` picks 1 MiB for object stores and 64 KiB for file systems.
        read_buffer_bytes: Cap on scratch memory for reads that cannot land
            directly in the destination tensor (resharded slices, dtype casts).
        files_per_rank: Data files each rank writes, in parallel threads.
        fsync: ``fsync`` data and metadata on file systems before commit.
            Turning it off trades crash safety for speed.
        frame_size: Bytes of raw data per frame: the unit that is compressed,
            checksummed and verified on its own. A reader that needs part of a
            stored chunk reads (and decompresses) only the frames covering it,
            so smaller frames mean less over-read on partial loads and a
            bigger index in the metadata (about 30 bytes per frame: 30 KB per
            GiB at the default 1 MiB).
        verify_checksums: Check every frame a reader reads against the
            checksum recorded at save time (xxh3-64, which hashes about
            20 GB/s per core); turn off only for data you trust.
        key_prefixes: Saves put each data file under one of this many key
            prefixes inside the checkpoint directory
            (``step100_partial/30/model_rank3.distcp``; see
            :func:`dcp_ext.layout.key_prefix`), so that S3 spreads the ranks'
            requests over several partitions. ``0`` (default) keeps
            SageMaker's names (``step100_partial/model_rank3.distcp``). The
            metadata records each file's name: loading needs no setting.
        metadata_version: Format of the metadata saves write: ``3``
            (default; a compact chunk table, and each data file's frame
            checksums in an index at its end that only its readers read) or
            ``2`` (every frame's checksum in the JSON document, as dcp_ext
            0.x wrote). Loads read both.
        torch_metadata_chunks: Uncompressed saves also write torch's pickled
            ``.metadata``, so torch's own readers can load them, when the
            checkpoint has at most this many chunks (``0``: never). Pickling
            costs the coordinator ~25 us per chunk (8B model on 1,024 ranks:
            900k chunks, about 25 s), so large saves skip it; dcp_ext reads
            either way.
        retry: Backoff policy for transient errors.
        s3_connect_timeout: Seconds an S3 request waits for its TCP (and
            TLS) connection to open (botocore's ``connect_timeout``, default
            60 s there). Environment: ``DCP_EXT_S3_CONNECT_TIMEOUT``.
        s3_read_timeout: Seconds an S3 request waits for the endpoint's
            next bytes, while sending the body or receiving the answer
            (botocore's ``read_timeout``, default 60 s there); a silent
            endpoint fails the attempt after this long. Environment:
            ``DCP_EXT_S3_READ_TIMEOUT``.
        s3_request_deadline: Seconds one S3 request may take with all its
            retries. No attempt starts (and no backoff sleeps) once it
            could not end, if the endpoint stays silent, within this
            deadline (``s3_connect_timeout + s3_read_timeout`` per attempt),
            so a dead endpoint fails a request in at most this long: with
            the defaults after two 20 s attempts, 40 s. Environment:
            ``DCP_EXT_S3_REQUEST_DEADLINE``. ``storage_options``'
            ``config_kwargs`` ``connect_timeout``/``read_timeout`` take
            precedence over the two timeouts (and count in the deadline).
        heartbeat_interval: Seconds between renewals of the save locks and
            leases this process holds. Environment: ``DCP_EXT_HEARTBEAT_INTERVAL``.
        heartbeat_timeout: Seconds after its last renewal at which a lock
            or lease counts as dead, whichever host wrote it (at least three
            intervals). Written into each record, so other jobs judge it by
            the holder's own setting. Environment: ``DCP_EXT_HEARTBEAT_TIMEOUT``.
        clock_skew_tolerance: Seconds another host's (or the storage's)
            clock may run ahead of this one's and its times still be
            believed. Environment: ``DCP_EXT_CLOCK_SKEW_TOLERANCE``.
        collective_timeout: Seconds a rank of a save or load waits at one
            collective step (planning, the end of the writes, the commit,
            the reads) for the others before every surviving rank raises
            :class:`~dcp_ext.errors.RankFailedError` naming the ranks and
            hosts that did not come. It must exceed the longest a rank may
            legitimately take between two steps: its share of the bytes at
            its storage's write speed, plus margin (default 600 s: 60 GB per
            rank at 100 MB/s). Applies to dcp_ext's saves and loads on the
            default group (a caller's ``process_group`` keeps its own
            timeout); the same on every rank. Environment:
            ``DCP_EXT_COLLECTIVE_TIMEOUT``.
        background_cpu_share: The share of a core, in ``(0, 1]``, that the
            threads of an asynchronous save with background staging
            (:class:`~dcp_ext.Stager`: its copy threads, and DCP's upload
            thread with the writer, encoder and S3 threads it starts) get
            while training keeps that core busy. On Linux it sets their nice
            value (CFS weight ``w / (w + 1024)``: ``0.25`` is nice +5,
            ``0.1`` nice +10, ``1.0`` training's own priority); CPU that
            training leaves idle they use in full, so the save is not slower
            on an idle machine. Synchronous saves and loads run at the
            caller's priority. Environment: ``DCP_EXT_BACKGROUND_CPU_SHARE``.
    """

    part_size: int = 16 * _MIB
    max_concurrency: int = 8
    read_request_size: int = 16 * _MIB
    coalesce_gap: int | None = None
    read_buffer_bytes: int = 256 * _MIB
    files_per_rank: int = 1
    fsync: bool = True
    frame_size: int = 1 * _MIB
    verify_checksums: bool = True
    key_prefixes: int = 0
    metadata_version: int = 3
    torch_metadata_chunks: int = 100_000
    retry: RetryPolicy = dataclasses.field(default_factory=RetryPolicy)
    s3_connect_timeout: float = 5.0
    s3_read_timeout: float = 20.0
    s3_request_deadline: float = 60.0
    heartbeat_interval: float = 15.0
    heartbeat_timeout: float = 180.0
    clock_skew_tolerance: float = 60.0
    collective_timeout: float = 600.0
    background_cpu_share: float = 0.25

    def __post_init__(self) -> None:
        """Check every field's range and the relations between them.

        Raises:
            ValueError: A field out of its range (the message names it), a ``heartbeat_timeout`` below
                three ``heartbeat_interval``, or an ``s3_request_deadline`` shorter than one attempt
                (``s3_connect_timeout + s3_read_timeout``).
        """
        if self.part_size < 5 * _MIB:
            raise ValueError(
                f"part_size must be >= 5 MiB (S3's minimum part), got {self.part_size}"
            )
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.read_request_size < 64 * _KIB:
            raise ValueError(
                f"read_request_size must be >= 64 KiB, got {self.read_request_size}"
            )
        if self.coalesce_gap is not None and self.coalesce_gap < 0:
            raise ValueError(f"coalesce_gap must be >= 0, got {self.coalesce_gap}")
        if self.read_buffer_bytes < _MIB:
            raise ValueError(
                f"read_buffer_bytes must be >= 1 MiB, got {self.read_buffer_bytes}"
            )
        if not 4 * _KIB <= self.frame_size <= 256 * _MIB or self.frame_size % 8:
            raise ValueError(
                f"frame_size must be a multiple of 8 between 4 KiB and 256 MiB, got {self.frame_size}"
            )
        if self.files_per_rank < 1:
            raise ValueError(f"files_per_rank must be >= 1, got {self.files_per_rank}")
        if self.torch_metadata_chunks < 0:
            raise ValueError(f"torch_metadata_chunks must be >= 0, got {self.torch_metadata_chunks}")
        if self.metadata_version not in (2, 3):
            raise ValueError(f"metadata_version must be 2 or 3, got {self.metadata_version}")
        if self.key_prefixes < 0:
            raise ValueError(f"key_prefixes must be >= 0, got {self.key_prefixes}")
        for name in ("s3_connect_timeout", "s3_read_timeout", "s3_request_deadline", "heartbeat_interval",
                     "heartbeat_timeout", "clock_skew_tolerance", "collective_timeout"):
            value = getattr(self, name)
            # A NaN would compare false everywhere and disable the bound.
            if not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.heartbeat_timeout < 3 * self.heartbeat_interval:
            raise ValueError(
                f"heartbeat_timeout ({self.heartbeat_timeout:g} s) must be at least three heartbeat intervals "
                f"({3 * self.heartbeat_interval:g} s): one late renewal must not make a live save look dead"
            )
        share = self.background_cpu_share
        if not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ValueError(f"background_cpu_share must be a number in (0, 1], got {share!r}")
        if self.s3_request_deadline < self.s3_connect_timeout + self.s3_read_timeout:
            raise ValueError(
                f"s3_request_deadline ({self.s3_request_deadline:g} s) must leave room for one attempt: at least "
                f"s3_connect_timeout + s3_read_timeout = {self.s3_connect_timeout + self.s3_read_timeout:g} s"
            )

    @classmethod
    def from_env(cls, **overrides: object) -> IOConfig:
        """Build a config from ``DCP_EXT_*`` variables, then ``overrides``.

        ``None`` values in ``overrides`` mean "not given" and keep the
        environment's or the default value.
        """
        values: dict[str, object] = {}
        env = os.environ
        for field in dataclasses.fields(cls):
            if field.name == "retry":
                continue
            raw = env.get(f"DCP_EXT_{field.name.upper()}")
            if raw is None:
                continue
            if field.name in _SIZE_FIELDS:
                values[field.name] = parse_size(raw)
            elif field.name in _SECONDS_FIELDS:
                values[field.name] = _parse_seconds(raw, f"DCP_EXT_{field.name.upper()}")
            elif field.name in _FRACTION_FIELDS:
                values[field.name] = _parse_fraction(raw, f"DCP_EXT_{field.name.upper()}")
            elif field.name in ("fsync", "verify_checksums"):
                values[field.name] = raw.strip().lower() not in ("0", "false", "no", "off")
            else:
                values[field.name] = int(raw)
        retry_attempts = env.get("DCP_EXT_RETRY_MAX_ATTEMPTS")
        if retry_attempts is not None:
            values["retry"] = RetryPolicy(max_attempts=int(retry_attempts))
        return cls(**values).with_overrides(**overrides)  # type: ignore[arg-type]

    def with_overrides(self, **overrides: object) -> IOConfig:
        """A copy with the given fields replaced; ``None`` values are ignored
        and sizes may be strings such as ``"32MiB"``."""
        values: dict[str, object] = {}
        for key, value in overrides.items():
            if value is None:
                continue
            if key in _SIZE_FIELDS:
                value = parse_size(value)  # type: ignore[arg-type]
            values[key] = value
        return dataclasses.replace(self, **values)  # type: ignore[arg-type]


def usable_cores() -> int:
    """CPU cores this process may run on (threads for zstd and hashing, which
    release the GIL)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, 16))
