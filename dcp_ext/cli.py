"""``dcp-ext`` / ``python -m dcp_ext``: a thin command line over the library.

Commands: ``ls ROOT``, ``inspect CHECKPOINT``, ``verify CHECKPOINT``,
``export CHECKPOINT OUT``, ``prune ROOT --keep N [--dry-run]``, ``compact
ROOT TAG``, ``locks ROOT [--break NAME]``, ``demo``.
Paths are local paths or ``s3://`` URLs; S3 options come from
``--endpoint-url`` / ``--storage-options JSON`` or the usual AWS environment.
Errors print one line and exit 2 (``--verbose`` shows the cause chain);
``verify`` exits 1 when it finds damage; ``prune`` exits 3 when checkpoints
due for deletion were kept because a save in progress holds or builds on
them (it prints which lock or lease, its holder, and how to clear it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import sys
import traceback
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from . import demo
from .config import IOConfig
from .dcp_io import read_hf_index
from .errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    DcpExtError,
    InvalidOptionError,
    UnsupportedCodecError,
)
from .format import MAX_HEADER, parse_header
from .full import CREATED_KEY, HF_MARKERS, FullCheckpointReader
from .full._export import export_partial
from .hf import HF_INDEX_FILE, export_hf
from .layout import PARTIAL_SUFFIX, RETIRED_FILE
from .manager import CheckpointManager
from .metadata import METADATA_FILE, TORCH_METADATA_FILE, StoredItem
from .metadata.chunk_table import ChunkLocations, KeyTotals
from .metadata.decode import MAX_CREATED
from .root import (
    CheckpointRoot,
    KeepEvery,
    KeepLast,
    RetentionPolicy,
    read_own_metadata,
    verify,
    verify_full,
)
from .storage import Location, Store, normalize_path

__all__ = ["main"]

log = logging.getLogger("dcp_ext.cli")


def _options(args: argparse.Namespace) -> dict[str, Any]:
    options = _storage_options(args.storage_options)
    if args.endpoint_url:
        options.setdefault("client_kwargs", {})["endpoint_url"] = args.endpoint_url
        options.setdefault("config_kwargs", {"s3": {"addressing_style": "path"}})
    return options


def _location(args: argparse.Namespace, path: str) -> Location:
    """``path`` with the command line's storage options (:func:`_options`) and the environment's I/O config."""
    return Location.of(path, _options(args))


def _storage_options(text: str | None) -> dict[str, Any]:
    """``--storage-options``: a JSON object of fsspec/s3fs options.

    Raises:
        InvalidOptionError: Not JSON, or not an object (the message names the option).
    """
    if not text:
        return {}
    try:
        options = json.loads(text)
    except (ValueError, RecursionError) as err:
        detail = "nested too deeply" if isinstance(err, RecursionError) else str(err)
        raise InvalidOptionError(f"--storage-options is not valid JSON ({detail}): {text[:80]!r}") from err
    if not isinstance(options, dict):
        raise InvalidOptionError(
            f"--storage-options must be a JSON object of fsspec/s3fs options (e.g. '{{\"anon\": true}}'), "
            f"not a {type(options).__name__}: {text[:80]!r}"
        )
    return options


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


class _ProgressBar:
    """A one-line progress bar on stderr, called as ``bar(done, total)``.

    On a terminal the line is redrawn in place; when stderr is a file or a
    pipe only the final state is written, by :meth:`close`.
    """

    WIDTH = 30

    def __init__(self, label: str, quiet: bool) -> None:
        self.label = label
        self.quiet = quiet
        self.live = sys.stderr.isatty()
        self.last: tuple[int, int] | None = None

    def _line(self) -> str:
        assert self.last is not None
        done, total = self.last
        fraction = min(done / total, 1.0) if total else 1.0
        bar = "#" * int(self.WIDTH * fraction)
        return f"{self.label} [{bar:<{self.WIDTH}}] {100 * fraction:5.1f}% of {_size(total)}"

    def __call__(self, done: int, total: int) -> None:
        if self.quiet:
            return
        self.last = (done, total)
        if self.live:
            sys.stderr.write("\r" + self._line())
            sys.stderr.flush()

    def close(self) -> None:
        """End the bar's line (call before anything else is printed)."""
        if self.last is not None:
            sys.stderr.write(("\r" if self.live else "") + self._line() + "\n")
            sys.stderr.flush()
            self.last = None


