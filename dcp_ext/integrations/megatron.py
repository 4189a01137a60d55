"""Megatron-Core's distributed checkpoints (``megatron.core.dist_checkpointing``) through dcp_ext.

Megatron-Core saves a *sharded state dict* (``ShardedTensor``,
``ShardedObject`` and plain values) as a directory::

    common.pt                       # the plain values, torch.save by rank 0
    .metadata, *.distcp             # the sharded part, a DCP checkpoint (the "torch_dist" backend)
    metadata.json                   # {"sharded_backend": "torch_dist", ...}: written last, Megatron's marker

Its ``torch_dist`` strategies convert Megatron's shards to DCP items and write
them with a torch ``FileSystemWriter`` subclass. The two strategies here keep
that conversion and Megatron's items (``MCoreSavePlanner``'s local plan; on
load ``MCoreLoadPlanner``: same keys, same global-shape checks, same
resharding), plan the save with dcp_ext's planner
(:class:`MegatronLayoutPlanner`: data files per kind and rank where
Megatron writes ``__0_0.distcp``, ``optimizer_rank0.distcp`` for the keys
under ``optimizer.`` and ``state_rank0.distcp`` for the others, and plan
caching), and store the DCP part with
:class:`~dcp_ext.CheckpointWriter` /
:class:`~dcp_ext.CheckpointReader`: ``compression``, ``io_options``
(:class:`~dcp_ext.IOConfig` fields), ``storage_options``, checksums on every
read, the save lock, and the commit of dcp_ext's metadata after every rank's
data is durable.

* :class:`DcpExtSaveShardedStrategy`, for ``dist_checkpointing.save(...,
  sharded_strategy=...)``. Uncompressed, it records the backend
  ``("torch_dist", 1)`` in ``metadata.json``, so Megatron's own loader (and
  Megatron without dcp_ext) reads the checkpoint. Compressed
  (``compression="zstd"``), it records ``("dcp_ext", 1)``: importing this
  module registers :class:`DcpExtLoadShardedStrategy` under that backend with
  Megatron, so ``dist_checkpointing.load(sd, path)`` with no strategy finds
  it; Megatron's ``torch_dist`` loader refuses such a checkpoint with
  :class:`~dcp_ext.NeedsCheckpointReaderError`. ``overwrite=True`` by default,
  as Megatron: its ``save`` writes ``common.pt`` before the strategy runs, so
  a refusal there would leave a new ``common.pt`` beside the old shards.
* :class:`DcpExtLoadShardedStrategy`, for ``dist_checkpointing.load(...,
  sharded_strategy=...)``: reads checkpoints written by either strategy and by
  Megatron's own (whose ``.metadata`` also pickles every rank's DCP save plan,
  which dcp_ext's restricted unpickler admits).

Megatron's ``save`` and ``load`` entry points test, read and write
``common.pt`` and ``metadata.json`` with ``os`` and ``torch.save`` themselves,
outside the strategy (``Path(dir).iterdir()``, ``os.path.isdir``), so they
work on local and shared file systems only. For ``s3://`` or any fsspec URL
use :func:`save`, :func:`load` and :func:`load_common_state_dict` here: the
same arguments as Megatron's, the same files, every one through dcp_ext's
stores. :func:`save` writes ``common.pt`` (coordinator, under the save lock,
after the data is durable, before dcp_ext's commit) and ``metadata.json``
after the commit, so a crash at any point never leaves a ``metadata.json``
beside data of another save. Every process calls them, with the process group
initialized, as Megatron's::

    from dcp_ext.integrations import megatron as dcp_megatron

    opts = {"client_kwargs": {"region_name": "us-east-1"}}
    dcp_megatron.save(sharded_state_dict, "s3://bucket/run1/iter_0001000", compression="zstd",
                      storage_options=opts)
    state = dcp_megatron.load(sharded_state_dict, "s3://bucket/run1/iter_0001000", storage_options=opts)

``common.pt`` is loaded with ``torch.load(weights_only=True)``, as Megatron
loads it (register extra classes with ``torch.serialization.add_safe_globals``
as for Megatron). ``ShardedObject`` values (RNG states...) are unpickled by
Megatron's planner with ``torch.load(weights_only=False)``, as with
Megatron's own loader: load only checkpoints you trust.

Trainers (not exercised here: Megatron-LM and Megatron-Bridge are not
installed, and their trainers need CUDA). Their ``save_checkpoint`` takes a
``checkpointing_context`` dict and, when it holds ``"save_strategy"``, saves
every ``torch_dist`` checkpoint with that strategy: put a
:class:`DcpExtSaveShardedStrategy` there. Megatron-Bridge loads with
``get_default_load_sharded_strategy(dir)``, i.e. by the backend in
``metadata.json``: uncompressed checkpoints go to Megatron's loader, compressed
ones to :class:`DcpExtLoadShardedStrategy` once this module is imported.
Megatron-LM's loader builds ``TorchDistLoadShardedStrategy`` itself, which
reads uncompressed dcp_ext checkpoints; for compressed ones it would have to
be replaced in ``megatron.training.checkpointing``. Both trainers also write
tracker files and configs with ``os``, so with them checkpoints stay on local
or shared file systems; object stores need :func:`save` / :func:`load`.

Saves are synchronous. ``async_save`` (Megatron's ``async_sharded_save=True``,
Megatron-LM's ``--async-save``) saves before it returns and hands back an
``AsyncRequest`` with nothing left to run, so an asynchronous trainer keeps
working but waits for the save. Not exercised: Megatron's asynchronous
machinery (forked writer processes, CUDA synchronisation), CUDA tensors,
FP8 tensors, ``FullyParallelLoadStrategyWrapper`` around the load strategy
(megatron-core 0.16.1's ``exchange_utils`` allocates the exchanged tensors on
``"cuda"``), ``remove_sharded_tensors`` (refused: it would rewrite torch's
``.metadata`` behind dcp_ext's). ``FullyParallelSaveStrategyWrapper`` around
the save strategy is tested (2 ranks sharing out a replicated tensor's save,
read back bit-exact by Megatron's loader and by dcp_ext's). Tested with megatron-core 0.16.1 (the
newest for Python 3.11) on CPU, 2 gloo ranks. Install from a clone of dcp_ext:
``.venv/bin/pip install -e '.[megatron]'``.
"""

