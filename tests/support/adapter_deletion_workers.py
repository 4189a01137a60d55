"""Process functions for tests/test_adapter_deletion.py: a real Lightning
``Trainer`` whose ``ModelCheckpoint(save_last="link")`` deletes through
``DcpExtCheckpointIO``, torchtitan's purge through ``DcpExtCheckpointManager``,
and processes killed in the middle of a save or a deletion.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["frameworks_suite", "save_killed_before_commit", "delete_killed_after_uncommit", "file_tree",
           "small_state"]


def small_state(seed: int) -> dict[str, Any]:
    """A checkpoint dict as Lightning hands it to its ``CheckpointIO``."""
    g = torch.Generator().manual_seed(seed)
    return {"state_dict": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g).to(torch.bfloat16)},
            "epoch": seed, "global_step": 10 * seed}


def file_tree(path: str) -> dict[str, bytes | str]:
    """Every file under ``path`` by relative name: its bytes, or ``-> target``
    for a link (never followed)."""
    tree: dict[str, bytes | str] = {}
    for folder, dirs, files in os.walk(path):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(folder, d))]:
            full = os.path.join(folder, name)
            rel = os.path.relpath(full, path)
            if os.path.islink(full):
                tree[rel] = "-> " + os.readlink(full)
            else:
                with open(full, "rb") as f:
                    tree[rel] = f.read()
    return tree


def _lightning_links(root: str) -> dict[str, Any]:
    """``Trainer.fit`` for 4 epochs of 2 steps on one CPU with
    ``DcpExtCheckpointIO`` and ``ModelCheckpoint(save_top_k=2,
    save_last="link")`` whose last-checkpoint name changes every epoch
    (``last-{epoch}``), so Lightning hands each previous link to
    ``remove_checkpoint``; then every kept checkpoint is loaded."""
    import lightning.pytorch as L

    from dcp_ext.integrations.lightning import DcpExtCheckpointIO
    from tests.support.compare import state_diff

    class Net(L.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return (self.net(x) - y).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

        def train_dataloader(self) -> Any:
            g = torch.Generator().manual_seed(3)
            data = torch.utils.data.TensorDataset(torch.randn(16, 16, generator=g), torch.randn(16, 8, generator=g))
            return torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)

    class Recorder(L.Callback):  # type: ignore[misc, name-defined]
        """What each epoch's checkpoint must hold (ModelCheckpoint runs after it)."""

        def __init__(self) -> None:
            self.epochs: dict[int, dict[str, Any]] = {}

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            import copy

            self.epochs[trainer.current_epoch] = copy.deepcopy({
                "state_dict": module.state_dict(), "optimizer": trainer.optimizers[0].state_dict(),
                "global_step": trainer.global_step})

    recorder = Recorder()
    checkpoints = L.callbacks.ModelCheckpoint(dirpath=root, every_n_epochs=1, save_on_train_epoch_end=True,
                                              save_top_k=2, monitor="step", mode="max", save_last="link")
    checkpoints.CHECKPOINT_NAME_LAST = "last-{epoch}"  # Lightning's documented way to rename last.ckpt
    trainer = L.Trainer(accelerator="cpu", devices=1, plugins=[DcpExtCheckpointIO()], max_epochs=4,
                        callbacks=[recorder, checkpoints], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(Net())
    listing = sorted(os.listdir(root))
    out: dict[str, Any] = {"listing": listing, "links": {}, "loads": {}, "epochs": sorted(recorder.epochs)}
    io = DcpExtCheckpointIO()
    for name in listing:
        path = os.path.join(root, name)
        if os.path.islink(path):
            out["links"][name] = os.readlink(path)
            continue
        state = io.load_checkpoint(path)
        expected = recorder.epochs[state["epoch"]]
        out["loads"][name] = (state_diff(expected["state_dict"], state["state_dict"])
                              + state_diff(expected["optimizer"], state["optimizer_states"][0])
                              + state_diff(expected["global_step"], state["global_step"]))
    return out


def _torchtitan_purge(root: str) -> dict[str, Any]:
    """``DcpExtCheckpointManager`` (interval 1, ``keep_latest_k=2``) saving
    steps 1-4 in a folder that already holds ``step-0``, a checkpoint of
    torch's own writer; a user's ``notes.txt`` goes into ``step-1`` after its
    save. Then the steps that stay are loaded by fresh jobs."""
    import torch.distributed.checkpoint as dcp

    from dcp_ext.integrations import _checkpoint_dirs as dirs
    from dcp_ext.integrations.torchtitan import DcpExtCheckpointManager
    from dcp_ext.storage import Location
    from tests.support.compare import state_diff
    from tests.support.torchtitan_workers import Job

    folder = os.path.join(root, "titan")
    foreign = os.path.join(folder, "step-0")
    dcp.save({"w": torch.arange(12.0)}, storage_writer=dcp.FileSystemWriter(foreign), no_dist=True)
    foreign_before = file_tree(foreign)
    job = Job(DcpExtCheckpointManager, seed=0, folder=folder, interval=1, keep_latest_k=2)
    saved = {}
    for _ in range(4):
        job.step()
        job.manager.save(job.train_state.step)
        saved[job.train_state.step] = job.snapshot()
        if job.train_state.step == 1:
            with open(os.path.join(folder, "step-1", "notes.txt"), "wb") as f:
                f.write(b"mine")
    job.manager.maybe_wait_for_saving()
    job.manager.close()  # joins the purge thread
    out: dict[str, Any] = {
        "steps": sorted(os.listdir(folder)),
        "foreign_same": file_tree(foreign) == foreign_before,
        "step1": file_tree(os.path.join(folder, "step-1")),
        "committed": {name: dirs.is_committed(Location.of(os.path.join(folder, name)))
                      for name in sorted(os.listdir(folder))},
        "resumed": {},
    }
    for step in (3, 4):
        fresh = Job(DcpExtCheckpointManager, seed=1, folder=folder, interval=1, keep_latest_k=2)
        loaded = fresh.manager.load(step=step)
        out["resumed"][step] = (loaded, state_diff(saved[step], fresh.snapshot()))
        fresh.manager.close()
    return out


def frameworks_suite(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """(one rank) The Lightning and torchtitan runs of the test."""
    return {"lightning": _lightning_links(os.path.join(root, "lightning")),
            "torchtitan": _torchtitan_purge(root)}


def save_killed_before_commit(path: str) -> None:
    """Save a checkpoint with the plug-ins' single-process save and die
    (SIGKILL) just before its commit: data and a save lock, no metadata."""
    os.environ["DCP_EXT_CRASH_AT"] = "before_metadata"
    from dcp_ext import CheckpointWriter
    from dcp_ext._runtime import failpoints
    from dcp_ext.integrations._checkpoint_dirs import save_alone

    failpoints.reload()
    save_alone(small_state(5), CheckpointWriter(path))


def delete_killed_after_uncommit(path: str) -> None:
    """Delete ``path`` by the one rule and die (SIGKILL) right after its
    un-commit, before any data file went: a purge cut off at exit."""
    os.environ["DCP_EXT_CRASH_AT"] = "mid_retention"
    from dcp_ext._runtime import failpoints
    from dcp_ext.root import delete_checkpoint_dir

    failpoints.reload()
    delete_checkpoint_dir(path)
