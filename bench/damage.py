"""Damage trials: ``python -m bench.damage [--trials 500] [--seed 1]``.

Runs ``tests/support/damage_trials.py`` on an uncompressed and a zstd root: each trial
damages a copy of a good checkpoint root (byte flip, truncation, deleted
shard, deleted or garbled metadata, stale ``newest``) and checks the damage is
detected and never loaded as wrong data. Then every single-byte change of
the newest tag's metadata (each position xor each of the 255 masks) is
decoded, and any that passes is counted as undetected. Writes
``bench/results/damage-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
import time
from pathlib import Path

from dcp_ext.metadata import decode_metadata
from tests.support.damage_trials import make_root, run_trials

ROOT = Path(__file__).resolve().parent.parent


def exhaustive_metadata(base: Path) -> dict:
    data = (base / "step2_partial" / "dcp_ext.metadata.json").read_bytes()
    undetected = []
    for pos in range(len(data)):
        for mask in range(1, 256):
            changed = bytearray(data)
            changed[pos] ^= mask
            try:
                decode_metadata(bytes(changed), "metadata")
            except Exception:  # noqa: BLE001 - detected
                continue
            undetected.append([pos, mask])
    return {"bytes": len(data), "variants": len(data) * 255, "undetected": undetected}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=500, help="trials per compression setting")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    result: dict = {"date": datetime.date.today().isoformat(), "runs": {}}
    bad = 0
    for compression in (None, "zstd"):
        with tempfile.TemporaryDirectory(prefix="dcp_ext_damage_") as tmp:
            base = Path(tmp) / "base"
            make_root(base, compression)
            start = time.monotonic()
            stats = run_trials(base, Path(tmp), args.trials, seed=args.seed)
            name = compression or "uncompressed"
            result["runs"][name] = {
                "trials": stats.trials, "detected": stats.detected, "by_kind": stats.by_kind,
                "how": stats.how, "violations": stats.violations, "seconds": time.monotonic() - start,
            }
            start = time.monotonic()
            exhaustive = exhaustive_metadata(base)
            exhaustive["seconds"] = time.monotonic() - start
            result["runs"][name]["metadata_single_byte_changes"] = exhaustive
            bad += len(stats.violations) + len(exhaustive["undetected"])
            print(f"{name}: {stats.trials} trials, {stats.detected} detected, {len(stats.violations)} "
                  f"violations; by kind (trials, detected) {stats.by_kind}; how {stats.how}; every "
                  f"single-byte change of the metadata ({exhaustive['variants']} variants): "
                  f"{len(exhaustive['undetected'])} undetected", flush=True)
    out = ROOT / "bench" / "results" / f"damage-{result['date']}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"written to {out}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
