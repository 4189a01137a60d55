"""Reading a ``torch.save`` file (a zip archive) without unpickling its tensors: where each tensor's bytes lie.

Used by :func:`dcp_ext.load_pretrained` for ``pytorch_model.bin`` style
checkpoints. The archive's directory is checked against the file's size,
and ``data.pkl`` is walked by a restricted unpickler that admits torch's
tensor-rebuilding functions only (and builds nothing): every size the file
claims is checked before anything of that size is allocated (issue 32,
finding 6).
"""

from __future__ import annotations

import io
import pickle
import struct
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointCorruptError
from ..storage import Piece, Store, plan_requests

__all__ = ["StoredTensor", "torch_save_tensors", "numel", "MAX_PICKLE_BYTES"]


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's raw bytes lie in a full checkpoint file."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the raw data in ``file``


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# -- torch.save files without unpickling -------------------------------------------
@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: torch.dtype


@dataclass(frozen=True)
class StoredTensorRef:
    storage: _StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor(storage: _StorageRef, storage_offset: int, size: Any, stride: Any, *rest: Any) -> StoredTensorRef:
    if not isinstance(storage, _StorageRef):
        raise ValueError(f"a tensor is rebuilt from {type(storage).__name__}, not a storage record")
    return StoredTensorRef(storage, int(storage_offset), tuple(int(s) for s in size), tuple(int(s) for s in stride))


def _rebuild_parameter(data: StoredTensorRef, *rest: Any) -> StoredTensorRef:
    if not isinstance(data, StoredTensorRef):
        raise ValueError(f"a parameter is rebuilt from {type(data).__name__}, not a tensor")
    return data


# Legacy typed-storage class names in torch.save's data.pkl, and their dtypes.
_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool, "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}


class _PlainDict(dict):  # type: ignore[type-arg]
    """Stands in for OrderedDict; accepts the ``_metadata`` attribute state dicts carry."""


class _LayoutUnpickler(pickle.Unpickler):
    """Interprets ``data.pkl`` into tensor layouts; refuses everything else."""

    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor
        if module == "torch._utils" and name == "_rebuild_parameter":
            return _rebuild_parameter
        if module == "collections" and name == "OrderedDict":
            return _PlainDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                return value
        raise CheckpointCorruptError(
            f"{self.where} refers to {module}.{name}; only plain tensors in dicts can be "
            f"loaded from a torch.save file without unpickling code",
            self.where,
        )

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage"):
            raise CheckpointCorruptError(f"{self.where}: unexpected persistent id {pid!r}", self.where)
        dtype = pid[1]
        if not isinstance(dtype, torch.dtype):
            raise CheckpointCorruptError(f"{self.where}: storage of unknown type {dtype!r}", self.where)
        return _StorageRef(str(pid[2]), dtype)


#: Largest ``data.pkl`` read (the tensors' layout: a few hundred bytes per tensor).
MAX_PICKLE_BYTES = 1 << 30


