"""Which Azure storage account a URL names, where its Blob endpoint is, and
how requests prove who sends them.

``storage_options`` use adlfs's names, so one dictionary works with
``adlfs.AzureBlobFileSystem`` (and torch's ``FsspecWriter`` over it) and
with dcp_ext:

* ``account_name`` + ``account_key``: Shared Key, every request signed
  (:class:`SharedKey`; HMAC-SHA256, nothing to install);
* ``sas_token`` (with ``account_name``, or the account in the URL): the
  token is appended to every request's query, nothing to install;
* ``connection_string``: ``AccountName``, ``AccountKey`` or
  ``SharedAccessSignature``, ``BlobEndpoint`` (or ``DefaultEndpointsProtocol``
  and ``EndpointSuffix``), or ``UseDevelopmentStorage=true`` for Azurite on
  its default port;
* ``credential``: an object with ``get_token(scope)`` (any
  ``azure.identity`` credential): Entra ID bearer tokens, renewed before
  they expire; ``client_id`` + ``client_secret`` + ``tenant_id``: a service
  principal (``azure.identity.ClientSecretCredential``); with an account
  name and nothing else, ``azure.identity.DefaultAzureCredential`` (managed
  identity, ``az login``, workload identity...). These three need the
  ``dcp-ext[azure]`` extra (azure-identity), the others nothing;
* ``anon=True``: unsigned requests (a public container, reads only);
* ``account_host``: the Blob endpoint's host, when it is not
  ``{account}.blob.core.windows.net``.

Missing options come from the variables adlfs reads:
``AZURE_STORAGE_CONNECTION_STRING``, ``AZURE_STORAGE_ACCOUNT_NAME``,
``AZURE_STORAGE_ACCOUNT_KEY``, ``AZURE_STORAGE_SAS_TOKEN``. The account
may also be in the URL, as adlfs writes it:
``abfs://container@account.dfs.core.windows.net/path`` (the store talks to
the account's Blob endpoint, ``account.blob.core.windows.net``, which
hierarchical-namespace accounts serve too). Unknown options are an error.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import importlib
import os
import threading
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import CredentialsError

__all__ = [
    "API_VERSION",
    "DEV_ACCOUNT",
    "DEV_KEY",
    "Auth",
    "AzureAccount",
    "SharedKey",
    "SasToken",
    "BearerToken",
    "Anonymous",
    "parse_connection_string",
    "resolve_account",
]

#: The REST API version every request states. 2021-12-02 has everything the
#: store uses (conditional Put Block List, 4000 MiB blocks, encoded names in
#: listings) and Azurite 3.35 serves it without ``--skipApiVersionCheck``.
API_VERSION = "2021-12-02"
#: Azurite's (and the old storage emulator's) well-known development account.
DEV_ACCOUNT = "devstoreaccount1"
DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
_STORAGE_SCOPE = "https://storage.azure.com/.default"
# A token is renewed this long before it expires (a request signed with it may be retried for a minute).
_TOKEN_MARGIN = 300.0

_KNOWN_OPTIONS = frozenset({
    "account_name", "account_key", "sas_token", "connection_string", "credential", "anon", "account_host",
    "client_id", "client_secret", "tenant_id",
})
# adlfs options about its own caching and file objects: meaningless here.
_IGNORED_OPTIONS = frozenset({
    "skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths", "default_fill_cache",
    "default_cache_type", "version_aware", "assume_container_exists", "asynchronous", "loop", "blocksize",
    "max_concurrency", "location_mode",
})
# adlfs options whose job AzureOptions does here: refused with a pointer, not silently ignored.
_OPTION_FIELDS = {"timeout": "request_deadline", "connection_timeout": "connect_timeout",
                  "read_timeout": "read_timeout", "socket_timeout": "read_timeout"}


class Auth(Protocol):
    """Adds a request's proof of identity (a header, or query parameters)."""

    @property
    def how(self) -> str:
        """How requests are authorized, for messages ("account key", "SAS token", ...)."""
        ...

    def authorize(self, method: str, url: str, headers: dict[str, str]) -> str:
        """Authorize one attempt of a request; returns the URL to send
        (``headers`` may gain ``Authorization``)."""
        ...


