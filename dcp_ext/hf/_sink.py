"""(writer ranks of a Hugging Face export) Stream tensors into this rank's safetensors files.

Each file: its header (built from dtypes and shapes alone), then every
tensor's bytes in order, their frame checksums recorded on the way
(:mod:`dcp_ext.full._checksums`); committed when its last tensor is in, so it
appears complete or not at all. The first error stops all writing on the
rank and is kept, with the file and tensor it hit, for the outcome every
rank shares (:mod:`dcp_ext.hf._export`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from .._runtime import crash_point, fail_point
from ..errors import DcpExtError
from ..format import build_header, tensor_bytes
from ..full import ChecksumRecorder, FileChecksums
from ..storage import ObjectWriter, Store
from ._layout import HFFile, HFTensor

__all__ = ["Assembled", "FileSink", "Failure", "Outcome", "HEADER_METADATA"]

log = logging.getLogger("dcp_ext.hf_export")

#: Safetensors metadata transformers expects ("pt": PyTorch weights).
HEADER_METADATA = {"format": "pt"}


@dataclass(frozen=True)
class Failure:
    """A rank's first error, as every rank re-raises it."""

    rank: int
    file: str
    tensor: str | None
    kind: type[BaseException]
    message: str
    path: str

    def error(self) -> DcpExtError:
        what = f"{self.file}, tensor {self.tensor!r}" if self.tensor is not None else self.file
        text = f"Hugging Face export failed on rank {self.rank} writing {what}: {self.message}"
        kind = self.kind if issubclass(self.kind, DcpExtError) else DcpExtError
        try:
            return kind(text, self.path)
        except Exception:  # noqa: BLE001 - a subclass with another signature
            return DcpExtError(text, self.path)


@dataclass(frozen=True)
class Outcome:
    """One rank's result, shared with every rank."""

    failure: Failure | None
    files: tuple[str, ...]
    bytes_written: int
    checksums: tuple[FileChecksums, ...]


@dataclass(frozen=True)
class Assembled:
    """A tensor whose writer holds some row blocks in its own shard: those
    bytes are written from there, the rest from ``whole`` (the 256 MiB copy
    per rank of a 1 GiB two-rank export it saves was a fifth of the export).

    Attributes:
        whole: The full tensor's buffer; its bytes at the ``own`` ranges are not used.
        own: ``(byte offset in the tensor, contiguous local block)``, by offset.
    """

    whole: torch.Tensor
    own: tuple[tuple[int, torch.Tensor], ...]

    def runs(self) -> list[memoryview]:
        """The tensor's bytes in order, as runs of ``whole`` and of the own blocks."""
        data = tensor_bytes(self.whole)
        out: list[memoryview] = []
        at = 0
        for start, block in self.own:
            if start > at:
                out.append(data[at:start])
            own = tensor_bytes(block)
            out.append(own)
            at = start + len(own)
        if at < len(data):
            out.append(data[at:])
        return out


