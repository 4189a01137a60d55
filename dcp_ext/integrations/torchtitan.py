"""torchtitan's checkpoint manager, saving and loading through dcp_ext.

:class:`DcpExtCheckpointManager` is torchtitan's DCP ``CheckpointManager``
(same folder layout ``{dump_folder}/{folder}/step-N``, same intervals,
``keep_latest_k``, async modes, initial loads and last-step exports) with
three things changed:

* saves go through :class:`~dcp_ext.CheckpointWriter` (``storage_options``,
  ``compression``, ``overwrite``), synchronous or asynchronous
  (``async_mode="async"``: a background thread; ``"async_with_pinned_mem"``:
  torch's checkpoint daemon process, which receives the pickled writer);
* loads go through :class:`~dcp_ext.CheckpointReader`, so they read
  checkpoints written by dcp_ext (compressed or not) and by torch's writers;
  only the keys torchtitan asks for are read (a model-only load of a full
  checkpoint reads no optimizer byte);
* the step to resume is the highest ``step-N`` directory holding a commit
  marker: dcp_ext's ``dcp_ext.metadata.json``, torch's ``.metadata`` (which
  every dcp_ext checkpoint also has, as a marker in compressed ones; before
  that marker, stock torchtitan silently started from step 0 on compressed
  checkpoints), or a Hugging Face index. Listing, existence checks and
  ``keep_latest_k`` deletion use dcp_ext's stores with ``storage_options``,
  so an S3 endpoint that needs options works (torchtitan's own helpers call
  fsspec without any). Deletion goes by dcp_ext's one rule
  (:func:`dcp_ext.root.delete_checkpoint_dir`), not torchtitan's
  ``rmtree``: a ``step-N`` is un-committed before any data file goes (a
  purge cut off when the job exits leaves a directory the step search skips
  and the next purge finishes), only files dcp_ext wrote go (a file of yours
  in it stays), and a ``step-N`` dcp_ext did not write (torch's writer, a
  Hugging Face export) is left whole, with a warning in the log.

Hugging Face exports and imports (``last_save_in_hf``, ``initial_load_in_hf``)
are torchtitan's own code, on local paths as there.

Install (torchtitan 0.3.0 pins ``datasets``, whose fsspec pin would downgrade
the fsspec s3fs needs, so torchtitan itself goes in without its
dependencies; the ``[torchtitan]`` extra brings the ones its checkpoint
manager, optimizers and config system import). dcp-ext is not on PyPI: from
a clone of the repository, into its environment::

    .venv/bin/pip install -e '.[torchtitan]' 'torch==2.13.0'   # keep your torch
    .venv/bin/pip install --no-deps 'torchtitan==0.3.0'

Use it in a torchtitan config (torchtitan 0.3 configs are Python functions in
a ``config_registry``; the checkpoint section takes any
``BaseCheckpointManager.Config``)::

    from dcp_ext.integrations.torchtitan import DcpExtCheckpointManager

    def llama3_8b_s3() -> Trainer.Config:
        config = llama3_8b()
        config.checkpoint = DcpExtCheckpointManager.Config(
            enable=True,
            folder="s3://my-bucket/llama3-8b/checkpoint",  # or a local/shared path
            interval=500,
            keep_latest_k=3,
            async_mode="async",
            compression="zstd",
            storage_options={"client_kwargs": {"region_name": "us-east-1"}},
        )
        return config

Command-line overrides work as for the stock section, e.g.
``--checkpoint.interval 100 --checkpoint.compression zstd``. The same settings
as TOML, for tools that keep their configs in TOML and build the dataclass
from it (``DcpExtCheckpointManager.Config(**toml["checkpoint"])``)::

    [checkpoint]
    enable = true
    folder = "s3://my-bucket/llama3-8b/checkpoint"
    interval = 500
    keep_latest_k = 3
    async_mode = "async"
    compression = "zstd"
    overwrite = true
    storage_options = { client_kwargs = { region_name = "us-east-1" } }
    io_options = { max_concurrency = 16, part_size = "32MiB" }

Without a trainer (what the tests do): ``DcpExtCheckpointManager.Config(...).
build(dataloader=..., model_parts=[model], optimizers=..., lr_schedulers=...,
states={"train_state": train_state}, sd_adapter=None)``; every rank calls
``save(step)`` / ``load()``, as torchtitan's trainer does.
"""

