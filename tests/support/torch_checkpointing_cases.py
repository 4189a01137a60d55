"""Conformance cases for torch_checkpointing ``Storage`` backends (tests/test_integrations_torch_checkpointing.py).

:func:`exercise` calls every method of a ``Storage`` under a root directory
and records each outcome as a plain value: what came back (or what the
storage holds afterwards, read back through the storage), or the built-in
class of the error raised. Running it against torch_checkpointing's own
``LocalFileSystemStorage`` gives the reference the other backends are
compared with; the test checks the storage's effects through a side door
(the file system, or boto3 for S3).
"""

from __future__ import annotations

import array
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["exercise", "outcome", "config_round_trip", "BUILTIN_ERRORS", "PAYLOAD"]

#: Most specific first: dcp_ext's errors are subclasses of these.
BUILTIN_ERRORS = (FileExistsError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError,
                  OSError, RuntimeError, ValueError)

PAYLOAD = bytes(range(256)) * 801  # 205,056 bytes: 4 ranged requests of 64 KiB, the last partial


def outcome(fn: Callable[[], Any]) -> Any:
    """``fn()``'s value, or ``"raises <built-in error>"``."""
    try:
        return fn()
    except BUILTIN_ERRORS as err:
        kind = next(k for k in BUILTIN_ERRORS if isinstance(err, k))
        return f"raises {kind.__name__}"


def _partial_write(storage: Any, path: Path) -> None:
    with storage.stream_write(path) as stream:
        stream.write(b"half a file")
        raise RuntimeError("the save failed")


def _ranged(storage: Any, path: Path, read_args: Any) -> list[Any]:
    """seek/readinto as torch_checkpointing's mmap fill and resharder read."""
    with storage.stream_read(path, read_args) as stream:
        buf = bytearray(100)
        steps = [stream.seekable(), stream.seek(1000), stream.readinto(memoryview(buf)), bytes(buf) ==
                 PAYLOAD[1000:1100], stream.tell()]
        tail = bytearray(10)
        steps += [stream.seek(len(PAYLOAD) - 3), stream.readinto(tail), bytes(tail[:3]) == PAYLOAD[-3:],
                  stream.readinto(tail)]
        return steps


