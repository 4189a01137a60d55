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
partition record. Retention rules are in :mod:`dcp_ext.root._retention`; I/O in
:mod:`dcp_ext.root._root`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from ._runtime import validate_relative_name
from .errors import CheckpointCorruptError, DcpExtError

__all__ = [
    "RETIRED_FILE",
    "strays_marker",
    "strays_marker_tag",
    "is_valid_tag",
    "tags_of_partial_dirs",
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
"""The root's file naming the newest committed tag; written last, after the checkpoint's metadata."""
PARTITION_FILE = "partition.json"
"""A partial checkpoint's record of which rank wrote which data files (:class:`Partition`)."""
USER_CONTENT_FILE = "user_content.safetensors"
"""A partial checkpoint's file holding the ``user_content`` of the save (safetensors)."""
PARTIAL_SUFFIX = "_partial"
"""Appended to a tag to name its checkpoint's directory (``step100`` -> ``step100_partial``)."""
#: The checksum sidecar of a full checkpoint file: ``step100.checksums.json``
#: (:mod:`dcp_ext.full._checksums`).
CHECKSUMS_SUFFIX = ".checksums.json"
DATA_SUFFIX = ".distcp"
"""The extension of data files (``model_rank3.distcp``), as torch's writers name them."""

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


def is_valid_tag(tag: object) -> bool:
    """Whether :func:`validate_tag` accepts ``tag`` (for names read from a
    listing or a file, which are skipped rather than refused)."""
    try:
        validate_tag(tag)
    except InvalidTagError:
        return False
    return True


def partial_dir(tag: str) -> str:
    """``step100`` -> ``step100_partial``."""
    return f"{validate_tag(tag)}{PARTIAL_SUFFIX}"


#: Written in a partial directory whose checkpoint was deleted while later
#: (incremental) checkpoints still refer to some of its data files: the
#: directory keeps only those, and is removed once nothing refers to them.
RETIRED_FILE = "dcp_ext.retired.json"
_STRAYS_PREFIX = ".dcp_ext.strays."
_STRAYS_SUFFIX = ".json"


def strays_marker(tag: str) -> str:
    """The root-level marker ``.dcp_ext.strays.{tag}.json``: the committed
    directory of ``tag`` may hold data files its metadata does not name (a
    compaction or an overwrite killed before removing the files it
    replaced, or replaced files another checkpoint still refers to).
    Leftover cleanup removes those files once nothing refers to them, then
    the marker."""
    return f"{_STRAYS_PREFIX}{validate_tag(tag)}{_STRAYS_SUFFIX}"


def strays_marker_tag(name: str) -> str | None:
    """The tag of a root-level :func:`strays_marker` name, else ``None``."""
    if not name.startswith(_STRAYS_PREFIX) or not name.endswith(_STRAYS_SUFFIX):
        return None
    tag = name[len(_STRAYS_PREFIX): -len(_STRAYS_SUFFIX)]
    return tag if is_valid_tag(tag) else None


def tags_of_partial_dirs(names: Iterable[str]) -> list[str]:
    """The tags of the ``{tag}_partial`` names in a listing (other names skipped)."""
    return [name[: -len(PARTIAL_SUFFIX)] for name in names
            if name.endswith(PARTIAL_SUFFIX) and is_valid_tag(name[: -len(PARTIAL_SUFFIX)])]


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

    def names(self, files_per_rank: int) -> list[str]:
        """Every file name this assignment can give (by kind, or the prefix's ``files_per_rank`` names)."""
        if self.by_kind:
            return [name for _, name in self.by_kind]
        return [f"{self.prefix}{k}{DATA_SUFFIX}" for k in range(files_per_rank)]

    def avoiding(self, taken: set[str], files_per_rank: int) -> tuple[FileAssignment, dict[str, str]]:
        """This assignment with every name in ``taken`` replaced by a free
        generation of it (``model_rank0.distcp`` -> ``model_rank0.g1.distcp``,
        prefix ``__0_`` -> ``__0_g1_``), and the names it replaced: an
        overwrite writes beside the checkpoint it replaces."""
        if self.by_kind:
            renamed: dict[str, str] = {}
            pairs = []
            for kind, name in self.by_kind:
                if name in taken:
                    stem = name[: -len(DATA_SUFFIX)]
                    renamed[name] = next(f"{stem}.g{n}{DATA_SUFFIX}" for n in range(1, len(taken) + 2)
                                         if f"{stem}.g{n}{DATA_SUFFIX}" not in taken)
                pairs.append((kind, renamed.get(name, name)))
            return dataclasses.replace(self, by_kind=tuple(pairs)), renamed
        if not taken.intersection(self.names(files_per_rank)):
            return self, {}
        for n in range(1, len(taken) + 2):
            moved = dataclasses.replace(self, prefix=f"{self.prefix}g{n}_")
            if not taken.intersection(moved.names(files_per_rank)):
                return moved, dict(zip(self.names(files_per_rank), moved.names(files_per_rank)))
        raise AssertionError("unreachable: more generations than taken names")  # pragma: no cover

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
        """Check that shape, names and ranks agree; ``ValueError`` if they do not."""
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
        ValueError: A set is malformed or refers to a later one (the message
            names the field).
    """
    positions: list[dict[str, list[int]]] = []
    out: list[dict[str, tuple[str, ...]]] = []
    n = len(table)
    budget = _MAX_DECODED_KEYS
    for j, entry in enumerate(sets):
        mine: dict[str, list[int]] = {}
        for kind, value in _dict_field(entry, f"key_sets[{j}]").items():
            where = f"key_sets[{j}].{kind}"
            if isinstance(value, dict):
                like = _int_field(value.get("like"), f"{where}.like", high=_MAX_RANKS)
                if like >= j or kind not in positions[like]:
                    raise ValueError(f"field {where!r}: key set {j} refers to key set {like!r}, which does not "
                                     f"precede it or has no {kind!r} keys")
                drop = {_int_field(p, f"{where}.drop[{k}]", high=n - 1)
                        for k, p in enumerate(_list_field(value.get("drop"), f"{where}.drop"))}
                add = {_int_field(p, f"{where}.add[{k}]", high=n - 1)
                       for k, p in enumerate(_list_field(value.get("add"), f"{where}.add"))}
                found = sorted((set(positions[like][kind]) - drop) | add)
            else:
                found = _expand_runs(value, where, n)
            budget -= len(found)
            if budget < 0:
                raise ValueError(f"field {where!r}: the key sets name more than {_MAX_DECODED_KEYS} keys in all")
            mine[kind] = found
        positions.append(mine)
        out.append({kind: tuple(table[p] for p in found) for kind, found in mine.items()})
    return out


def _expand_runs(value: object, where: str, n: int) -> list[int]:
    """Positions from ``[start, end, start, end, ...]`` runs (ends exclusive),
    ascending and apart, as :func:`_runs` writes them (so no set is longer
    than the key table, whatever the document repeats)."""
    runs = _list_field(value, where)
    if len(runs) % 2:
        raise ValueError(f"field {where!r}: key runs must come in start/end pairs")
    found: list[int] = []
    previous = 0
    for k in range(0, len(runs), 2):
        start = _int_field(runs[k], f"{where}[{k}]", high=n)
        end = _int_field(runs[k + 1], f"{where}[{k + 1}]", high=n)
        if not previous <= start <= end:
            raise ValueError(f"field {where!r}: key run [{start}, {end}) is not ascending and apart from the one "
                             f"before it, within the key table of {n} keys")
        found.extend(range(start, end))
        previous = end
    return found


#: Largest rank, world size, node, mesh dimension or coordinate a partition
#: record may name: far beyond any job, small enough that nothing sized by it
#: is unreasonable.
_MAX_RANKS = 1 << 24
#: Keys all of a record's key sets (or version 1/2 rank key lists) may expand
#: to: a 405B model saved by 8,192 ranks in version 2 takes about 40 million.
_MAX_DECODED_KEYS = 1 << 26


def _describe_value(value: object) -> str:
    """A short description of a JSON value for a message (never its whole text)."""
    if isinstance(value, (dict, list)):
        return f"a {'dict' if isinstance(value, dict) else 'list'} of {len(value)}"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return "an integer of more than 30 digits"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _int_field(value: object, field: str, low: int = 0, high: int = _MAX_RANKS) -> int:
    """``value`` if it is an integer in ``[low, high]`` (not a bool, a float, NaN or infinity)."""
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"field {field!r} must be an integer in [{low}, {high}], not {_describe_value(value)}")
    return value


def _str_field(value: object, field: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"field {field!r} must be a string, not {_describe_value(value)}")
    return value


def _list_field(value: object, field: str) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"field {field!r} must be a list, not {_describe_value(value)}")
    return value


def _dict_field(value: object, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"field {field!r} must be an object (a dict), not {_describe_value(value)}")
    return value


def _required(doc: dict[str, Any], key: str, field: str) -> Any:
    if key not in doc:
        raise ValueError(f"field {field!r} is missing")
    return doc[key]


def _no_constants(name: str) -> Any:
    # json.loads takes NaN and Infinity by default; no dcp_ext record has them.
    raise ValueError(f"{name} is not valid in a partition record")


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

    def with_files_renamed(self, renamed: dict[str, str]) -> Partition:
        """The partition with each rank's file names mapped through ``renamed``
        (the writer's names for an overwrite: :meth:`FileAssignment.avoiding`)."""
        if not renamed:
            return self
        ranks = tuple(dataclasses.replace(r, files=tuple(renamed.get(f, f) for f in r.files)) for r in self.ranks)
        return dataclasses.replace(self, ranks=ranks)

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
        """Parse ``partition.json``, trusting nothing in it.

        Every field is checked for its type and range (integers are integers,
        not floats, NaN or infinity, and within ``2**24``), and every data file
        name is a plain relative name (:func:`dcp_ext._runtime.validate_relative_name`):
        tiered saves copy, send and delete the files a record names.

        Args:
            data: The file's bytes.
            where: The file, for messages.

        Raises:
            UnsafeNameError: A data file name could leave the checkpoint
                directory (absolute, ``..``, hidden, odd characters).
            CheckpointCorruptError: It is not a valid partition record: bad
                JSON, a missing field or one of the wrong type or range (the
                message names the file and the field).
        """
        try:
            doc = json.loads(data, parse_constant=_no_constants)
            if not isinstance(doc, dict):
                raise ValueError(f"the record must be a JSON object, not {_describe_value(doc)}")
            if doc.get("format") != "dcp_ext.partition":
                raise ValueError("field 'format' is not 'dcp_ext.partition'")
            version = _int_field(doc.get("version"), "version", 1, 3)
            table = [_str_field(key, f"key_table[{k}]")
                     for k, key in enumerate(_list_field(doc.get("key_table", []), "key_table"))]
            budget = [_MAX_DECODED_KEYS]

            def keys_of(value: object, field: str) -> tuple[str, ...]:
                if version == 1:
                    found = tuple(_str_field(x, f"{field}[{k}]") for k, x in enumerate(_list_field(value, field)))
                else:
                    found = tuple(table[p] for p in _expand_runs(value, field, len(table)))
                budget[0] -= len(found)
                if budget[0] < 0:
                    raise ValueError(f"field {field!r}: the ranks name more than {_MAX_DECODED_KEYS} keys in all")
                return found

            world_size = _int_field(_required(doc, "world_size", "world_size"), "world_size", 1)
            mesh_doc = _required(doc, "mesh", "mesh")
            mesh = None
            if mesh_doc is not None:
                _dict_field(mesh_doc, "mesh")
                mesh = MeshInfo(
                    tuple(_int_field(s, f"mesh.shape[{k}]", 1)
                          for k, s in enumerate(_list_field(_required(mesh_doc, "shape", "mesh.shape"), "mesh.shape"))),
                    tuple(_str_field(x, f"mesh.dim_names[{k}]") for k, x in enumerate(
                        _list_field(_required(mesh_doc, "dim_names", "mesh.dim_names"), "mesh.dim_names"))),
                    tuple(_int_field(r, f"mesh.ranks[{k}]") for k, r in enumerate(
                        _list_field(_required(mesh_doc, "ranks", "mesh.ranks"), "mesh.ranks"))),
                )
            key_sets = (_decode_key_sets(_list_field(_required(doc, "key_sets", "key_sets"), "key_sets"), table)
                        if version >= 3 else [])

            def rank_keys(r: dict[str, Any], field: str) -> dict[str, tuple[str, ...]]:
                if version >= 3:
                    k = _int_field(_required(r, "key_set", f"{field}.key_set"), f"{field}.key_set",
                                   high=len(key_sets) - 1)
                    shared: dict[str, tuple[str, ...]] = key_sets[k]
                    return shared
                keys = _dict_field(_required(r, "keys", f"{field}.keys"), f"{field}.keys")
                return {kind: keys_of(v, f"{field}.keys.{kind}") for kind, v in keys.items()}

            ranks: list[RankPartition] = []
            seen: set[int] = set()
            for i, r in enumerate(_list_field(_required(doc, "ranks", "ranks"), "ranks")):
                field = f"ranks[{i}]"
                _dict_field(r, field)
                rank = _int_field(_required(r, "rank", f"{field}.rank"), f"{field}.rank", high=world_size - 1)
                if rank in seen:
                    raise ValueError(f"field {field + '.rank'!r}: rank {rank} is listed twice")
                seen.add(rank)
                coords = {k: _int_field(v, f"{field}.coords.{k}")
                          for k, v in _dict_field(_required(r, "coords", f"{field}.coords"), f"{field}.coords").items()}
                files = tuple(
                    validate_relative_name(f, where, f"data file {field}.files[{k}] (of rank {rank})")
                    for k, f in enumerate(_list_field(_required(r, "files", f"{field}.files"), f"{field}.files"))
                )
                ranks.append(RankPartition(rank, coords, files, rank_keys(r, field)))
            nodes = tuple(_int_field(n, f"nodes[{k}]") for k, n in enumerate(_list_field(doc.get("nodes", []), "nodes")))
            partners = tuple(_int_field(n, f"partners[{k}]")
                             for k, n in enumerate(_list_field(doc.get("partners", []), "partners")))
            return cls(world_size, mesh, tuple(ranks), nodes, partners)
        except DcpExtError:
            raise  # UnsafeNameError names the file and the field already
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, RecursionError) as err:
            # ValueError covers bad JSON and bad UTF-8; RecursionError deeply nested brackets.
            raise CheckpointCorruptError(f"{where} is not a valid partition record: {err}", where) from err


@dataclass(frozen=True)
class TagInfo:
    """A committed partial checkpoint and when it committed (seconds since the epoch)."""

    tag: str
    """The checkpoint's tag (``step100``; its directory is ``step100_partial``)."""
    committed_at: float
    """When it committed, seconds since the epoch (``created`` in its metadata; 0.0 if unreadable)."""