@dataclass(frozen=True)
class SharedKey:
    """Shared Key authorization: each request signed with the account key
    (https://learn.microsoft.com/rest/api/storageservices/authorize-with-shared-key)."""

    account: str
    key: bytes = field(repr=False)
    how: str = "account key"

    @classmethod
    def from_base64(cls, account: str, key: str) -> SharedKey:
        try:
            raw = base64.b64decode(key, validate=True)
        except ValueError as err:
            raise CredentialsError(f"the account key of Azure storage account {account!r} is not base64: check "
                                   f"account_key (or AccountKey in the connection string)") from err
        return cls(account, raw)

    def authorize(self, method: str, url: str, headers: dict[str, str]) -> str:
        parts = urllib.parse.urlsplit(url)
        h = {k.lower(): str(v) for k, v in headers.items()}
        length = h.get("content-length", "")
        standard = [
            h.get("content-encoding", ""), h.get("content-language", ""), "" if length == "0" else length,
            h.get("content-md5", ""), h.get("content-type", ""), "", h.get("if-modified-since", ""),
            h.get("if-match", ""), h.get("if-none-match", ""), h.get("if-unmodified-since", ""), h.get("range", ""),
        ]
        canonical_headers = "".join(f"{k}:{h[k].strip()}\n" for k in sorted(h) if k.startswith("x-ms-"))
        # The path as sent (percent-encoded); with path-style endpoints (Azurite)
        # it already starts with the account, which is then named twice.
        resource = f"/{self.account}{parts.path}"
        query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
        for name in sorted(query, key=str.lower):
            resource += f"\n{name.lower()}:{','.join(sorted(query[name]))}"
        signed = f"{method}\n" + "\n".join(standard) + "\n" + canonical_headers + resource
        digest = hmac.new(self.key, signed.encode("utf-8"), hashlib.sha256).digest()
        headers["Authorization"] = f"SharedKey {self.account}:{base64.b64encode(digest).decode()}"
        return url


@dataclass(frozen=True)
class SasToken:
    """A shared access signature, appended to every request's query."""

    token: str = field(repr=False)
    how: str = "SAS token"

    def authorize(self, method: str, url: str, headers: dict[str, str]) -> str:
        return f"{url}{'&' if '?' in url else '?'}{self.token}"


class BearerToken:
    """Entra ID (OAuth) bearer tokens from an ``azure.identity``-style
    credential, fetched once and renewed :data:`_TOKEN_MARGIN` seconds
    before they expire; shared by the store's threads."""

    def __init__(self, credential: Any, how: str = "Entra ID token") -> None:
        if not callable(getattr(credential, "get_token", None)):
            raise CredentialsError(f"storage_options['credential'] must have a get_token(scope) method (an "
                                   f"azure.identity credential), got {type(credential).__name__}")
        self.credential = credential
        self.how = how
        self._lock = threading.Lock()
        self._token = ""
        self._expires = 0.0

    def token(self) -> str:
        with self._lock:
            if time.time() > self._expires - _TOKEN_MARGIN:
                try:
                    got = self.credential.get_token(_STORAGE_SCOPE)
                except Exception as err:  # noqa: BLE001 - azure.identity raises several families
                    raise CredentialsError(f"could not get an Entra ID token for Azure Storage from "
                                           f"{type(self.credential).__name__}: {err}") from err
                self._token, self._expires = str(got.token), float(got.expires_on)
            return self._token

    def authorize(self, method: str, url: str, headers: dict[str, str]) -> str:
        headers["Authorization"] = f"Bearer {self.token()}"
        return url


@dataclass(frozen=True)
class Anonymous:
    """Unsigned requests (public read access)."""

    how: str = "anonymous access"

    def authorize(self, method: str, url: str, headers: dict[str, str]) -> str:
        return url


@dataclass(frozen=True)
class AzureAccount:
    """A storage account as the store reaches it.

    Attributes:
        name: The account name.
        endpoint: Its Blob service endpoint, no trailing ``/``
            (``https://acct.blob.core.windows.net``, ``http://127.0.0.1:10000/devstoreaccount1``).
        auth: How requests are authorized.
    """

    name: str
    endpoint: str
    auth: Auth = field(compare=False)


def parse_connection_string(text: str) -> dict[str, str]:
    """``Key=Value;...`` as a dict (values may contain ``=``)."""
    found: dict[str, str] = {}
    for part in text.split(";"):
        key, sep, value = part.strip().partition("=")
        if sep and key:
            found[key.strip()] = value.strip()
    return found


def _from_connection_string(text: str) -> dict[str, str]:
    """A connection string as adlfs-style options (``endpoint`` included)."""
    fields = {k.lower(): v for k, v in parse_connection_string(text).items()}
    if fields.get("usedevelopmentstorage", "").lower() == "true":
        proxy = fields.get("developmentstorageproxyuri", "http://127.0.0.1").rstrip("/")
        return {"account_name": DEV_ACCOUNT, "account_key": DEV_KEY, "endpoint": f"{proxy}:10000/{DEV_ACCOUNT}"}
    out: dict[str, str] = {}
    if "accountname" in fields:
        out["account_name"] = fields["accountname"]
    if "accountkey" in fields:
        out["account_key"] = fields["accountkey"]
    if "sharedaccesssignature" in fields:
        out["sas_token"] = fields["sharedaccesssignature"]
    if "blobendpoint" in fields:
        out["endpoint"] = fields["blobendpoint"].rstrip("/")
    elif "accountname" in fields:
        protocol = fields.get("defaultendpointsprotocol", "https")
        suffix = fields.get("endpointsuffix", "core.windows.net")
        out["endpoint"] = f"{protocol}://{fields['accountname']}.blob.{suffix}"
    return out


