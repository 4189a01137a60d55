"""What checksum verification costs a warm load: ``python -m bench.verify_cost``.

Issue 15's target: a warm local load verified costs at most 10 % more than the
same load with ``IOConfig(verify_checksums=False)``, at most 5 % compressed.
This saves ``--size`` bytes of bf16 random normal tensors (355 of varied shapes,
like a small model) uncompressed and with zstd under ``--dir``, then loads each
with ``dcp_ext.load`` in this one process: every round runs the unverified load
and the verified one in alternating order (after one untimed load of each, so
both read from the page cache), and the cost of a round is verified / unverified
- 1. Prints the median and range of the rounds' costs and the 1-minute load
average before and after: on a shared host, compare passes only when it stayed
low (the copy's speed here doubles between a quiet and a busy host).

Measured with it (issue 15, 2 cores): see "Verification cost" in bench/README.md.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import dcp_ext
from dcp_ext.config import IOConfig, parse_size

_TENSORS = 355


def build(directory: Path, size: int) -> dict[str, Path]:
    """Save the bench state under ``directory`` (``raw`` and ``zstd``) unless
    already there; return the checkpoint of each."""
    paths = {kind: directory / f"{kind}-{size}" for kind in ("raw", "zstd")}
    if all((p / "dcp_ext.metadata.json").exists() for p in paths.values()):
        return paths
    rng = random.Random(0)
    torch.manual_seed(0)
    weights = [rng.uniform(0.05, 3.0) for _ in range(_TENSORS)]
    state: dict[str, torch.Tensor] = {}
    for i, weight in enumerate(weights):
        cols = rng.choice([256, 512, 1024, 2048, 4096])
        rows = max(1, int(size / 2 * weight / sum(weights)) // cols)
        state[f"layer{i}.weight"] = torch.randn(rows, cols).to(torch.bfloat16)
    for kind, path in paths.items():
        shutil.rmtree(path, ignore_errors=True)
        dcp_ext.save(state, path, compression=None if kind == "raw" else "zstd")
    return paths


def cost(path: Path, rounds: int) -> tuple[list[float], list[float]]:
    """Seconds per load, verified and unverified, over ``rounds`` alternated rounds."""
    reader = dcp_ext.CheckpointReader(path)
    metadata = reader.read_metadata()
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }

    def load(verify: bool) -> float:
        start = time.perf_counter()
        dcp_ext.load(state, path, config=IOConfig(verify_checksums=verify))
        return time.perf_counter() - start

    load(True)
    load(False)
    times: dict[bool, list[float]] = {True: [], False: []}
    for n in range(rounds):
        for verify in (True, False) if n % 2 == 0 else (False, True):
            times[verify].append(load(verify))
    return times[True], times[False]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB", help="bytes of tensors (default 1GiB)")
    parser.add_argument("--rounds", type=int, default=6, help="alternated rounds per checkpoint (default 6)")
    parser.add_argument("--dir", default="/tmp/dcp_ext-verify-cost", help="where the checkpoints are kept")
    args = parser.parse_args()
    paths = build(Path(args.dir), parse_size(args.size))
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    for kind, path in paths.items():
        verified, unverified = cost(path, args.rounds)
        costs = [v / u - 1 for v, u in zip(verified, unverified)]
        print(
            f"{kind:4s}: unverified {statistics.median(unverified) * 1e3:.0f} ms, verified "
            f"{statistics.median(verified) * 1e3:.0f} ms; cost median {statistics.median(costs):+.1%} "
            f"(rounds {min(costs):+.1%} .. {max(costs):+.1%})"
        )
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
