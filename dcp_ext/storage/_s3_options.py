"""The S3 store's own settings: :class:`S3Options`."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import IOConfig

__all__ = ["S3Options"]

_MIB = 1 << 20


@dataclass(frozen=True)
class S3Options:
    """How the S3 store talks to its endpoint.

    Built from :class:`~dcp_ext.IOConfig` when not given (its ``s3_*``,
    ``part_size`` and ``max_concurrency`` fields and their ``DCP_EXT_*``
    variables keep working), or passed in a :class:`~dcp_ext.storage.Location`.

    Attributes:
        connect_timeout: Seconds a request waits for its connection.
        read_timeout: Seconds a request waits for the endpoint's next bytes.
        request_deadline: Seconds one request may take with all its retries.
        part_size: Bytes per multipart part (at least 5 MiB).
        max_concurrency: Requests in flight per store.
    """

    connect_timeout: float = 5.0
    read_timeout: float = 20.0
    request_deadline: float = 60.0
    part_size: int = 16 * _MIB
    max_concurrency: int = 8

    def __post_init__(self) -> None:
        """Check the options.

        Raises:
            ValueError: A timeout is not a positive number, the deadline leaves no room for one
                attempt, a part is smaller than S3's 5 MiB minimum, or concurrency is below 1.
        """
        for name in ("connect_timeout", "read_timeout", "request_deadline"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"S3Options.{name} must be a positive number of seconds, got {value!r}")
        if self.request_deadline < self.connect_timeout + self.read_timeout:
            raise ValueError(f"S3Options.request_deadline ({self.request_deadline:g} s) must leave room for one "
                             f"attempt: at least connect_timeout + read_timeout")
        if self.part_size < 5 * _MIB:
            raise ValueError(f"S3Options.part_size must be >= 5 MiB (S3's minimum part), got {self.part_size}")
        if self.max_concurrency < 1:
            raise ValueError(f"S3Options.max_concurrency must be >= 1, got {self.max_concurrency}")

    @classmethod
    def from_config(cls, config: IOConfig) -> S3Options:
        """The options ``config`` (and so the ``DCP_EXT_S3_*`` variables) describe."""
        return cls(config.s3_connect_timeout, config.s3_read_timeout, config.s3_request_deadline,
                   config.part_size, config.max_concurrency)
