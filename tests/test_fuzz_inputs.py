"""Fuzz: every malformed file dcp_ext reads gives a typed error or a correct
load, never another exception (issue 32, "typed errors everywhere").

A seeded mutator (:mod:`tests.support.json_mutator`) edits real files:
metadata documents (versions 2, 3, compressed, incremental version 4; the
document's fields, its chunk table's integers and its raw bytes), data files'
frame indexes (versions 1 and 2, with the document's digest of them and
their own trailer recomputed so parsing goes past the checksums),
``partition.json`` records, safetensors headers and Hugging Face indexes,
and torch's pickled ``.metadata`` (:mod:`tests.support.pickle_mutator`: its
objects edited, or its bytes flipped or cut). Each mutated file is re-signed
where the format has a checksum, as a deliberate edit would be, then read
the way users read it. An exception
that is not a :class:`~dcp_ext.errors.DcpExtError`, or a load that returns
values other than the saved ones, is a failure; all are collected and shown
with the edit that caused them. Fixed seeds: the same cases every run.
"""

from __future__ import annotations

import base64
import functools
import json
import pickle
import random
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
import zstandard
from torch import nn

import dcp_ext
from dcp_ext.format import parse_header
from dcp_ext.config import IOConfig
from dcp_ext.errors import DcpExtError
from dcp_ext.dcp_io import read_hf_index
from dcp_ext.layout import Partition
from dcp_ext.metadata import METADATA_FILE, decode_metadata, seal
from dcp_ext.storage import open_store
from dcp_ext.whole_state import load_whole
from tests.support.compare import state_diff
from tests.support.hostile_files import safetensors_bytes
from tests.support.json_mutator import dump, flip_bytes, mutate_tree, resign
from tests.support.pickle_mutator import mutate_object
from tests.support.torch_checkpoints import STATE as TORCH_STATE
from tests.support.torch_checkpoints import read_metadata, template, write_chunked

STATE = {
    "a": torch.arange(96, dtype=torch.float32).reshape(12, 8),
    "b": torch.arange(10, dtype=torch.int64),
    "c": torch.linspace(-1, 1, 16).to(torch.bfloat16).reshape(4, 4),
    "d": torch.linspace(0, 1, 3000),  # 3 frames of 4 KiB in the incremental checkpoint
}


class Failures:
    """Collects what broke the rule, with the edit that caused it."""

    def __init__(self) -> None:
        self.found: list[str] = []
        self.outcomes: dict[str, int] = {}
        #: Outcomes with the error type (``typed:CheckpointCorruptError``).
        self.kinds: dict[str, int] = {}

    def run(self, what: str, edits: list[str], attempt: Callable[[], str]) -> None:
        try:
            outcome = attempt()
        except DcpExtError as err:
            outcome = f"typed:{type(err).__name__}"
        except Exception as err:  # noqa: BLE001 - exactly what this test looks for
            self.found.append(f"{what} {edits}: {type(err).__name__}: {str(err)[:300]}")
            return
        if outcome.startswith("WRONG"):
            self.found.append(f"{what} {edits}: {outcome}")
        self.outcomes[outcome.split(":")[0]] = self.outcomes.get(outcome.split(":")[0], 0) + 1
        self.kinds[outcome] = self.kinds.get(outcome, 0) + 1


def _load(path: Path) -> str:
    """Load ``path`` into fresh tensors shaped like STATE: "loaded", or WRONG values."""
    target = {k: torch.zeros_like(v) for k, v in STATE.items()}
    dcp_ext.load(target, path)
    wrong = [k for k, v in STATE.items() if not torch.equal(target[k], v)]
    return f"WRONG values for {wrong}" if wrong else "loaded"


def _checkpoints(tmp_path: Path) -> dict[str, Path]:
    """Checkpoints of every metadata flavour, holding STATE."""
    out = {}
    for name, kwargs in {"v3": {}, "v3-zstd": {"compression": "zstd"},
                         "v2": {"config": IOConfig(metadata_version=2)}}.items():
        out[name] = tmp_path / name
        dcp_ext.save(STATE, out[name], **kwargs)  # type: ignore[arg-type]
    # Version 4: an incremental save whose frames refer to an earlier one's file.
    root = tmp_path / "incremental"
    manager = dcp_ext.CheckpointManager(root, config=IOConfig(frame_size=4096), incremental=True)
    model = nn.ParameterDict({k: nn.Parameter(v.float().clone(), requires_grad=False) for k, v in STATE.items()})
    with torch.no_grad():
        model["d"][:10] += 1  # s0 differs from STATE in d's first frame only
    manager.save("s0", model)
    with torch.no_grad():
        model["d"][:10] = STATE["d"][:10]
    manager.save("s1", model)  # writes that frame, refers to s0 for the rest
    out["v4"] = root / "s1_partial"
    return out


