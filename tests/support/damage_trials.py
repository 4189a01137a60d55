"""Damage trials: break a good checkpoint root at random and check the damage
is detected and never turns into wrong data.

A root holds two committed tags (``step1`` then ``step2``, newest), saved by
one process, uncompressed or zstd. Each trial copies the root, applies one
damage to the newest tag, then resumes the newest checkpoint into a fresh
model:

* ``flip``: xor a random nonzero byte into a random position of a data file;
* ``truncate``: cut a data file at a random length;
* ``delete_shard``: delete a data file;
* ``delete_metadata``: delete ``dcp_ext.metadata.json``;
* ``garble_metadata``: xor a random byte of ``dcp_ext.metadata.json``;
* ``stale_newest``: point ``newest`` at a tag that does not exist.

A trial counts as detected when the resume raises a dcp_ext error, or warns
(naming the file) and loads the newest committed tag, or loads correct data
and ``verify`` reports
the damage (a flip in the ``torch.save`` envelope, which loads never read).
Wrong data returned without an error, or damage nobody reports, is a
violation.
"""

from __future__ import annotations

import os
import random
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

import dcp_ext
from tests.support.compare import same_state

KINDS = ("flip", "truncate", "delete_shard", "delete_metadata", "garble_metadata", "stale_newest")


def flip_byte(path: str | os.PathLike[str], position: int, mask: int = 0x40) -> None:
    """Xor ``mask`` (nonzero) into the byte of file ``path`` at ``position``."""
    with open(path, "r+b") as f:
        f.seek(position)
        (byte,) = f.read(1)
        f.seek(position)
        f.write(bytes([byte ^ mask]))


def model(step: int) -> nn.Module:
    torch.manual_seed(step)
    return nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 256))


def make_root(root: Path, compression: str | None) -> None:
    for step in (1, 2):
        m = model(step)
        optim = torch.optim.Adam(m.parameters())
        dcp_ext.CheckpointManager(root, compression=compression, config=dcp_ext.IOConfig(frame_size=64 * 1024)).save(
            f"step{step}", m, optim, user_content={"step": step}
        )


@dataclass
class DamageStats:
    trials: int = 0
    detected: int = 0
    by_kind: dict[str, list[int]] = field(default_factory=dict)  # kind -> [trials, detected]
    how: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)


def _damage(tag_dir: Path, root: Path, kind: str, rng: random.Random) -> str:
    data = sorted(p for p in tag_dir.iterdir() if p.suffix == ".distcp")
    meta = tag_dir / "dcp_ext.metadata.json"
    if kind in ("flip", "truncate", "delete_shard"):
        target = rng.choice(data)
        size = target.stat().st_size
        if kind == "flip":
            pos = rng.randrange(size)
            flip_byte(target, pos, rng.randrange(1, 256))
            return f"{target.name}@{pos}"
        if kind == "truncate":
            cut = rng.randrange(size)
            target.write_bytes(target.read_bytes()[:cut])
            return f"{target.name}[:{cut}]"
        target.unlink()
        return target.name
    if kind == "delete_metadata":
        meta.unlink()
        return meta.name
    if kind == "garble_metadata":
        pos = rng.randrange(meta.stat().st_size)
        flip_byte(meta, pos, rng.randrange(1, 256))
        return f"{meta.name}@{pos}"
    (root / "newest").write_text("step9\n")
    return "newest -> step9"


def run_trials(base: Path, work: Path, trials: int, seed: int = 0) -> DamageStats:
    """``base`` holds a root made by :func:`make_root`; trials run in ``work``."""
    rng = random.Random(seed)
    stats = DamageStats()
    for trial in range(trials):
        kind = KINDS[trial % len(KINDS)] if trial < len(KINDS) else rng.choice(KINDS)
        root = work / f"t{trial}"
        shutil.copytree(base, root)
        what = _damage(root / "step2_partial", root, kind, rng)
        target = model(1000 + trial)
        optim = torch.optim.Adam(target.parameters())
        outcome = ""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                result = dcp_ext.resume_from_checkpoint(root, target, optim)
            except dcp_ext.DcpExtError as err:
                outcome = f"error {type(err).__name__}"
            else:
                warned = [w for w in caught if "newest" in str(w.message)]
                expected = model(result.user_content["step"])
                if not same_state(expected.state_dict(), target.state_dict()):
                    stats.violations.append(f"trial {trial} {kind} {what}: WRONG DATA from {result.tag}")
                elif warned:
                    outcome = f"warned, loaded the newest committed tag ({result.tag})"
                else:
                    report = dcp_ext.verify(root / f"{result.tag}_partial")
                    if not report.ok:
                        outcome = "loaded correct data; verify reported it"
        stats.trials += 1
        counts = stats.by_kind.setdefault(kind, [0, 0])
        counts[0] += 1
        if outcome:
            stats.detected += 1
            counts[1] += 1
            key = outcome.split(" (")[0]
            stats.how[key] = stats.how.get(key, 0) + 1
        elif not any(v.startswith(f"trial {trial} ") for v in stats.violations):
            stats.violations.append(f"trial {trial} {kind} {what}: not detected")
        shutil.rmtree(root)
    return stats
