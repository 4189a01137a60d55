"""The I/O settings an adapter passes on to every CheckpointWriter / CheckpointReader it builds."""

from __future__ import annotations

from typing import Any

from dcp_ext.config import IOConfig
from dcp_ext.errors import InvalidOptionError

__all__ = ["io_config"]


def io_config(options: Any, where: str) -> IOConfig | None:
    """The :class:`~dcp_ext.IOConfig` of an adapter's ``io_options``, checked now.

    Args:
        options: ``None``, ``{}`` or a dict of ``IOConfig`` fields such as
            ``{"max_concurrency": 16, "part_size": "32MiB"}``; the fields it
            leaves out keep their ``DCP_EXT_*`` environment value or default.
        where: The setting's name in the framework, for the error.

    Returns:
        ``None`` for no options (writers and readers then build their own
        config, as without the adapter), else the config both are given.

    Raises:
        InvalidOptionError: Not a dict, an unknown field or a bad value, naming ``where``.
    """
    if options is None:
        return None
    if not isinstance(options, dict):
        raise InvalidOptionError(f"{where} must be a dict of dcp_ext.IOConfig fields, not {type(options).__name__}")
    if not options:
        return None
    try:
        return IOConfig.from_env(**options)
    except (TypeError, ValueError) as err:
        raise InvalidOptionError(f"{where}: {err} (fields of dcp_ext.IOConfig: max_concurrency, part_size, ...)") \
            from err