def _load_v4(path: Path) -> str:
    """Load the incremental checkpoint (model. keys, float32 values)."""
    target = {f"model.{k}": torch.zeros(v.shape) for k, v in STATE.items()}
    dcp_ext.load(target, path)
    wrong = [k for k, v in STATE.items() if not torch.equal(target[f"model.{k}"], v.float())]
    return f"WRONG values for {wrong}" if wrong else "loaded"


def _table_edit(doc: dict[str, Any], rng: random.Random) -> list[str]:
    """Set one integer of a version-3 chunk table to a hostile value (and re-encode it)."""
    packed = base64.b64decode(doc["chunk_table"])
    raw = (zstandard.ZstdDecompressor().decompress(packed, max_output_size=doc["chunk_table_bytes"])
           if doc["chunk_table_codec"] == "zstd" else zlib.decompress(packed))
    table = np.frombuffer(raw, dtype="<i8").copy()
    at = rng.randrange(len(table))
    table[at] = rng.choice([-1, -(2**63), 2**63 - 1, 2**40, 0, 7, int(table[at]) + 1])
    doc["chunk_table"] = base64.b64encode(zstandard.ZstdCompressor().compress(table.tobytes())).decode()
    doc["chunk_table_codec"] = "zstd"
    return [f"chunk table integer {at} = {table[at]}"]


def test_fuzz_metadata_documents(tmp_path: Path) -> None:
    failures = Failures()
    checkpoints = _checkpoints(tmp_path)
    rng = random.Random(20261127)
    for name, path in checkpoints.items():
        meta = path / METADATA_FILE
        original = meta.read_bytes()
        doc = json.loads(original)
        load = _load_v4 if name == "v4" else _load
        for trial in range(90):
            kind = trial % 3
            if kind == 0 or "chunk_table" not in doc and kind == 1:
                mutated, edits = mutate_tree(doc, rng, edits=rng.choice([1, 1, 2, 3]), fixed_length=_codec_chain)
                data = resign(_sealed(mutated) if isinstance(mutated, dict) else dump(mutated))
            elif kind == 1:
                edited = json.loads(original)
                edits = _table_edit(edited, rng)
                data = seal(edited)
            else:
                data, edits = flip_bytes(original, rng, rng.choice([1, 2, 4]))
                data = resign(data)
            meta.write_bytes(data)
            failures.run(f"{name} metadata", edits, functools.partial(load, path))
            failures.run(f"{name} decode", edits, functools.partial(_decode, data, str(meta)))
        meta.write_bytes(original)
        assert load(path) == "loaded"
    print(failures.outcomes)
    assert failures.found == [], "\n".join(failures.found)
    assert failures.outcomes.get("loaded", 0) > 10 and sum(failures.outcomes.values()) >= 700


def _codec_chain(path: tuple[Any, ...]) -> bool:
    """An element of a codec chain: dropping a transform leaves a valid chain
    whose frames still match their checksums (those cover stored bytes), so a
    re-signed document may state it; the mutator replaces such elements only."""
    return "codecs" in path[:1] or "codec" in path


def _sealed(doc: dict[str, Any]) -> bytes:
    """``doc`` sealed like a real document, then its markers expanded (and re-signed)."""
    document = {k: v for k, v in doc.items() if k != "integrity"}
    document["integrity"] = "xxh3-64:" + "0" * 16
    return dump(document)


def _decode(data: bytes, where: str) -> str:
    decode_metadata(data, where)
    return "decoded"