def _created(timestamp: float | None) -> str:
    if not timestamp or not 0 < timestamp <= MAX_CREATED:  # the readers refuse the rest; NaN fails both tests
        return ""
    return datetime.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M:%S")


def _time_or_none(value: object) -> float | None:
    """A commit time recorded as text (a full checkpoint's header), if it is a plausible one."""
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return None
    return number if 0 < number <= MAX_CREATED else None


def _full_checkpoint_entry(store: Store, name: str) -> dict[str, Any] | None:
    """The ``ls`` entry of a full checkpoint file, or ``None`` if ``name`` is not one
    (``name`` comes from :meth:`CheckpointRoot.full_candidates`)."""
    head = store.read_head(name, 8)
    size = store.size(name)
    entry: dict[str, Any] = {"tag": name, "state": "full", "newest": False, "stored_bytes": size, "ratio": 1.0,
                             "world_size": None, "mesh": None, "created": None}
    if head[:4] == b"PK\x03\x04":
        return entry | {"format": "torch"}
    if len(head) < 8 or int.from_bytes(head, "little") > min(MAX_HEADER, size - 8):
        return None
    try:
        header = parse_header(store.read_head(name, 8 + int.from_bytes(head, "little")), store.describe(name), size)
    except CheckpointCorruptError:
        return None
    return entry | {"format": "safetensors", "created": _time_or_none(header.metadata.get(CREATED_KEY))}


def _hf_folder_entry(root: CheckpointRoot, tag: str) -> dict[str, Any]:
    """The ``ls`` entry of the Hugging Face folder ``ROOT/{tag}/`` (its index exists)."""
    store = root.hf_store(tag)
    entry: dict[str, Any] = {"tag": tag, "state": "full", "format": "hf", "newest": False, "stored_bytes": None,
                             "ratio": 1.0, "world_size": None, "mesh": None, "created": store.modified(HF_INDEX_FILE)}
    try:
        files = sorted(set(read_hf_index(store).values()))
        return entry | {"stored_bytes": sum(store.size(f) for f in files)}
    except DcpExtError:
        return entry | {"state": "damaged"}


def _partial_entry(root: Location, tag: str, newest: str | None, directory: str | None = None) -> dict[str, Any]:
    """The ``ls`` entry of ``ROOT/{tag}_partial`` (or of ``ROOT/{directory}``, a
    framework's checkpoint folder): committed, incomplete or damaged."""
    location = root.child(directory if directory is not None else tag + PARTIAL_SUFFIX)
    entry: dict[str, Any] = {"tag": tag, "state": "committed", "newest": tag == newest, "stored_bytes": None,
                             "ratio": None, "world_size": None, "mesh": None, "created": None}
    try:
        decoded = read_own_metadata(location)
        totals = _key_totals(decoded.metadata).values()
    except FileNotFoundError:
        store = location.open()
        if store.exists(RETIRED_FILE):  # deleted; keeps the files later incremental checkpoints refer to
            kept = [n for n in store.list_tree() if n.endswith(".distcp")]
            return entry | {"state": "retired", "stored_bytes": sum(store.size(n) for n in kept)}
        if store.exists(TORCH_METADATA_FILE):  # committed by torch's own writer: resumable, never cleaned up
            files = [n for n in store.list_tree() if n.endswith(".distcp")]
            return entry | {"state": "torch", "stored_bytes": sum(store.size(n) for n in files)}
        return entry | {"state": "incomplete"}
    except (CheckpointCorruptError, UnsupportedCodecError) as err:
        # One damaged (or hostile) tag must not hide the others: it is listed as such.
        log.warning("%s: %s", tag, str(err).splitlines()[0] if str(err) else type(err).__name__)
        return entry | {"state": "damaged", "problem": str(err)}
    data = sum(t.data_bytes for t in totals)
    entry.update(stored_bytes=sum(decoded.files.values()), ratio=sum(t.raw_bytes for t in totals) / data if data else 1.0,
                 world_size=decoded.world_size, created=decoded.created)
    if decoded.incremental is not None:
        entry.update(referenced_bytes=decoded.incremental.referenced_bytes, base=decoded.incremental.base,
                     chain=decoded.incremental.chain)
    try:
        mesh = json.loads(location.open().read_file("partition.json")).get("mesh")
        if mesh:
            entry["mesh"] = dict(zip(mesh.get("dim_names") or [], mesh.get("shape") or []))
    except (DcpExtError, ValueError, TypeError, AttributeError, RecursionError):
        pass  # the mesh column is informative; a damaged partition.json is reported when the tag is loaded
    return entry