from __future__ import annotations

import io
import json
import logging
import os
from dataclasses import asdict
from typing import Any

import torch
from megatron.core.dist_checkpointing.core import (  # type: ignore[import-untyped]
    CheckpointingConfig,
    CheckpointingException,
)
from megatron.core.dist_checkpointing.dict_utils import merge, nested_values  # type: ignore[import-untyped]
from megatron.core.dist_checkpointing.mapping import (  # type: ignore[import-untyped]
    ShardedObject,
    ShardedTensor,
    apply_factory_merges,
)
from megatron.core.dist_checkpointing.state_dict_utils import (  # type: ignore[import-untyped]
    load_preprocess,
    save_preprocess,
)
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest  # type: ignore[import-untyped]
from megatron.core.dist_checkpointing.strategies.base import (  # type: ignore[import-untyped]
    StrategyAction,
    register_default_strategy,
)
from megatron.core.dist_checkpointing.strategies.torch import (  # type: ignore[import-untyped]
    MCoreLoadPlanner,
    MCoreSavePlanner,
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict,
)
from megatron.core.dist_checkpointing.utils import (  # type: ignore[import-untyped]
    extract_sharded_base,
    force_all_tensors_to_non_fp8,
)
from megatron.core.dist_checkpointing.validation import (  # type: ignore[import-untyped]
    StrictHandling,
    determine_global_metadata,
    parse_strict_flag,
    validate_integrity_and_strict_load,
)
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from dcp_ext.dcp_io import CheckpointReader, CheckpointWriter, run_load, run_save
from dcp_ext.errors import CheckpointCorruptError, InvalidOptionError, NotACheckpointError
from dcp_ext.format import parse_stored_json, resolve_codec
from dcp_ext.planners import LayoutSavePlanner
from dcp_ext.storage import Location, Store

from ._io_options import io_config
from ._paths import location