from __future__ import annotations

import re
import atexit
import threading
import weakref
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, async_save
from torchtitan.components.checkpointer.base import MODEL, purge_thread  # type: ignore[import-untyped]
from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager  # type: ignore[import-untyped]
from torchtitan.tools.logging import logger  # type: ignore[import-untyped]
from torchtitan.tools.utils import GarbageCollection  # type: ignore[import-untyped]

import dcp_ext
from dcp_ext.dcp_io import run_save
from dcp_ext.errors import InvalidOptionError
from dcp_ext.storage import Location

from . import _checkpoint_dirs as dirs
from ._io_options import io_config
from ._planning import save_planner

__all__ = ["DcpExtCheckpointManager"]

_STEP = re.compile(r"step-(\d+)")


class DcpExtCheckpointManager(CheckpointManager):  # type: ignore[misc]
    """torchtitan's ``CheckpointManager`` with dcp_ext storage (see the module doc).

    Every rank constructs it and calls ``save`` / ``load`` /
    ``maybe_wait_for_saving`` / ``close``, as with the stock manager; rank 0
    alone deletes old checkpoints (``keep_latest_k``), in a background thread.

    Args:
        config: The checkpoint section, a :class:`DcpExtCheckpointManager.Config`
            (torchtitan's fields plus ``storage_options``, ``compression``,
            ``overwrite``, ``verify_checksums`` and ``io_options``).
        **kwargs: The other arguments of torchtitan's ``CheckpointManager``
            (``dataloader``, ``model_parts``, ``optimizers``, ``lr_schedulers``,
            ``states``, ``sd_adapter``, ``base_folder``), passed on unchanged.

    Raises:
        InvalidOptionError: A ``compression`` other than ``"zstd"`` or
            ``None``, ``storage_options`` that is not a dict, or ``io_options``
            that are not ``IOConfig`` fields (from the config's own check).
    """

    purge_thread: threading.Thread | None
    """The thread that deletes checkpoints beyond ``keep_latest_k`` (torchtitan's, replaced by
    one that deletes by dcp_ext's rule: nothing in use, un-committed first); ``None`` when none
    runs."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):  # type: ignore[misc]
        """torchtitan's checkpoint settings plus dcp_ext's."""

        storage_options: dict[str, Any] | None = field(default_factory=dict)
        """fsspec/s3fs options for every save, load, listing and deletion
        (S3 ``endpoint_url`` / ``client_kwargs``, ``key``, ``secret``...)."""

        compression: str | None = None
        """``"zstd"`` for seekable zstd with byte grouping; ``None`` stores
        raw bytes (then torch's own readers can load the checkpoints too)."""

        overwrite: bool = True
        """Replace a committed ``step-N`` when the same step is saved again
        (a job restarted from an earlier step), as torch's writer does;
        ``False`` raises ``CheckpointExistsError`` instead."""

        verify_checksums: bool = True
        """Check every frame's checksum on load."""

        io_options: dict[str, Any] = field(default_factory=dict)
        """:class:`~dcp_ext.IOConfig` fields for every save and load
        (``{"max_concurrency": 16, "part_size": "32MiB"}``); unset fields
        keep their ``DCP_EXT_*`` environment value or default."""

        def __post_init__(self) -> None:
            """torchtitan's checks, then dcp_ext's.

            Raises:
                InvalidOptionError: A ``compression`` other than ``"zstd"`` or ``None``,
                    ``storage_options`` that is not a dict, or ``io_options`` that are not
                    ``IOConfig`` fields.
            """
            CheckpointManager.Config.__post_init__(self)
            if self.compression not in (None, "zstd", "auto"):
                raise InvalidOptionError(
                    f"checkpoint.compression must be 'zstd', 'auto' or None, not {self.compression!r}")
            if self.storage_options is None:  # as the other adapters accept it: no options
                self.storage_options = {}
            if not isinstance(self.storage_options, dict):
                raise InvalidOptionError(
                    f"checkpoint.storage_options must be a dict, not {type(self.storage_options).__name__}")
            io_config(self.io_options, "checkpoint.io_options")

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if not self.enable:
            return
        self.storage_options: dict[str, Any] = dict(config.storage_options or {})
        """The config's ``storage_options``, for every save, load, listing and deletion."""
        self.compression = config.compression
        """The config's ``compression``: ``zstd`` or ``None`` (raw bytes)."""
        self.overwrite = config.overwrite
        """The config's ``overwrite``: whether saving a step again replaces its committed
        checkpoint."""
        self.verify_checksums = config.verify_checksums
        """The config's ``verify_checksums``: whether loads check every frame's checksum."""
        self.io_config = io_config(config.io_options, "checkpoint.io_options")
        """The :class:`~dcp_ext.IOConfig` of every save and load, from the config's
        ``io_options``."""
        #: The checkpoint the last save wrote (an asynchronous one may not be
        #: listed yet: it still counts for keep_latest_k).
        self._saving: str | None = None
        if self.purge_thread is not None:
            # torchtitan's purge thread deletes with fsspec's rmtree and no
            # options: swap it for one that deletes by dcp_ext's one rule.
            self.purge_queue.put(None)
            self.purge_thread.join()
            self.purge_thread = threading.Thread(
                target=purge_thread, args=(self.purge_queue, self._remove_checkpoint), daemon=True
            )
            self.purge_thread.start()
            # torchtitan's purge thread is a daemon: a job that ends without close() would cut its
            # last deletion off at exit. Each deletion un-commits first (a cut-off one leaves no
            # half-deleted directory that looks committed), and this finishes the queue at exit.
            atexit.register(_close_at_exit, weakref.ref(self))

    # -- storage ------------------------------------------------------------
    def _writer(self, checkpoint_id: str) -> dcp_ext.CheckpointWriter:
        self._saving = checkpoint_id
        return dcp_ext.CheckpointWriter(checkpoint_id, storage_options=self.storage_options,
                                        overwrite=self.overwrite, compression=self.compression, config=self.io_config)

    def _remove_checkpoint(self, path: str) -> None:
        """(rank 0, the purge thread) Delete ``step-N`` by dcp_ext's one rule
        (see the module doc); torchtitan's purge thread logs a refusal
        (``ForeignCheckpointError``, ``CheckpointInUseError``) and goes on."""
        dirs.remove_checkpoint(Location.of(path, self.storage_options))

    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Any:
        """(all ranks) Save ``state_dict`` to ``checkpoint_id`` through dcp_ext.

        Returns what torchtitan's ``dcp_save`` returns: ``None`` (synchronous),
        a ``Future`` (``async``) or an ``AsyncSaveResponse``
        (``async_with_pinned_mem``). Hugging Face exports are torchtitan's.
        """
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        ret: Any = None
        writer, planner = self._writer(checkpoint_id), save_planner("torchtitan", self.io_config)
        if async_mode == AsyncMode.ASYNC:
            # The writer stages (a blocking copy) and a thread uploads.
            ret = async_save(state_dict, storage_writer=writer, planner=planner, process_group=self.pg)
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            ret = async_save(state_dict, storage_writer=writer, planner=planner, process_group=self.pg,
                             async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=self.stager)
        else:
            run_save(state_dict, writer, planner, None)  # the default group, as torchtitan's synchronous save
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool,
                 from_quantized: bool) -> None:
        """(all ranks) Load ``checkpoint_id`` into ``state_dict`` in place with
        :class:`~dcp_ext.CheckpointReader`, resharding to the current layout.

        Only the keys of ``state_dict`` are read (each missing one is an
        error naming it); Hugging Face imports are torchtitan's.
        """
        if from_hf:
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        keys = {k for key in state_dict for k in (key, f"{key}.")}
        dcp_ext.load(state_dict, checkpoint_id, storage_options=self.storage_options,
                     planner=dcp_ext.LayoutLoadPlanner(strict=True, keys=keys),
                     config=self.io_config, verify_checksums=self.verify_checksums)
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)

    # -- finding, loading and purging steps ---------------------------------------
    def _find_load_step(self, folder: str = "") -> int:
        """The highest ``step-N`` under ``folder`` (default: the checkpoint
        folder) that holds a commit marker, or -1 (see the module doc)."""
        where = Location.of(folder or self.folder, self.storage_options)
        steps = []
        for name in dirs.child_dirs(where):
            match = _STEP.search(name)
            if match and dirs.is_committed(where.child(name)):
                steps.append(int(match.group(1)))
        return max(steps, default=-1)

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """(all ranks) torchtitan's ``_load``, with storage checks through dcp_ext."""
        has_folder = dirs.exists(Location.of(self.folder, self.storage_options))
        if step != -1 and not has_folder:
            raise FileNotFoundError(f"--checkpoint.load_step={step} not found because "
                                    f"checkpoint.folder {self.folder} does not exist")
        load_step = (self._find_load_step() if step == -1 else step) if has_folder else -1
        from_hf = from_quantized = False
        if load_step == -1:
            model_only = self.initial_load_model_only
            from_hf = self.initial_load_in_hf
            from_quantized = self.initial_load_in_hf_quantized
            if self.initial_load_path:
                checkpoint_id = self.initial_load_path
                if not dirs.exists(Location.of(checkpoint_id, self.storage_options)):
                    raise ValueError(f"Checkpoint.initial_load_path is invalid: {checkpoint_id}")
            elif from_hf:
                assert self.sd_adapter and self.sd_adapter.hf_assets_path, (
                    "from_hf=True requires sd_adapter and hf_assets_path.")
                checkpoint_id = self.sd_adapter.hf_assets_path
                if not dirs.exists(Location.of(checkpoint_id)):
                    raise ValueError("model.hf_assets_path is being used to load HF weights but the path "
                                     "is not valid. Either make sure hf_assets_path is correct or provide "
                                     "a valid checkpoint.initial_load_path")
            else:
                logger.info("No checkpoint was provided, this is a fresh start.")
                return False
        else:
            # checkpoint.folder holds checkpoints of an earlier run: resume, and
            # ignore the initial_* options (torchtitan's fault-tolerance rule).
            model_only = load_step == 0
            checkpoint_id = self._create_checkpoint_id(load_step)
            if not dirs.exists(Location.of(checkpoint_id, self.storage_options)):
                raise FileNotFoundError(f"--checkpoint.load_step={load_step} not found at {checkpoint_id}")
        logger.info(f"Loading the checkpoint from {checkpoint_id}.")
        begin = time.monotonic()
        states = self._states_to_load(model_only)
        self.dcp_load(states, checkpoint_id=checkpoint_id, from_hf=from_hf, from_quantized=from_quantized)
        GarbageCollection.collect("GC collection for checkpoint loading.")
        logger.info(f"Finished loading the checkpoint in {time.monotonic() - begin:.2f} seconds.")
        return True

    def _should_purge(self) -> bool:
        return (self.keep_latest_k > 0 and dist.get_rank() == 0
                and dirs.exists(Location.of(self.folder, self.storage_options)))

    def _purge_stale_checkpoints(self) -> None:
        """(rank 0) Queue every ``step-N`` but the newest ``keep_latest_k`` for
        deletion; the one being saved counts even before it is listed (an
        asynchronous upload to S3 has no prefix until its first object)."""
        if not self._should_purge():
            return
        names = set(dirs.child_dirs(Location.of(self.folder, self.storage_options)))
        if self._saving is not None and self._saving.rstrip("/").startswith(self.folder.rstrip("/")):
            names.add(self._saving.rstrip("/").rsplit("/", 1)[-1])
        found = sorted(
            (int(m.group(1)), dirs.join(self.folder, name)) for name in names if (m := _STEP.search(name))
        )
        for _, path in found[: -self.keep_latest_k]:
            assert self.purge_thread is not None
            self.purge_queue.put(path)


def _close_at_exit(manager: weakref.ref[DcpExtCheckpointManager]) -> None:
    """(at interpreter exit) Finish the purges still queued (torchtitan's ``close``)."""
    alive = manager()
    if alive is not None:
        alive.close()