def _frame_index_edit(index: bytes, rng: random.Random) -> tuple[bytes, list[str]]:
    """A damaged or hostile frame index (its own trailer recomputed half the time)."""
    body = index[:-8]
    op = rng.randrange(5)
    if op == 0:
        body, edits = flip_bytes(body, rng, rng.choice([1, 3]))
    elif op == 1:
        cut = rng.randrange(len(body))
        body, edits = body[:cut], [f"cut to {cut} bytes"]
    elif op == 2:
        extra = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        body, edits = body + extra, [f"{len(extra)} bytes appended"]
    elif op == 3:  # a header count: items (u32 at 8), frames (u64 at 12) or compressed frames (u64 at 20)
        at, fmt = rng.choice([(8, "<I"), (12, "<Q"), (20, "<Q")])
        value = rng.choice([0, 1, 2**31, 2**32 - 1] if fmt == "<I" else [0, 1, 2**40, 2**63, 2**64 - 1])
        body = body[:at] + struct.pack(fmt, value) + body[at + struct.calcsize(fmt):]
        edits = [f"header field at {at} = {value}"]
    else:  # version 2's table of referenced files (the JSON after the fixed sections)
        start = body.rfind(b"[")
        table = rng.choice([b'["../../../etc/passwd"]', b"[1]", b"{}", b"[" * 5000, b'["../s0_partial/a\\nb"]',
                            b'["../s0_partial/x.distcp"]', b"NaN", b"\xff\xfe"])
        if start < 0:
            body, edits = body + table, ["table appended"]
        else:
            body = body[:start - 4] + struct.pack("<I", len(table)) + table
            edits = [f"referenced files = {table[:30]!r}"]
    if rng.random() < 0.5:
        return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)), edits + ["trailer recomputed"]
    return body + index[-8:], edits


def test_fuzz_frame_indexes(tmp_path: Path) -> None:
    failures = Failures()
    checkpoints = _checkpoints(tmp_path)
    rng = random.Random(7)
    for name in ("v3", "v3-zstd", "v4"):
        path = checkpoints[name]
        meta = path / METADATA_FILE
        original_meta = meta.read_bytes()
        doc = json.loads(original_meta)
        load = _load_v4 if name == "v4" else _load
        for entry_index, entry in enumerate(doc["files"]):
            file_name, _, at, length, _ = entry
            data_file = path / file_name
            original = data_file.read_bytes()
            for _ in range(40):
                index, edits = _frame_index_edit(original[at : at + length], rng)
                data_file.write_bytes(original[:at] + index)
                edited = json.loads(original_meta)
                edited["files"][entry_index] = [file_name, at + len(index), at, len(index),
                                                f"{xxhash.xxh3_64_intdigest(index):016x}"]
                meta.write_bytes(seal(edited))
                failures.run(f"{name} frame index of {file_name}", edits, functools.partial(load, path))
            data_file.write_bytes(original)
        meta.write_bytes(original_meta)
        assert load(path) == "loaded"
    print(failures.outcomes)
    assert failures.found == [], "\n".join(failures.found)
    assert sum(failures.outcomes.values()) >= 120


def _partition(data: bytes) -> str:
    return type(Partition.from_json(data, "partition.json")).__name__


def _header(content: bytes, where: str) -> str:
    return type(parse_header(content, where, len(content))).__name__


def test_fuzz_partition_records(tmp_path: Path) -> None:
    """``Partition.from_json`` (dcp_ext/layout.py) must raise a DcpExtError or
    return a value for any record."""
    root = tmp_path / "root"
    dcp_ext.save_checkpoint(root, "t", nn.Linear(4, 4))
    original = (root / "t_partial" / "partition.json").read_bytes()
    assert isinstance(Partition.from_json(original, "partition.json"), Partition)
    doc = json.loads(original)
    failures = Failures()
    rng = random.Random(11)
    for trial in range(400):
        if trial % 4 == 3:
            data, edits = flip_bytes(original, rng, rng.choice([1, 3]))
        else:
            mutated, edits = mutate_tree(doc, rng, edits=rng.choice([1, 2, 3]))
            data = dump(mutated)
        failures.run("partition.json", edits, functools.partial(_partition, data))
    print(failures.outcomes)
    assert failures.found == [], "\n".join(failures.found)


_SAFETENSORS_HEADER = {
    "__metadata__": {"format": "pt"},
    "weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
    "bias": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]},
}
_WEIGHTS = torch.arange(6, dtype=torch.float32)


def _load_linear(path: Path) -> str:
    model = nn.Linear(2, 2)
    dcp_ext.load_pretrained(model, path)
    right = model.weight.flatten().tolist() == [0, 1, 2, 3] and model.bias.tolist() == [4, 5]
    return "loaded" if right else f"WRONG values {model.weight.tolist()} {model.bias.tolist()}"


