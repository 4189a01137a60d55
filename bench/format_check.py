"""On-storage format check: ``python -m bench.format_check OUT.json [--dir DIR]``.

Saves a fixed set of checkpoints from fixed-seed states through the public
API only (a plain ``dcp_ext.save``, a zstd one, manager saves with optimizer
and ``user_content``, two incremental saves, a full safetensors checkpoint,
a Hugging Face export) and writes, per file, the SHA-256 of its bytes with
the fields that differ from run to run normalized away: commit times,
``save_id`` / ``load_id`` / ``checkpoint_id`` and the metadata's own
checksum (which covers the time). Run it with two versions of dcp_ext (say
before and after a refactor, each from its own checkout with
``PYTHONPATH``) and compare the two files: equal digests mean
byte-identical checkpoints but for those fields.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import shutil
import struct
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

import dcp_ext
from dcp_ext.errors import NeedsCheckpointReaderError

#: Fields that hold a time or an id of one run.
_VOLATILE = {"created", "integrity", "save_id", "load_id", "checkpoint_id", "dcp_ext.created"}


def _scrub(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _scrub(v) for k, v in value.items() if k not in _VOLATILE}
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    return value


def _digest(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".json" or path.name in ("newest",):
        try:
            data = json.dumps(_scrub(json.loads(data)), sort_keys=True).encode()
        except ValueError:
            pass
    elif path.name == ".metadata":
        try:
            metadata = pickle.loads(data)  # our own pickle, written by this run
        except NeedsCheckpointReaderError:
            return "marker " + hashlib.sha256(data).hexdigest()  # the .metadata marker of compressed/incremental
        metadata.storage_meta = None
        data = pickle.dumps((metadata.state_dict_metadata, metadata.planner_data,
                             sorted((str(k), repr(v)) for k, v in (metadata.storage_data or {}).items())))
    elif path.suffix != ".distcp" and len(data) > 9 and data[8:9] == b"{":  # a safetensors file
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + length])
        data = json.dumps(_scrub(header), sort_keys=True).encode() + data[8 + length :]
    return hashlib.sha256(data).hexdigest()


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))


def write_all(root: Path) -> None:
    """Save every kind of checkpoint under ``root`` (fixed seeds, public API only)."""
    model = _model(0)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64, generator=torch.Generator().manual_seed(1))).sum().backward()
    optimizer.step()
    state = {"w": torch.arange(1000.0).reshape(10, 100), "step": 7, "b": torch.ones(3, dtype=torch.bfloat16)}
    dcp_ext.save(state, str(root / "plain"))
    dcp_ext.save(state, str(root / "zstd"), compression="zstd")
    manager = dcp_ext.CheckpointManager(str(root / "managed"))
    manager.save("step1", model, optimizer, user_content={"step": 1, "note": "fixed"})
    manager.save("full", model, partial=False)
    manager.export("step1", out="exported", full_format="safetensors")
    manager.export("step1", out="hf", full_format="hf")
    manager.close()
    incremental = dcp_ext.CheckpointManager(str(root / "incremental"), incremental=True,
                                            config=dcp_ext.IOConfig(frame_size=4096))
    incremental.save("s1", model, optimizer)
    with torch.no_grad():
        model[2].bias.add_(1)
    incremental.save("s2", model, optimizer)
    incremental.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="where to write the digests (JSON)")
    parser.add_argument("--dir", help="save the checkpoints here (default: a temporary directory, removed)")
    args = parser.parse_args(argv)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="dcp_ext_format_"))
    root = base / "checkpoints"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        write_all(root)
    digests = {str(p.relative_to(root)): _digest(p) for p in sorted(root.rglob("*")) if p.is_file()}
    Path(args.out).write_text(json.dumps({"dcp_ext": str(Path(dcp_ext.__file__).parent), "files": digests},
                                         indent=1))
    print(f"{len(digests)} files; digests in {args.out}")
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