def _framework_folders(root: CheckpointRoot, hf_folders: set[str]) -> list[str]:
    """Checkpoint directories the framework adapters write, relative to the root:
    torchtitan's ``step-N``, Lightning's ``*.ckpt``, Accelerate's
    ``checkpoint-N/pytorch_model_fsdp_0`` and ``optimizer_0``: any directory
    (or directory of such a directory) holding a commit marker."""
    found = []
    for name in sorted(root.store.list_dirs()):
        if name.endswith(PARTIAL_SUFFIX) or name in hf_folders:
            continue
        folder = root.location.child(name)
        store = folder.open()
        if store.exists(METADATA_FILE) or store.exists(TORCH_METADATA_FILE):
            found.append(name)
            continue
        for inner in sorted(store.list_dirs()):
            inner_store = folder.child(inner).open()
            if inner_store.exists(METADATA_FILE) or inner_store.exists(TORCH_METADATA_FILE):
                found.append(f"{name}/{inner}")
    return found


def _full_checkpoint_file(location: Location) -> bool:
    """Whether ``location`` names a full checkpoint: a file rather than a
    directory, or a Hugging Face folder (``model.safetensors`` or its index,
    and no dcp_ext metadata)."""
    parent = location.parent()
    if parent is not None and parent.open().exists(location.name):
        return True
    store = location.open()
    return not store.exists(METADATA_FILE) and any(store.exists(n) for n in HF_MARKERS)


def _key_entries(metadata: Metadata) -> list[dict[str, Any]]:
    """One ``inspect`` entry per key: dtype, shape, shards, stored and raw bytes, codec."""
    totals = _key_totals(metadata)
    entries: list[dict[str, Any]] = []
    for fqn, md in sorted(metadata.state_dict_metadata.items()):
        key = totals.get(fqn, KeyTotals(0, 0, 0, ()))
        tensor = md if isinstance(md, TensorStorageMetadata) else None
        entries.append({
            "key": fqn,
            "dtype": str(tensor.properties.dtype).removeprefix("torch.") if tensor else "bytes",
            "shape": list(tensor.size) if tensor else None,
            "shards": key.chunks,
            "stored_bytes": key.data_bytes,
            "raw_bytes": key.raw_bytes,
            "codec": ",".join(sorted({"+".join(c) or "raw" for c in key.codecs})),
        })
    return entries


def _key_totals(metadata: Metadata) -> dict[str, KeyTotals]:
    """Each key's items summed: on version-3 columns without building an item
    per chunk (millions at scale), else item by item."""
    locations = metadata.storage_data
    if isinstance(locations, ChunkLocations):
        return locations.totals()
    by_key: dict[str, list[StoredItem]] = {}
    for index, item in locations.items():
        by_key.setdefault(index.fqn, []).append(item)
    return {
        fqn: KeyTotals(len(items), sum(i.data_length for i in items), sum(i.raw_size for i in items),
                       tuple({i.transforms for i in items}))
        for fqn, items in by_key.items()
    }


