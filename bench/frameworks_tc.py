"""The torch_checkpointing rows of ``python -m bench.frameworks`` (issue 43).

The bench model's FSDP2 parameters and AdamW moments (the same tensors, the
same bytes as every framework row) as torch_checkpointing 0.1.1 payload
items: ``model`` (the parameters, ``Shard(0)`` DTensors), ``optimizer``
(``{name: {"exp_avg", "exp_avg_sq"}}``, DTensors) and ``step`` (an int),
each item with torch_checkpointing's default ``ItemSpec`` (no resharder:
its metadata manager, which a resharder wires in, gathers with CUDA tensors
and does not run on a CPU-only torch; each rank's file holds its shards,
loadable at the same sharding). Saved with one ``CheckpointManager`` per system, synchronous
(``Config.with_sync_save()``, as the other rows save), each save into a fresh
directory, by:

* **torch_checkpointing's own** storage, ``LocalFileSystemStorageConfig``
  (written into a temporary sibling directory, rank 0 renames it onto the
  final path after the barrier), with one setting changed:
  ``use_direct_io=False``. Its default ``O_DIRECT`` opens each file with
  ``O_DIRECT`` and writes it through Python's buffered file, whose last,
  partial block is refused (``OSError: [Errno 22]`` when ``torch.save``'s
  stream closes, ext4): it cannot save this state at all, so the stock rows
  write buffered (page cache, as every other row; it never calls ``fsync``,
  dcp_ext's stores do, for every file). Local disk only: it writes
  local paths, and torch_checkpointing ships no backend for S3.
* **dcp_ext**: ``config.storage_config = DcpExtStorageConfig(...)``
  (``dcp_ext.integrations.torch_checkpointing``); locally with
  torch_checkpointing's own temporary-directory commit (an ``os.rename``), on
  S3 the way the guide documents for object stores:
  ``write_to_temp_dir=False`` and ``finalize_callback=commit_marker``.

Everything else is torch_checkpointing's defaults for both (one file-write
thread, ``{item}_{rank}.pt`` files by ``torch.save``). After a system's first
(warm-up) save, untimed, each rank loads it back with the same manager into
fresh tensors and checks every tensor is bit-exact (on S3 after checking
the commit marker), so a row never times a save it cannot load.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TorchCheckpointingSystem", "tc_payload"]


def tc_payload(model: Any, optimizers: Any, step: int) -> dict[str, Any]:
    """(each rank) The model and its AdamW moments as a torch_checkpointing payload."""
    optimizer = optimizers.optimizers[0]
    params = dict(model.named_parameters())
    return {"model": {n: p.detach() for n, p in params.items()},
            "optimizer": {n: {k: optimizer.state[p][k] for k in ("exp_avg", "exp_avg_sq")}
                          for n, p in params.items()},
            "step": step}


def _templates(value: Any) -> Any:
    """Fresh zero tensors (DTensors alike) shaped as ``value``'s, to load into."""
    import torch

    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: _templates(v) for k, v in value.items()}
    return None


def _same(saved: Any, loaded: Any, path: str = "") -> None:
    import torch

    from bench.harness.state import local_tensor

    if isinstance(saved, torch.Tensor):
        a, b = local_tensor(saved), local_tensor(loaded)
        assert a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{path} differs"
    elif isinstance(saved, dict):
        assert set(saved) == set(loaded), f"{path}: keys differ"
        for k, v in saved.items():
            _same(v, loaded[k], f"{path}.{k}")
    else:
        assert saved == loaded, f"{path}: {saved!r} != {loaded!r}"


class TorchCheckpointingSystem:
    """A torch_checkpointing ``CheckpointManager`` save of :func:`tc_payload` (a system of bench.frameworks)."""

    framework = "torch_checkpointing"
    #: Not in bench.frameworks' table of what a save pays storing nothing (that one measures DCP).
    fixed_costs = False

    def __init__(self, kind: str, root: str, job: dict[str, Any], stock: bool,
                 options: dict[str, Any] | None, fsync: bool = True) -> None:
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        from dcp_ext.integrations.torch_checkpointing import DcpExtStorageConfig, commit_marker

        self.kind = kind
        self.stock = stock
        self.name = "tc_stock" if stock else "tc_dcp_ext" if fsync else "tc_dcp_ext_nofsync"
        self.root = f"{root}/{self.name}"
        self.job = job
        self.options = dict(options or {})
        self.checked = False
        config = CheckpointManager.Config.with_sync_save()
        if stock:
            assert kind == "local", "torch_checkpointing's own storage writes local paths only"
            config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)  # O_DIRECT fails: module doc
            self.label = "torch_checkpointing CheckpointManager, LocalFileSystemStorage (stock)"
            self.settings = ("sync save, `LocalFileSystemStorageConfig(use_direct_io=False)` (its O_DIRECT default "
                             "fails on close), no fsync, temp dir + rename")
        else:
            # fsync=False: the stock storage's terms (it never fsyncs), for a like-for-like local row.
            config.storage_config = DcpExtStorageConfig(storage_options=self.options,
                                                        io_options=None if fsync else {"fsync": False})
            self.label = "dcp_ext DcpExtStorageConfig (torch_checkpointing)" + ("" if fsync else ", no fsync")
            if kind == "local":
                self.settings = ("sync save, dcp_ext store defaults (files fsynced), temp dir + rename" if fsync else
                                 "sync save, `io_options={'fsync': False}` (as the stock row), temp dir + rename")
            else:
                config.save.writer_config.write_to_temp_dir = False  # object stores: no directory rename ...
                config.finalize_callback = commit_marker  # ... a commit marker instead (the guide's way)
                self.settings = ("sync save, dcp_ext store defaults, `write_to_temp_dir=False` + "
                                 "`commit_marker`")
        self.manager = config.build()

    def prepare(self) -> dict[str, Any]:
        """This rank's tensors (for the byte count)."""
        return tc_payload(self.job["model"], self.job["optimizers"], 0)

    def before(self, i: int) -> None:
        """(all ranks) Nothing: the manager makes the directory."""

    def save(self, i: int) -> str:
        where = f"{self.root}/save-{i}"
        assert self.manager.save(where, tc_payload(self.job["model"], self.job["optimizers"], i)) is None
        return where

    def after(self, i: int, where: str) -> None:
        """(all ranks, untimed, first save only) Load it back and check it bit-exact."""
        if self.checked:
            return
        from dcp_ext.integrations.torch_checkpointing import is_committed

        if self.kind != "local":
            assert is_committed(where, self.options), f"{where}: no commit marker"
        saved = tc_payload(self.job["model"], self.job["optimizers"], i)
        loaded = self.manager.load(where, into={k: _templates(v) for k, v in saved.items()})
        _same(saved, dict(loaded))
        self.checked = True

    def close(self) -> None:
        self.manager.close()
