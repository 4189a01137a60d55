"""Rank functions of tests/test_lightning_s3_resume.py: Lightning runs whose
``ModelCheckpoint`` writes to S3 (SeaweedFS) with options only in the
plug-in (no ``AWS_*`` environment), resumed with ``ckpt_path="last"`` and
validated with ``ckpt_path="best"``, under DDP + the plug-in and under the
FSDP2 strategy; then the modules loaded back with ``load_module``."""

from __future__ import annotations

import os
from typing import Any

import torch

from tests.support.lightning_workers import _classes, _same


def _net_with_validation(L: Any) -> Any:
    Net, _ = _classes(L)

    class Validated(Net):  # type: ignore[misc, valid-type]
        def __init__(self, fsdp: bool) -> None:
            super().__init__(fsdp)
            self.save_hyperparameters()
            self.seen: list[float] = []

        def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = (self.net(x) - y).square().mean()
            self.log("val_loss", loss, sync_dist=True)
            return loss

        def val_dataloader(self) -> Any:
            return self.train_dataloader()

    return Validated


def resume_suite(rank: int, world_size: int, s3_root: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        del os.environ[name]  # the plug-in's storage_options are all there is
    import warnings

    warnings.filterwarnings("ignore")
    import lightning.pytorch as L

    from dcp_ext.integrations.lightning import (
        DcpExtCheckpointIO,
        DcpExtModelCheckpoint,
        DcpExtModelParallelStrategy,
        load_module,
    )

    _, Recorder = _classes(L)
    Net = _net_with_validation(L)
    out: dict[str, Any] = {}

    def run(strategy: Any, plugins: Any, dirpath: str, epochs: int, fsdp: bool, ckpt_path: str | None = None,
            validate: bool = False) -> tuple[Any, Any, Any]:
        os.environ["WORLD_SIZE"] = "2"
        recorder = Recorder()
        checkpoint = DcpExtModelCheckpoint(dirpath=dirpath, storage_options=storage_options, save_last=True,
                                           monitor="step", mode="max", save_top_k=1, every_n_epochs=1,
                                           save_on_train_epoch_end=True)
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, plugins=plugins, max_epochs=epochs,
                            callbacks=[recorder, checkpoint], logger=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=1)
        model = Net(fsdp)
        trainer.fit(model, ckpt_path=ckpt_path)
        return trainer, recorder, checkpoint

    for kind in ("ddp", "fsdp"):
        fsdp = kind == "fsdp"
        dirpath = f"{s3_root}/{kind}"

        def strategy(fsdp: bool = fsdp) -> Any:
            if fsdp:
                return DcpExtModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                                   storage_options=storage_options, compression="zstd")
            return L.strategies.DDPStrategy()

        plugins = None if fsdp else [DcpExtCheckpointIO(storage_options=storage_options, compression="zstd")]
        first, a, checkpoint = run(strategy(), plugins, dirpath, 2, fsdp)
        # "best" (monitor step, mode max: the newest; save_last copies it), validated in the same process.
        best = checkpoint.best_model_path
        out[f"{kind}_best_path"] = best.rsplit("/", 1)[-1]
        first.validate(ckpt_path="best")
        out[f"{kind}_best_loaded"] = first.ckpt_path == best
        out[f"{kind}_best_weights"] = _same(a.epochs[1]["model"], {k: v for k, v in _local_model(first).items()})
        # "last" in a fresh trainer: the run goes on from epoch 2, never from step 0.
        _, b, _ = run(strategy(), plugins if not fsdp else None, dirpath, 3, fsdp, ckpt_path="last")
        out[f"{kind}_last_resume"] = _same(a.epochs[1], b.start)
        out[f"{kind}_resumed_step"] = b.start["global_step"] if b.start else None
        # load_module: the last checkpoint (epoch 2 of the resumed run) as a plain module, whole
        # tensors; this rank's part of each (its FSDP2 rows, or all of it under DDP) bit-exact.
        module = load_module(Net, f"{dirpath}/last.ckpt", storage_options=storage_options, fsdp=False)
        mine = b.epochs[2]["model"]
        out[f"{kind}_load_module"] = isinstance(module, Net) and all(
            torch.equal(whole if not fsdp else whole.chunk(2)[rank], mine[k])
            for k, whole in module.net.state_dict().items())
    torch.distributed.barrier()
    return out


def _local_model(trainer: Any) -> dict[str, Any]:
    from tests.support.lightning_workers import _local

    return _local(dict(trainer.lightning_module.net.state_dict()))
