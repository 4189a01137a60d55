"""The GCS store's own settings: :class:`GCSOptions`, and how ``storage_options`` fill them.

``storage_options`` use gcsfs's names where gcsfs has one, so one dictionary
serves ``gcsfs.GCSFileSystem``, torch's ``FsspecWriter`` and dcp_ext:

* ``endpoint_url``: the JSON API's root (default ``https://storage.googleapis.com``;
  an emulator's ``http://127.0.0.1:PORT``). Without it, ``STORAGE_EMULATOR_HOST``
  is used when set (as Google's own clients do), and then the requests go
  unauthenticated unless credentials are given.
* ``token``: gcsfs's meanings: ``"anon"`` (no credentials: emulators, public
  data); ``None``, ``"google_default"`` or ``"cloud"`` (Application Default
  Credentials, through google-auth); the path of a JSON key file or its parsed
  content (a service account's key, or any credentials JSON google-auth
  reads); or a ``google.auth.credentials.Credentials`` object.
* ``access_token``: a ready OAuth 2 access token, sent as it is (never
  refreshed; for short jobs and tests). Needs no google-auth.
* ``project`` and gcsfs's cache settings (``skip_instance_cache``,
  ``cache_timeout``, ``block_size``...): accepted and unused (object
  requests need no project).

Anything else is an error. Timeouts, the part size and concurrency are not
``storage_options``: they come from :class:`~dcp_ext.IOConfig` (``part_size``,
``max_concurrency`` and the ``s3_*`` request bounds, which bound every object
store's requests) or from a :class:`GCSOptions` passed in a
:class:`~dcp_ext.storage.Location`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config import IOConfig

__all__ = ["GCSOptions", "GCS_ENDPOINT"]

_KIB = 1 << 10
_MIB = 1 << 20

#: The public JSON API endpoint.
GCS_ENDPOINT = "https://storage.googleapis.com"

# gcsfs options about its own caches and file objects: meaningless here.
_IGNORED = frozenset({
    "project", "skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths",
    "cache_timeout", "block_size", "default_block_size", "consistency", "asynchronous", "loop",
    "session_kwargs", "check_connection", "version_aware", "timeout",
})
_DEFAULT_TOKENS = (None, "google_default", "cloud")


@dataclass(frozen=True)
class GCSOptions:
    """How the GCS store talks to its endpoint.

    Built from :class:`~dcp_ext.IOConfig` and ``storage_options`` when not
    given (see the module docstring), or passed in a
    :class:`~dcp_ext.storage.Location` (``Location(url, options=GCSOptions(...))``);
    ``storage_options`` then only add what the options leave at its default.

    Attributes:
        endpoint: The JSON API's root URL.
        connect_timeout: Seconds a request waits for its connection.
        read_timeout: Seconds a request waits for the endpoint's next bytes.
        request_deadline: Seconds one request may take with all its retries.
        part_size: Bytes per part of a data file uploaded in parts (at least
            256 KiB); a file smaller than one part is a single upload.
        max_concurrency: Requests in flight per store (part uploads, ranged reads).
        anonymous: Send no credentials (emulators, public buckets).
        token: Credentials for google-auth: the path of a JSON key file, its
            parsed content, or a ``google.auth.credentials.Credentials``;
            ``None`` with neither ``anonymous`` nor ``access_token``:
            Application Default Credentials.
        access_token: A ready OAuth 2 access token (not refreshed).
    """

    endpoint: str = GCS_ENDPOINT
    connect_timeout: float = 5.0
    read_timeout: float = 20.0
    request_deadline: float = 60.0
    part_size: int = 16 * _MIB
    max_concurrency: int = 8
    anonymous: bool = False
    token: Any = field(default=None, repr=False)
    access_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        """Check the options and strip the endpoint's trailing ``/``.

        Raises:
            ValueError: A timeout that is not a positive number, a deadline that leaves no room for one
                attempt, a part below 256 KiB, concurrency below 1, an endpoint that is not an http(s)
                URL, or more than one kind of credentials.
        """
        for name in ("connect_timeout", "read_timeout", "request_deadline"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"GCSOptions.{name} must be a positive number of seconds, got {value!r}")
        if self.request_deadline < self.connect_timeout + self.read_timeout:
            raise ValueError(f"GCSOptions.request_deadline ({self.request_deadline:g} s) must leave room for one "
                             f"attempt: at least connect_timeout + read_timeout")
        if self.part_size < 256 * _KIB:
            raise ValueError(f"GCSOptions.part_size must be >= 256 KiB, got {self.part_size}")
        if self.max_concurrency < 1:
            raise ValueError(f"GCSOptions.max_concurrency must be >= 1, got {self.max_concurrency}")
        if not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(f"GCSOptions.endpoint must be an http(s) URL, got {self.endpoint!r}")
        object.__setattr__(self, "endpoint", self.endpoint.rstrip("/"))
        given = [n for n, v in (("anonymous", self.anonymous), ("token", self.token is not None),
                                ("access_token", self.access_token is not None)) if v]
        if len(given) > 1:
            raise ValueError(f"GCSOptions: give one kind of credentials, not {' and '.join(given)}")

    @property
    def credentials_kind(self) -> str:
        """``"anonymous"``, ``"access token"``, ``"google-auth"`` or
        ``"application default"`` (for messages)."""
        if self.anonymous:
            return "anonymous"
        if self.access_token is not None:
            return "access token"
        return "google-auth" if self.token is not None else "application default"

    @classmethod
    def from_config(cls, config: IOConfig) -> GCSOptions:
        """The options ``config`` describes: its part size, concurrency and
        object-store request bounds (``s3_connect_timeout``, ``s3_read_timeout``,
        ``s3_request_deadline`` and their ``DCP_EXT_S3_*`` variables)."""
        return cls(connect_timeout=config.s3_connect_timeout, read_timeout=config.s3_read_timeout,
                   request_deadline=config.s3_request_deadline, part_size=config.part_size,
                   max_concurrency=config.max_concurrency)

    @classmethod
    def resolve(cls, config: IOConfig, storage_options: Mapping[str, Any] | None,
                options: GCSOptions | None = None) -> GCSOptions:
        """``options`` (default: :meth:`from_config`) with what ``storage_options``
        and ``STORAGE_EMULATOR_HOST`` add.

        Raises:
            ValueError: An option dcp_ext does not understand, or one given
                both here and, differently, in ``options``.
        """
        base = options if options is not None else cls.from_config(config)
        given = dict(storage_options or {})
        unknown = sorted(k for k in given if k not in _IGNORED and k not in ("endpoint_url", "token", "access_token"))
        if unknown:
            raise ValueError(f"unsupported GCS storage_options {unknown}; dcp_ext understands endpoint_url, token "
                             f"and access_token (and ignores gcsfs's project and cache settings)")
        changes: dict[str, Any] = {}
        endpoint = given.get("endpoint_url")
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        if endpoint is None and emulator and base.endpoint == GCS_ENDPOINT:
            endpoint = emulator if "://" in emulator else f"http://{emulator}"
            if base.credentials_kind == "application default" and given.get("token") in _DEFAULT_TOKENS \
                    and "access_token" not in given:
                changes["anonymous"] = True  # what Google's clients do with an emulator
        if endpoint is not None:
            changes["endpoint"] = str(endpoint).rstrip("/")
        token = given.get("token")
        if token == "anon":
            changes["anonymous"] = True
        elif token not in _DEFAULT_TOKENS:
            changes["token"] = os.fspath(token) if isinstance(token, os.PathLike) else token
        if given.get("access_token") is not None:
            changes["access_token"] = str(given["access_token"])
        defaults = cls()
        for name, value in changes.items():
            mine = getattr(base, name)
            if mine != getattr(defaults, name) and mine != value:
                raise ValueError(f"GCS {name} given twice, differently: in GCSOptions and in storage_options")
        return dataclasses.replace(base, **changes) if changes else base
