"""``python -m bench.gpu`` without a GPU: a typed refusal and a non-zero exit, at once (issue 44)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench import gpu

ROOT = Path(__file__).resolve().parents[1]

needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


@needs_no_gpu
def test_bench_gpu_refuses_without_a_gpu() -> None:
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "bench.gpu"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == gpu.EXIT_NO_GPU == 2
    assert "NoGpuError: no CUDA GPU: torch.cuda.is_available() is False" in done.stderr
    assert "--device cpu" in done.stderr  # says what to do instead
    assert "Traceback" not in done.stderr and done.stdout == ""
    # Fails before anything is built (no world, no checkpoint): importing torch is the cost.
    assert time.monotonic() - began < 120
    with pytest.raises(gpu.NoGpuError):
        gpu.require_gpus(None)


def test_the_summary_of_a_gpu_run() -> None:
    """What the script prints on a GPU machine, from a made-up record."""
    loop = {"wall": 10.0, "blocked": [0.05, 0.01, 0.02]}
    rank = {"device": "cuda:0", "bytes": 1 << 30, "save_sync": [0.5, 0.4], "save_async": [0.6, 0.5],
            "load": [0.25, 0.2], "loops": {"none": [{"wall": 9.0, "blocked": []}] * 2, "dcp_ext": [loop] * 2,
                                           "torch": [{"wall": 12.0, "blocked": [0.1, 0.03, 0.04]}] * 2}}
    rows = gpu.summarize([rank])
    assert rows[0]["save_sync"] == pytest.approx([(1 << 30) / 1e9 / 0.5, (1 << 30) / 1e9 / 0.4])
    assert rows[0]["blocked_dcp_ext"] == pytest.approx(15.0)  # median of saves 2..n, ms per GiB
    assert rows[0]["blocked_torch"] == pytest.approx(35.0)
    assert rows[0]["goodput_dcp_ext"] == pytest.approx([0.9, 0.9]) and rows[0]["goodput_torch"] == pytest.approx([0.75] * 2)
    record = {"date": "2026-11-28", "command": "python -m bench.gpu", "gpu_name": "H100",
              "machine": {"cpu_count": 64, "versions": {"torch": "2.13", "dcp_ext": "0.1"}},
              "params": {"gpus": 1, "size": 1 << 30, "tensors": 64, "repeats": 2, "steps": 40, "every": 10,
                         "root_kind": "local"}, "ranks": [rank]}
    text = gpu.render(record)
    assert "| cuda:0 | 2.42 (2.15–2.68) |" in text and "| 15.0 | 35.0 | 0.90 (0.90–0.90) | 0.75 (0.75–0.75) |" in text