def _zip_directory(store: Store, name: str) -> dict[str, tuple[int, int]]:
    """``{record name: (local header offset, size)}`` from the zip central directory.

    Every record is checked to lie inside the file before anything is read:
    the sizes in a zip directory are claims, and reading a claimed 3 GiB
    ``data.pkl`` from a 3.8 KB file would allocate 3 GiB before finding the
    file short (issue 32, finding 6).

    Raises:
        CheckpointCorruptError: Not a zip archive, or a record claims bytes
            beyond the end of the file (message: file, record, claim).
    """
    where = store.describe(name)
    size = store.size(name)
    tail_len = min(size, 65536 + 22)
    tail = store.read_range(name, size - tail_len, tail_len)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0:
        raise CheckpointCorruptError(f"{where} is not a zip archive (no end of central directory)", where)
    entries, cd_size, cd_offset = struct.unpack("<HII", tail[at + 10 : at + 20])
    if cd_offset == 0xFFFFFFFF or cd_size == 0xFFFFFFFF or entries == 0xFFFF:
        loc = tail.rfind(b"PK\x06\x07", 0, at)
        if loc < 0:
            raise CheckpointCorruptError(f"{where}: zip64 locator missing", where)
        (eocd64_offset,) = struct.unpack("<Q", tail[loc + 8 : loc + 16])
        if eocd64_offset + 56 > size:
            raise CheckpointCorruptError(f"{where}: its zip64 directory record lies outside the file", where)
        eocd64 = store.read_range(name, eocd64_offset, 56)
        cd_size, cd_offset = struct.unpack("<QQ", eocd64[40:56])
    if cd_offset + cd_size > size:
        raise CheckpointCorruptError(
            f"{where}: its zip directory ({cd_size} bytes at {cd_offset}) lies outside the file ({size} bytes)", where
        )
    directory = store.read_range(name, cd_offset, cd_size)
    records: dict[str, tuple[int, int]] = {}
    pos = 0
    while pos + 46 <= len(directory) and directory[pos : pos + 4] == b"PK\x01\x02":
        method, = struct.unpack("<H", directory[pos + 10 : pos + 12])
        csize, usize, n, e, c = struct.unpack("<IIHHH", directory[pos + 20 : pos + 34])
        (local,) = struct.unpack("<I", directory[pos + 42 : pos + 46])
        record = directory[pos + 46 : pos + 46 + n].decode(errors="replace")
        extra = directory[pos + 46 + n : pos + 46 + n + e]
        values = []
        x = 0
        while x + 4 <= len(extra):
            tag, length = struct.unpack("<HH", extra[x : x + 4])
            if tag == 1:
                values = [struct.unpack("<Q", extra[x + 4 + 8 * i : x + 12 + 8 * i])[0] for i in range(length // 8)]
            x += 4 + length
        it = iter(values)
        try:
            if usize == 0xFFFFFFFF:
                usize = next(it)
            if csize == 0xFFFFFFFF:
                csize = next(it)
            if local == 0xFFFFFFFF:
                local = next(it)
        except StopIteration:
            raise CheckpointCorruptError(f"{where}: record {record}'s zip64 sizes are missing", where) from None
        if method != 0:
            raise CheckpointCorruptError(f"{where}: record {record} is compressed; torch.save files are not", where)
        # 30 bytes of local header come first; the data cannot end past the file.
        if local + 30 + usize > size:
            raise CheckpointCorruptError(
                f"{where}: zip record {record} claims {usize} bytes at offset {local}, past the end of the file "
                f"({size} bytes); the file is truncated or damaged",
                where,
            )
        records[record] = (int(local), int(usize))
        pos += 46 + n + e + c
    return records


def torch_save_tensors(store: Store, name: str) -> dict[str, StoredTensor]:
    where = store.describe(name)
    try:
        records = _zip_directory(store, name)
    except struct.error as err:  # a record cut short
        raise CheckpointCorruptError(f"{where}: its zip directory is damaged ({err})", where) from err
    pkl = [r for r in records if r.endswith("/data.pkl")]
    if len(pkl) != 1:
        raise CheckpointCorruptError(f"{where} is not a torch.save archive (no data.pkl)", where)
    prefix = pkl[0][: -len("data.pkl")]
    # Local headers: 30 fixed bytes, then name and extra field of their own lengths.
    headers = {r: bytearray(30) for r in records}
    store.read(plan_requests(
        [Piece(name, records[r][0], memoryview(headers[r])) for r in records], gap=4096, max_request=1 << 24,
    ))

    def data_offset(record: str) -> int:
        head = headers[record]
        if head[:4] != b"PK\x03\x04":
            raise CheckpointCorruptError(f"{where}: bad local header for {record}", where)
        n, e = struct.unpack("<HH", head[26:30])
        return int(records[record][0] + 30 + n + e)

    # Its claimed size is at most the file's (checked in _zip_directory).
    length = records[pkl[0]][1]
    if length > MAX_PICKLE_BYTES:
        raise CheckpointCorruptError(
            f"{where}: its {pkl[0]} claims {length} bytes; dcp_ext reads tensor layouts of at most "
            f"{MAX_PICKLE_BYTES} bytes",
            where,
        )
    pickled = store.read_range(name, data_offset(pkl[0]), length)
    try:
        obj = _LayoutUnpickler(pickled, where).load()
    except CheckpointCorruptError:
        raise
    except Exception as err:
        raise CheckpointCorruptError(f"{where}: cannot read data.pkl ({err})", where) from err
    flat: dict[str, StoredTensorRef] = {}
    # Iterative, not recursive: a hostile data.pkl nests dicts as deep as it likes.
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, StoredTensorRef):
            flat[path] = node
        elif isinstance(node, dict):
            stack.extend((v, f"{path}.{k}" if path else str(k)) for k, v in reversed(list(node.items())))
        # other plain values (ints, strings) are not tensors: not loaded here
    tensors: dict[str, StoredTensor] = {}
    for key, ref in flat.items():
        if len(ref.shape) != len(ref.stride) or min((*ref.shape, ref.offset, 0)) < 0 \
                or max((*ref.shape, ref.offset, 0)) >= 1 << 63:
            raise CheckpointCorruptError(
                f"{where}: tensor {key!r} has an impossible layout (size {ref.shape[:8]}, stride {ref.stride[:8]}, "
                f"storage offset {ref.offset})",
                where,
            )
        expected = 1
        for size, stride in zip(reversed(ref.shape), reversed(ref.stride)):
            if size != 1 and stride != expected:
                raise CheckpointCorruptError(
                    f"{where}: tensor {key!r} is stored non-contiguously (stride {ref.stride}); "
                    f"re-save it with .contiguous()",
                    where,
                )
            expected *= size
        record = f"{prefix}data/{ref.storage.key}"
        if record not in records:
            raise CheckpointCorruptError(f"{where}: tensor {key!r} refers to missing record {record}", where)
        nbytes = numel(ref.shape) * ref.storage.dtype.itemsize
        start = ref.offset * ref.storage.dtype.itemsize
        if start + nbytes > records[record][1]:
            raise CheckpointCorruptError(f"{where}: tensor {key!r} lies outside its storage record", where)
        tensors[key] = StoredTensor(name, ref.storage.dtype, ref.shape, data_offset(record) + start)
    return tensors