def _print_entries(entries: list[dict[str, Any]]) -> None:
    rows = [["key", "dtype", "shape", "shards", "stored", "ratio", "codec"]]
    for e in entries:
        shape = "x".join(map(str, e["shape"])) if e["shape"] is not None else "-"
        ratio = f"{e['raw_bytes'] / e['stored_bytes']:.2f}" if e["stored_bytes"] else "-"
        rows.append([e["key"], e["dtype"], shape or "scalar", str(e["shards"]), _size(e["stored_bytes"]), ratio,
                     e["codec"]])
    print(_table(rows))


def _open_root(location: Location) -> CheckpointRoot:
    """The root at ``location``; a path that does not exist is an error (a typo must not look like an empty root)."""
    root = CheckpointRoot(location)
    if not root.exists():
        raise CheckpointNotFoundError(f"{root.store.describe()} does not exist: check the path (for S3: bucket, "
                                      f"prefix and endpoint)", root.store.describe())
    return root


def _local_tiers(dirs: list[str]) -> list[tuple[str, set[str]]]:
    """``(label, committed tags)`` of each local-tier directory."""
    out = []
    for directory in dirs:
        tier = CheckpointRoot(normalize_path(directory), IOConfig.from_env())
        if not tier.exists():
            raise CheckpointNotFoundError(f"local tier {directory} does not exist", directory)
        out.append((f"local:{directory}", {t.tag for t in tier.committed()}))
    return out


def cmd_ls(args: argparse.Namespace) -> int:
    root = _open_root(_location(args, args.root))
    store = root.store
    newest = root.newest_record()
    entries = [_partial_entry(root.location, tag, newest) for tag in root.partial_tags()]
    if args.local_tier:
        tiers = _local_tiers(args.local_tier)
        for entry in entries:
            entry["tiers"] = (["persistent"] if entry["state"] == "committed" else []) + [
                label for label, tags in tiers if entry["tag"] in tags]
        listed = {e["tag"] for e in entries}
        for tag in sorted({t for _, tags in tiers for t in tags} - listed):
            entries.append({"tag": tag, "state": "committed (local tiers only)", "newest": False,
                            "stored_bytes": None, "ratio": None, "world_size": None, "mesh": None, "created": None,
                            "tiers": [label for label, tags in tiers if tag in tags]})
    entries += [e for name in root.full_candidates() if (e := _full_checkpoint_entry(store, name))]
    hf_folders = root.hf_folders()
    entries += [_hf_folder_entry(root, tag) for tag in hf_folders]
    entries += [_partial_entry(root.location, name, newest, directory=name)
                for name in _framework_folders(root, set(hf_folders))]
    if args.json:
        print(json.dumps({"root": store.describe(), "newest": newest, "checkpoints": entries}, indent=1))
        return 0
    if not entries:
        print(f"no checkpoints under {store.describe()}")
        return 0
    incremental = any("referenced_bytes" in e for e in entries)
    rows = [["tag", "state", "newest", "stored"] + (["refers to", "base"] if incremental else [])
            + ["ratio", "world", "mesh", "created"] + (["tiers"] if args.local_tier else [])]
    for e in entries:
        state = f"full ({e['format']})" if e["state"] == "full" else e["state"]
        refers = [_size(e["referenced_bytes"]) if "referenced_bytes" in e else "", e.get("base") or ""]
        rows.append([
            e["tag"], state, "*" if e["newest"] else "",
            _size(e["stored_bytes"]) if e["stored_bytes"] is not None else "",
        ] + (refers if incremental else []) + [
            f"{e['ratio']:.2f}" if e["ratio"] is not None else "",
            str(e["world_size"] or ""),
            "x".join(f"{k}={v}" for k, v in e["mesh"].items()) if e["mesh"] else "",
            _created(e["created"]),
        ] + ([", ".join(e.get("tiers", []))] if args.local_tier else []))
    print(_table(rows))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    location = _location(args, args.checkpoint)
    if _full_checkpoint_file(location):
        reader = FullCheckpointReader(location.url, storage_options=location.storage_options)
        entries = _key_entries(reader.read_metadata())
        if args.json:
            print(json.dumps({"full": True, "keys": entries}, indent=1))
            return 0
        _print_entries(entries)
        print(f"{len(entries)} tensors, {_size(sum(e['stored_bytes'] for e in entries))}: a full checkpoint")
        return 0
    decoded = read_own_metadata(location)
    entries = _key_entries(decoded.metadata)
    if args.json:
        print(json.dumps({"world_size": decoded.world_size, "files": decoded.files, "keys": entries}, indent=1))
        return 0
    _print_entries(entries)
    print(f"{len(entries)} keys, {len(decoded.files)} files, {_size(sum(decoded.files.values()))} stored, "
          f"saved by {decoded.world_size} rank(s)")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    location = _location(args, args.checkpoint)
    if _full_checkpoint_file(location):
        return _verify_full(location, args.quiet)
    bar = _ProgressBar("verifying", args.quiet)
    try:
        report = verify(location, progress=bar, present_only=args.local_copy)
    finally:
        bar.close()
    print(report)
    return 0 if report.ok else 1


