"""dcp_ext.integrations.accelerate with Accelerate's real FSDP2 checkpoint functions.

One 2-rank gloo world trains an FSDP2 model with AdamW for 2 steps and saves
model and optimizer with dcp_ext's ``save_fsdp_model`` / ``save_fsdp_optimizer``
(local uncompressed, SeaweedFS zstd) and with accelerate's own; fresh models
(other initial weights) then load each copy: dcp_ext's from both of its own,
dcp_ext's from accelerate's, accelerate's from dcp_ext's. Each load must be
bit-exact (model and optimizer shards) and one more step equal to the
original's. ``load_whole`` of the 2-rank checkpoints, in each process on its
own, equals the full state dicts gathered from the shards. Before anything imports accelerate, each rank checks that
``import dcp_ext``, ``dcp_ext.integrations``, ``dcp_ext.whole_state`` and
``dcp_ext.dcp_default`` imported no framework.
"""

from __future__ import annotations

from tests.support.accelerate_workers import accelerate_suite
from tests.support.dist import run_world


def test_accelerate_fsdp2_sharded_checkpoints(make_backend, tmp_path) -> None:
    backend = make_backend("seaweedfs")
    results = run_world(2, accelerate_suite, str(tmp_path), backend.url("accelerate"), backend.storage_options)
    for rank, out in enumerate(results):
        # import dcp_ext (and dcp_ext.integrations) imports no framework: each module imports its own.
        assert out["frameworks_imported_by_dcp_ext"] == [], out["frameworks_imported_by_dcp_ext"]
        for case in ("ours_local", "ours_s3_zstd", "theirs_to_ours", "ours_to_theirs"):
            assert out[case] == [] and out[case + "_next"] == [], (rank, case, out[case], out[case + "_next"])
        assert out["load_whole"] == [], (rank, out["load_whole"])
        # Saved with io_options={"key_prefixes": 4}: each rank's optimizer file under a key prefix.
        assert out["s3_data_files"] == ["0/optimizer_rank0.distcp", "1/optimizer_rank1.distcp"], out["s3_data_files"]
        local, local_optim, s3, s3_optim = out["paths"]
        assert local.endswith("/ours/pytorch_model_fsdp_0") and local_optim.endswith("/ours/optimizer_0")
        assert s3.startswith("s3://") and s3.endswith("/zstd/pytorch_model_fsdp_0"), s3
