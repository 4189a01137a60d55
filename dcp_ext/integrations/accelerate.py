"""Hugging Face Accelerate's FSDP sharded checkpoints through dcp_ext.

Accelerate saves and loads FSDP models and optimizers in
``accelerate/utils/fsdp_utils.py`` with a hard-coded ``FileSystemWriter`` /
``FileSystemReader`` and ``os.makedirs``: local paths only, no storage
options. The four functions here have the same signatures (plus keyword-only
dcp_ext settings: ``storage_options``, ``io_options`` (:class:`~dcp_ext.IOConfig`
fields), and for saves ``compression`` and ``overwrite``) and write the same layout, through
:class:`~dcp_ext.CheckpointWriter` / :class:`~dcp_ext.CheckpointReader`::

    {output_dir}/pytorch_model_fsdp_{model_index}/   # DCP checkpoint of {"model": ...}
    {output_dir}/optimizer_{optimizer_index}/         # DCP checkpoint of {"optimizer": ...}

so ``output_dir`` may be ``s3://bucket/run1/checkpoint-100`` or any fsspec
URL, checkpoints can be compressed and are checksummed, and each direction
interoperates with accelerate's own functions for uncompressed checkpoints
(accelerate's reader cannot read compressed ones).

Handled here: FSDP2 (``fsdp_version=2``) with ``SHARDED_STATE_DICT`` and
``use_dcp=True`` (accelerate's defaults for FSDP2 checkpoints). Anything else
(FSDP1, ``FULL_STATE_DICT``, ``use_dcp=False``, PEFT ``adapter_only``) is
passed to accelerate's own function for a local path, and refused with
``InvalidOptionError`` for a URL. Install, from a clone of the repository (dcp-ext
is not on PyPI): ``.venv/bin/pip install -e '.[accelerate]'``.

Every process calls each function, as with accelerate's (``wait_for_everyone``
barriers included)::

    from accelerate import Accelerator
    from dcp_ext.integrations import accelerate as dcp_acc

    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    model, optimizer = accelerator.prepare(model, optimizer)
    plugin = accelerator.state.fsdp_plugin
    opts = {"storage_options": {"client_kwargs": {"region_name": "us-east-1"}}}
    dcp_acc.save_fsdp_model(plugin, accelerator, model, "s3://bucket/run1/step100", compression="zstd", **opts)
    dcp_acc.save_fsdp_optimizer(plugin, accelerator, optimizer, model, "s3://bucket/run1/step100",
                                compression="zstd", **opts)
    # ... later, on any number of processes:
    dcp_acc.load_fsdp_model(plugin, accelerator, model, "s3://bucket/run1/step100", **opts)
    dcp_acc.load_fsdp_optimizer(plugin, accelerator, optimizer, model, "s3://bucket/run1/step100", **opts)

``Accelerator.save_state`` / ``load_state`` call accelerate's functions
directly and have no hook for another writer; call these for the model and
optimizer (and ``save_state`` for the rest, locally) instead.

Under ``transformers.Trainer`` (5.x) with FSDP2, the model and optimizer of
each ``checkpoint-N`` folder are saved in ``_save_optimizer_and_scheduler``
and loaded in ``_load_from_checkpoint`` / ``_load_optimizer_and_scheduler``,
all with accelerate's functions bound in ``transformers.trainer``. Override
those three methods (private Trainer API: check them against your
transformers version; this sketch is not run by dcp_ext's tests)::

    import os, torch, transformers
    from dcp_ext.integrations import accelerate as dcp_acc

    class DcpExtTrainer(transformers.Trainer):
        dcp_ext_options = {"compression": "zstd"}

        def _save_optimizer_and_scheduler(self, output_dir):
            if not self.is_fsdp_enabled:
                return super()._save_optimizer_and_scheduler(output_dir)
            plugin = self.accelerator.state.fsdp_plugin
            dcp_acc.save_fsdp_model(plugin, self.accelerator, self.model, output_dir, **self.dcp_ext_options)
            dcp_acc.save_fsdp_optimizer(plugin, self.accelerator, self.optimizer, self.model, output_dir,
                                        **self.dcp_ext_options)
            if self.args.should_save:
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

        def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
            if not self.is_fsdp_enabled:
                return super()._load_from_checkpoint(resume_from_checkpoint, model)
            dcp_acc.load_fsdp_model(self.accelerator.state.fsdp_plugin, self.accelerator,
                                    model or self.model, resume_from_checkpoint)

        def _load_optimizer_and_scheduler(self, checkpoint):
            if checkpoint is None or not self.is_fsdp_enabled:
                return super()._load_optimizer_and_scheduler(checkpoint)
            dcp_acc.load_fsdp_optimizer(self.accelerator.state.fsdp_plugin, self.accelerator,
                                        self.optimizer, self.model, checkpoint)
            self.lr_scheduler.load_state_dict(
                torch.load(os.path.join(checkpoint, "scheduler.pt"), weights_only=True))

Trainer writes the rest of ``checkpoint-N`` (trainer state, RNG states, the
scheduler above) with ``os`` and ``torch.save``, so ``output_dir`` stays a
local or shared path there; uncompressed checkpoints written this way also
resume with the stock Trainer.
"""

