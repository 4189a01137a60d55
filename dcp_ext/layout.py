"""The SageMaker-style checkpoint layout under a root path: names and rules.

::

    ROOT/
    ├── newest                       # text: the newest committed tag
    ├── step100_partial/             # one DCP checkpoint per tag
    │   ├── model_rank0.distcp       # model shards written by rank 0
    │   ├── optimizer_rank0.distcp   # optimizer shards written by rank 0
    │   ├── ...                      # (model_dp0_tp1.distcp with a named DeviceMesh)
    │   ├── user_content.safetensors # the user's extra state (no pickle)
    │   ├── partition.json           # who wrote what, readable without torch
    │   ├── .metadata                # torch's metadata (interop)
    │   └── dcp_ext.metadata.json    # dcp_ext's metadata: the commit marker
    ├── step100                      # full checkpoint: the whole model in one file
    ├── step100.checksums.json       # its frame checksums, written after it
    └── user_content_step100         # its user content

With ``IOConfig(key_prefixes=N)`` each data file goes one directory deeper,
under one of ``N`` key prefixes (``step100_partial/30/model_rank3.distcp``),
so that S3 spreads the requests of many ranks over several partitions
(:func:`key_prefix`). The metadata records every file by that relative name:
loads and the ``dcp-ext`` tools need no setting.

Pure functions and values only: tag validation, file names (data files
included: which file each saved item goes to, :class:`FileAssignment`), the
partition record. Retention rules are in :mod:`dcp_ext.retention`; I/O in
:mod:`dcp_ext.root`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from .errors import CheckpointCorruptError, DcpExtError

__all__ = [
    "InvalidTagError",
    "validate_tag",
    "partial_dir",
    "user_content_name",
    "NEWEST_FILE",
    "PARTITION_FILE",
    "USER_CONTENT_FILE",
    "PARTIAL_SUFFIX",
    "CHECKSUMS_SUFFIX",
    "KIND_FILES",
    "kind_of",
    "item_kind",
    "key_kind",
    "REPLICATED_KIND",
    "DATA_SUFFIX",
    "data_file_name",
    "key_prefix",
    "spread_name",
    "FileAssignment",
    "split_items",
    "item_nbytes",
    "MeshInfo",
    "RankPartition",
    "Partition",
    "position_name",
    "TagInfo",
]

NEWEST_FILE = "newest"
PARTITION_FILE = "partition.json"
USER_CONTENT_FILE = "user_content.safetensors"
PARTIAL_SUFFIX = "_partial"
#: The checksum sidecar of a full checkpoint file: ``step100.checksums.json``
#: (:mod:`dcp_ext.full_checksums`).
CHECKSUMS_SUFFIX = ".checksums.json"
DATA_SUFFIX = ".distcp"

#: State-dict top-level key -> data file stem. Anything else goes to "state".
KIND_FILES = {"model": "model", "optimizer": "optimizer"}
_OTHER_KIND = "state"

# Matched whole (fullmatch): "$" alone would accept a trailing line break.
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=+-]{0,199}")
_RESERVED = {NEWEST_FILE}


class InvalidTagError(DcpExtError, ValueError):
    """A checkpoint tag that could name something outside its place."""


def validate_tag(tag: object) -> str:
    """Return ``tag`` if it is a safe checkpoint tag.

    Tags are 1-200 characters of letters, digits and ``. _ - = +``, starting
    with a letter or digit: no ``/``, no ``..``, no hidden names, nothing that
    could escape the root or collide with ``newest`` / ``user_content_*``.

    Raises:
        InvalidTagError: Otherwise, with the reason.
    """
    if not isinstance(tag, str):
        raise InvalidTagError(f"checkpoint tag must be a string, got {type(tag).__name__}")
    if not _TAG.fullmatch(tag) or ".." in tag:
        raise InvalidTagError(
            f"invalid checkpoint tag {tag!r}: use 1-200 letters, digits and . _ - = +, "
            f"starting with a letter or digit (no '/', '..' or hidden names)"
        )
    if (tag in _RESERVED or tag.startswith("user_content_") or tag.endswith(PARTIAL_SUFFIX)
            or tag.endswith(CHECKSUMS_SUFFIX)):
        raise InvalidTagError(
            f"invalid checkpoint tag {tag!r}: it collides with a name the layout uses "
            f"({NEWEST_FILE!r}, 'user_content_*', '*{PARTIAL_SUFFIX}', '*{CHECKSUMS_SUFFIX}')"
        )
    return tag


def partial_dir(tag: str) -> str:
    """``step100`` -> ``step100_partial``."""
    return f"{validate_tag(tag)}{PARTIAL_SUFFIX}"


def user_content_name(tag: str) -> str:
    """The user-content file of a full checkpoint: ``user_content_{tag}``."""
    return f"user_content_{validate_tag(tag)}"


def kind_of(fqn: str) -> str:
    """The data-file stem for a flattened state-dict key (``model.w`` -> ``model``)."""
    return KIND_FILES.get(fqn.split(".", 1)[0], _OTHER_KIND)


#: Tiered saves put every item that is not a shard of a sharded tensor (plain
#: tensors, which DCP saves once for all ranks, and non-tensor values) into
#: a file of this kind, which every node's local tier gets a copy of.
REPLICATED_KIND = "replicated"


def item_kind(item: WriteItem, replicated_apart: bool = False) -> str:
    """The data-file stem of a saved item (:func:`key_kind`)."""
    return key_kind(item.index.fqn, item.type == WriteItemType.SHARD, replicated_apart)


def key_kind(fqn: str, shard: bool, replicated_apart: bool = False) -> str:
    """The data-file stem of a key's items: :func:`kind_of` the key, or
    :data:`REPLICATED_KIND` for a non-shard key when ``replicated_apart``."""
    if replicated_apart and not shard:
        return REPLICATED_KIND
    return kind_of(fqn)


def data_file_name(kind: str, position: str) -> str:
    """The data file of one kind written at one rank position: ``model_rank3.distcp``.

    Args:
        kind: A data-file stem (:func:`kind_of`): ``model``, ``optimizer``, ``state``.
        position: The writer's :func:`position_name` (``rank3``, ``dp0_tp1``).
    """
    return f"{kind}_{position}{DATA_SUFFIX}"


def key_prefix(index: int, count: int) -> str:
    """The key prefix of the ``index``-th data file of a save spread over ``count`` prefixes.

    ``index % count`` in hexadecimal, zero-padded to the width of ``count - 1``
    and with its digits reversed, so that the first character changes from one
    file to the next: with 256 prefixes, files 0, 1, 2 go under ``00``, ``10``,
    ``20``. S3 partitions a bucket by ranges of key names and a request rate
    applies per partition (3,500 writes and 5,500 reads per second, AWS's
    "Best practices design patterns: optimizing Amazon S3 performance");
    variety in the first character after the checkpoint's directory gives it
    split points that divide the load evenly. Files are dealt out in turn
    rather than hashed: no two of the first ``count`` files share a prefix,
    where hashing 1,024 ranks' files onto 256 prefixes would put about twice
    the mean on the busiest one. s3torchconnector's ``HexPrefixStrategy``
    (reversed hexadecimal, dealt by rank) makes the same choice.

    Raises:
        ValueError: ``count`` is not positive.
    """
    if count < 1:
        raise ValueError(f"key prefix count must be >= 1, got {count}")
    width = len(format(count - 1, "x"))
    return format(index % count, f"0{width}x")[::-1]


def spread_name(name: str, index: int, count: int) -> str:
    """``name`` under its key prefix (``30/model_rank3.distcp``); ``name`` itself when ``count`` is 0."""
    return f"{key_prefix(index, count)}/{name}" if count else name


@dataclass(frozen=True)
class FileAssignment:
    """Which data file(s) a rank writes; the ``storage_data`` of its ``SavePlan``.

    Attributes:
        prefix: File names are ``{prefix}{k}.distcp`` for ``k`` in
            ``range(files_per_rank)``, unless ``by_kind`` is given.
        by_kind: ``(kind, file name)`` pairs: each item goes to the file of
            its kind (:func:`item_kind`), one file per kind (used by
            :class:`dcp_ext.planners.LayoutSavePlanner`).
        replicated_apart: Non-shard items go to the :data:`REPLICATED_KIND` file.
    """

    prefix: str = ""
    by_kind: tuple[tuple[str, str], ...] = ()
    replicated_apart: bool = False

    def files_for(self, items: list[WriteItem], files_per_rank: int) -> list[tuple[str, list[WriteItem]]]:
        """``(file name, items)`` for each file this rank writes."""
        if self.by_kind:
            names = dict(self.by_kind)
            groups: dict[str, list[WriteItem]] = {}
            for item in items:
                kind = item_kind(item, self.replicated_apart)
                if kind not in names:
                    raise ValueError(f"no data file assigned for {item.index.fqn!r} (kind {kind!r})")
                groups.setdefault(names[kind], []).append(item)
            return list(groups.items())
        buckets = split_items(items, files_per_rank)
        return [(f"{self.prefix}{k}{DATA_SUFFIX}", bucket) for k, bucket in enumerate(buckets)]


def item_nbytes(item: WriteItem) -> int:
    """Bytes of a tensor item's data (``0`` for a bytes item)."""
    if item.tensor_data is None:
        return 0
    numel = 1
    for size in item.tensor_data.size:
        numel *= int(size)
    return numel * item.tensor_data.properties.dtype.itemsize