def _verify_full(location: Location, quiet: bool) -> int:
    """Check the full checkpoint at ``location`` against the checksums recorded in its sidecar."""
    bar = _ProgressBar("verifying", quiet)
    try:
        report = verify_full(location.url, storage_options=location.storage_options, progress=bar)
    finally:
        bar.close()
    print(report)
    if report.unchecked_items and not report.frames:
        print("  (no checksums were recorded for this full checkpoint: only its header and size were checked)")
    return 0 if report.ok else 1


def cmd_export(args: argparse.Namespace) -> int:

    path = normalize_path(args.checkpoint).rstrip("/")
    root, _, name = path.rpartition("/")
    out: str | None
    if name.endswith(PARTIAL_SUFFIX):  # export ROOT/TAG_partial OUT
        out = normalize_path(args.out)
        if "/" not in out:
            out = "./" + out
    elif "/" not in args.out and not _holds_checkpoint(_location(args, path)):  # export ROOT TAG: into the root
        root, name, out = path, args.out + PARTIAL_SUFFIX, None
    elif _holds_checkpoint(_location(args, path)):  # a framework's checkpoint folder (step-8, last.ckpt, ...)
        return _export_folder(args, _location(args, path))
    else:
        raise ValueError(f"{path} holds no committed checkpoint; pass a checkpoint directory and OUT "
                         f"(ROOT/TAG{PARTIAL_SUFFIX}, torchtitan's step-N, Lightning's *.ckpt...), or ROOT TAG")
    manager = CheckpointManager(_location(args, root))
    hf: dict[str, Any] = {}
    if args.format == "hf":
        hf = {"max_shard_size": args.max_shard_size, "dtype": _EXPORT_DTYPES[args.dtype] if args.dtype else None,
              "hf_config": None if args.hf_config is None else open(args.hf_config, encoding="utf-8").read()}
    elif args.dtype or args.max_shard_size != "5GB" or args.hf_config:
        raise ValueError("--dtype, --max-shard-size and --hf-config apply to --format hf only")
    bar = _ProgressBar(f"exporting ({args.format})", args.quiet)
    try:
        written = manager.export(name[: -len(PARTIAL_SUFFIX)], out=out, full_format=args.format,
                                 include_optimizer=args.include_optimizer, overwrite=args.overwrite, progress=bar,
                                 **hf)
    finally:
        bar.close()
    print(written)
    return 0


_EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _holds_checkpoint(location: Location) -> bool:
    store = location.open()
    return store.exists(METADATA_FILE) or store.exists(TORCH_METADATA_FILE)