__all__ = [
    "DcpExtSaveShardedStrategy",
    "DcpExtLoadShardedStrategy",
    "MegatronLayoutPlanner",
    "save",
    "load",
    "load_common_state_dict",
    "TORCH_DIST_BACKEND",
    "DCP_EXT_BACKEND",
    "COMMON_FILE",
    "CONFIG_FILE",
]

log = logging.getLogger("dcp_ext.integrations.megatron")

#: ``metadata.json``'s backend of an uncompressed checkpoint: Megatron's own loader reads it.
TORCH_DIST_BACKEND = ("torch_dist", 1)
#: ``metadata.json``'s backend of a compressed checkpoint: only :class:`DcpExtLoadShardedStrategy` reads it.
DCP_EXT_BACKEND = ("dcp_ext", 1)
#: Megatron's file names (``strategies.common.COMMON_STATE_FNAME``, ``core.CONFIG_FNAME``).
COMMON_FILE = "common.pt"
CONFIG_FILE = "metadata.json"


class DcpExtSaveShardedStrategy(TorchDistSaveShardedStrategy):  # type: ignore[misc]
    """Megatron's ``torch_dist`` save strategy with the DCP part stored by
    :class:`~dcp_ext.CheckpointWriter` (see the module doc).

    Every rank calls ``save`` with its sharded state dict, as Megatron's
    ``dist_checkpointing.save`` does; the coordinator (rank 0) commits.

    Args:
        storage_options: fsspec/s3fs options (S3 ``endpoint_url``, ``key``...).
        compression: ``None`` (Megatron and torch can read the checkpoint) or
            ``"zstd"`` (or a :class:`~dcp_ext.ZstdCodec`); decides the backend
            recorded (``backend``: :data:`TORCH_DIST_BACKEND` or :data:`DCP_EXT_BACKEND`).
        overwrite: Replace a committed checkpoint at the path (Megatron's
            behaviour, default); ``False`` raises ``CheckpointExistsError``.
        io_options: :class:`~dcp_ext.IOConfig` fields (``{"max_concurrency": 16}``).
        keep_only_main_replica: Megatron's setting: only each shard's main
            replica (``replica_id`` 0) is saved.
        enable_plan_caching: dcp_ext's plan caching (:class:`MegatronLayoutPlanner`):
            a save whose plans are bit for bit the last successful one's (the
            same keys, dtypes, shapes and shards on every rank) reuses its
            global plan. On by default; a save whose state changed plans afresh.

    Attributes:
        last_planner: The planner of this rank's last save (on the
            coordinator, its ``reused_global_plan`` says whether the cached
            plan served).

    Raises:
        InvalidOptionError: ``storage_options`` or ``io_options`` are not
            dicts of valid settings.
        UnsupportedCodecError: An unknown ``compression``.
    """

    def __init__(self, *, storage_options: dict[str, Any] | None = None, compression: Any = None,
                 overwrite: bool = True, io_options: dict[str, Any] | None = None,
                 keep_only_main_replica: bool = True, enable_plan_caching: bool = True) -> None:
        codec = resolve_codec(compression)
        backend, version = TORCH_DIST_BACKEND if codec is None else DCP_EXT_BACKEND
        super().__init__(backend, version, keep_only_main_replica=keep_only_main_replica)
        self.storage_options = _options(storage_options)
        self.compression = compression
        self.overwrite = overwrite
        self.io_config = io_config(io_options, "io_options")
        self.enable_plan_caching = enable_plan_caching
        self.last_planner: MegatronLayoutPlanner | None = None
        self._warned_sync = False

    def save(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | os.PathLike[str]) -> None:
        """(all ranks) Save the sharded part of a Megatron checkpoint to ``checkpoint_dir``."""
        self.save_dcp(sharded_state_dict, checkpoint_dir)

    def async_save(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | os.PathLike[str]) -> Any:
        """(all ranks) Save now (synchronously, see the module doc); the returned
        ``AsyncRequest`` has nothing left to run but the finalizers Megatron adds."""
        if not self._warned_sync:
            log.warning("dcp_ext's Megatron strategy saves synchronously: async_save returns once %s is "
                        "committed", location(checkpoint_dir))
            self._warned_sync = True
        self.save_dcp(sharded_state_dict, checkpoint_dir)
        return AsyncRequest(None, (), [])

    def save_dcp(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | os.PathLike[str],
                 files: _MegatronFiles | None = None) -> Metadata:
        """(all ranks) Convert with Megatron's helpers and save through dcp_ext;
        ``files`` (by :func:`save`) adds ``common.pt`` before the commit and
        ``metadata.json`` after it.

        Returns:
            The checkpoint's DCP metadata.
        """
        sharded, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
        state = mcore_to_pyt_state_dict(sharded, False)
        writer = CheckpointWriter(
            location(checkpoint_dir), storage_options=self.storage_options, overwrite=self.overwrite,
            compression=self.compression, config=self.io_config,
            before_commit=files.before_commit if files is not None else None,
            after_commit=files.after_commit if files is not None else None,
        )
        # The planner names the data files: over the key prefixes of the writer's own settings.
        planner = self.last_planner = MegatronLayoutPlanner(enable_plan_caching=self.enable_plan_caching,
                                                            key_prefixes=writer.config.key_prefixes)
        metadata: Metadata = run_save(state, writer, planner, None)
        return metadata