from __future__ import annotations

import os
from typing import Any

from accelerate.utils import fsdp_utils as _accelerate_fsdp  # type: ignore[import-untyped]

import dcp_ext
from dcp_ext.errors import InvalidOptionError
from dcp_ext.storage import Location

from . import _checkpoint_dirs as dirs
from ._io_options import io_config
from ._planning import save_planner

__all__ = ["save_fsdp_model", "load_fsdp_model", "save_fsdp_optimizer", "load_fsdp_optimizer",
           "save_checkpoint", "load_checkpoint", "latest_checkpoint", "MODEL_DIR", "OPTIMIZER_DIR",
           "TRAINING_STATE_DIR"]

#: accelerate's directory names (``accelerate.utils.constants``).
MODEL_DIR = "pytorch_model_fsdp"
OPTIMIZER_DIR = "optimizer"
"""accelerate's directory name of the optimizer state (``accelerate.utils.constants``)."""


def _ours(fsdp_plugin: Any, use_dcp: bool, adapter_only: bool, path: str, what: str) -> bool:
    """Whether dcp_ext handles this call (else accelerate's own function does)."""
    state_dict_type = str(getattr(fsdp_plugin, "state_dict_type", ""))
    if (getattr(fsdp_plugin, "fsdp_version", 1) == 2 and "SHARDED_STATE_DICT" in state_dict_type and use_dcp
            and not adapter_only):
        return True
    if "://" in path and not path.startswith("file://"):
        raise InvalidOptionError(
            f"{what} to {path}: dcp_ext handles FSDP2 with SHARDED_STATE_DICT and use_dcp=True, not "
            f"fsdp_version={getattr(fsdp_plugin, 'fsdp_version', None)}, state_dict_type={state_dict_type}, "
            f"use_dcp={use_dcp}, adapter_only={adapter_only}; accelerate's own function writes local paths only",
            path)
    return False


def _sd_options(fsdp_plugin: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=False,
                            cpu_offload=bool(getattr(fsdp_plugin.state_dict_config, "offload_to_cpu", False)))


def _dir(root: str, prefix: str, index: int) -> str:
    """accelerate's rule: ``root/{prefix}_{index}``, unless ``root`` is that directory already."""
    name = f"{prefix}_{index}"
    return root if root.rstrip("/").rsplit("/", 1)[-1] == name else dirs.join(root, name)


def save_fsdp_model(fsdp_plugin: Any, accelerator: Any, model: Any, output_dir: str | os.PathLike[str],
                    model_index: int = 0, adapter_only: bool = False, use_dcp: bool = True, *,
                    storage_options: dict[str, Any] | None = None, compression: Any = None,
                    overwrite: bool = True, io_options: dict[str, Any] | None = None) -> str | None:
    """(all processes) Save ``model``'s FSDP2 shards to
    ``output_dir/pytorch_model_fsdp_{model_index}`` through dcp_ext.

    Args: accelerate's ``save_fsdp_model`` arguments, plus
        storage_options: fsspec/s3fs options.
        io_options: :class:`~dcp_ext.IOConfig` fields (``{"max_concurrency": 16}``).
        compression: ``None`` (accelerate can read it too) or ``"zstd"``.
        overwrite: Replace an existing checkpoint there (accelerate's
            writer does; default).

    Returns:
        The checkpoint directory, or ``None`` when accelerate's own function
        handled the call (see the module doc).
    """
    root = os.fspath(output_dir)
    if not _ours(fsdp_plugin, use_dcp, adapter_only, root, "save_fsdp_model"):
        _accelerate_fsdp.save_fsdp_model(fsdp_plugin, accelerator, model, root, model_index, adapter_only, use_dcp)
        return None
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    path = _dir(root, MODEL_DIR, model_index)
    state = {"model": get_model_state_dict(model, options=_sd_options(fsdp_plugin))}
    config = io_config(io_options, "io_options")
    dcp_ext.save(state, path, storage_options=storage_options, compression=compression, overwrite=overwrite,
                 planner=save_planner("accelerate.model", config), config=config)
    return path


