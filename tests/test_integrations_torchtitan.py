"""dcp_ext.integrations.torchtitan with torchtitan's real checkpoint manager.

One 2-rank gloo world drives an FSDP2 model, torchtitan's AdamW container,
its warmup-cosine LR scheduler container and a train state through
``DcpExtCheckpointManager`` (and torchtitan's stock ``CheckpointManager`` for
cross-reading): 6 steps saving every 2nd with ``keep_latest_k=2``, then a
fresh job with other initial weights resumes. Each case checks that the fresh
job resumed at step 6, that model and optimizer shards, LR scheduler and
train state are bit-exact what was saved, and that one more step gives the
same result in both jobs.

Cases: local synchronous zstd (the checkpoint stock torchtitan cannot find to
resume), SeaweedFS asynchronous zstd (storage_options, keep_latest_k deleting
through dcp_ext), stock-written read by ours, ours (asynchronous,
uncompressed) read by stock, and stock torchtitan (async) under
``dcp_ext.use_for_dcp(compression="zstd")``, whose checkpoint_id-only DCP
calls then go through dcp_ext, and which finds the compressed step to resume
by its ``.metadata`` (before issue 34 it found none and started from 0).
"""

from __future__ import annotations

from tests.support.dist import run_world
from tests.support.torchtitan_workers import torchtitan_suite


def test_torchtitan_checkpoint_manager(make_backend, tmp_path) -> None:
    backend = make_backend("seaweedfs")
    s3_root = backend.url("titan")
    results = run_world(2, torchtitan_suite, str(tmp_path), s3_root, backend.storage_options)
    for rank, out in enumerate(results):
        for case in ("local_sync_zstd", "s3_async_zstd", "stock_to_ours", "ours_to_stock", "stock_use_for_dcp"):
            got = out[case]
            assert got["loaded"] is True and got["step"] == 7, (rank, case, got)  # resumed at 6, one more step
            assert not got["resumed_diff"], (rank, case, got["resumed_diff"][:10])
            assert not got["next_diff"], (rank, case, got["next_diff"][:10])
    # Saved with io_options={"key_prefixes": 4}: every data file of the kept steps under a key prefix.
    data_files = results[0]["s3_data_files"]
    assert {name.split("/")[0] for name in data_files} == {"step-4", "step-6"}, data_files
    assert all(len(name.split("/")) == 3 and name.split("/")[1].isdigit() for name in data_files), data_files
    listings = results[0]["listings"]
    # keep_latest_k=2 deleted step-2 through dcp_ext (on S3 too).
    assert listings["zstd"] == ["step-4", "step-6"] and listings["s3"] == ["step-4", "step-6"], listings
    assert "dcp_ext.metadata.json" in listings["s3_markers"], listings
    # Written by dcp_ext, compressed, with torch's commit marker that stock torchtitan resumes by.
    assert {"dcp_ext.metadata.json", ".metadata"} <= set(listings["use_for_dcp_markers"]), listings
    # Planned by LayoutSavePlanner (with plan caching: steps 4 and 6 reused step 2's plan, and the
    # resumes above are bit-exact): files named by kind and rank, which torch's reader still loads.
    assert listings["ours_data_files"] == [f"{kind}_rank{r}.distcp" for kind in ("optimizer", "state")
                                           for r in (0, 1)], listings



def test_io_options_are_checked_when_the_config_is_built() -> None:
    """``checkpoint.io_options`` are ``IOConfig`` fields, refused at config time (naming the setting),
    not at the first save hours into a run; good ones are kept."""
    import pytest

    from dcp_ext.errors import InvalidOptionError
    from dcp_ext.integrations.torchtitan import DcpExtCheckpointManager

    good = DcpExtCheckpointManager.Config(enable=True, io_options={"max_concurrency": 16, "part_size": "32MiB"})
    assert good.io_options == {"max_concurrency": 16, "part_size": "32MiB"}  # the SeaweedFS case saves with some
    for bad, words in (({"max_concurency": 2}, "max_concurency"), ({"part_size": "lots"}, "lots"),
                       ({"max_concurrency": 0}, "max_concurrency")):
        with pytest.raises(InvalidOptionError, match=words) as info:
            DcpExtCheckpointManager.Config(enable=True, io_options=bad)
        assert "checkpoint.io_options" in str(info.value)


def test_storage_options_none_means_none() -> None:
    """``checkpoint.storage_options=None`` (as TOML's absent table or a user's default) is accepted, as
    the other adapters accept it (issue 43: it was refused with "must be a dict, not NoneType")."""
    import pytest

    from dcp_ext.errors import InvalidOptionError
    from dcp_ext.integrations.torchtitan import DcpExtCheckpointManager

    assert DcpExtCheckpointManager.Config(enable=True, storage_options=None).storage_options == {}
    with pytest.raises(InvalidOptionError, match="checkpoint.storage_options must be a dict"):
        DcpExtCheckpointManager.Config(enable=True, storage_options=["key"])  # type: ignore[arg-type]
