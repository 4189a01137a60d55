"""The package's shape (ARCHITECTURE.md): layers, no import cycles, small modules and classes.

Reads dcp_ext/ with ``ast`` (nothing is imported), so a violation names the
file and line. Every check here failed on the flat layout before issue 33
(60 modules in dcp_ext/, two import cycles, function-level imports to dodge
them, classes of 994 and 896 lines, modules of 1,375 and 1,019 lines).
"""

from __future__ import annotations

import ast
import functools
import itertools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dcp_ext"

#: Each unit (a top-level module or subpackage) and its layer: a unit imports only lower layers.
LAYERS = {
    "errors": 0, "config": 0,
    "_runtime": 1,
    "storage": 2, "format": 2, "layout": 2,
    "metadata": 3,
    "frames": 4, "planning": 4, "guard": 4,
    "planners": 5, "incremental": 5,
    "dcp_io": 6,
    "api": 7, "full": 7, "whole_state": 7, "dcp_default": 7,
    "hf": 8,
    "root": 9,
    "tiers": 10,
    "manager": 11,
    "cli": 12, "demo": 11, "testing": 12,
    "__init__": 13, "__main__": 14, "integrations": 14,
}
#: Top-level modules that are documented public API (imported by users, docs and bench).
PUBLIC_TOP = {"__init__", "__main__", "api", "cli", "config", "demo", "errors", "layout", "planners",
              "dcp_default", "whole_state"}
MAX_TOP_LEVEL_MODULES = 16
MAX_CLASS_LINES = 450
MAX_MODULE_LINES = 750


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, int, bool]]:
    """``(imported module, line, inside a function)`` for every import of a dcp_ext module."""
    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    base = name if is_package else name.rpartition(".")[0]
    found = []
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    nested = {id(sub) for f in functions for sub in ast.walk(f)}
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            parts = base.split(".")
            module = node.module or ""
            if node.level:
                module = ".".join(parts[: len(parts) - node.level + 1] + ([module] if module else []))
            for alias in node.names:  # `from . import demo` imports the module demo
                targets.append(f"{module}.{alias.name}" if f"{module}.{alias.name}" in MODULES else module)
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        for target in targets:
            if target.split(".")[0] == "dcp_ext" and target in MODULES and target != name:
                found.append((target, node.lineno, id(node) in nested))
    return found


def _unit(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_layers_and_no_import_cycles() -> None:
    problems = []
    edges: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        unit = _unit(name)
        assert unit in LAYERS, f"{path}: {unit!r} has no layer in this test and ARCHITECTURE.md"
        for target, line, in_function in _imports(name, path):
            edges.setdefault(name, set()).add(target)
            if in_function and not name.startswith("dcp_ext.testing"):
                problems.append(f"{path}:{line}: imports {target} inside a function")
            other = _unit(target)
            if other != unit and LAYERS[other] >= LAYERS[unit]:
                problems.append(f"{path}:{line}: {unit} (layer {LAYERS[unit]}) imports {target} "
                                f"({other}, layer {LAYERS[other]})")
    assert problems == [], "\n".join(problems)
    # Tarjan's strongly connected components: any with two modules or more is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []
    counter = itertools.count()

    def visit(v: str) -> None:
        index[v] = low[v] = next(counter)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in MODULES:
        if v not in index:
            visit(v)
    assert cycles == []


def test_folders_show_the_architecture() -> None:
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    assert set(top) <= PUBLIC_TOP, set(top) - PUBLIC_TOP
    for package in sorted(p for p in PACKAGE.iterdir() if (p / "__init__.py").exists()):
        tree = ast.parse((package / "__init__.py").read_text())
        assert ast.get_docstring(tree), f"{package.name}/__init__.py says nothing of its job"
        if package.name in ("testing",):
            continue
        assert any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in n.targets)
                   for n in tree.body), f"{package.name}/__init__.py has no __all__"
        if package.name in ("metadata", "storage", "_runtime", "integrations"):
            continue  # public modules (metadata, storage), a private package, or per-framework modules
        public = [p.name for p in package.glob("*.py") if not p.name.startswith("_")]
        assert public == [], f"{package.name}/: implementation modules are _-prefixed, not {public}"


