"""``dcp-ext`` on the folders the framework adapters write (issue 43): torchtitan's
``step-N``, Lightning's ``*.ckpt`` directories and Accelerate's
``checkpoint-N/pytorch_model_fsdp_0``: ``ls`` lists them (it said "no
checkpoints"), ``inspect`` and ``verify`` read them, and ``export`` writes a
full file from ``step-8`` (it refused: "its name must end with _partial")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import dcp_ext
from dcp_ext.cli import main as cli_main


def test_ls_inspect_verify_export_on_framework_folders(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4)}}
    root = tmp_path / "run"
    for step in (4, 8):
        dcp_ext.save(state, str(root / f"step-{step}"), compression="zstd" if step == 8 else None)
    dcp_ext.save(state, str(root / "last.ckpt"))
    dcp_ext.save(state, str(root / "checkpoint-8" / "pytorch_model_fsdp_0"))
    (root / "notes").mkdir()
    (root / "notes" / "readme.txt").write_text("not a checkpoint")
    assert cli_main(["ls", str(root)]) == 0
    listed = capsys.readouterr().out
    for name in ("step-4", "step-8", "last.ckpt", "checkpoint-8/pytorch_model_fsdp_0"):
        assert name in listed, listed
    assert "notes" not in listed and "no checkpoints" not in listed
    assert cli_main(["inspect", str(root / "step-8")]) == 0 and "model.w" in capsys.readouterr().out
    assert cli_main(["verify", str(root / "step-8")]) == 0
    out = tmp_path / "out.safetensors"
    assert cli_main(["export", str(root / "step-8"), str(out), "-q"]) == 0
    exported = load_file(str(out))
    assert torch.equal(exported["w"], state["model"]["w"]) and torch.equal(exported["b"], state["model"]["b"])  # the model's keys
    assert cli_main(["export", str(root / "step-8"), str(out), "-q"]) == 2  # exists: refused without --overwrite
    assert cli_main(["export", str(root / "notes"), str(tmp_path / "x.safetensors")]) == 2
