"""Lightning on S3 resumes the right checkpoint (issue 43): with
``DcpExtModelCheckpoint(dirpath="s3://...")`` and the options in the plug-in or
strategy only, ``fit(ckpt_path="last")`` resumes the newest ``last.ckpt``
bit-exact (stock Lightning found none on S3 and silently trained from step 0),
``validate(ckpt_path="best")`` loads the best one, and ``load_module`` loads
a directory checkpoint as a ``LightningModule`` from S3; under DDP + the
plug-in and under the FSDP2 strategy, on 2 gloo ranks."""

from __future__ import annotations

from tests.support import lightning_s3_workers
from tests.support.dist import run_world


def test_last_and_best_on_s3_resume_the_right_checkpoint(make_backend) -> None:  # type: ignore[no-untyped-def]
    backend = make_backend("seaweedfs")
    results = run_world(2, lightning_s3_workers.resume_suite, backend.url("resume"), backend.storage_options,
                        timeout=400)
    for rank, out in enumerate(results):
        for kind in ("ddp", "fsdp"):
            assert out[f"{kind}_last_resume"] == [], (rank, kind, out[f"{kind}_resumed_step"], out[f"{kind}_last_resume"][:3])
            assert out[f"{kind}_resumed_step"] == 4, (rank, kind, out)  # after epoch 1 (2 steps each): not step 0
            assert out[f"{kind}_best_path"] == "epoch=1-step=4.ckpt" and out[f"{kind}_best_loaded"], (rank, out)
            assert out[f"{kind}_best_weights"] == [], (rank, kind, out[f"{kind}_best_weights"])
            assert out[f"{kind}_load_module"], (rank, kind)