def exercise(storage: Any, root: Path) -> dict[str, Any]:
    """Every ``Storage`` method under ``root`` (which must not exist yet)."""
    from torch_checkpointing.storage.base_storage import ReadArgs

    d = root / "d"
    out: dict[str, Any] = {"mkdir": outcome(lambda: storage.mkdir(d / "sub")),
                           "isdir after mkdir": storage.isdir(d / "sub")}
    # write(): every buffer kind torch_checkpointing hands it; read back through the storage.
    buffers = {"bytes": PAYLOAD, "bytearray": bytearray(PAYLOAD), "memoryview": memoryview(PAYLOAD),
               "numpy": np.frombuffer(PAYLOAD, dtype=np.uint8), "tensor.numpy": torch.tensor(list(PAYLOAD),
               dtype=torch.uint8).numpy(), "array": array.array("B", PAYLOAD), "empty": b""}
    for kind, data in buffers.items():
        storage.write(d / f"{kind}.bin", data)
        out[f"write {kind}"] = storage.read(d / f"{kind}.bin") == bytes(data)
    # stream_write(): raw writes and torch.save, as torch_checkpointing's writer does.
    tensor = torch.arange(1000, dtype=torch.float32)
    with storage.stream_write(d / "stream.bin") as stream:
        for start in range(0, len(PAYLOAD), 40_000):
            stream.write(memoryview(PAYLOAD)[start:start + 40_000])
    with storage.get_write_stream(d / "t.pt", tensor) as stream:
        torch.save({"t": tensor}, stream)
    out["stream_write"] = storage.read(d / "stream.bin") == PAYLOAD
    out["torch.save / torch.load"] = torch.equal(
        torch.load(storage.stream_read(d / "t.pt"), weights_only=True)["t"], tensor)
    out["stream_write missing parent"] = outcome(lambda: storage.write(root / "elsewhere" / "x.bin", b"x"))
    out["stream_write failed"] = outcome(lambda: _partial_write(storage, d / "partial.bin"))
    out["after failed stream_write"] = storage.exists(d / "partial.bin")
    # Reads.
    out["read missing"] = outcome(lambda: storage.read(d / "missing.bin"))
    out["stream_read missing"] = outcome(lambda: storage.stream_read(d / "missing.bin"))
    out["getsize"] = storage.getsize(d / "bytes.bin")
    out["getsize missing"] = outcome(lambda: storage.getsize(d / "missing.bin"))
    out["full read"] = storage.stream_read(d / "bytes.bin", ReadArgs(pre_read_full_file=True)).read() == PAYLOAD
    out["ranged read"] = _ranged(storage, d / "bytes.bin", ReadArgs(pre_read_full_file=False))
    out["ranged read, known size"] = _ranged(
        storage, d / "bytes.bin", ReadArgs(pre_read_full_file=False, known_size_bytes=len(PAYLOAD)))
    # Namespace.
    out["exists"] = [storage.exists(p) for p in (d / "bytes.bin", d, d / "missing.bin", root / "nope")]
    out["isdir"] = [storage.isdir(p) for p in (d, d / "bytes.bin", d / "missing")]
    out["ls"] = storage.ls(d)
    out["ls missing"] = outcome(lambda: storage.ls(root / "nope"))
    out["glob"] = sorted(Path(p).name for p in storage.glob(f"{storage.remap_path(d)}/*y*.bin"))
    out["remap_path"] = storage.remap_path(d / "bytes.bin").endswith("/d/bytes.bin")
    # rename(): each row of torch_checkpointing's table.
    r = root / "r"
    storage.mkdir(r)
    for name in ("a", "b", "c"):
        storage.write(r / name, name.encode() * 3)
    out["rename file -> absent"] = outcome(lambda: storage.rename(r / "a", r / "a2"))
    out["... then"] = [storage.exists(r / "a"), storage.read(r / "a2")]
    out["rename file -> file"] = outcome(lambda: storage.rename(r / "a2", r / "b"))
    out["... replaced"] = [storage.exists(r / "a2"), storage.read(r / "b")]
    storage.mkdir(r / "src")
    storage.write(r / "src" / "x", b"x")
    storage.write(r / "src" / "y", b"yy")
    out["rename file -> directory"] = outcome(lambda: storage.rename(r / "c", r / "src"))
    out["rename directory -> absent"] = outcome(lambda: storage.rename(r / "src", r / "dst", is_directory=True))
    out["... landed"] = [storage.exists(r / "src"), storage.ls(r / "dst"), storage.read(r / "dst" / "y")]
    storage.mkdir(r / "full")
    storage.write(r / "full" / "z", b"z")
    out["rename directory -> populated"] = outcome(
        lambda: storage.rename(r / "dst", r / "full", is_directory=True))
    out["rename directory -> file"] = outcome(lambda: storage.rename(r / "dst", r / "c", is_directory=True))
    out["... untouched"] = [storage.ls(r / "dst"), storage.ls(r / "full"), storage.read(r / "c")]
    out["rename missing"] = outcome(lambda: storage.rename(r / "missing", r / "m2"))
    # Deletion.
    out["delete"] = outcome(lambda: storage.delete(d / "bytes.bin"))
    out["delete missing"] = outcome(lambda: storage.delete(d / "bytes.bin"))
    out["delete directory"] = outcome(lambda: storage.delete(d / "sub"))
    out["rmdir"] = outcome(lambda: storage.rmdir(r))
    out["... gone"] = storage.exists(r)
    out["rmdir missing"] = outcome(lambda: storage.rmdir(r))
    out["mkdir not recursive, missing parent"] = outcome(lambda: storage.mkdir(root / "p" / "q", recursive=False))
    return out


def config_round_trip(config: Any) -> Any:
    """What torch_checkpointing's asynchronous saver does with a storage config: pickle it to a process."""
    return pickle.loads(pickle.dumps(config)).create_storage()

