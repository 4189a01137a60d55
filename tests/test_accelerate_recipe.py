"""The Accelerate recipe of the framework guide runs as written (issue 43):
the guide's ``example:accelerate-cpu`` script under ``torchrun
--nproc_per_node 2`` (CPU, gloo): one run of 8 steps, and a run of 4 steps that
resumes from the first run's ``checkpoint-4`` (the newest ``checkpoint-N``,
with the scheduler and RNG): both ``checkpoint-8`` folders hold the same model
and optimizer, bit for bit. And ``DcpExtTrainer`` refuses to start without FSDP."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dcp_ext
from tests.support.compare import state_diff

REPO = Path(__file__).resolve().parent.parent


def _recipe() -> str:
    text = (REPO / "docs" / "guides" / "integrations.md").read_text()
    match = re.search(r"<!-- example:accelerate-cpu -->\n```python\n(.+?)```\n<!-- /example:accelerate-cpu -->",
                      text, re.S)
    assert match, "the framework guide lacks the example:accelerate-cpu block"
    return match.group(1)


def _torchrun(script: Path, root: Path, steps: int, cwd: Path) -> None:
    env = {**os.environ, "CKPT_ROOT": str(root), "STEPS": str(steps), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    # --standalone: the rendezvous binds a port the kernel picks and holds it (a probed "free" port can be
    # taken by another test's server before torchrun binds it).
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_guides_accelerate_recipe_resumes_bit_exact(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_recipe())
    _torchrun(script, tmp_path / "straight", 8, tmp_path)
    # The first 4 steps of the straight run are those of a run of 4 (same seeds, same saves), so its
    # checkpoint-2 and checkpoint-4 stand for that run's folders: one torchrun fewer (a launcher and 2
    # ranks' imports, about a third of the test's CPU). The second run of the script resumes from them.
    (tmp_path / "resumed").mkdir()
    for n in (2, 4):
        shutil.copytree(tmp_path / "straight" / f"checkpoint-{n}", tmp_path / "resumed" / f"checkpoint-{n}")
    _torchrun(script, tmp_path / "resumed", 4, tmp_path)
    for part in ("pytorch_model_fsdp_0", "optimizer_0", "training_state"):
        resumed = dcp_ext.load_whole(str(tmp_path / "resumed" / "checkpoint-8" / part))
        straight = dcp_ext.load_whole(str(tmp_path / "straight" / "checkpoint-8" / part))
        assert state_diff(straight, resumed) == [], part
    training = dcp_ext.load_whole(str(tmp_path / "resumed" / "checkpoint-8" / "training_state"))["training"]
    assert training["step"] == 8 and training["scheduler"]["last_epoch"] == 8
    assert sorted(p.name for p in (tmp_path / "resumed").iterdir()) == [f"checkpoint-{n}" for n in (2, 4, 6, 8)]


def test_dcp_ext_trainer_refuses_to_run_without_fsdp(tmp_path: Path) -> None:
    """On CPU, ``fsdp="full_shard"`` with ``use_cpu=True`` trains with DDP: the
    subclass refuses instead of writing no dcp_ext checkpoint, silently."""
    import transformers

    from dcp_ext.errors import InvalidOptionError
    from dcp_ext.integrations.transformers import DcpExtTrainer

    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[])
    model = torch.nn.Linear(4, 4)
    with pytest.raises(InvalidOptionError, match="FSDP is not enabled"):
        DcpExtTrainer(model=model, args=args)