def load_fsdp_model(fsdp_plugin: Any, accelerator: Any, model: Any, input_dir: str | os.PathLike[str],
                    model_index: int = 0, adapter_only: bool = False, use_dcp: bool = True, *,
                    storage_options: dict[str, Any] | None = None, strict: bool = True,
                    io_options: dict[str, Any] | None = None) -> Any:
    """(all processes) Load ``model``'s FSDP2 shards from
    ``input_dir/pytorch_model_fsdp_{model_index}`` (written by dcp_ext or by
    accelerate), resharded to the current layout.

    Returns:
        ``set_model_state_dict``'s result (missing and unexpected keys), as
        accelerate's function does.
    """
    root = os.fspath(input_dir)
    if not _ours(fsdp_plugin, use_dcp, adapter_only, root, "load_fsdp_model"):
        return _accelerate_fsdp.load_fsdp_model(fsdp_plugin, accelerator, model, root, model_index, adapter_only,
                                                use_dcp)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    accelerator.wait_for_everyone()
    options = _sd_options(fsdp_plugin)
    state = {"model": get_model_state_dict(model, options=options)}
    dcp_ext.load(state, _dir(root, MODEL_DIR, model_index), storage_options=storage_options, strict=strict,
                 config=io_config(io_options, "io_options"))
    result = set_model_state_dict(model, state["model"], options=options)
    accelerator.wait_for_everyone()
    return result


def save_fsdp_optimizer(fsdp_plugin: Any, accelerator: Any, optimizer: Any, model: Any,
                        output_dir: str | os.PathLike[str], optimizer_index: int = 0, use_dcp: bool = True, *,
                        storage_options: dict[str, Any] | None = None, compression: Any = None,
                        overwrite: bool = True, io_options: dict[str, Any] | None = None) -> str | None:
    """(all processes) Save ``optimizer``'s sharded state to
    ``output_dir/optimizer_{optimizer_index}`` through dcp_ext.

    Returns:
        The checkpoint directory, or ``None`` when accelerate's own function
        handled the call.
    """
    root = os.fspath(output_dir)
    if not _ours(fsdp_plugin, use_dcp, False, root, "save_fsdp_optimizer"):
        _accelerate_fsdp.save_fsdp_optimizer(fsdp_plugin, accelerator, optimizer, model, root, optimizer_index,
                                             use_dcp)
        return None
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    path = _dir(root, OPTIMIZER_DIR, optimizer_index)
    state = {"optimizer": get_optimizer_state_dict(model, optimizer, options=_sd_options(fsdp_plugin))}
    config = io_config(io_options, "io_options")
    dcp_ext.save(state, path, storage_options=storage_options, compression=compression, overwrite=overwrite,
                 planner=save_planner("accelerate.optimizer", config), config=config)
    return path


def load_fsdp_optimizer(fsdp_plugin: Any, accelerator: Any, optimizer: Any, model: Any,
                        input_dir: str | os.PathLike[str], optimizer_index: int = 0, adapter_only: bool = False,
                        use_dcp: bool = True, *, storage_options: dict[str, Any] | None = None,
                        io_options: dict[str, Any] | None = None) -> None:
    """(all processes) Load ``optimizer``'s state from
    ``input_dir/optimizer_{optimizer_index}`` (written by dcp_ext or by
    accelerate), resharded to the current layout, into ``optimizer``."""
    root = os.fspath(input_dir)
    if not _ours(fsdp_plugin, use_dcp, False, root, "load_fsdp_optimizer"):
        _accelerate_fsdp.load_fsdp_optimizer(fsdp_plugin, accelerator, optimizer, model, root, optimizer_index,
                                             adapter_only, use_dcp)
        return
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    accelerator.wait_for_everyone()
    options = _sd_options(fsdp_plugin)
    state = {"optimizer": get_optimizer_state_dict(model, optimizer, options=options)}
    dcp_ext.load(state, _dir(root, OPTIMIZER_DIR, optimizer_index), storage_options=storage_options,
                 config=io_config(io_options, "io_options"))
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)
    accelerator.wait_for_everyone()