def _export_folder(args: argparse.Namespace, source: Location) -> int:
    """``export`` of the committed checkpoint directory ``source`` (not a root's tag): one file, or an HF folder."""
    target = source.at(args.out)
    bar = _ProgressBar(f"exporting ({args.format})", args.quiet)
    try:
        if args.format == "hf":
            export_hf(source.url, target.url, include_optimizer=args.include_optimizer, overwrite=args.overwrite,
                      max_shard_size=args.max_shard_size, storage_options=source.storage_options,
                      dtype=_EXPORT_DTYPES[args.dtype] if args.dtype else None,
                      config_json=None if args.hf_config is None else open(args.hf_config, encoding="utf-8").read())
            written = target.url
        else:
            if args.dtype or args.max_shard_size != "5GB" or args.hf_config:
                raise ValueError("--dtype, --max-shard-size and --hf-config apply to --format hf only")
            parent = target.parent() or target.at(".")
            store = parent.open()
            if store.exists(target.name) and not args.overwrite:
                raise CheckpointExistsError(f"Checkpoint already exists at {store.describe(target.name)}; pass "
                                            f"--overwrite", store.describe(target.name))
            export_partial(source, store, target.name, full_format=args.format,
                           include_optimizer=args.include_optimizer, progress=bar)
            written = store.describe(target.name)
    finally:
        bar.close()
    print(written)
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    root = _open_root(_location(args, args.root))
    keep_last = KeepLast(args.keep)
    policy: RetentionPolicy = keep_last | KeepEvery(args.keep_every) if args.keep_every else keep_last
    committed = len(root.committed())
    report = root.retain(policy, dry_run=args.dry_run)
    doomed = report.deleted
    for tag in doomed:
        print(f"{'would delete' if args.dry_run else 'deleted'} {tag}")
    for tag, reason in report.held:
        print(f"kept {tag} for now: {reason}")
    leftovers = None if args.dry_run else root.remove_leftovers()
    print(f"{len(doomed)} of {committed} partial checkpoints {'would be ' if args.dry_run else ''}deleted; "
          f"newest is {root.newest_record()}" + (f"; {len(report.held)} due for deletion kept by saves in "
                                                  f"progress (exit 3)" if report.held else ""))
    if leftovers is not None and (leftovers.uncommitted or leftovers.uploads or leftovers.temp_files):
        print(f"removed leftovers of crashed saves: {len(leftovers.uncommitted)} uncommitted checkpoint(s), "
              f"{len(leftovers.uploads)} incomplete upload(s), {len(leftovers.temp_files)} temporary file(s)")
    return 3 if report.held else 0


def cmd_locks(args: argparse.Namespace) -> int:
    root = _open_root(_location(args, args.root))
    if args.break_name:
        broken = root.break_record(args.break_name, force=args.force)
        print(f"removed {broken.name} ({broken.state.reason})")
        return 0
    records = root.records()
    for record in records:
        print(record.line())
    if not records:
        print(f"no save locks or leases under {root.url}")
    return 0