def test_fuzz_safetensors_headers(tmp_path: Path) -> None:
    failures = Failures()
    rng = random.Random(3)
    path = tmp_path / "model.safetensors"
    data = _WEIGHTS.numpy().tobytes()
    valid = safetensors_bytes(_SAFETENSORS_HEADER, data)
    path.write_bytes(valid)
    assert _load_linear(path) == "loaded"
    # Bytes of the JSON header only: a file without a checksum sidecar has no
    # way to tell damaged data, or a length prefix moved within the header's
    # space padding (valid JSON, data shifted), from what was written.
    header_end = len(valid) - len(data)
    for trial in range(300):
        if trial % 5 == 4:
            raw, edits = flip_bytes(valid[8:header_end], rng, rng.choice([1, 2]))
            content = valid[:8] + raw + data
        else:
            header, edits = mutate_tree(_SAFETENSORS_HEADER, rng, edits=rng.choice([1, 1, 2]))
            content = safetensors_bytes(dump(header), data)
        path.write_bytes(content)
        failures.run("safetensors header", edits, functools.partial(_header, content, str(path)))
        failures.run("safetensors load", edits, lambda: _load_linear(path))
    print(failures.outcomes)
    assert failures.found == [], "\n".join(failures.found)


def test_fuzz_hf_indexes(tmp_path: Path) -> None:
    failures = Failures()
    rng = random.Random(5)
    folder = tmp_path / "hf"
    folder.mkdir()
    shard = "model-00001-of-00001.safetensors"
    (folder / shard).write_bytes(safetensors_bytes({k: v for k, v in _SAFETENSORS_HEADER.items()},
                                                   _WEIGHTS.numpy().tobytes()))
    index = {"metadata": {"total_size": 24}, "weight_map": {"weight": shard, "bias": shard}}
    index_path = folder / "model.safetensors.index.json"
    index_path.write_bytes(dump(index))
    assert _load_linear(folder) == "loaded"
    store = open_store(str(folder), IOConfig(), {})
    for trial in range(150):
        if trial % 5 == 4:
            data, edits = flip_bytes(dump(index), rng, rng.choice([1, 2]))
        else:
            mutated, edits = mutate_tree(index, rng, edits=rng.choice([1, 1, 2]))
            data = dump(mutated)
        index_path.write_bytes(data)
        failures.run("HF index", edits, lambda: type(read_hf_index(store)).__name__)
        failures.run("HF load_pretrained", edits, lambda: _load_linear(folder))
        failures.run("HF CheckpointReader", edits,
                     lambda: type(dcp_ext.CheckpointReader(folder).read_metadata()).__name__)
    print(failures.outcomes)
    assert failures.found == [], "\n".join(failures.found)


# -- torch's pickled .metadata ---------------------------------------------------------------------------
def _torch_checkpoints(tmp_path: Path) -> dict[str, Path]:
    """Checkpoints whose metadata is torch's pickle alone, holding TORCH_STATE: written by
    torch's FileSystemWriter (chunked like a multi-rank save; raw and with zstd stream
    extensions) and by dcp_ext uncompressed (its interop pickle, its own document removed)."""
    from torch.distributed.checkpoint._extension import ZStandard

    out = {"torch": tmp_path / "torch", "torch-zstd": tmp_path / "torch-zstd", "interop": tmp_path / "interop"}
    write_chunked(out["torch"])
    write_chunked(out["torch-zstd"], _extensions=[ZStandard()])
    dcp_ext.save(TORCH_STATE, out["interop"])
    (out["interop"] / METADATA_FILE).unlink()
    return out


def _torch_metadata_edit(metadata: Any, original: bytes, rng: random.Random) -> tuple[bytes, list[str], bool]:
    """A damaged or hostile ``.metadata``: its objects edited (60%), bytes flipped (30%) or
    cut short; and whether it has no planner data (keys then load flat, by design)."""
    kind = rng.random()
    if kind < 0.6:
        while True:
            mutated, edits = mutate_object(metadata, rng, edits=rng.choice([1, 1, 2, 3]))
            try:  # TensorProperties pickles a memory format it knows only
                return pickle.dumps(mutated), edits, getattr(mutated, "planner_data", {}) is None
            except (RuntimeError, TypeError, ValueError, AttributeError, pickle.PicklingError):
                continue
    if kind < 0.9:
        data, edits = flip_bytes(original, rng, rng.choice([1, 2, 4]))
        return data, edits, False
    cut = rng.randrange(len(original))
    return original[:cut], [f"cut to {cut} bytes"], False


