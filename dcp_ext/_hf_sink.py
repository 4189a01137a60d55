"""(writer ranks of a Hugging Face export) Stream tensors into this rank's safetensors files.

Each file: its header (built from dtypes and shapes alone), then every
tensor's bytes in order, their frame checksums recorded on the way
(:mod:`dcp_ext.full_checksums`); committed when its last tensor is in, so it
appears complete or not at all. The first error stops all writing on the
rank and is kept, with the file and tensor it hit, for the outcome every
rank shares (:mod:`dcp_ext.hf_export`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ._failpoints import fail_point
from ._safetensors import build_header
from ._torch_format import tensor_bytes
from .errors import DcpExtError
from .full_checksums import ChecksumRecorder, FileChecksums
from .hf_layout import HFFile, HFTensor
from .storage import ObjectWriter, Store

__all__ = ["FileSink", "Failure", "Outcome", "HEADER_METADATA"]

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


class FileSink:
    """(writer ranks) Streams tensors into this rank's files, one file open at a time.

    The first error stops all writing on this rank (the open file is
    aborted); it is kept as :attr:`failure` for the outcome exchange.
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
        self.checksums: list[FileChecksums] = []
        self._writer: ObjectWriter | None = None
        self._file = -1
        self._offsets: dict[int, int] = {}
        self._recorder: ChecksumRecorder | None = None
        self._size = 0

    def fail(self, file: int, tensor: int | None, err: BaseException) -> None:
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

    def put(self, file: int, index: int, tensor: torch.Tensor) -> None:
        """Write tensor ``index`` (contiguous, CPU, its stored dtype and shape) of file ``file``."""
        if self.failure is not None:
            return
        try:
            spec = self.tensors[index]
            if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
                raise ValueError(f"expected {spec.dtype} {list(spec.shape)}, got {tensor.dtype} {list(tensor.shape)}")
            data = tensor_bytes(tensor)
            assert self._writer is not None and self._recorder is not None
            self._recorder.add(spec.name, self._offsets[index], data)
            self._writer.write(data)
            fail_point("mid_hf_export")
        except Exception as err:  # noqa: BLE001 - shared with every rank
            self.fail(file, index, err)

    def close(self, file: int) -> None:
        """Commit file ``file``."""
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
        if self._writer is not None:
            writer, self._writer = self._writer, None
            try:
                writer.abort()
            except Exception as err:  # noqa: BLE001 - a temporary name is never read
                log.warning("could not abort %s: %s", writer.name, err)

    def outcome(self) -> Outcome:
        return Outcome(self.failure, tuple(self.written), self.bytes_written, tuple(self.checksums))
