"""dcp_ext.integrations.lightning / .pytorch_lightning with real Lightning Trainers.

One 2-rank gloo world runs ``Trainer.fit`` (2 steps per epoch, fixed data,
AdamW and a per-step LR schedule) and checks, each bit-exact on every rank
(model and optimizer shards, LR scheduler, global step):

* ``DcpExtModelParallelStrategy`` (FSDP2, ``lightning`` namespace), local:
  ``ModelCheckpoint`` at each epoch end plus ``last.ckpt`` saved 3 times;
  ``fit(ckpt_path=epoch=1...)`` resumes the saved state and its next epoch
  equals the original run's; ``fit(ckpt_path=last.ckpt)`` resumes the newest;
* the same strategy on S3 (SeaweedFS, zstd): ``trainer.save_checkpoint(
  "s3://...")`` lands in the bucket (not in ``./s3:``), and a new Trainer
  resumes from it;
* cross-reading with Lightning's stock ``ModelParallelStrategy``, both ways;
* DDP + ``DcpExtCheckpointIO`` (``pytorch_lightning`` namespace, zstd):
  ``save_top_k=2`` deletes the oldest checkpoint through the plug-in,
  ``last.ckpt`` is saved 3 times, resumes from an epoch checkpoint and from
  ``last.ckpt`` are exact (a template-free load: optimizer integer keys
  restored); a file saved by Lightning's own ``TorchCheckpointIO`` loads too.
"""

from __future__ import annotations

from tests.support.dist import run_world
from tests.support.lightning_workers import lightning_suite


def test_lightning_trainers(make_backend, tmp_path) -> None:
    backend = make_backend("seaweedfs")
    results = run_world(2, lightning_suite, str(tmp_path), backend.url("lightning"), backend.storage_options,
                        timeout=400)
    for rank, out in enumerate(results):
        for check in ("fsdp_local_resume", "fsdp_local_next", "fsdp_last_resume", "s3_saved_epoch0", "s3_resume",
                      "s3_next", "stock_to_ours", "ours_to_stock", "ddp_resume", "ddp_next", "ddp_last_resume",
                      "ddp_plain_to_ours"):
            assert out[check] == [], (rank, check, out[check])
        assert out["s3_not_local"], rank
    first = results[0]
    assert first["ddp_listing"] == ["epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt", "last.ckpt"], first["ddp_listing"]
    assert first["fsdp_listing"] == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt",
                                     "last.ckpt"], first["fsdp_listing"]
    assert {"meta.pt", "dcp_ext.metadata.json"} <= set(first["s3_files"]), first["s3_files"]
    # Saved with io_options={"key_prefixes": 4}: every data file under a key prefix.
    data_files = first["s3_data_files"]
    assert data_files and all(len(n.split("/")) == 2 and n.split("/")[0].isdigit() for n in data_files), data_files


def test_strategy_io_options_become_the_config_of_every_save_and_load() -> None:
    """``io_options`` are checked when the strategy is built (naming the setting) and become the
    ``IOConfig`` its saves and loads use; none given: writers and readers build their own."""
    import pytest

    from dcp_ext.errors import InvalidOptionError
    from dcp_ext.integrations.lightning import DcpExtModelParallelStrategy

    strategy = DcpExtModelParallelStrategy(io_options={"max_concurrency": 16, "part_size": "32MiB"})
    assert (strategy.io_config.max_concurrency, strategy.io_config.part_size) == (16, 32 << 20)
    assert DcpExtModelParallelStrategy().io_config is None
    with pytest.raises(InvalidOptionError, match="io_options: .*max_concurency"):
        DcpExtModelParallelStrategy(io_options={"max_concurency": 2})