def split_items(items: list[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Spread items over ``bins`` files with balanced bytes, keeping plan order
    within each file. Byte items are dealt round-robin."""
    if bins <= 1:
        return [list(items)]
    buckets: list[list[WriteItem]] = [[] for _ in range(bins)]
    loads = [0] * bins
    byte_items = [i for i in items if i.type == WriteItemType.BYTE_IO]
    tensor_items = sorted(
        (i for i in items if i.type != WriteItemType.BYTE_IO), key=item_nbytes, reverse=True
    )
    for n, item in enumerate(byte_items):
        buckets[n % bins].append(item)
    for item in tensor_items:
        target = loads.index(min(loads))
        buckets[target].append(item)
        loads[target] += item_nbytes(item)
    return [b for b in buckets if b]


@dataclass(frozen=True)
class MeshInfo:
    """A device mesh as plain data.

    Attributes:
        shape: Mesh shape.
        dim_names: One name per dimension (``("dp", "tp")``).
        ranks: Global rank at each position, row-major (``len == prod(shape)``).
    """

    shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        size = 1
        for s in self.shape:
            size *= s
        if len(self.ranks) != size or len(self.dim_names) != len(self.shape):
            raise ValueError(f"inconsistent mesh: shape {self.shape}, names {self.dim_names}, {len(self.ranks)} ranks")

    @classmethod
    def from_device_mesh(cls, mesh: Any) -> MeshInfo:
        """Read a ``torch.distributed.DeviceMesh`` (its dimension names are required)."""
        names = getattr(mesh, "mesh_dim_names", None)
        if not names:
            raise ValueError(
                "the DeviceMesh has no dimension names; create it with "
                "init_device_mesh(..., mesh_dim_names=('dp', 'tp'))"
            )
        tensor = mesh.mesh
        return cls(tuple(int(s) for s in tensor.shape), tuple(names), tuple(int(r) for r in tensor.flatten().tolist()))

    def coords(self, rank: int) -> dict[str, int]:
        """``{"dp": 0, "tp": 1}`` for ``rank``."""
        try:
            index = self.ranks.index(rank)
        except ValueError:
            raise ValueError(f"rank {rank} is not part of the device mesh {self.shape}") from None
        coords: dict[str, int] = {}
        for name, size in zip(reversed(self.dim_names), reversed(self.shape)):
            coords[name] = index % size
            index //= size
        return {name: coords[name] for name in self.dim_names}


def _runs(positions: list[int]) -> list[int]:
    """Sorted positions as ``[start, end, start, end, ...]`` runs (ends exclusive)."""
    runs: list[int] = []
    for p in positions:
        if runs and runs[-1] == p:
            runs[-1] = p + 1
        else:
            runs += [p, p + 1]
    return runs


def _key_set_doc(mine: dict[str, list[int]], earlier: list[dict[str, list[int]]]) -> dict[str, Any]:
    """One key set of partition.json version 3: per kind, runs, or the
    difference from the first or the latest earlier set if shorter."""
    doc: dict[str, Any] = {}
    candidates = sorted({0, len(earlier) - 1}) if earlier else []
    for kind, positions in mine.items():
        best: Any = _runs(positions)
        size = len(best)
        wanted = set(positions)
        for j in candidates:
            base = earlier[j].get(kind)
            if base is None:
                continue
            have = set(base)
            add, drop = sorted(wanted - have), sorted(have - wanted)
            if len(add) + len(drop) + 1 < size:
                best, size = {"like": j, "add": add, "drop": drop}, len(add) + len(drop) + 1
        doc[kind] = best
    return doc


def _decode_key_sets(sets: list[Any], table: list[str]) -> list[dict[str, tuple[str, ...]]]:
    """partition.json version 3's key sets, each kind's keys in table order.

    Raises:
        ValueError: A set is malformed or refers to a later one.
    """
    positions: list[dict[str, list[int]]] = []
    out: list[dict[str, tuple[str, ...]]] = []
    n = len(table)
    for j, entry in enumerate(sets):
        mine: dict[str, list[int]] = {}
        for kind, value in entry.items():
            if isinstance(value, dict):
                like = value["like"]
                if not (isinstance(like, int) and 0 <= like < j) or kind not in positions[like]:
                    raise ValueError(f"key set {j} refers to key set {like!r}, which does not precede it")
                chosen = (set(positions[like][kind]) - set(value["drop"])) | set(value["add"])
                found = sorted(chosen)
            else:
                if len(value) % 2:
                    raise ValueError("a key set's runs must come in start/end pairs")
                found = []
                for start, end in zip(value[::2], value[1::2]):
                    if not 0 <= start <= end <= n:
                        raise ValueError(f"key run [{start}, {end}) outside the key table")
                    found.extend(range(start, end))
            if found and not (0 <= found[0] and found[-1] < n and all(isinstance(p, int) for p in found)):
                raise ValueError(f"key set {j} names a key outside the key table")
            mine[str(kind)] = found
        positions.append(mine)
        out.append({kind: tuple(table[p] for p in found) for kind, found in mine.items()})
    return out


def position_name(rank: int, mesh: MeshInfo | None) -> str:
    """``rank3``, or ``pp0_tp1_dp0`` from the mesh coordinates of ``rank``."""
    if mesh is None:
        return f"rank{rank}"
    return "_".join(f"{name}{index}" for name, index in mesh.coords(rank).items())


@dataclass(frozen=True)
class RankPartition:
    """What one rank wrote.

    Attributes:
        rank: Rank in the saving process group.
        coords: Mesh coordinates (empty without a mesh).
        files: Data files the rank wrote.
        keys: State-dict keys the rank wrote, per kind (``model``, ``optimizer``, ``state``).
    """

    rank: int
    coords: dict[str, int]
    files: tuple[str, ...]
    keys: dict[str, tuple[str, ...]]


@dataclass(frozen=True)
class Partition:
    """The partition decision of a save, stored as ``partition.json``.

    Attributes:
        world_size: Ranks that saved.
        mesh: Their device mesh, if named.
        ranks: What each rank wrote.
        nodes: Tiered saves: the node of each rank (empty otherwise).
        partners: Tiered saves with replicas: the node keeping each node's replicas.
    """

    world_size: int
    mesh: MeshInfo | None
    ranks: tuple[RankPartition, ...] = field(default=())
    nodes: tuple[int, ...] = ()
    partners: tuple[int, ...] = ()

    def to_json(self, version: int = 3) -> bytes:
        """The record as ``partition.json``.

        Version 3 (default): every key once (``key_table``, sorted); each
        distinct per-kind key set once (``key_sets``), as runs of positions in
        the table (``[start, end, start, end, ...]``, ends exclusive) or as
        positions added to and dropped from an earlier set (``{"like": j,
        "add": [...], "drop": [...]}``), whichever is shorter; each rank names
        its set (``key_set``). FSDP's ranks write the same keys but for a few
        (the one rank that writes each replicated value or empty shard), so
        thousands of ranks take a few distinct sets. Version 2 gave each rank
        its own runs (86 MiB for a 405B model on 8,192 ranks).
        """
        if version not in (2, 3):
            raise ValueError(f"partition.json versions 2 and 3 can be written, not {version!r}")
        table = sorted({key for r in self.ranks for keys in r.keys.values() for key in keys})
        position = {key: k for k, key in enumerate(table)}
        head = {
            "format": "dcp_ext.partition",
            "version": version,
            "world_size": self.world_size,
            "mesh": None
            if self.mesh is None
            else {
                "shape": list(self.mesh.shape),
                "dim_names": list(self.mesh.dim_names),
                "ranks": list(self.mesh.ranks),
            },
            "key_table": table,
        }
        extra = {**({"nodes": list(self.nodes)} if self.nodes else {}),
                 **({"partners": list(self.partners)} if self.partners else {})}
        if version == 2:
            ranks = [
                {"rank": r.rank, "coords": r.coords, "files": list(r.files),
                 "keys": {k: _runs(sorted(position[key] for key in v)) for k, v in r.keys.items()}}
                for r in self.ranks
            ]
            return json.dumps({**head, "ranks": ranks, **extra}, separators=(",", ":")).encode()
        sets: list[dict[str, list[int] | dict[str, Any]]] = []
        positions_of: list[dict[str, list[int]]] = []
        set_of: dict[tuple[Any, ...], int] = {}
        by_id: dict[tuple[int, ...], int] = {}  # ranks of one layout share their key tuples
        ranks_doc = []
        for r in self.ranks:
            ids = tuple(id(v) for v in r.keys.values()) + tuple(map(hash, r.keys))
            found = by_id.get(ids)
            if found is None:
                content = tuple(sorted(r.keys.items()))
                found = set_of.get(content)
                if found is None:
                    found = set_of[content] = len(sets)
                    mine = {k: sorted(position[key] for key in v) for k, v in content}
                    sets.append(_key_set_doc(mine, positions_of))
                    positions_of.append(mine)
                by_id[ids] = found
            ranks_doc.append({"rank": r.rank, "coords": r.coords, "files": list(r.files), "key_set": found})
        return json.dumps({**head, "key_sets": sets, "ranks": ranks_doc, **extra}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Partition:
        """Parse ``partition.json``.

        Raises:
            CheckpointCorruptError: It is not a valid partition record.
        """
        try:
            doc = json.loads(data)
            if doc.get("format") != "dcp_ext.partition" or doc.get("version") not in (1, 2, 3):
                raise ValueError("not a dcp_ext partition record (version 1, 2 or 3)")
            table = [str(key) for key in doc.get("key_table", ())]
            version = doc["version"]

            def keys_of(value: Any) -> tuple[str, ...]:
                if version == 1:
                    return tuple(str(x) for x in value)
                if len(value) % 2:
                    raise ValueError("a rank's key runs must come in start/end pairs")
                found: list[str] = []
                for start, end in zip(value[::2], value[1::2]):
                    if not 0 <= start <= end <= len(table):
                        raise ValueError(f"key run [{start}, {end}) outside the key table")
                    found.extend(table[start:end])
                return tuple(found)

            mesh_doc = doc["mesh"]
            mesh = None if mesh_doc is None else MeshInfo(
                tuple(int(s) for s in mesh_doc["shape"]),
                tuple(str(n) for n in mesh_doc["dim_names"]),
                tuple(int(r) for r in mesh_doc["ranks"]),
            )
            key_sets = _decode_key_sets(doc["key_sets"], table) if version >= 3 else []

            def rank_keys(r: dict[str, Any]) -> dict[str, tuple[str, ...]]:
                if version >= 3:
                    k = r["key_set"]
                    if not (isinstance(k, int) and 0 <= k < len(key_sets)):
                        raise ValueError(f"rank {r.get('rank')!r} names key set {k!r}, which is not listed")
                    shared: dict[str, tuple[str, ...]] = key_sets[k]
                    return shared
                return {str(k): keys_of(v) for k, v in r["keys"].items()}

            ranks = tuple(
                RankPartition(
                    int(r["rank"]), {str(k): int(v) for k, v in r["coords"].items()},
                    tuple(str(f) for f in r["files"]),
                    rank_keys(r),
                )
                for r in doc["ranks"]
            )
            nodes = tuple(int(n) for n in doc.get("nodes", ()))
            partners = tuple(int(n) for n in doc.get("partners", ()))
            return cls(int(doc["world_size"]), mesh, ranks, nodes, partners)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as err:
            raise CheckpointCorruptError(f"{where} is not a valid partition record: {err}", where) from err


@dataclass(frozen=True)
class TagInfo:
    """A committed partial checkpoint and when it committed (seconds since the epoch)."""

    tag: str
    committed_at: float