#: The training state beside the model and optimizer in a :func:`save_checkpoint` folder.
TRAINING_STATE_DIR = "training_state"


def save_checkpoint(accelerator: Any, fsdp_plugin: Any, model: Any, optimizer: Any, output_dir: str | os.PathLike[str],
                    *, scheduler: Any = None, step: int | None = None, storage_options: dict[str, Any] | None = None,
                    compression: Any = None, overwrite: bool = True,
                    io_options: dict[str, Any] | None = None) -> str:
    """(all processes) A whole training checkpoint in ``output_dir``: the model
    and optimizer (:func:`save_fsdp_model`, :func:`save_fsdp_optimizer`) and
    the training state (the LR scheduler's state, ``step``, and each
    process's torch RNG state) in ``output_dir/training_state``, all through
    dcp_ext, local or any URL. The training state is written last, so a
    folder whose three checkpoints are committed is whole
    (:func:`latest_checkpoint` finds only those).

    Returns:
        ``output_dir``.
    """
    import torch

    root = os.fspath(output_dir)
    options = {"storage_options": storage_options, "compression": compression, "overwrite": overwrite,
               "io_options": io_options}
    save_fsdp_model(fsdp_plugin, accelerator, model, root, **options)
    save_fsdp_optimizer(fsdp_plugin, accelerator, optimizer, model, root, **options)
    state: dict[str, Any] = {
        "training": {"step": -1 if step is None else int(step),
                     "scheduler": scheduler.state_dict() if scheduler is not None else {}},
        "rng": {f"process{accelerator.process_index}": torch.get_rng_state()},
    }
    dcp_ext.save(state, dirs.join(root, TRAINING_STATE_DIR), storage_options=storage_options,
                 compression=compression, overwrite=overwrite, config=io_config(io_options, "io_options"))
    return root


def load_checkpoint(accelerator: Any, fsdp_plugin: Any, model: Any, optimizer: Any, input_dir: str | os.PathLike[str],
                    *, scheduler: Any = None, storage_options: dict[str, Any] | None = None,
                    io_options: dict[str, Any] | None = None) -> int | None:
    """(all processes) Load a :func:`save_checkpoint` folder into ``model``,
    ``optimizer`` and ``scheduler`` (resharded to the current layout) and
    restore this process's torch RNG state.

    The RNG states are restored when as many processes load as saved; with
    another number, each process keeps its own and a warning says so (an RNG
    stream has no meaning on another process).

    Returns:
        The saved ``step`` (``None`` if none was given).
    """
    import logging

    import torch

    root = os.fspath(input_dir)
    load_fsdp_model(fsdp_plugin, accelerator, model, root, storage_options=storage_options, io_options=io_options)
    load_fsdp_optimizer(fsdp_plugin, accelerator, optimizer, model, root, storage_options=storage_options,
                        io_options=io_options)
    path = dirs.join(root, TRAINING_STATE_DIR)
    saved = dcp_ext.load_whole(path, storage_options=storage_options)
    rng = saved.get("rng", {})
    mine = rng.get(f"process{accelerator.process_index}")
    if len(rng) == accelerator.num_processes and isinstance(mine, torch.Tensor):
        torch.set_rng_state(mine)
    else:
        logging.getLogger("dcp_ext.integrations").warning(
            "%s holds the RNG states of %d processes; %d load it: each keeps its own RNG state", path, len(rng),
            accelerator.num_processes)
    training = saved.get("training", {})
    if scheduler is not None and training.get("scheduler"):
        scheduler.load_state_dict(training["scheduler"])
    step = int(training.get("step", -1))
    return None if step < 0 else step


def latest_checkpoint(root: str | os.PathLike[str], *, prefix: str = "checkpoint-",
                      storage_options: dict[str, Any] | None = None) -> str | None:
    """(any process) The ``{prefix}N`` folder under ``root`` with the highest
    ``N`` whose model, optimizer and training state are all committed (a
    folder a killed save left half written is skipped); ``None`` if none."""
    import re

    text = os.fspath(root)
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)$")
    where = Location.of(text, storage_options)
    found = []
    for name in dirs.child_dirs(where):
        match = pattern.match(name)
        folder = dirs.join(text, name)
        parts = (f"{MODEL_DIR}_0", f"{OPTIMIZER_DIR}_0", TRAINING_STATE_DIR)
        if match and all(dirs.is_committed(where.child(name).child(part)) for part in parts):
            found.append((int(match.group(1)), folder))
    return max(found)[1] if found else None