def cmd_compact(args: argparse.Namespace) -> int:
    root = _open_root(_location(args, args.root))
    report = root.compact(args.tag)
    if not report.changed:
        print(f"{root.partial_url(args.tag)} refers to no other checkpoint: nothing to do")
        return 0
    print(f"{report.path}: rewrote {len(report.rewritten)} data file(s), copied {_size(report.copied_bytes)} from "
          f"earlier checkpoints" + (f"; kept {len(report.kept_old)} replaced file(s) that other checkpoints "
                                    f"refer to" if report.kept_old else ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dcp-ext", description="dcp_ext command-line tool")
    parser.add_argument("--verbose", "-v", action="store_true", help="show the full cause chain of errors")
    # Storage options are accepted before or after the command; given after,
    # they override (argparse.SUPPRESS keeps the command's absent ones from
    # resetting the global ones).
    parser.add_argument("--endpoint-url", help="S3 endpoint (e.g. http://127.0.0.1:9000); also AWS_ENDPOINT_URL")
    parser.add_argument("--storage-options", help="fsspec/s3fs options as JSON")
    commands = parser.add_subparsers(dest="command", required=True)

    def storage(p: argparse.ArgumentParser) -> None:
        p.add_argument("--endpoint-url", default=argparse.SUPPRESS, help="S3 endpoint (e.g. http://127.0.0.1:9000)")
        p.add_argument("--storage-options", default=argparse.SUPPRESS, help="fsspec/s3fs options as JSON")

    p = commands.add_parser("ls", help="list the checkpoints under a root")
    p.add_argument("root", help="checkpoint root: local path or s3://bucket/prefix")
    p.add_argument("--json", action="store_true", help="one JSON object per checkpoint, sizes in bytes")
    p.add_argument("--local-tier", action="append", default=[], metavar="DIR",
                   help="a node's local-tier directory (repeatable): show which tiers hold each tag")
    storage(p)
    p = commands.add_parser("inspect", help="keys, dtypes, shapes, shards, stored bytes, codecs")
    p.add_argument("checkpoint", help="ROOT/{tag}_partial, a dcp_ext.save path, or a full checkpoint file")
    p.add_argument("--json", action="store_true", help="machine-readable output, sizes in bytes")
    storage(p)
    p = commands.add_parser("verify", help="check every checksum; exit 1 on damage")
    p.add_argument("checkpoint", help="ROOT/{tag}_partial, a dcp_ext.save path, or a full checkpoint file")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.add_argument("--local-copy", action="store_true",
                   help="a node's copy in a local tier: check the files it has, list the others as absent")
    storage(p)
    p = commands.add_parser("export", help="write a full checkpoint (one file, or a Hugging Face folder) from a "
                                           "partial one")
    p.add_argument("checkpoint", help="ROOT/{tag}_partial, or ROOT (then OUT is the tag, written as ROOT/{tag})")
    p.add_argument("out", help="output file or folder path or URL, or the tag when CHECKPOINT is ROOT")
    p.add_argument("--format", choices=("safetensors", "torch", "hf"), default="safetensors",
                   help="safetensors (default), a torch.save file of a {name: tensor} dict, or hf: a Hugging "
                        "Face folder (sharded safetensors + model.safetensors.index.json)")
    p.add_argument("--dtype", choices=sorted(_EXPORT_DTYPES), help="hf: cast floating tensors to this dtype")
    p.add_argument("--max-shard-size", default="5GB", help="hf: most bytes per file, e.g. 5GB (default), 500MB")
    p.add_argument("--hf-config", metavar="FILE", help="hf: a config.json to put in the folder")
    p.add_argument("--include-optimizer", action="store_true", help="also write the optimizer's tensors")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    storage(p)
    p = commands.add_parser(
        "prune", help="delete old partial checkpoints, keeping the newest N (safe while training saves to the root: "
                      "a checkpoint a save in progress builds on, or that others refer to, stays)")
    p.add_argument("root", help="checkpoint root")
    p.add_argument("--keep", type=int, required=True, help="partial checkpoints to keep (newest is always kept)")
    p.add_argument("--keep-every", type=int, default=0, metavar="K",
                   help="also keep every checkpoint whose step (last number in its tag) is a multiple of K")
    p.add_argument("--dry-run", action="store_true", help="only print what would be deleted")
    storage(p)
    p = commands.add_parser(
        "compact", help="rewrite an incremental checkpoint so it refers to no other (safe while training saves to "
                        "the root: refused while a save to TAG or one building on it is in progress)")
    p.add_argument("root", help="checkpoint root")
    p.add_argument("tag", help="the checkpoint to rewrite")
    storage(p)
    p = commands.add_parser(
        "locks", help="list the save locks and leases under a root (holder, age, heartbeat, live or dead); "
                      "--break NAME removes one whose holder is gone")
    p.add_argument("root", help="checkpoint root")
    p.add_argument("--break", dest="break_name", metavar="NAME",
                   help="remove this lock or lease (as listed); refused while its holder is alive")
    p.add_argument("--force", action="store_true", help="with --break: remove it even if it looks alive")
    storage(p)
    demo.add_arguments(commands.add_parser("demo", help="save and load a sharded checkpoint across 2 local processes"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    handlers = {"ls": cmd_ls, "inspect": cmd_inspect, "verify": cmd_verify, "export": cmd_export, "prune": cmd_prune,
                "compact": cmd_compact, "locks": cmd_locks}
    try:
        if args.command == "demo":
            return demo.run(args.path, args.width, args.depth)
        return handlers[args.command](args)
    except (DcpExtError, OSError, ValueError, KeyError) as err:
        if args.verbose:
            traceback.print_exception(err)
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        print(f"dcp-ext: error: {message}", file=sys.stderr)
        return 2
