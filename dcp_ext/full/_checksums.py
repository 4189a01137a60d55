"""Checksums of full checkpoints, kept in a small JSON sidecar written last.

A full checkpoint's header comes before its data (safetensors, ``torch.save``),
so it cannot carry checksums of data streamed after it. Each tensor's stored
bytes are instead cut into frames of ``frame_size`` bytes (the last one
shorter), as in partial checkpoints, and the xxh3-64 of every frame is
computed while the file is written and recorded in a sidecar:

* a single file ``ROOT/{tag}`` has ``ROOT/{tag}.checksums.json``
  (:func:`sidecar_name`);
* a Hugging Face folder has ``dcp_ext.checksums.json`` inside it
  (:data:`FOLDER_SIDECAR`), covering every shard file.

The sidecar is written after the files it describes have committed, and an
overwrite deletes the old sidecar before the new file commits, so a sidecar
never describes other bytes than the file's (a crash in between leaves a file
without checksums, which loads unverified). Readers attach the frame
checksums to the tensors they read (:class:`~dcp_ext.full.FullCheckpointReader`),
so every load and :func:`dcp_ext.verify` checks them.

The document::

    {"format": "dcp_ext.full_checksums", "version": 1, "checksum": "xxh3-64",
     "files": {"model.safetensors": {"size": 1234, "frame_size": 1048576,
               "tensors": {"w": {"offset": 96, "length": 1024,
                                 "checksums": "<16 hex digits per frame>"}}}}}
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from ..errors import CheckpointCorruptError, CheckpointNotFoundError
from ..frames import CHECKSUM, checksum
from ..layout import CHECKSUMS_SUFFIX
from ..storage import Store

__all__ = [
    "FOLDER_SIDECAR",
    "SIDECAR_SUFFIX",
    "TensorChecksums",
    "FileChecksums",
    "ChecksumRecorder",
    "TensorHasher",
    "sidecar_name",
    "encode_sidecar",
    "decode_sidecar",
    "read_checksums",
    "check_file_size",
]

SIDECAR_SUFFIX = CHECKSUMS_SUFFIX
#: The sidecar inside a Hugging Face folder written by dcp_ext.
FOLDER_SIDECAR = "dcp_ext.checksums.json"
_FORMAT = "dcp_ext.full_checksums"
_VERSION = 1
_HEX = 16  # hex digits per xxh3-64 checksum


def sidecar_name(name: str) -> str:
    """The sidecar of the single-file full checkpoint ``name``."""
    return name + SIDECAR_SUFFIX


@dataclass(frozen=True)
class TensorChecksums:
    """The frame checksums of one tensor's stored bytes.

    Attributes:
        name: The tensor's key in its file.
        offset: Absolute byte offset of its data in the file.
        length: Bytes of its data.
        frame_size: Bytes per frame (the last frame may be shorter).
        checksums: xxh3-64 of each frame, in order.
    """

    name: str
    offset: int
    length: int
    frame_size: int
    checksums: tuple[int, ...]


@dataclass(frozen=True)
class FileChecksums:
    """The checksums of one file of a full checkpoint.

    Attributes:
        file: Its name, relative to the sidecar's directory.
        size: Its size in bytes when written.
        frame_size: Bytes per frame of every tensor in it.
        tensors: Its tensors, by name.
    """

    file: str
    size: int
    frame_size: int
    tensors: dict[str, TensorChecksums]


class ChecksumRecorder:
    """Collects the frame checksums of the tensors written into one file.

    Args:
        file: The file's name, relative to the sidecar's directory.
        frame_size: Bytes per frame.
    """

    def __init__(self, file: str, frame_size: int) -> None:
        if frame_size <= 0:
            raise ValueError(f"frame_size must be positive, got {frame_size}")
        self.file = file
        self.frame_size = frame_size
        self._tensors: dict[str, TensorChecksums] = {}

    def add(self, name: str, offset: int, data: bytes | bytearray | memoryview | Sequence[memoryview]) -> None:
        """Record tensor ``name`` whose stored bytes ``data`` start at ``offset`` of the file.

        ``data`` may be a list of byte runs, the tensor's bytes in order (a
        frame may span runs: it is hashed as one).
        """
        step = self.frame_size
        if isinstance(data, (bytes, bytearray, memoryview)):
            view = memoryview(data).cast("B")
            sums = tuple(checksum(view[at : at + step]) for at in range(0, len(view), step))
            self._tensors[name] = TensorChecksums(name, offset, len(view), step, sums)
            return
        hasher = self.start(name, offset)
        for run in data:
            hasher.update(run)
        hasher.finish()

    def start(self, name: str, offset: int) -> TensorHasher:
        """Record tensor ``name`` from bytes handed over run by run
        (:class:`TensorHasher`), its data starting at ``offset`` of the file."""
        return TensorHasher(self, name, offset)

    def _record(self, sums: TensorChecksums) -> None:
        self._tensors[sums.name] = sums

    def finish(self, size: int) -> FileChecksums:
        """The file's checksums, once it is complete and ``size`` bytes long."""
        return FileChecksums(self.file, size, self.frame_size, dict(self._tensors))


