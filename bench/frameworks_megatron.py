"""The Megatron-Core rows of ``python -m bench.frameworks`` (issue 43).

The bench model's FSDP2 parameters and AdamW moments (the same tensors, the
same bytes as every framework row) as a Megatron-Core sharded state dict:
each rank's ``Shard(0)`` shard of each tensor a ``ShardedTensor`` split
along axis 0 (``model.{name}``, ``optimizer.{name}.exp_avg`` /
``.exp_avg_sq``), plus the iteration as a plain value (``common.pt``).
Saved with megatron-core's own ``dist_checkpointing.save``, by:

* **Megatron's default** ``torch_dist`` strategy (``TorchDistSaveShardedStrategy``:
  torch DCP with Megatron's ``FileSystemWriterAsync``, 2 writer processes
  forked per rank, run synchronously as ``save`` does without
  ``async_sharded_save``). It does not run on a CPU-only torch as shipped:
  two CUDA calls are stubbed for it (``torch.cuda.synchronize`` does
  nothing, ``torch.cuda.current_device`` answers ``"cpu"``,
  ``tests.support.megatron_workers.cuda_calls_stubbed``), nothing else
  changes.
* **dcp_ext**: ``DcpExtSaveShardedStrategy()`` through the same ``save``
  (local); on S3 ``dcp_ext.integrations.megatron.save`` (same files, through
  dcp_ext's stores).

**Megatron's default on S3** does not exist: ``save(state, "s3://b/x")``
raises ``FileNotFoundError: [Errno 2] No such file or directory:
's3:/b/x'`` (rank 0 lists the directory with ``pathlib`` first), writes
``common.pt`` (``torch.save``) and ``metadata.json`` (``open``) to local
paths, and ``TorchDistSaveShardedStrategy.async_save`` builds its
``FileSystemWriterAsync(checkpoint_dir)`` itself: no argument substitutes
torch's ``FsspecWriter`` without patching it. (Megatron's one object-store
path is NVIDIA's multi-storage-client, ``msc://`` URLs, which it switches on
for every path as soon as the package is importable; not installed here.) So
the S3 stock row is **what a user does without dcp_ext**: the same
``torch_dist`` save to a local directory, then rank 0 uploads that folder
with s3fs (``S3FileSystem(**storage_options).put(dir/, url/,
recursive=True)``, s3fs defaults: files concurrently, 50 MiB parts, 10 in
flight per file), timed together (:func:`upload_folder`; the local copy is
deleted after the save, untimed).

Both save the same items (Megatron's conversion); each save writes into a
fresh directory. Untimed before each save, as for both systems: the sharded
state dict is built, and (local saves, the upload's staging included) the
directory created, since Megatron's ``save`` lists it first on rank 0.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["MegatronSystem", "megatron_state", "megatron_systems", "upload_folder"]


def upload_folder(local: str, url: str, options: dict[str, Any]) -> None:
    """Copy the local checkpoint folder ``local`` to ``url`` (its files land at
    ``url/<name>``) as a user without an S3 path would: one s3fs ``put``,
    recursive, s3fs's defaults."""
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    fs.put(local.rstrip("/") + "/", url.rstrip("/") + "/", recursive=True)


@contextlib.contextmanager
def _timed_preprocess(seconds: list[float]) -> Iterator[None]:
    """Append to ``seconds`` the time each call of Megatron's ``save_preprocess``
    takes (its sharding validation, with ``validate_access_integrity``'s
    all-gather of every rank's shard metadata, and the split of common from
    sharded state): Megatron's own ``save`` and dcp_ext's ``megatron.save``
    call it before any byte is written."""
    from megatron.core.dist_checkpointing import serialization

    from dcp_ext.integrations import megatron as dcp_megatron

    original = serialization.save_preprocess

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    serialization.save_preprocess = dcp_megatron.save_preprocess = timed
    try:
        yield
    finally:
        serialization.save_preprocess = dcp_megatron.save_preprocess = original


def megatron_state(model: Any, optimizers: Any, rank: int, world: int) -> dict[str, Any]:
    """(each rank) The model and its AdamW moments as a Megatron sharded state dict."""
    from megatron.core.dist_checkpointing import ShardedTensor

    from bench.harness.state import local_tensor

    optimizer = optimizers.optimizers[0]

    def sharded(key: str, tensor: Any) -> Any:
        local = local_tensor(tensor).detach()
        assert local.shape[0] * world == tensor.shape[0], f"{key}: Shard(0) of {tuple(tensor.shape)} is uneven"
        return ShardedTensor.from_rank_offsets(key, local, (0, rank, world))

    state: dict[str, Any] = {"model": {}, "optimizer": {}, "iteration": 0}
    for name, param in model.named_parameters():
        state["model"][name] = sharded(f"model.{name}", param)
        moments = optimizer.state[param]
        state["optimizer"][name] = {k: sharded(f"optimizer.{name}.{k}", moments[k]) for k in ("exp_avg", "exp_avg_sq")}
    return state


