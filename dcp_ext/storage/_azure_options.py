"""The Azure Blob store's own settings: :class:`AzureOptions`."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import IOConfig

__all__ = ["AzureOptions"]

_MIB = 1 << 20
# Azure's limits for a block blob built from blocks (API version 2019-12-12 and later).
MAX_BLOCK_SIZE = 4000 * _MIB
MAX_BLOCKS = 50_000


@dataclass(frozen=True)
class AzureOptions:
    """How the Azure Blob store talks to its endpoint.

    Built from :class:`~dcp_ext.IOConfig` when not given (:meth:`from_config`:
    ``part_size`` becomes ``block_size``, ``max_concurrency`` is kept, and the
    object-store request bounds ``s3_connect_timeout``, ``s3_read_timeout``,
    ``s3_request_deadline``, with their ``DCP_EXT_S3_*`` variables, bound
    Azure's requests as they bound S3's and GCS's), or passed in a
    :class:`~dcp_ext.storage.Location`::

        Location("az://ckpt/run1", {"account_name": "acct", "account_key": KEY},
                 options=AzureOptions(block_size=32 << 20, max_concurrency=16))

    Attributes:
        endpoint: The Blob service endpoint, when it is not
            ``https://{account}.blob.core.windows.net`` (from the account
            name) or the ``BlobEndpoint`` of a connection string: Azurite's
            ``http://127.0.0.1:10000/devstoreaccount1``, a private endpoint,
            a sovereign cloud.
        connect_timeout: Seconds a request waits for its connection.
        read_timeout: Seconds a request waits for the endpoint's next bytes
            (while sending a block too).
        request_deadline: Seconds one request may take with all its retries:
            no attempt starts that could end after it if the endpoint stayed
            silent (``connect_timeout + read_timeout`` per attempt).
        block_size: Bytes per staged block of a data file (Put Block); a file
            smaller than one block is a single Put Blob. At most
            ``block_size * (max_concurrency + 1)`` bytes of blocks are held
            in memory per store, whatever the number of files.
        max_concurrency: Requests in flight per store (blocks being staged,
            ranged reads).
    """

    endpoint: str | None = None
    connect_timeout: float = 5.0
    read_timeout: float = 20.0
    request_deadline: float = 60.0
    block_size: int = 16 * _MIB
    max_concurrency: int = 8

    def __post_init__(self) -> None:
        """Check the options.

        Raises:
            ValueError: An endpoint that is not an http(s) URL, a timeout that is not a positive number,
                a deadline that leaves no room for one attempt, a block size outside 1 MiB to 4000 MiB,
                or concurrency below 1.
        """
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(f"AzureOptions.endpoint must be an http:// or https:// URL, got {self.endpoint!r}")
        for name in ("connect_timeout", "read_timeout", "request_deadline"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"AzureOptions.{name} must be a positive number of seconds, got {value!r}")
        if self.request_deadline < self.connect_timeout + self.read_timeout:
            raise ValueError(f"AzureOptions.request_deadline ({self.request_deadline:g} s) must leave room for one "
                             f"attempt: at least connect_timeout + read_timeout")
        if not _MIB <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"AzureOptions.block_size must be between 1 MiB and 4000 MiB (Azure's largest block), "
                             f"got {self.block_size}")
        if self.max_concurrency < 1:
            raise ValueError(f"AzureOptions.max_concurrency must be >= 1, got {self.max_concurrency}")

    @classmethod
    def from_config(cls, config: IOConfig) -> AzureOptions:
        """The options ``config`` describes: its ``part_size`` as the block
        size, its ``max_concurrency`` and its object-store request bounds."""
        return cls(connect_timeout=config.s3_connect_timeout, read_timeout=config.s3_read_timeout,
                   request_deadline=config.s3_request_deadline, block_size=min(config.part_size, MAX_BLOCK_SIZE),
                   max_concurrency=config.max_concurrency)

    @property
    def attempt_seconds(self) -> float:
        """The longest one attempt can wait on an endpoint that sends nothing."""
        return self.connect_timeout + self.read_timeout