def test_modules_and_classes_are_small() -> None:
    big = []
    for path in MODULES.values():
        source = path.read_text()
        lines = source.count("\n")
        if lines > MAX_MODULE_LINES:
            big.append(f"{path}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                big.append(f"{path}: class {node.name} has {node.end_lineno - node.lineno + 1} lines")
        doc = ast.get_docstring(ast.parse(source))
        if not doc:
            big.append(f"{path}: no module docstring")
    assert big == [], "\n".join(big)


def test_stores_are_opened_from_locations_above_storage() -> None:
    """Issue 42: above ``storage/`` a store is opened from a :class:`~dcp_ext.storage.Location`
    (which carries its options), never by ``open_store(path, config, options)``."""
    calls = []
    for name, path in MODULES.items():
        if name.startswith("dcp_ext.storage"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                if called == "open_store":
                    calls.append(f"{path}:{node.lineno}")
    assert calls == [], calls


#: Private definitions above ``storage/`` that still declare ``storage_options``, and why.
KEEPS_STORAGE_OPTIONS = {
    # use_for_dcp's settings, recorded before there is any path: DCP names the checkpoint at each
    # call (checkpoint_id), and _Settings.writer/reader hand both to CheckpointWriter/CheckpointReader,
    # the public entry points that make the Location.
    "dcp_ext.dcp_default._Settings",
    # Public in all but its package: the one deletion rule the adapters' users are pointed to
    # (docs/guides/integrations.md), ``dcp_ext.root.delete_checkpoint_dir(path, storage_options)``;
    # it takes a Location too.
    "dcp_ext.root._standalone.delete_checkpoint_dir",
}


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The module ``from ... import`` names, in ``module``."""
    parts = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
    if not node.level:
        return node.module or ""
    return ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _defined_at(module: str, name: str) -> str | None:
    """``module.Name`` where ``name``, as ``module`` has it, is defined (``from`` imports followed)."""
    tree = _tree(MODULES[module])
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return f"{module}.{name}"
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                source = _absolute(module, node)
                if (alias.asname or alias.name) == name and source in MODULES:
                    return _defined_at(source, alias.name)
    return None


def _is_public_module(module: str) -> bool:
    """A module users import (``dcp_ext.api``, ``dcp_ext.integrations.torchtitan``): no ``_``-prefixed
    part and not an internal package's ``__init__`` (whose ``__all__`` serves the layers above)."""
    parts = module.split(".")[1:]
    return bool(parts) and not any(p.startswith("_") for p in parts) and MODULES[module].name != "__init__.py"


def _public_definitions() -> set[str]:
    """``module.Name`` of the public API's classes and functions: what ``dcp_ext`` exports, the public
    modules' own names, and what those hand out from private modules (in their ``__all__``, or as a
    base class of a class of theirs: the Lightning adapters' mixins)."""
    public: set[str] = set()
    exported = next(n.value for n in _tree(MODULES["dcp_ext"]).body
                    if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in n.targets))
    public |= {where for name in ast.literal_eval(exported) if (where := _defined_at("dcp_ext", name))}
    for module in filter(_is_public_module, MODULES):
        tree = _tree(MODULES[module])
        handed_out: set[str] = set()
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
                handed_out |= set(ast.literal_eval(node.value))
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                handed_out |= {b.id for b in node.bases if isinstance(b, ast.Name)}
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                    and not node.name.startswith("_"):
                public.add(f"{module}.{node.name}")
        public |= {where for name in handed_out if (where := _defined_at(module, name))}
    return public


def test_storage_options_stop_at_the_public_entry_points() -> None:
    """Issue 42: below the public entry points (which take a path and ``storage_options``) a location
    travels as one :class:`~dcp_ext.storage.Location`: no private function, method or class above
    ``storage/`` declares a ``storage_options`` parameter (a dataclass field is a parameter
    of its constructor). On 04dc854, before the move, it named 21 (drains, the manager's context, the
    HF and full exports, the deletion rule's helpers, the adapters' directory helpers...)."""
    public = _public_definitions()
    loose: list[str] = []
    kept: set[str] = set()

    def check(name: str, found: str) -> None:
        if name in KEEPS_STORAGE_OPTIONS:
            kept.add(name)
        else:
            loose.append(found)

    def visit(node: ast.AST, prefix: str, path: Path, in_public: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            name = f"{prefix}.{child.name}"
            own = child.name.startswith("_") and not (child.name.startswith("__") and child.name.endswith("__"))
            is_public = name in public or (in_public and not own)
            if isinstance(child, ast.ClassDef):
                fields = [s for s in child.body if isinstance(s, ast.AnnAssign)
                          and getattr(s.target, "id", "") == "storage_options"]
                if fields and not is_public:
                    check(name, f"{path}:{fields[0].lineno}: {name} has a storage_options field")
                visit(child, name, path, is_public)
                continue
            args = child.args
            if "storage_options" in [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs] \
                    and not is_public:
                check(name, f"{path}:{child.lineno}: {name} takes storage_options")
            visit(child, name, path, False)  # a function's own functions are its business

    for module, path in MODULES.items():
        if LAYERS[_unit(module)] <= LAYERS["storage"]:
            continue
        # Top-level names of a public module are public unless _-prefixed; elsewhere only those listed.
        visit(_tree(path), module, path, _is_public_module(module))
    assert loose == [], "take a Location instead:\n" + "\n".join(loose)
    assert kept == KEEPS_STORAGE_OPTIONS, f"no longer take storage_options: {KEEPS_STORAGE_OPTIONS - kept}"


#: What each public module exported before the redesign (2062839, issue 33): every name must still import.
NAMES_BEFORE_REDESIGN = {
    "dcp_ext": (
        "AsyncSaveHandle", "BucketNotFoundError", "CheckpointCorruptError", "CheckpointExistsError",
        "CheckpointInProgressError", "CheckpointInUseError", "CheckpointIncompleteError",
        "CheckpointKeyError", "CheckpointManager", "CheckpointNotFoundError", "CheckpointReader",
        "CheckpointReplacedError", "CheckpointRoot", "CheckpointWriter", "ChecksumMismatchError", "Codec",
        "CompactReport", "CredentialsError", "DcpExtError", "ForeignCheckpointError", "FullCheckpointReader",
        "HFExportReport", "IOConfig", "InvalidOptionError", "InvalidPathError", "InvalidTagError", "KeepAny",
        "KeepEvery", "KeepLast", "KeepMatching", "LayoutLoadPlanner", "LayoutSavePlanner", "MeshInfo",
        "NotACheckpointError", "Partition", "PostCommitError", "PretrainedLoadReport", "Problem",
        "RankPartition", "ReadOnceExchangeError", "ReshardError", "ResumeResult", "RetentionPolicy",
        "RetryPolicy", "Stager", "StagingStats", "StorageError", "StorageFullError", "StoragePermissionError",
        "StorageTimeoutError", "TagInfo", "TransientStorageError", "UnsafeNameError",
        "UnsafeUserContentError", "UnsupportedCodecError", "VerifyReport", "ZstdCodec", "close_checkpoints",
        "compact", "export_hf", "load", "load_pretrained", "register_model", "registered_model",
        "resume_from_checkpoint", "save", "save_checkpoint", "save_hf", "unwrap_checkpoint_exception",
        "verify", "verify_full",
    ),
    "dcp_ext.storage": (
        "FsspecStore", "IOStats", "IOStatsSnapshot", "IncompleteUpload", "LocalStore", "ObjectWriter",
        "S3Store", "Store", "TMP_MARK", "clear_client_cache", "join_path", "normalize_path", "open_store",
    ),
    "dcp_ext.metadata": (
        "DecodedMetadata", "FORMAT_VERSION", "IncrementalSection", "MAX_FRAME_SIZE", "METADATA_FILE",
        "StoredItem", "TORCH_METADATA_FILE", "check_integrity", "chunk_shapes", "decode_metadata",
        "encode_metadata", "load_torch_metadata", "read_created", "read_incremental_section",
        "read_leading_field", "seal", "to_torch_metadata", "validate_file_name",
    ),
    "dcp_ext.planners": (
        "LayoutLoadPlanner", "LayoutSavePlanner",
    ),
    "dcp_ext.layout": (
        "CHECKSUMS_SUFFIX", "DATA_SUFFIX", "FileAssignment", "InvalidTagError", "KIND_FILES", "MeshInfo",
        "NEWEST_FILE", "PARTIAL_SUFFIX", "PARTITION_FILE", "Partition", "REPLICATED_KIND", "RankPartition",
        "TagInfo", "USER_CONTENT_FILE", "data_file_name", "item_kind", "item_nbytes", "key_kind",
        "key_prefix", "kind_of", "partial_dir", "position_name", "split_items", "spread_name",
        "user_content_name", "validate_tag",
    ),
    "dcp_ext.config": (
        "IOConfig", "RetryPolicy", "parse_size",
    ),
}


def test_every_public_name_of_before_the_redesign_still_imports() -> None:
    import importlib

    missing = {module: [n for n in names if not hasattr(importlib.import_module(module), n)]
               for module, names in NAMES_BEFORE_REDESIGN.items()}
    assert not any(missing.values()), missing
    assert set(NAMES_BEFORE_REDESIGN["dcp_ext"]) <= set(importlib.import_module("dcp_ext").__all__)
