"""Rank functions for tests/test_integrations_lightning.py: real Lightning
``Trainer.fit`` runs on a 2-rank gloo world, with dcp_ext's strategy and
CheckpointIO and with Lightning's stock ones.

Lightning sees the world as processes it did not create (``LOCAL_RANK`` set:
its ``LightningEnvironment``) and reuses the process group already there.
Each epoch is 2 steps per rank on fixed data, so runs that start from the same
state are step for step identical, and checkpoints are saved at epoch ends
(what Lightning resumes from exactly). A recorder callback snapshots this
rank's model and optimizer shards, LR scheduler and step at train start (just
after a resume) and at each epoch end.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["lightning_suite"]


def _local(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.to_local().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_local(v) for v in value]
    return value


def _classes(L: Any) -> tuple[Any, Any]:
    """(LightningModule subclass, recorder Callback) for namespace ``L``."""
    from torch.distributed.fsdp import fully_shard

    class Net(L.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self, fsdp: bool) -> None:
            super().__init__()
            self.fsdp = fsdp
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))

        def configure_model(self) -> None:
            if self.fsdp and not isinstance(self.net[0].weight, DTensor):
                mesh = self.device_mesh["data_parallel"]
                for layer in self.net:
                    if isinstance(layer, torch.nn.Linear):
                        fully_shard(layer, mesh=mesh)
                fully_shard(self.net, mesh=mesh)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return (self.net(x) - y).square().mean()

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        def train_dataloader(self) -> Any:
            g = torch.Generator().manual_seed(3)
            data = torch.utils.data.TensorDataset(torch.randn(32, 16, generator=g), torch.randn(32, 8, generator=g))
            return torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)

    class Recorder(L.Callback):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            self.start: dict[str, Any] | None = None
            self.epochs: dict[int, dict[str, Any]] = {}

        @staticmethod
        def snapshot(trainer: Any, module: Any) -> dict[str, Any]:
            return _local({
                "model": dict(module.net.state_dict()),
                "optimizer": trainer.optimizers[0].state_dict(),
                "lr_scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                "global_step": trainer.global_step,
            })

        def on_train_start(self, trainer: Any, module: Any) -> None:
            self.start = self.snapshot(trainer, module)

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            self.epochs[trainer.current_epoch] = self.snapshot(trainer, module)

    return Net, Recorder


def _fit(L: Any, strategy: Any, max_epochs: int, ckpt_path: str | None = None, plugins: Any = None,
         callbacks: Any = (), fsdp: bool = True) -> Any:
    """One ``Trainer.fit``; returns its recorder."""
    Net, Recorder = _classes(L)
    os.environ["WORLD_SIZE"] = "2"  # LightningEnvironment.teardown removed it after the last fit
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, plugins=plugins, max_epochs=max_epochs,
        callbacks=[recorder, *callbacks], enable_checkpointing=bool(callbacks), logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(Net(fsdp), ckpt_path=ckpt_path)
    return recorder


def _same(expected: Any, actual: Any) -> list[str]:
    from tests.support.compare import state_diff

    return state_diff(expected, actual)[:10]


def lightning_suite(rank: int, world_size: int, local_root: str, s3_root: str,
                    storage_options: dict[str, Any]) -> dict[str, Any]:
    """Every Lightning check in one world (see the test's docstring)."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    import warnings

    warnings.filterwarnings("ignore")
    import lightning.pytorch as L
    import pytorch_lightning as PL

    from dcp_ext.integrations.lightning import DcpExtModelParallelStrategy
    from dcp_ext.integrations.pytorch_lightning import DcpExtCheckpointIO
    from dcp_ext.storage import Location

    def ours(**kwargs: Any) -> Any:
        return DcpExtModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, **kwargs)

    def stock() -> Any:
        return L.strategies.ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)

    out: dict[str, Any] = {}
    # FSDP2, local: 3 epochs, a checkpoint at each epoch end, last.ckpt saved 3 times.
    ckpts = os.path.join(local_root, "fsdp")
    a = _fit(L, ours(), 3, callbacks=[L.callbacks.ModelCheckpoint(
        dirpath=ckpts, every_n_epochs=1, save_on_train_epoch_end=True, save_top_k=-1, save_last=True)])
    b = _fit(L, ours(), 3, ckpt_path=os.path.join(ckpts, "epoch=1-step=4.ckpt"))
    out["fsdp_local_resume"] = _same(a.epochs[1], b.start)
    out["fsdp_local_next"] = _same(a.epochs[2], b.epochs[2])
    c = _fit(L, ours(), 4, ckpt_path=os.path.join(ckpts, "last.ckpt"))
    out["fsdp_last_resume"] = _same(a.epochs[2], c.start)

    # FSDP2 on S3 (SeaweedFS), compressed: save after 1 epoch, resume, 1 more epoch.
    url = f"{s3_root}/fsdp/epoch0.ckpt"
    strategy = ours(storage_options=storage_options, compression="zstd",
                    io_options={"max_concurrency": 2, "part_size": "5MiB", "key_prefixes": 4})
    Net, Recorder = _classes(L)
    os.environ["WORLD_SIZE"] = "2"
    recorder = Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, callbacks=[recorder],
                        enable_checkpointing=False, logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Net(True))
    trainer.save_checkpoint(url)
    out["s3_saved_epoch0"] = _same(a.epochs[0], recorder.epochs[0])
    d = _fit(L, ours(storage_options=storage_options, io_options={"max_concurrency": 2}), 2, ckpt_path=url)
    out["s3_resume"] = _same(a.epochs[0], d.start)
    out["s3_next"] = _same(a.epochs[1], d.epochs[1])
    out["s3_not_local"] = not os.path.exists("s3:") and not os.path.exists(os.path.join(os.getcwd(), "s3:"))

    # Cross-reading with Lightning's stock strategy (FileSystemWriter/Reader).
    stock_ckpt = os.path.join(local_root, "stock.ckpt")
    os.environ["WORLD_SIZE"] = "2"
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=stock(), max_epochs=1, enable_checkpointing=False,
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Net(True))
    trainer.save_checkpoint(stock_ckpt)
    e = _fit(L, ours(), 2, ckpt_path=stock_ckpt)
    out["stock_to_ours"] = _same(a.epochs[0], e.start) + _same(a.epochs[1], e.epochs[1])
    f = _fit(L, stock(), 3, ckpt_path=os.path.join(ckpts, "epoch=1-step=4.ckpt"))
    out["ours_to_stock"] = _same(a.epochs[1], f.start) + _same(a.epochs[2], f.epochs[2])

    # DDP + DcpExtCheckpointIO (pytorch_lightning namespace): save_top_k=2 deletes
    # the oldest epoch checkpoint, last.ckpt is saved 3 times.
    ddp_ckpts = os.path.join(local_root, "ddp")
    io_plugin = DcpExtCheckpointIO(compression="zstd")
    g = _fit(PL, PL.strategies.DDPStrategy(), 3, plugins=[io_plugin], fsdp=False, callbacks=[
        PL.callbacks.ModelCheckpoint(dirpath=ddp_ckpts, every_n_epochs=1, save_on_train_epoch_end=True,
                                     save_top_k=2, monitor="step", mode="max", save_last=True)])
    h = _fit(PL, PL.strategies.DDPStrategy(), 3, plugins=[DcpExtCheckpointIO()], fsdp=False,
             ckpt_path=os.path.join(ddp_ckpts, "epoch=1-step=4.ckpt"))
    out["ddp_resume"] = _same(g.epochs[1], h.start)
    out["ddp_next"] = _same(g.epochs[2], h.epochs[2])
    i = _fit(PL, PL.strategies.DDPStrategy(), 4, plugins=[DcpExtCheckpointIO()], fsdp=False,
             ckpt_path=os.path.join(ddp_ckpts, "last.ckpt"))
    out["ddp_last_resume"] = _same(g.epochs[2], i.start)
    # Lightning's own TorchCheckpointIO file, read by the plug-in.
    plain = os.path.join(local_root, "plain.ckpt")
    os.environ["WORLD_SIZE"] = "2"
    trainer = PL.Trainer(accelerator="cpu", devices=2, strategy=PL.strategies.DDPStrategy(), max_epochs=1,
                         enable_checkpointing=False, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(_classes(PL)[0](False))
    trainer.save_checkpoint(plain)
    j = _fit(PL, PL.strategies.DDPStrategy(), 2, plugins=[DcpExtCheckpointIO()], fsdp=False, ckpt_path=plain)
    out["ddp_plain_to_ours"] = _same(g.epochs[0], j.start) + _same(g.epochs[1], j.epochs[1])
    torch.distributed.barrier()
    if rank == 0:
        out["ddp_listing"] = sorted(os.listdir(ddp_ckpts))
        out["fsdp_listing"] = sorted(os.listdir(ckpts))
        out["s3_files"] = sorted(Location.of(url, storage_options).open().list_names())
        out["s3_data_files"] = sorted(name for name in Location.of(url, storage_options).open().list_tree()
                                      if name.endswith(".distcp"))
    return out
