"""``transformers.Trainer`` with FSDP2 checkpoints through dcp_ext: :class:`DcpExtTrainer`.

Trainer saves the model and optimizer of each ``checkpoint-N`` folder in
``_save_optimizer_and_scheduler`` and loads them in ``_load_from_checkpoint``
and ``_load_optimizer_and_scheduler``, with accelerate's FSDP functions bound
in ``transformers.trainer``. :class:`DcpExtTrainer` overrides those three
(private Trainer API, checked against transformers 5.24) to call
:mod:`dcp_ext.integrations.accelerate`'s, so the shards are checksummed and
optionally compressed. Trainer writes the rest of ``checkpoint-N`` (trainer
state, RNG states, the scheduler) with ``os`` and ``torch.save``, so
``output_dir`` stays a local or shared path.

It refuses to start when FSDP is not enabled: on a CPU machine
``TrainingArguments(fsdp="full_shard", use_cpu=True)`` trains with DDP and
would write ``model.safetensors`` / ``optimizer.pt`` and no dcp_ext checkpoint,
silently (issue 43). Trainer's FSDP2 path needs accelerators; dcp_ext's tests
check the refusal on CPU, not a save. Install: ``pip install -e '.[transformers]'``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import transformers

from dcp_ext.errors import InvalidOptionError

from . import accelerate as dcp_acc

__all__ = ["DcpExtTrainer"]


class DcpExtTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` whose FSDP2 model and optimizer checkpoints go
    through dcp_ext (every process calls each method, as Trainer does).

    Args:
        *args: ``Trainer``'s positional arguments.
        dcp_ext_options: Keyword arguments of :func:`~dcp_ext.integrations.accelerate.save_fsdp_model`
            for every save (``{"compression": "zstd"}``, ``storage_options``, ``io_options``).
        **kwargs: ``Trainer``'s keyword arguments.

    Raises:
        InvalidOptionError: FSDP is not enabled (no FSDP plug-in on the
            accelerator): the run would write no dcp_ext checkpoint.
    """

    def __init__(self, *args: Any, dcp_ext_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dcp_ext_options = dict(dcp_ext_options or {})
        if not self.is_fsdp_enabled:
            raise InvalidOptionError(
                "DcpExtTrainer saves FSDP2 checkpoints through dcp_ext, but FSDP is not enabled here (no FSDP "
                "plug-in on the accelerator: on a CPU, TrainingArguments(fsdp=..., use_cpu=True) trains with DDP "
                "and would write no dcp_ext checkpoint). Enable FSDP2 (fsdp='full_shard', "
                "fsdp_config={'fsdp_version': 2}) on accelerators, or use transformers.Trainer; on CPU, follow "
                "the Accelerate recipe in dcp_ext's framework guide")

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        plugin = self.accelerator.state.fsdp_plugin
        dcp_acc.save_fsdp_model(plugin, self.accelerator, self.model, output_dir, **self.dcp_ext_options)
        dcp_acc.save_fsdp_optimizer(plugin, self.accelerator, self.optimizer, self.model, output_dir,
                                    **self.dcp_ext_options)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        options = {k: v for k, v in self.dcp_ext_options.items() if k in ("storage_options", "io_options")}
        dcp_acc.load_fsdp_model(self.accelerator.state.fsdp_plugin, self.accelerator, model or self.model,
                                resume_from_checkpoint, **options)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        options = {k: v for k, v in self.dcp_ext_options.items() if k in ("storage_options", "io_options")}
        dcp_acc.load_fsdp_optimizer(self.accelerator.state.fsdp_plugin, self.accelerator, self.optimizer,
                                    self.model, checkpoint, **options)
        scheduler = os.path.join(checkpoint, "scheduler.pt")
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