def _leaves(state: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    if isinstance(state, dict):
        return [leaf for key, value in state.items() for leaf in _leaves(value, (*path, key))]
    if isinstance(state, list) and any(isinstance(v, (dict, list, torch.Tensor)) for v in state):
        return [leaf for i, value in enumerate(state) for leaf in _leaves(value, (*path, i))]
    return [(path, state)]


def _same(expected: Any, actual: Any) -> bool:
    return not state_diff(expected, actual)


def _whole_outcome(expected: dict[str, Any], got: dict[str, Any]) -> str:
    """"loaded" when bit-exact; "renamed" when only top-level keys' names differ, values
    bit-exact: torch's pickle stores a one-part key's name once (memoized) for the key, its
    storage record and its path, so a byte flipped in it renames the key everywhere, and
    nothing in a format without checksums tells the new name from the saved one."""
    if _same(expected, got):
        return "loaded"
    want, have = dict(_leaves(expected)), dict(_leaves(got))
    if all(_same(want[p], have[p]) for p in want.keys() & have.keys()):
        missing = [want[p] for p in want.keys() - have.keys() if len(p) == 1]
        extra = [(p, have[p]) for p in have.keys() - want.keys()]
        if len(missing) == len(want.keys() - have.keys()) and len(missing) == len(extra):
            for p, value in extra:
                match = next((i for i, v in enumerate(missing) if len(p) == 1 and _same(v, value)), None)
                if match is None:
                    break
                missing.pop(match)
            else:
                return "renamed"
    return f"WRONG values: {state_diff(expected, got)[:3]}"


def _load_whole_torch(path: Path, flat: bool) -> str:
    expected = {".".join(map(str, p)): v for p, v in _leaves(TORCH_STATE)} if flat else TORCH_STATE
    return _whole_outcome(expected, load_whole(path))


def _load_torch(path: Path) -> str:
    target = template()
    dcp_ext.load(target, path)
    diff = state_diff(TORCH_STATE, target)
    return f"WRONG values: {diff[:3]}" if diff else "loaded"


#: What a damaged or hostile ``.metadata`` may end in: a correct load, or a typed error. Not
#: a plain DcpExtError (load_whole wraps any other exception in one) nor a KeyError.
_TORCH_OUTCOMES = {
    "loaded", "renamed", "typed:CheckpointCorruptError", "typed:UnsafeNameError",
    "typed:CheckpointKeyError",  # dcp_ext.load: the checkpoint lacks a key of the template (renamed)
    "typed:CheckpointNotFoundError",  # a data file name damaged into another file's
    "typed:UnsupportedCodecError",  # a stream extension's descriptor damaged into an unknown one
}


def test_fuzz_torch_metadata(tmp_path: Path) -> None:
    """Torch's ``.metadata`` (dcp_ext/metadata/torch_checks.py, dcp_ext/whole_state.py): 600
    mutated documents, each read by ``load_whole`` (dtype, shape and nesting from the metadata)
    and by ``dcp_ext.load`` into a template. Before: 3.1% of 450 documents ended in an untyped
    error (AttributeError, AssertionError, IndexError, TypeError), and size edits in wrong tensors."""
    failures = Failures()
    rng = random.Random(20261208)
    documents = 0
    for name, path in _torch_checkpoints(tmp_path).items():
        meta = path / ".metadata"
        original = meta.read_bytes()
        metadata = read_metadata(path)
        for _ in range(200):
            data, edits, flat = _torch_metadata_edit(metadata, original, rng)
            meta.write_bytes(data)
            documents += 1
            failures.run(f"{name} load_whole", edits, functools.partial(_load_whole_torch, path, flat))
            failures.run(f"{name} dcp_ext.load", edits, functools.partial(_load_torch, path))
        meta.write_bytes(original)
        assert _load_whole_torch(path, False) == "loaded" and _load_torch(path) == "loaded"
    print(documents, failures.kinds)
    assert failures.found == [], "\n".join(failures.found)
    assert set(failures.kinds) <= _TORCH_OUTCOMES, failures.kinds
    assert documents == 600 and failures.kinds.get("loaded", 0) > 30