class TensorHasher:
    """The frame checksums of one tensor's bytes, computed as its runs come
    (a frame may span runs); :meth:`finish` records them with the recorder
    it came from (:meth:`ChecksumRecorder.start`). Hash each run while it is
    in the CPU cache: right after it was read or before it is written."""

    def __init__(self, recorder: ChecksumRecorder, name: str, offset: int) -> None:
        self._recorder = recorder
        self._name = name
        self._offset = offset
        self._hasher = xxhash.xxh3_64()
        self._frames: list[int] = []
        self._filled = 0
        self._total = 0

    def update(self, run: bytes | bytearray | memoryview) -> None:
        """Hash the tensor's next bytes."""
        step = self._recorder.frame_size
        view = memoryview(run).cast("B")
        at = 0
        while at < len(view):
            take = min(step - self._filled, len(view) - at)
            if take == step:  # a whole frame in one piece: no hasher state
                self._frames.append(checksum(view[at : at + take]))
            else:
                self._hasher.update(view[at : at + take])
                self._filled += take
                if self._filled == step:
                    self._frames.append(self._hasher.intdigest())
                    self._hasher.reset()
                    self._filled = 0
            at += take
        self._total += len(view)

    def finish(self) -> None:
        """Record the tensor's checksums (its last frame may be shorter)."""
        if self._filled:
            self._frames.append(self._hasher.intdigest())
            self._hasher.reset()
            self._filled = 0
        step = self._recorder.frame_size
        self._recorder._record(TensorChecksums(self._name, self._offset, self._total, step, tuple(self._frames)))


def encode_sidecar(files: Sequence[FileChecksums]) -> bytes:
    """The sidecar document for ``files`` (deterministic JSON)."""
    doc: dict[str, Any] = {
        "format": _FORMAT,
        "version": _VERSION,
        "checksum": CHECKSUM,
        "files": {
            f.file: {
                "size": f.size,
                "frame_size": f.frame_size,
                "tensors": {
                    t.name: {"offset": t.offset, "length": t.length,
                             "checksums": "".join(f"{c:016x}" for c in t.checksums)}
                    for t in f.tensors.values()
                },
            }
            for f in files
        },
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def decode_sidecar(raw: bytes, where: str) -> dict[str, FileChecksums]:
    """Parse a sidecar document: ``{file name: its checksums}``.

    Raises:
        CheckpointCorruptError: Not a valid sidecar (named by ``where``), or
            one of a newer format version.
    """
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
            raise ValueError("not a dcp_ext checksum sidecar")
        if doc.get("version") != _VERSION:
            raise ValueError(f"format version {doc.get('version')!r} is not {_VERSION}: upgrade dcp_ext")
        if doc.get("checksum") != CHECKSUM:
            raise ValueError(f"unknown checksum {doc.get('checksum')!r}")
        files: dict[str, FileChecksums] = {}
        for file, entry in doc["files"].items():
            frame_size = int(entry["frame_size"])
            if frame_size <= 0:
                raise ValueError(f"{file}: frame_size {frame_size}")
            tensors: dict[str, TensorChecksums] = {}
            for name, t in entry["tensors"].items():
                offset, length, text = int(t["offset"]), int(t["length"]), str(t["checksums"])
                frames = -(-length // frame_size)
                if offset < 0 or length < 0 or len(text) != frames * _HEX:
                    raise ValueError(f"{file}: tensor {name!r} has {len(text) // _HEX} checksums "
                                     f"for {length} bytes in frames of {frame_size}")
                sums = tuple(int(text[i : i + _HEX], 16) for i in range(0, len(text), _HEX))
                tensors[str(name)] = TensorChecksums(str(name), offset, length, frame_size, sums)
            files[str(file)] = FileChecksums(str(file), int(entry["size"]), frame_size, tensors)
        return files
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as err:
        # OverflowError: Infinity in an int field; RecursionError: deeply nested brackets.
        raise CheckpointCorruptError(f"{where} is not a valid checksum sidecar: {err}", where) from err


def read_checksums(store: Store, file: str | None) -> dict[str, FileChecksums]:
    """The recorded checksums of a full checkpoint, ``{}`` where it has none.

    Args:
        store: The directory holding the checkpoint's file(s).
        file: The single file's name, or ``None`` for a folder (its
            :data:`FOLDER_SIDECAR`).

    Raises:
        CheckpointCorruptError: The sidecar is damaged.
    """
    name = FOLDER_SIDECAR if file is None else sidecar_name(file)
    try:
        raw = store.read_file(name)
    except CheckpointNotFoundError:
        return {}
    return decode_sidecar(raw, store.describe(name))


def check_file_size(recorded: FileChecksums, actual: int, where: str) -> None:
    """Refuse a file whose size differs from the one its checksums were recorded for.

    Raises:
        CheckpointCorruptError: Naming the file and both sizes.
    """
    if actual < recorded.size:
        raise CheckpointCorruptError(
            f"{where} is {actual} bytes, shorter than the {recorded.size} bytes written: it was truncated",
            where,
        )
    if actual > recorded.size:
        raise CheckpointCorruptError(
            f"{where} is {actual} bytes but its checksums were recorded for {recorded.size} bytes: it was "
            f"replaced or appended to after it was written (delete its {SIDECAR_SUFFIX} / {FOLDER_SIDECAR} "
            f"sidecar only if the new file is trusted)",
            where,
        )