def _blob_host(host: str) -> tuple[str, str]:
    """``(account, blob endpoint host)`` of a URL's ``account.dfs.core.windows.net``
    or ``account.blob.core.windows.net`` (other clouds' suffixes too)."""
    account, _, rest = host.partition(".")
    if rest.startswith("dfs."):
        rest = "blob." + rest[len("dfs."):]
    return account, f"{account}.{rest}" if rest else host


def resolve_account(url: str, url_account: str | None, storage_options: Mapping[str, Any],
                    endpoint: str | None = None, environ: Mapping[str, str] | None = None) -> AzureAccount:
    """The account, endpoint and credentials for ``url`` (see the module docstring).

    Args:
        url: The store's URL, for messages.
        url_account: The ``container@host`` host of the URL, if it has one.
        storage_options: adlfs-style options.
        endpoint: :attr:`AzureOptions.endpoint`, which wins over every other source.
        environ: The environment (``os.environ``).

    Raises:
        ValueError: An option dcp_ext does not understand, or two sources that disagree.
        CredentialsError: No credentials at all, and azure-identity is not
            installed to look for Entra ID ones.
    """
    env = os.environ if environ is None else environ
    options = dict(storage_options)
    unknown = sorted(k for k in options if k not in _KNOWN_OPTIONS and k not in _IGNORED_OPTIONS)
    if unknown:
        hints = [f"{k} (use AzureOptions.{_OPTION_FIELDS[k]})" for k in unknown if k in _OPTION_FIELDS]
        raise ValueError(
            f"unsupported Azure storage_options {unknown} for {url}; dcp_ext understands "
            f"{', '.join(sorted(_KNOWN_OPTIONS))}" + (f"; timeouts are set with {', '.join(hints)}" if hints else ""))
    explicit = {k: v for k, v in options.items() if k in _KNOWN_OPTIONS and v is not None}
    connection = explicit.pop("connection_string", None) or (
        None if explicit else env.get("AZURE_STORAGE_CONNECTION_STRING"))
    parsed = _from_connection_string(str(connection)) if connection else {}
    settings: dict[str, Any] = {**parsed, **explicit}
    if not explicit and not connection:
        for key, variable in (("account_name", "AZURE_STORAGE_ACCOUNT_NAME"), ("account_key", "AZURE_STORAGE_ACCOUNT_KEY"),
                              ("sas_token", "AZURE_STORAGE_SAS_TOKEN")):
            if env.get(variable):
                settings[key] = env[variable]
    host = None
    if url_account:
        named, host = _blob_host(url_account)
        given = settings.get("account_name")
        if given and given != named:
            raise ValueError(f"{url} names the account {named!r} but storage_options give {given!r}")
        settings["account_name"] = named
    account = settings.get("account_name")
    if not account:
        raise CredentialsError(
            f"no Azure storage account for {url}: pass storage_options={{'account_name': ..., 'account_key': ...}} "
            f"(or 'sas_token', or 'connection_string'), write the URL as abfs://container@ACCOUNT.dfs.core.windows.net/"
            f"path, or set AZURE_STORAGE_ACCOUNT_NAME / AZURE_STORAGE_CONNECTION_STRING", url)
    if endpoint is None:
        if settings.get("account_host"):
            endpoint = f"https://{settings['account_host']}"
        elif host is not None and "endpoint" not in parsed:
            endpoint = f"https://{host}"
        else:
            endpoint = parsed.get("endpoint") or f"https://{account}.blob.core.windows.net"
    return AzureAccount(str(account), endpoint.rstrip("/"), _auth(url, str(account), settings))


def _auth(url: str, account: str, settings: dict[str, Any]) -> Auth:
    if settings.get("anon"):
        return Anonymous()
    if settings.get("credential") is not None:
        return BearerToken(settings["credential"])
    if settings.get("account_key"):
        return SharedKey.from_base64(account, str(settings["account_key"]))
    if settings.get("sas_token"):
        return SasToken(str(settings["sas_token"]).lstrip("?"))
    try:
        identity = importlib.import_module("azure.identity")  # the [azure] extra: Entra ID only
    except ImportError:
        raise CredentialsError(
            f"no credentials for Azure storage account {account!r} ({url}): pass storage_options with "
            f"'account_key', 'sas_token' or 'connection_string' (or set AZURE_STORAGE_ACCOUNT_KEY / "
            f"AZURE_STORAGE_SAS_TOKEN); for Entra ID (managed identity, az login, a service principal) "
            f"install dcp-ext[azure] (azure-identity)", url) from None
    if settings.get("client_id") and settings.get("client_secret") and settings.get("tenant_id"):
        credential = identity.ClientSecretCredential(settings["tenant_id"], settings["client_id"],
                                                     settings["client_secret"])
        return BearerToken(credential, "Entra ID token (service principal)")
    return BearerToken(identity.DefaultAzureCredential(), "Entra ID token (DefaultAzureCredential)")
