"""The manager's option groups, checked when made: :class:`TierOptions`,
:class:`IncrementalOptions`, :class:`FullSaveOptions`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from ..full import TranslateFunction
from ..incremental import DEFAULT_MAX_CHAIN
from ..storage import normalize_path

__all__ = ["TierOptions", "IncrementalOptions", "FullSaveOptions", "ASYNC_UPLOADS", "FULL_FORMATS"]

#: What a full save may write.
FULL_FORMATS = ("safetensors", "torch", "hf")

#: Where an asynchronous save's upload may run.
ASYNC_UPLOADS = ("thread", "process")


@dataclass(frozen=True)
class TierOptions:
    """How partial saves use a node-local tier (see :class:`~dcp_ext.CheckpointManager`).

    Attributes:
        local_tier: This node's local-tier directory, normalized (``None``: no tiers).
        persist_every: Drain every N-th save to the root (``0``: only ``persist=True`` saves).
        keep_local: Newest tags kept in each local tier (``None``: all).
        replicas: ``1`` to keep each node's files in its partner node's tier too.
        local_tier_bytes: The most bytes this node's tier may hold (``None``: no cap).

    Raises:
        ValueError: A value out of range, or ``local_tier`` is a URL.
    """

    local_tier: str | None = None
    persist_every: int = 10
    keep_local: int | None = 2
    replicas: int = 0
    local_tier_bytes: int | None = None

    def __post_init__(self) -> None:
        """Check the options.

        Raises:
            ValueError: A value out of range, or ``local_tier`` is a URL.
        """
        if self.persist_every < 0:
            raise ValueError(f"persist_every must be >= 0, got {self.persist_every}")
        if self.keep_local is not None and self.keep_local < 1:
            raise ValueError(f"keep_local must be >= 1 or None, got {self.keep_local}")
        if self.replicas not in (0, 1):
            raise ValueError(f"replicas must be 0 or 1, got {self.replicas}")
        if self.local_tier_bytes is not None and self.local_tier_bytes < 0:
            raise ValueError(f"local_tier_bytes must be >= 0 or None, got {self.local_tier_bytes}")
        if self.local_tier is not None and "://" in self.local_tier:
            raise ValueError(f"local_tier must be a directory on this node, got the URL {self.local_tier!r}")

    @classmethod
    def of(cls, local_tier: str | os.PathLike[str] | None, persist_every: int, keep_local: int | None,
           replicas: int, local_tier_bytes: int | None) -> TierOptions:
        """The options as the manager's keyword arguments give them."""
        url = None if local_tier is None else normalize_path(local_tier)
        return cls(url, persist_every, keep_local, replicas, local_tier_bytes)

    @classmethod
    def given(cls, tiers: TierOptions | None, local_tier: str | os.PathLike[str] | None, persist_every: int,
              keep_local: int | None, replicas: int, local_tier_bytes: int | None) -> TierOptions:
        """``tiers``, or the keyword arguments' options; not both.

        Raises:
            ValueError: Both were given.
        """
        if tiers is None:
            return cls.of(local_tier, persist_every, keep_local, replicas, local_tier_bytes)
        if local_tier is not None or (persist_every, keep_local, replicas, local_tier_bytes) != (10, 2, 0, None):
            raise ValueError("pass the tier settings in tiers=TierOptions(...) or as keyword arguments, not both")
        return tiers


@dataclass(frozen=True)
class IncrementalOptions:
    """Whether partial saves write only the frames that changed (:mod:`dcp_ext.incremental`).

    Attributes:
        enabled: Incremental saves on.
        max_chain: Incremental saves in a row before a self-contained one.

    Raises:
        ValueError: ``max_chain`` is negative.
    """

    enabled: bool = False
    max_chain: int = DEFAULT_MAX_CHAIN

    def __post_init__(self) -> None:
        """Check the options.

        Raises:
            ValueError: ``max_chain`` is negative.
        """
        if self.max_chain < 0:
            raise ValueError(f"max_chain must be >= 0, got {self.max_chain}")

    @classmethod
    def given(cls, incremental: bool | IncrementalOptions, max_chain: int) -> IncrementalOptions:
        """The manager's ``incremental`` argument as options (``max_chain`` beside a
        :class:`IncrementalOptions` is an error)."""
        if not isinstance(incremental, IncrementalOptions):
            return cls(bool(incremental), max_chain)
        if max_chain != DEFAULT_MAX_CHAIN:
            raise ValueError("pass max_chain in incremental=IncrementalOptions(...), not beside it")
        return incremental


@dataclass(frozen=True)
class FullSaveOptions:
    """How a full checkpoint (``save(..., partial=False)``) is written; the
    keyword arguments of the same names in :meth:`~dcp_ext.CheckpointManager.save`
    mean the same.

    Attributes:
        full_format: ``"safetensors"`` or ``"torch"`` (one file), or ``"hf"``
            (a Hugging Face folder written by every rank).
        include_optimizer: Also put the optimizer state in it.
        translate_if_full: Rename the keys with ``translate_function`` first.
        translate_function: SageMaker's state-dict translation
            (``{key: tensor}`` in, the state dict to write out).
        max_shard_size: ``"hf"``: most bytes of tensor data per file.
        dtype: ``"hf"``: cast floating tensors to this dtype.
        hf_config: ``"hf"``: the ``config.json`` to write (dict or JSON string).

    Raises:
        ValueError: An unknown format.
    """

    full_format: str = "safetensors"
    include_optimizer: bool = False
    translate_if_full: bool = True
    translate_function: TranslateFunction | None = None
    max_shard_size: int | str = "5GB"
    dtype: torch.dtype | None = None
    hf_config: dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        """Check the options.

        Raises:
            ValueError: ``full_format`` is not a known format.
        """
        if self.full_format not in FULL_FORMATS:
            raise ValueError(f"full_format must be one of {FULL_FORMATS}, got {self.full_format!r}")

    @classmethod
    def given(cls, full: FullSaveOptions | None, full_format: str, include_optimizer: bool, translate_if_full: bool,
              translate_function: TranslateFunction | None, max_shard_size: int | str, dtype: torch.dtype | None,
              hf_config: dict[str, Any] | str | None) -> FullSaveOptions:
        """``full``, or the keyword arguments' options; not both.

        Raises:
            ValueError: Both were given, or a value is invalid.
        """
        given = (full_format, include_optimizer, translate_if_full, translate_function, max_shard_size, dtype,
                 hf_config)
        if full is None:
            return cls(*given)
        if given != ("safetensors", False, True, None, "5GB", None, None):
            raise ValueError("pass the full-save settings in full=FullSaveOptions(...) or as keyword arguments, not both")
        return full
