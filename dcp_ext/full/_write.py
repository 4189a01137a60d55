"""Full checkpoints: the whole model in one file, written tensor by tensor.

Two formats, both streamed so that no process ever holds the whole model:

* ``"safetensors"`` (default): the header is built from dtypes and shapes
  alone, written first, then each tensor's bytes follow in order.
* ``"torch"``: a ``torch.save`` archive of a ``{name: tensor}`` dict. Its
  archive structure comes from ``torch.save`` run under
  ``torch.serialization.skip_data`` on unallocated tensors of the same dtypes
  and shapes; each tensor's bytes are then streamed into its record.

Sources are pluggable: a callable returns each tensor in full when asked, so
the same writer serves a sharded model (one all-gather per tensor, see
:func:`save_full`), a model in memory, and a partial checkpoint on storage
(one ranged read per tensor, :mod:`dcp_ext.full._export`).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.serialization import skip_data

from .._runtime import GroupView
from ..errors import CheckpointExistsError, DcpExtError
from ..format import HoleRecorder, build_header, tensor_bytes
from ..layout import user_content_name
from ..storage import ObjectWriter, Store
from ._checksums import ChecksumRecorder, encode_sidecar, sidecar_name

__all__ = [
    "CREATED_KEY", "FULL_FORMATS", "FullTensorSpec", "full_layout", "stream_full_checkpoint", "commit_with_checksums",
    "save_full",
]

FULL_FORMATS = ("safetensors", "torch")
# Safetensors header metadata: when the file was written (Unix time, fixed
# width so every rank computes a header of the same length). ``format: pt``
# is the Hugging Face convention for PyTorch weights.
CREATED_KEY = "dcp_ext.created"


@dataclass(frozen=True)
class FullTensorSpec:
    """A tensor of a full checkpoint: its key, dtype and full shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for s in self.shape:
            numel *= s
        return numel * self.dtype.itemsize


@dataclass(frozen=True)
class FullLayout:
    """How to stream a full checkpoint.

    Attributes:
        segments: Bytes to write before each tensor, and (last) after all.
        order: Index into the specs of the tensor that follows each segment.
    """

    segments: tuple[bytes, ...]
    order: tuple[int, ...]

    def total_bytes(self, specs: Sequence[FullTensorSpec]) -> int:
        return sum(len(s) for s in self.segments) + sum(specs[i].nbytes for i in self.order)


def full_layout(specs: Sequence[FullTensorSpec], fmt: str, metadata: dict[str, str] | None = None) -> FullLayout:
    """Compute the byte layout of a full checkpoint in format ``fmt``.

    Raises:
        ValueError: Unknown format.
        TypeError: A dtype the format cannot hold.
    """
    if fmt == "safetensors":
        stamped = {"format": "pt", CREATED_KEY: f"{time.time():014.3f}", **(metadata or {})}
        header, _ = build_header(((s.name, s.dtype, s.shape) for s in specs), metadata=stamped)
        order = tuple(range(len(specs)))
        return FullLayout((header,) + (b"",) * len(specs), order)
    if fmt == "torch":
        return _torch_layout(specs)
    raise ValueError(f"unknown full checkpoint format {fmt!r}; use one of {FULL_FORMATS}")


def _torch_layout(specs: Sequence[FullTensorSpec]) -> FullLayout:
    # Unallocated templates: torch.empty does not touch its pages.
    templates = {s.name: torch.empty(s.shape, dtype=s.dtype) for s in specs}
    recorder = HoleRecorder()
    with skip_data():
        torch.save(templates, recorder)  # type: ignore[arg-type]
    del templates
    order: list[int] = []
    # Each data region follows the zip local header of its record,
    # ``archive/data/<key>``; keys number the storages in pickling order,
    # which is the dict's order. Checked against the region sizes.
    for index, segment in enumerate(recorder.segments[:-1]):
        data = bytes(segment)
        at = data.rfind(b"PK\x03\x04")
        if at < 0:
            raise RuntimeError("unexpected torch.save layout: no record header before a data region")
        (name_length,) = struct.unpack("<H", data[at + 26 : at + 28])
        record = data[at + 30 : at + 30 + name_length].decode()
        key = int(record.rsplit("/", 1)[1])
        if key >= len(specs) or specs[key].nbytes != recorder.hole_sizes[index]:
            raise RuntimeError(f"unexpected torch.save layout: record {record} does not match tensor order")
        order.append(key)
    expected = [i for i, s in enumerate(specs) if s.nbytes > 0]
    if sorted(order) != expected:
        raise RuntimeError("unexpected torch.save layout: data records do not cover every tensor")
    return FullLayout(tuple(bytes(s) for s in recorder.segments), tuple(order))