class _MegatronItems(MCoreSavePlanner):  # type: ignore[misc]
    """Megatron's local plan: every rank writes its own ``ShardedObject`` s
    (``BytesIO``, serialized already), items keep Megatron's keys. Megatron's
    decentralized planning is its own save path's; DCP's planning runs here."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(flatten_state_dict=False, can_run_decentralized_global_plan=False, **kwargs)


class MegatronLayoutPlanner(LayoutSavePlanner, _MegatronItems):
    """(every rank) Megatron's items (``MCoreSavePlanner``'s local plan) planned
    by :class:`~dcp_ext.planners.LayoutSavePlanner`: per-kind data files
    (``state_rank0.distcp``, ``optimizer_rank0.distcp``), compact plans and
    write results, and, with ``enable_plan_caching``, dcp_ext's plan cache
    (a save whose every rank's plan matches, keys, dtypes, shapes and chunks,
    the last successful one's reuses its global plan and metadata).

    A replicated tensor's copies (``keep_only_main_replica=False``) are saved
    once, by the lowest rank holding one, as ``MCoreSavePlanner`` with
    ``dedup_replicated_tensors`` does. ``key_prefixes``: the strategy's
    ``io_options`` (:attr:`~dcp_ext.IOConfig.key_prefixes`).
    """

    def __init__(self, enable_plan_caching: bool = True, key_prefixes: int = 0) -> None:
        super().__init__(key_prefixes=key_prefixes, enable_plan_caching=enable_plan_caching,
                         plan_cache_name="megatron")


class DcpExtLoadShardedStrategy(TorchDistLoadShardedStrategy):  # type: ignore[misc]
    """Megatron's ``torch_dist`` load strategy reading through
    :class:`~dcp_ext.CheckpointReader`: checkpoints of either backend
    (:data:`TORCH_DIST_BACKEND`, :data:`DCP_EXT_BACKEND`), written by dcp_ext
    (compressed or not) or by Megatron, resharded to the sharded state dict
    given (every rank calls ``load``, as Megatron's ``dist_checkpointing.load``).

    Args:
        storage_options: fsspec/s3fs options.
        verify_checksums: Check every frame's checksum (dcp_ext's checkpoints).
        io_options: :class:`~dcp_ext.IOConfig` fields.
    """

    def __init__(self, *, storage_options: dict[str, Any] | None = None, verify_checksums: bool = True,
                 io_options: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.storage_options = _options(storage_options)
        self.verify_checksums = verify_checksums
        self.io_config = io_config(io_options, "io_options")

    def _reader(self, checkpoint_dir: str | os.PathLike[str]) -> CheckpointReader:
        return CheckpointReader(location(checkpoint_dir), storage_options=self.storage_options,
                                config=self.io_config, verify_checksums=self.verify_checksums)

    def load(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
        """(all ranks) Megatron's ``torch_dist`` load with dcp_ext's reader: the
        shards this rank's ``ShardedTensor`` s ask for, its ``ShardedObject`` s.

        Returns:
            The loaded state dict, in the structure of ``sharded_state_dict``.
        """
        shape_checked = [t for t in nested_values(sharded_state_dict)
                         if isinstance(t, ShardedTensor) and not t.allow_shape_mismatch]
        shape_free = {t.key: t for t in nested_values(sharded_state_dict)
                      if isinstance(t, ShardedTensor) and t.allow_shape_mismatch}
        sharded, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
        state = mcore_to_pyt_state_dict(sharded, True)
        planner = MCoreLoadPlanner(shapes_validation_sharded_tensors=shape_checked,
                                   allow_shape_mismatch_sharded_tensors=shape_free)
        run_load(state, self._reader(checkpoint_dir), planner, None)
        loaded = {key: _unwrap_pyt_sharded_tensor(value) for key, value in state.items()}
        result: dict[str, Any] = _replace_sharded_keys_with_state_dict_keys(loaded, flat_mapping, rename_mapping)
        _restore_dict_types(result, sharded_state_dict)
        return result

    def load_tensors_metadata(self, checkpoint_dir: str | os.PathLike[str],
                              metadata: Metadata | None = None) -> dict[str, Any]:
        """(any rank) Every stored tensor as a data-less ``ShardedTensor`` (global shape, dtype)."""
        if metadata is None:
            metadata = self._reader(checkpoint_dir).read_metadata()
        found: dict[str, Any] = super().load_tensors_metadata(checkpoint_dir, metadata)
        return found

    def load_sharded_metadata(self, checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
        """(any rank) :meth:`load_tensors_metadata` plus every stored ``ShardedObject``."""
        metadata = self._reader(checkpoint_dir).read_metadata()
        found: dict[str, Any] = {}
        for key, stored in metadata.state_dict_metadata.items():
            if isinstance(stored, BytesStorageMetadata):
                shard = ShardedObject.empty_from_unique_key(key)
                found[shard.unique_key] = shard
        found.update(self.load_tensors_metadata(checkpoint_dir, metadata))
        return found

    def remove_sharded_tensors(self, checkpoint_dir: str, key_prefix: str) -> None:
        """Refused: Megatron's version rewrites torch's ``.metadata`` on a
        local path, leaving dcp_ext's metadata (the commit) describing the removed data."""
        raise NotImplementedError(
            f"removing sharded tensors from {checkpoint_dir} is not supported by dcp_ext's Megatron strategy: "
            f"load the checkpoint and save the tensors to keep instead"
        )

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend not in (TORCH_DIST_BACKEND[0], DCP_EXT_BACKEND[0]):
            raise CheckpointingException(
                f"dcp_ext's Megatron load strategy reads the backends {TORCH_DIST_BACKEND[0]!r} and "
                f"{DCP_EXT_BACKEND[0]!r}, not {loaded_backend!r}")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != 1:
            raise CheckpointingException(
                f"dcp_ext's Megatron load strategy reads backend version 1, not {loaded_version!r}")


def _options(given: Any) -> dict[str, Any]:
    """The ``storage_options`` argument of a strategy, checked: a dict (``None``: no options)."""
    if given is not None and not isinstance(given, dict):
        raise InvalidOptionError(f"storage_options must be a dict, not {type(given).__name__}")
    return dict(given or {})


class _MegatronFiles:
    """(the coordinator, inside the DCP commit of :func:`save`) Megatron's own
    files: ``common.pt`` before dcp_ext's commit, ``metadata.json`` after it."""

    def __init__(self, common_state_dict: dict[str, Any], backend: str, version: int) -> None:
        self.common_state_dict = common_state_dict
        self.config = CheckpointingConfig(backend, version)
        self.store: Store | None = None

    def before_commit(self, store: Store) -> None:
        # A checkpoint being replaced was un-committed just before: its
        # metadata.json (Megatron's marker) goes first, then common.pt is replaced.
        self.store = store
        store.delete(CONFIG_FILE)
        buffer = io.BytesIO()
        torch.save(self.common_state_dict, buffer)
        store.write_file(COMMON_FILE, buffer.getvalue())

    def after_commit(self) -> None:
        assert self.store is not None, "before_commit runs first"
        # Byte for byte what Megatron's save_config writes.
        self.store.write_file(CONFIG_FILE, json.dumps(asdict(self.config)).encode())


def save(sharded_state_dict: dict[str, Any], checkpoint_dir: str | os.PathLike[str],
         sharded_strategy: DcpExtSaveShardedStrategy | None = None, *, validate_access_integrity: bool = True,
         preprocess_common_before_consistancy_check: Any = None, content_metadata: dict[str, Any] | None = None,
         storage_options: dict[str, Any] | None = None, compression: Any = None, overwrite: bool = True,
         io_options: dict[str, Any] | None = None) -> None:
    """(all ranks) Megatron's ``dist_checkpointing.save`` for any location: the
    same files, all through dcp_ext's stores (see the module doc).

    Args:
        sharded_state_dict, validate_access_integrity,
        preprocess_common_before_consistancy_check, content_metadata: As for
            Megatron's ``save`` (``content_metadata`` is added to
            ``sharded_state_dict``, as there).
        checkpoint_dir: Local path, ``s3://`` or any fsspec URL; created if missing.
        sharded_strategy: A :class:`DcpExtSaveShardedStrategy`; default: one
            built from the settings below (give one or the other).
        storage_options, compression, overwrite, io_options: As for
            :class:`DcpExtSaveShardedStrategy`.

    Raises:
        InvalidOptionError: Both a strategy and settings, or a strategy of another kind.
        CheckpointExistsError: ``overwrite=False`` and a checkpoint is committed there.
    """
    settings = {"storage_options": storage_options, "compression": compression, "io_options": io_options}
    if sharded_strategy is None:
        sharded_strategy = DcpExtSaveShardedStrategy(overwrite=overwrite, **settings)
    elif not isinstance(sharded_strategy, DcpExtSaveShardedStrategy):
        raise InvalidOptionError(f"sharded_strategy must be a DcpExtSaveShardedStrategy, not "
                                 f"{type(sharded_strategy).__name__}")
    elif any(v is not None for v in settings.values()) or overwrite is not True:
        raise InvalidOptionError("give either sharded_strategy or its settings (storage_options, compression, "
                                 "overwrite, io_options), not both")
    if content_metadata is not None:
        sharded_state_dict["content_metadata"] = content_metadata  # Megatron's _CONTENT_METADATA_KEY
    sharded_part, common_state_dict = save_preprocess(sharded_state_dict, validate_access_integrity,
                                                      preprocess_common_before_consistancy_check)
    files = _MegatronFiles(common_state_dict, sharded_strategy.backend, sharded_strategy.version)
    sharded_strategy.save_dcp(sharded_part, checkpoint_dir, files)


def _read_config(store: Store) -> Any:
    """The checkpoint's ``CheckpointingConfig`` (``metadata.json``), checked.

    Raises:
        NotACheckpointError: No ``metadata.json``: not a Megatron checkpoint,
            or its save did not finish.
        CheckpointCorruptError: It is damaged.
    """
    where = store.describe(CONFIG_FILE)
    try:
        data = store.read_file(CONFIG_FILE)
    except FileNotFoundError as err:
        raise NotACheckpointError(
            f"{store.url} is not a Megatron distributed checkpoint: it has no {CONFIG_FILE} (Megatron's "
            f"save writes it last, so a save that did not finish leaves none)", store.url) from err
    fields = parse_stored_json(data, where, "Megatron checkpoint config")
    try:
        config = CheckpointingConfig(**fields)
    except TypeError as err:
        raise CheckpointCorruptError(f"{where} is not a Megatron checkpoint config: {err}", where) from err
    if (config.common_backend, config.common_backend_version) != ("torch", 1):
        raise CheckpointCorruptError(f"{where}: common backend {config.common_backend!r} version "
                                     f"{config.common_backend_version!r}; Megatron writes only ('torch', 1)", where)
    return config


def _checked_store(checkpoint_dir: str | os.PathLike[str], strategy: DcpExtLoadShardedStrategy) -> Store:
    store = Location.of(location(checkpoint_dir), strategy.storage_options).open()
    config = _read_config(store)
    strategy.check_backend_compatibility(config.sharded_backend)
    strategy.check_version_compatibility(config.sharded_backend_version)
    return store


def _read_common(store: Store) -> dict[str, Any]:
    """``common.pt``, loaded as Megatron loads it (``weights_only=True``)."""
    common: dict[str, Any] = torch.load(io.BytesIO(store.read_file(COMMON_FILE)), map_location="cpu",
                                        weights_only=True)
    return common


def load_common_state_dict(checkpoint_dir: str | os.PathLike[str],
                           storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """(any rank) Megatron's ``load_common_state_dict`` for any location: the plain values (``common.pt``)."""
    return _read_common(_checked_store(checkpoint_dir, DcpExtLoadShardedStrategy(storage_options=storage_options)))


def load(sharded_state_dict: dict[str, Any], checkpoint_dir: str | os.PathLike[str],
         sharded_strategy: DcpExtLoadShardedStrategy | None = None, *, validate_access_integrity: bool = True,
         strict: str | StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED,
         storage_options: dict[str, Any] | None = None, verify_checksums: bool = True,
         io_options: dict[str, Any] | None = None) -> Any:
    """(all ranks) Megatron's ``dist_checkpointing.load`` for any location, of a
    checkpoint written by :func:`save`, by Megatron with either strategy, or
    by Megatron's own ``torch_dist`` strategy.

    Args:
        sharded_state_dict, validate_access_integrity, strict: As for Megatron's ``load``.
        checkpoint_dir: Local path, ``s3://`` or any fsspec URL.
        sharded_strategy: A :class:`DcpExtLoadShardedStrategy`; default: one
            built from the settings below (give one or the other).
        storage_options, verify_checksums, io_options: As for :class:`DcpExtLoadShardedStrategy`.

    Returns:
        The loaded state dict, or ``(state dict, missing keys, unexpected
        keys)`` for the ``strict`` values that return them (as Megatron's).

    Raises:
        NotACheckpointError: No ``metadata.json`` there.
        CheckpointingException: (Megatron's) its backend is not one this reads.
    """
    if sharded_strategy is None:
        sharded_strategy = DcpExtLoadShardedStrategy(storage_options=storage_options,
                                                     verify_checksums=verify_checksums, io_options=io_options)
    elif not isinstance(sharded_strategy, DcpExtLoadShardedStrategy):
        raise InvalidOptionError(f"sharded_strategy must be a DcpExtLoadShardedStrategy, not "
                                 f"{type(sharded_strategy).__name__}")
    elif storage_options is not None or io_options is not None or verify_checksums is not True:
        raise InvalidOptionError("give either sharded_strategy or its settings (storage_options, "
                                 "verify_checksums, io_options), not both")
    url = location(checkpoint_dir)
    store = _checked_store(url, sharded_strategy)
    # What Megatron's load does after reading metadata.json, step by step.
    force_all_tensors_to_non_fp8(sharded_state_dict)
    common_state_dict = _read_common(store)
    sharded_state_dict, nonpersistent, factories = load_preprocess(sharded_state_dict)
    merge(common_state_dict, nonpersistent)
    sharded_state_dict, _ = extract_sharded_base(sharded_state_dict)
    strict = parse_strict_flag(strict)
    checkpoint_metadata = (sharded_strategy.load_sharded_metadata(url)
                           if StrictHandling.requires_explicit_ckpt_mismatch_check(strict) else None)
    local_metadata = global_metadata = None
    if validate_access_integrity or StrictHandling.requires_global_app_metadata(strict):
        local_metadata, global_metadata = determine_global_metadata(sharded_state_dict)
    sharded_state_dict, missing, unexpected = validate_integrity_and_strict_load(
        sharded_state_dict, strict, validate_access_integrity, local_metadata, global_metadata,
        checkpoint_metadata)
    merge(common_state_dict, sharded_strategy.load(sharded_state_dict, url))
    apply_factory_merges(common_state_dict, factories)
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return common_state_dict, missing, unexpected
    return common_state_dict


# Megatron's default loader finds the strategy of compressed checkpoints by the
# backend in their metadata.json ("dcp_ext", 1); Megatron re-registers only its
# own backends before each lookup, so these stay registered.
register_default_strategy(StrategyAction.LOAD_SHARDED, *DCP_EXT_BACKEND, DcpExtLoadShardedStrategy())
register_default_strategy(StrategyAction.SAVE_SHARDED, *DCP_EXT_BACKEND, DcpExtSaveShardedStrategy(compression="zstd"))
