"""The ``dcp-ext`` command line: its ``main()`` in-process (a subprocess per
command proves nothing more and costs ~1.5 s of imports each), plus one run
through the installed ``python -m dcp_ext`` entry point."""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

import dcp_ext
from tests.support.damage_trials import flip_byte


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``dcp-ext ARGS`` in this process: exit code, stdout and stderr as a subprocess would give them."""
    from dcp_ext.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), mock.patch.dict(os.environ, env or {}):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse errors
            code = exc.code if isinstance(exc.code, int) else 2
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def _run_entry_point(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dcp_ext", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("kind", ["local", "moto"])
def test_cli_commands(kind: str, make_backend, tmp_path: Path) -> None:
    backend = make_backend(kind)
    root = backend.url("cli")
    opts = ["--storage-options", json.dumps(backend.storage_options)] if backend.storage_options else []
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    for i in range(3):
        dcp_ext.save_checkpoint(root, f"s{i}", model, storage_options=backend.storage_options,
                                user_content={"step": i}, compression="zstd" if i == 2 else None)
    dcp_ext.save_checkpoint(root, "final", model, partial=False, storage_options=backend.storage_options,
                            user_content={"step": 3})

    listed = _run("ls", root, *opts)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split()[:3] == ["tag", "state", "newest"]
    assert [line.split()[0] for line in lines[1:]] == ["s0", "s1", "s2", "final"]  # not user_content_final
    assert "*" in lines[3].split() and "committed" in lines[1]
    assert "full (safetensors)" in lines[4] and str(datetime.date.today().year) in lines[4]

    inspected = _run("inspect", f"{root}/s2_partial", "--json", *opts)
    assert inspected.returncode == 0, inspected.stderr
    doc = json.loads(inspected.stdout)
    keys = {k["key"]: k for k in doc["keys"]}
    assert keys["model.0.weight"]["dtype"] == "float32" and keys["model.0.weight"]["shape"] == [64, 64]
    assert keys["model.0.weight"]["codec"] == "bytegroup.4/1+zstd.planes.4/1"
    assert keys["model.0.weight"]["raw_bytes"] == 64 * 64 * 4
    table = _run("inspect", f"{root}/s1_partial", *opts)
    assert "model.0.weight" in table.stdout and "raw" in table.stdout

    full_doc = json.loads(_run("inspect", f"{root}/final", "--json", *opts).stdout)
    assert full_doc["full"] and [k["key"] for k in full_doc["keys"]] == ["0.bias", "0.weight", "1.bias", "1.weight"]
    full_ok = _run("verify", f"{root}/final", *opts)
    assert full_ok.returncode == 0 and "1 files, 4 frames" in full_ok.stdout and ": OK" in full_ok.stdout, (
        full_ok.stdout + full_ok.stderr)
    at_root = _run("inspect", root, *opts)
    assert at_root.returncode == 2 and "is a checkpoint root (partial checkpoints: s0, s1, s2)" in at_root.stderr
    assert "s2_partial" in at_root.stderr  # the one newest names

    ok = _run("verify", f"{root}/s2_partial", "--quiet", *opts)
    assert ok.returncode == 0 and ok.stdout.strip().endswith("OK"), ok.stdout + ok.stderr

    out = tmp_path / "full.safetensors"
    exported = _run("export", f"{root}/s1_partial", str(out), *opts)
    assert exported.returncode == 0, exported.stderr
    assert "exporting (safetensors) [" in exported.stderr and "100.0% of" in exported.stderr
    from safetensors.torch import load_file

    full = load_file(str(out))  # a full model checkpoint: the model's own key names
    assert sorted(full) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert torch.equal(full["0.weight"], model[0].weight.detach())

    dry = _run("prune", root, "--keep", "1", "--dry-run", *opts)
    assert dry.returncode == 0 and "would delete s0" in dry.stdout and "would delete s1" in dry.stdout
    assert dcp_ext.CheckpointManager(root, storage_options=backend.storage_options).tags() == ["s0", "s1", "s2"]
    pruned = _run("prune", root, "--keep", "1", *opts)
    assert pruned.returncode == 0, pruned.stderr
    assert dcp_ext.CheckpointManager(root, storage_options=backend.storage_options).tags() == ["s2"]

    as_torch = _run("export", f"{root}/s2_partial", f"{root}/s2_torch", "--format", "torch", "--quiet", *opts)
    assert as_torch.returncode == 0 and as_torch.stderr == "", as_torch.stderr
    rows = [line.split()[:3] for line in _run("ls", root, *opts).stdout.splitlines()[1:]]
    assert rows == [["s2", "committed", "*"], ["final", "full", "(safetensors)"], ["s2_torch", "full", "(torch)"]]
    as_json = _run(*opts, "ls", root, "--json")  # storage options before the command work too
    assert as_json.returncode == 0, as_json.stderr
    listing = json.loads(as_json.stdout)
    assert listing["newest"] == "s2"
    assert [(c["tag"], c["state"], c.get("format")) for c in listing["checkpoints"]] == [
        ("s2", "committed", None), ("final", "full", "safetensors"), ("s2_torch", "full", "torch")]
    assert listing["checkpoints"][0]["ratio"] > 1.0 and listing["checkpoints"][0]["world_size"] == 1
    if backend.storage_options:  # S3 endpoint and credentials from the environment alone
        so = backend.storage_options
        env = {"AWS_ENDPOINT_URL": so["client_kwargs"]["endpoint_url"], "AWS_ACCESS_KEY_ID": so["key"],
               "AWS_SECRET_ACCESS_KEY": so["secret"], "AWS_DEFAULT_REGION": so["client_kwargs"]["region_name"]}
        from_env = _run("ls", root, "--json", env=env)
        assert from_env.returncode == 0, from_env.stderr
        assert json.loads(from_env.stdout)["checkpoints"] == listing["checkpoints"]


def test_cli_damage_and_errors(tmp_path: Path) -> None:
    root = tmp_path / "root"
    dcp_ext.save_checkpoint(root, "s", torch.nn.Linear(256, 256))
    data = next((root / "s_partial").glob("model_*.distcp"))
    flip_byte(data, data.stat().st_size // 2, 0xFF)
    bad = _run_entry_point("verify", str(root / "s_partial"))  # the real entry point and exit code
    assert bad.returncode == 1
    assert "1 problem(s)" in bad.stdout and "checksum mismatch" in bad.stdout and data.name in bad.stdout

    missing = _run("inspect", str(tmp_path / "nothing"))
    assert missing.returncode == 2
    lines = missing.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dcp-ext: error: ") and "nothing" in lines[0]
    verbose = _run("--verbose", "inspect", str(tmp_path / "nothing"))
    assert verbose.returncode == 2 and "Traceback" in verbose.stderr
    assert _run("prune", str(root), "--keep", "0").returncode == 2

    dcp_ext.save_checkpoint(root, "full", torch.nn.Linear(256, 256), partial=False)
    (root / "cut").write_bytes((root / "full").read_bytes()[:-100])
    cut = _run("verify", str(root / "cut"))
    assert cut.returncode == 1 and "truncated" in cut.stdout, cut.stdout + cut.stderr