def stream_full_checkpoint(
    writer: ObjectWriter | None,
    specs: Sequence[FullTensorSpec],
    layout: FullLayout,
    fetch: Callable[[int], torch.Tensor | None],
    recorder: ChecksumRecorder | None = None,
) -> int:
    """Write a full checkpoint, one tensor in memory at a time.

    Args:
        writer: Where the bytes go; ``None`` on ranks that only take part in
            the collectives ``fetch`` may run (they must call this too, with
            the same specs and layout, so that every rank fetches in the same
            order).
        specs: The tensors, in file order.
        layout: From :func:`full_layout`.
        fetch: Returns tensor ``i`` in full (any device); called once per
            tensor with data, in the layout's order. May return ``None`` on
            ranks without a writer.

    Raises:
        ValueError: A fetched tensor's dtype or shape differs from its spec.
    """
    position = 0
    if writer is not None:
        writer.write(layout.segments[0])
        position = len(layout.segments[0])
    for segment, index in zip(layout.segments[1:], layout.order):
        tensor = fetch(index)
        if writer is not None:
            spec = specs[index]
            if tensor is None or tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
                got = None if tensor is None else (tensor.dtype, tuple(tensor.shape))
                raise ValueError(f"tensor {spec.name!r}: expected {spec.dtype} {spec.shape}, got {got}")
            data = tensor.detach().to("cpu").contiguous()
            raw = tensor_bytes(data)
            if recorder is not None:
                recorder.add(spec.name, position, raw)
            writer.write(raw)
            position += len(raw)
            del data, raw
            writer.write(segment)
            position += len(segment)
        del tensor
    # Tensors with no data (0 elements) have no region: nothing to fetch.
    return position


def commit_with_checksums(store: Store, name: str, writer: ObjectWriter, recorder: ChecksumRecorder, size: int) -> None:
    """Commit the full checkpoint ``store/name`` and then its checksum sidecar.

    The old sidecar (of a file being overwritten) goes first, so that no
    sidecar ever describes bytes other than the file's: a crash before the
    new one is written leaves a file that loads unverified.
    """
    sidecar = sidecar_name(name)
    if store.exists(sidecar):
        store.delete(sidecar)
    writer.commit()
    store.write_file(sidecar, encode_sidecar([recorder.finish(size)]))


def spec_of(name: str, value: Any) -> FullTensorSpec:
    """The full-tensor spec of a tensor or DTensor (whose ``shape`` is global)."""
    return FullTensorSpec(name, value.dtype, tuple(int(s) for s in value.shape))


def save_full(
    group: GroupView,
    store: Store,
    name: str,
    state: dict[str, Any],
    *,
    fmt: str = "safetensors",
    user_content: bytes | None = None,
    overwrite: bool = False,
    frame_size: int = 1 << 20,
) -> None:
    """(all ranks) Write ``state``'s tensors as one full checkpoint ``store/name``.

    Every rank gathers each sharded tensor (``DTensor.full_tensor()``, a
    collective) in file order; the coordinator streams it out, so no rank
    holds more than one full tensor. The file appears only when complete.

    Args:
        group: The ranks that hold ``state``.
        store: The root the file goes to.
        name: The file's name (the tag).
        state: Flat ``{key: tensor or DTensor}`` (other values are skipped).
        fmt: ``"safetensors"`` or ``"torch"``.
        user_content: Encoded user content, stored as ``user_content_{name}``.
        overwrite: Replace an existing file.
        frame_size: Bytes per checksummed frame (see :mod:`dcp_ext.full._checksums`).

    Raises:
        CheckpointExistsError: The file exists and ``overwrite`` is off (every rank).
        DcpExtError: Writing failed on the coordinator (every rank).
    """
    if fmt not in FULL_FORMATS:
        raise ValueError(f"unknown full_format {fmt!r}; use one of {FULL_FORMATS}")
    tensors = [(k, v) for k, v in state.items() if isinstance(v, torch.Tensor)]
    specs = [spec_of(k, v) for k, v in tensors]

    def refuse_existing() -> None:
        if not overwrite and store.exists(name):
            raise CheckpointExistsError(
                f"Checkpoint already exists: the full checkpoint {store.describe(name)}; pass overwrite=True", store.describe(name)
            )

    group.run_on_coordinator(refuse_existing)
    layout = full_layout(specs, fmt)
    coordinator = group.is_coordinator
    writer = None
    if coordinator:
        store.ensure_root()
        writer = store.open_writer(name, size_hint=layout.total_bytes(specs))

    def fetch(index: int) -> torch.Tensor | None:
        value = tensors[index][1]
        whole = value.full_tensor() if hasattr(value, "full_tensor") else value
        return whole if coordinator else None

    recorder = ChecksumRecorder(name, frame_size)
    failure: BaseException | None = None
    try:
        size = stream_full_checkpoint(writer, specs, layout, fetch, recorder)
        if writer is not None:
            if user_content is not None:
                store.write_file(user_content_name(name), user_content)
            commit_with_checksums(store, name, writer, recorder, size)
    except BaseException as err:
        failure = err
        if writer is not None:
            writer.abort()
    # Every rank took part in every gather; now all learn the coordinator's outcome.
    message = group.broadcast(None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    if message is not None:
        raise DcpExtError(f"saving full checkpoint {store.describe(name)} failed on the coordinator: {message}")