class FileSink:
    """(writer ranks) Streams tensors into this rank's files, one file open at a time.

    The first error stops all writing on this rank (the open file is
    aborted); it is kept as :attr:`failure` for the outcome exchange. Two
    threads may call it (the one that writes, and the one that exchanges or
    reads the next tensors and may :meth:`fail`): each call holds one lock.
    """

    def __init__(self, store: Store, rank: int, files: Sequence[HFFile], tensors: Sequence[HFTensor],
                 frame_size: int) -> None:
        self.store = store
        self.rank = rank
        self.files = files
        self.tensors = tensors
        self.frame_size = frame_size
        self.failure: Failure | None = None
        self.cause: BaseException | None = None  # the original error of :attr:`failure`
        self.written: list[str] = []
        self.bytes_written = 0
        self.streamed_bytes = 0  # tensor bytes written by put_stream
        self.checksums: list[FileChecksums] = []
        self._writer: ObjectWriter | None = None
        self._file = -1
        self._offsets: dict[int, int] = {}
        self._recorder: ChecksumRecorder | None = None
        self._size = 0
        self._lock = threading.RLock()

    def fail(self, file: int, tensor: int | None, err: BaseException) -> None:
        with self._lock:
            if self.failure is None:
                self.cause = err
                name = self.files[file].name
                self.failure = Failure(
                    self.rank, name, None if tensor is None else self.tensors[tensor].name, type(err),
                    f"{type(err).__name__}: {err}", self.store.describe(name),
                )
                log.debug("rank %d failed on %s", self.rank, name, exc_info=err)
            self.abort()

    def open(self, file: int) -> None:
        """Start file ``file``: write its header."""
        with self._lock:
            if self.failure is not None:
                return
            try:
                spec = self.files[file]
                header, entries = build_header(
                    ((self.tensors[i].name, self.tensors[i].dtype, self.tensors[i].shape) for i in spec.tensors),
                    metadata=HEADER_METADATA,
                )
                self._file = file
                self._offsets = {i: len(header) + e.begin for i, e in zip(spec.tensors, entries)}
                self._size = len(header) + spec.nbytes
                self._recorder = ChecksumRecorder(file=spec.name, frame_size=self.frame_size)
                self._writer = self.store.open_writer(spec.name, size_hint=self._size)
                self._writer.write(header)
            except Exception as err:  # noqa: BLE001 - shared with every rank
                self.fail(file, None, err)

    def put(self, file: int, index: int, tensor: torch.Tensor | Assembled) -> None:
        """Write tensor ``index`` (contiguous, CPU, its stored dtype and shape) of file ``file``."""
        with self._lock:
            if self.failure is not None:
                return
            try:
                spec = self.tensors[index]
                whole = tensor.whole if isinstance(tensor, Assembled) else tensor
                if whole.dtype != spec.dtype or tuple(whole.shape) != spec.shape:
                    raise ValueError(f"expected {spec.dtype} {list(spec.shape)}, got {whole.dtype} {list(whole.shape)}")
                runs = tensor.runs() if isinstance(tensor, Assembled) else [tensor_bytes(tensor)]
                assert self._writer is not None and self._recorder is not None
                self._recorder.add(spec.name, self._offsets[index], runs)
                for run in runs:
                    self._writer.write(run)
                crash_point("mid_hf_file")
                fail_point("mid_hf_export")
            except Exception as err:  # noqa: BLE001 - shared with every rank
                self.fail(file, index, err)

    def put_stream(self, file: int, index: int, runs: Iterable[memoryview]) -> None:
        """Write tensor ``index`` of file ``file`` from ``runs``, its bytes in
        order, each hashed and written as it comes (a run may be a reused
        buffer: it is done with before the next is asked for). An error from
        ``runs`` (a damaged source frame) fails the export like any other."""
        with self._lock:
            if self.failure is not None:
                return
            try:
                spec = self.tensors[index]
                assert self._writer is not None and self._recorder is not None
                hasher = self._recorder.start(spec.name, self._offsets[index])
                written = 0
                for run in runs:
                    hasher.update(run)
                    self._writer.write(run)
                    written += run.nbytes
                if written != spec.nbytes:
                    raise ValueError(f"expected {spec.nbytes} bytes of {spec.dtype} {list(spec.shape)}, got {written}")
                hasher.finish()
                self.streamed_bytes += written
                crash_point("mid_hf_file")
                fail_point("mid_hf_export")
            except Exception as err:  # noqa: BLE001 - shared with every rank
                self.fail(file, index, err)

    def close(self, file: int) -> None:
        """Commit file ``file``."""
        with self._lock:
            if self.failure is not None or self._writer is None:
                return
            name = self.files[file].name
            try:
                self._writer.commit()
                self._writer = None
                self.written.append(name)
                self.bytes_written += self._size
                assert self._recorder is not None
                self.checksums.append(self._recorder.finish(size=self._size))
            except Exception as err:  # noqa: BLE001 - shared with every rank
                self.fail(file, None, err)

    def abort(self) -> None:
        with self._lock:
            if self._writer is not None:
                writer, self._writer = self._writer, None
                try:
                    writer.abort()
                except Exception as err:  # noqa: BLE001 - a temporary name is never read
                    log.warning("could not abort %s: %s", writer.name, err)

    def outcome(self) -> Outcome:
        return Outcome(self.failure, tuple(self.written), self.bytes_written, tuple(self.checksums))