class MegatronSystem:
    """A Megatron-Core save of :func:`megatron_state` (a system of bench.frameworks)."""

    framework = "megatron"
    #: Not in bench.frameworks' table of what a save pays storing nothing
    #: (that one measures DCP's default planner on the framework's own state dict).
    fixed_costs = False

    def __init__(self, kind: str, root: str, job: dict[str, Any], stock: bool,
                 options: dict[str, Any] | None, staging: str | None = None) -> None:
        self.kind = kind
        self.stock = stock
        self.name = "megatron_stock" if stock else "megatron_dcp_ext"
        self.root = f"{root}/{self.name}"
        self.job = job
        self.options = dict(options or {})
        self.state: dict[str, Any] = {}
        #: This rank's seconds of the last save's parts (:meth:`parts`).
        self._parts: dict[str, float] = {}
        #: (S3 stock row) where Megatron's save writes before the upload.
        self.staging = f"{staging}/{self.name}" if stock and kind != "local" else None
        if stock and kind == "local":
            self.label = "Megatron-Core dist_checkpointing.save, torch_dist (stock)"
            self.settings = ("`TorchDistSaveShardedStrategy` defaults (2 writer processes per rank); "
                             "CUDA calls stubbed for CPU")
        elif stock:
            assert staging is not None, "the S3 stock row saves to a local staging directory first"
            self.label = ("Megatron-Core torch_dist (stock) to local disk, then s3fs `put` of the folder "
                          "(Megatron has no S3 path)")
            self.settings = ("`TorchDistSaveShardedStrategy` defaults, CUDA calls stubbed for CPU; then rank 0 "
                             "`S3FileSystem.put(dir, url, recursive=True)`, s3fs defaults; both timed")
        else:
            self.label = "dcp_ext DcpExtSaveShardedStrategy"
            self.settings = ("dcp_ext CheckpointWriter defaults, through Megatron's `save`" if kind == "local"
                             else "dcp_ext CheckpointWriter defaults, through `dcp_ext.integrations.megatron.save`")

    def _state(self) -> dict[str, Any]:
        import torch.distributed as dist

        return megatron_state(self.job["model"], self.job["optimizers"], dist.get_rank(), dist.get_world_size())

    def prepare(self) -> dict[str, Any]:
        """This rank's tensors (for the byte count): each shard's local data."""
        from megatron.core.dist_checkpointing import ShardedTensor
        from megatron.core.dist_checkpointing.dict_utils import nested_values

        return {sh.key: sh.data for sh in nested_values(self._state()) if isinstance(sh, ShardedTensor)}

    def before(self, i: int) -> None:
        """(all ranks, untimed) Build the sharded state dict (as a trainer does
        before each save, the same for both systems) and, as Megatron's
        ``save`` lists the directory first (rank 0), make it."""
        import torch.distributed as dist

        self.state = self._state()
        self.state["iteration"] = i
        local = f"{self.root}/save-{i}" if self.kind == "local" else self._staged(i) if self.staging else None
        if local is not None and dist.get_rank() == 0:
            os.makedirs(local)
        dist.barrier()

    def _staged(self, i: int) -> str:
        return f"{self.staging}/save-{i}"

    def save(self, i: int) -> str:
        from megatron.core import dist_checkpointing

        from dcp_ext.integrations import megatron as dcp_megatron
        from tests.support.megatron_workers import cuda_calls_stubbed

        where = f"{self.root}/save-{i}"
        preprocess: list[float] = []
        self._parts = {}
        with _timed_preprocess(preprocess):
            if self.stock and self.staging:
                import torch.distributed as dist

                start = time.perf_counter()
                with cuda_calls_stubbed():
                    dist_checkpointing.save(self.state, self._staged(i))  # ends in a barrier: every file written
                self._parts["local_save"] = time.perf_counter() - start
                start = time.perf_counter()
                if dist.get_rank() == 0:
                    upload_folder(self._staged(i), where, self.options)
                dist.barrier()
                self._parts["upload"] = time.perf_counter() - start
            elif self.stock:
                with cuda_calls_stubbed():
                    dist_checkpointing.save(self.state, where)
            elif self.kind == "local":
                dist_checkpointing.save(self.state, where, sharded_strategy=dcp_megatron.DcpExtSaveShardedStrategy())
            else:
                dcp_megatron.save(self.state, where, storage_options=self.options)
        self._parts["save_preprocess"] = sum(preprocess)
        return where

    def parts(self) -> dict[str, float]:
        """This rank's seconds of the last save's parts (untimed themselves):
        ``save_preprocess`` (Megatron's, before any byte is written), and for
        the S3 stock row ``local_save`` (Megatron's save to local disk) and
        ``upload`` (rank 0's s3fs ``put``, to the barrier after it)."""
        return dict(self._parts)

    def after(self, i: int, where: str) -> None:
        """(all ranks, untimed) The S3 stock row: delete the local copy the upload came from."""
        import torch.distributed as dist

        if self.staging and dist.get_rank() == 0:
            shutil.rmtree(self._staged(i))

    def close(self) -> None:
        """(each rank, after the last save) Stop the process Megatron's writer started."""
        if self.stock:
            from tests.support.megatron_workers import stop_writer_results_manager

            stop_writer_results_manager()


def megatron_systems(kind: str, root: str, job: dict[str, Any], options: dict[str, Any] | None,
                     staging: str) -> list[MegatronSystem]:
    """The Megatron-Core systems of storage ``kind``: stock (on S3: saved to ``staging``, then uploaded) and dcp_ext."""
    return [MegatronSystem(kind, root, job, stock=True, options=options, staging=staging),
            MegatronSystem(kind, root, job, stock=False, options=options)]
