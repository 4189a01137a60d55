"""The API reference pages, generated at build time from the public names.

Every name in ``dcp_ext.__all__`` is rendered once, under its public path
(``::: dcp_ext.CheckpointManager``), on the page :data:`PAGES` assigns it to;
every public module (:data:`MODULES`) is rendered with the members of its
``__all__`` that are not top-level names (those are linked instead). Internal
module paths are never named: they are being moved (issue 33), the public
paths stay. A public name added later and not yet placed in :data:`PAGES`
still gets an entry, on the "Other public names" page, and the build says so.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field

log = logging.getLogger("mkdocs.plugins.dcp_ext_api")

PACKAGE = "dcp_ext"
MODULES = ("storage", "metadata", "planners", "layout", "config", "errors")


@dataclass(frozen=True)
class Page:
    """One page of the API reference."""

    slug: str
    title: str
    intro: str
    names: tuple[str, ...] = ()
    module: str | None = None  # a public module rendered at the top of the page
    sections: tuple[tuple[str, tuple[str, ...]], ...] = field(default=())
    #: Optional modules outside ``__all__`` (framework adapters), each rendered
    #: whole with the members of its own ``__all__``; read from source, so the
    #: frameworks they wrap need not be installed to build the site.
    extra_modules: tuple[str, ...] = ()


PAGES: tuple[Page, ...] = (
    Page(
        "save-load",
        "Saving and loading",
        "The DCP storage layer (`CheckpointWriter`, `CheckpointReader`) for stock `dcp.save`, "
        "`dcp.load` and `dcp.async_save`, the one-call wrappers `save` / `load` that raise "
        "dcp_ext's own errors, and the stager of asynchronous saves.",
        names=("save", "load", "CheckpointWriter", "CheckpointReader", "AsyncSaveHandle", "Stager", "StagingStats"),
    ),
    Page(
        "manager",
        "Checkpoint manager",
        "The SageMaker-style workflow: tagged partial checkpoints, `newest`, retention, user "
        "content, full checkpoints, tiers and incremental saves.",
        names=(
            "CheckpointManager", "ResumeResult", "save_checkpoint", "resume_from_checkpoint",
            "close_checkpoints", "register_model", "registered_model", "redistribute_dataloader",
        ),
    ),
    Page(
        "root",
        "Roots, tags and retention",
        "A checkpoint root seen from one process (listing, deletion, retention, leftovers), "
        "retention policies, and the records of a partial checkpoint's partition.",
        names=(
            "CheckpointRoot", "TagInfo", "RetentionPolicy", "KeepLast", "KeepEvery", "KeepMatching",
            "KeepAny", "Partition", "RankPartition", "MeshInfo",
        ),
    ),
    Page(
        "pretrained",
        "Pretrained weights and Hugging Face",
        "Loading full checkpoints (safetensors, Hugging Face folders, `torch.save` files) into "
        "sharded models, and writing Hugging Face folders from live state or a partial checkpoint.",
        names=("load_pretrained", "PretrainedLoadReport", "FullCheckpointReader", "save_hf", "export_hf", "HFExportReport"),
    ),
    Page(
        "frameworks",
        "Framework hooks",
        "Make stock `dcp.save` / `dcp.async_save` / `dcp.load` (and so torchtitan, Lightning or "
        "Accelerate code that passes only `checkpoint_id`) use dcp_ext, and load a whole checkpoint "
        "without a template. The framework adapters live in `dcp_ext.integrations`; see the "
        "[framework guide](../guides/integrations.md).",
        names=(
            "use_for_dcp", "stop_using_for_dcp", "active_dcp_default", "DcpDefault", "load_whole",
            "restore_optimizer_keys", "WholeStatePlanner", "KeyList", "UnsupportedTorchError",
        ),
    ),
    Page(
        "integrations",
        "Framework adapters",
        "`dcp_ext.integrations`: torchtitan's checkpoint manager, Lightning's `CheckpointIO` and "
        "`ModelParallelStrategy`, Accelerate's FSDP save/load functions and `transformers.Trainer`, "
        "saving and loading "
        "through dcp_ext. Each module imports its framework, so import the one you use; install "
        "with the extra of the same name from a clone (`.venv/bin/pip install -e '.[lightning]'`; "
        "dcp-ext is not on PyPI). See the "
        "[framework guide](../guides/integrations.md).",
        extra_modules=(
            "integrations.torchtitan", "integrations.lightning", "integrations.pytorch_lightning",
            "integrations.accelerate", "integrations.transformers",
        ),
    ),
    Page(
        "integrity",
        "Verification and compaction",
        "Checking every stored byte of a checkpoint, and rewriting an incremental checkpoint so "
        "that it refers to no other.",
        names=("verify", "verify_full", "VerifyReport", "Problem", "compact", "CompactReport"),
    ),
    Page(
        "config",
        "Configuration and codecs",
        "I/O tunables (also settable as `DCP_EXT_*` environment variables), the retry policy, "
        "and compression codecs.",
        module="config",
        names=("IOConfig", "RetryPolicy", "Codec", "ZstdCodec"),
    ),
    Page(
        "planners",
        "Planners",
        "The save and load planners of the partial-checkpoint layout, for stock `dcp.save` / "
        "`dcp.load` (`dcp_ext.save`, `dcp_ext.load` and the manager use them already).",
        module="planners",
        names=("LayoutSavePlanner", "LayoutLoadPlanner"),
    ),
    Page(
        "errors",
        "Errors",
        "Every error about a checkpoint or its storage derives from `DcpExtError` and from the "
        "built-in it resembles. Each class below is importable from `dcp_ext` and from "
        "`dcp_ext.errors`.",
        module="errors",
        names=(
            "DcpExtError", "CheckpointNotFoundError", "BucketNotFoundError", "NotACheckpointError",
            "CheckpointIncompleteError", "CheckpointExistsError", "CheckpointInProgressError",
            "CheckpointInUseError", "ForeignCheckpointError", "CheckpointReplacedError", "PostCommitError",
            "CheckpointCorruptError", "ChecksumMismatchError", "UnsupportedCodecError", "UnsafeNameError",
            "InvalidPathError", "InvalidOptionError", "InvalidTagError", "UnsafeUserContentError",
            "StoragePermissionError", "CredentialsError", "StorageError", "StorageFullError",
            "TransientStorageError", "StorageTimeoutError", "CheckpointKeyError", "ReshardError",
            "ReadOnceExchangeError", "RankStateMismatchError", "unwrap_checkpoint_exception",
        ),
    ),
    Page(
        "storage",
        "dcp_ext.storage",
        "Storage back-ends: where checkpoint bytes live. Most users never touch them directly: "
        "the writer, reader and manager open the right store from the path.",
        module="storage",
    ),
    Page(
        "metadata",
        "dcp_ext.metadata",
        "The checkpoint metadata on storage: dcp_ext's JSON document and torch's pickled "
        "`.metadata`. See also [the on-storage format](../format.md).",
        module="metadata",
    ),
    Page(
        "layout",
        "dcp_ext.layout",
        "Names and records of the partial-checkpoint layout: tags, `newest`, data file names, "
        "the partition record.",
        module="layout",
    ),
)

OTHER = Page("other", "Other public names", "Public names not yet grouped on another page.")


def _exports(module: str) -> list[str]:
    mod = importlib.import_module(module)
    names = getattr(mod, "__all__", None)
    if names is None:
        raise RuntimeError(f"{module} has no __all__: the API reference cannot list its public names")
    return [str(n) for n in names]


def _entry(identifier: str) -> str:
    return f"::: {identifier}\n"


def build() -> dict[str, str]:
    """``{path in the docs: markdown}`` of every API page, and the index."""
    top = _exports(PACKAGE)
    placed: dict[str, str] = {}
    for page in PAGES:
        for name in page.names:
            if name in placed:
                raise RuntimeError(f"{PACKAGE}.{name} is placed on two API pages: {placed[name]}, {page.slug}")
            placed[name] = page.slug
    missing = [n for n in top if n not in placed]
    gone = [n for n in placed if n not in top]
    pages = list(PAGES)
    if missing:
        log.info("API reference: %s not placed in docs/hooks/api_pages.py PAGES; rendered on '%s'",
                 ", ".join(missing), OTHER.title)
        pages.append(Page(OTHER.slug, OTHER.title, OTHER.intro, names=tuple(missing)))
        for name in missing:
            placed[name] = OTHER.slug
    module_exports = {m: _exports(f"{PACKAGE}.{m}") for m in MODULES}
    out: dict[str, str] = {}
    for page in pages:
        lines = [f"# {page.title}", "", page.intro, ""]
        if page.module:
            exports = module_exports[page.module]
            own = [n for n in exports if n not in top]
            also = [n for n in exports if n in top and n not in page.names]
            members = "[" + ", ".join(own) + "]" if own else "false"
            lines += [
                f"::: {PACKAGE}.{page.module}",
                "    options:",
                f"      members: {members}",
                "      show_root_heading: true",
                "      heading_level: 2",
                "",
            ]
            if also:
                lines += [
                    f"Also in `{PACKAGE}.{page.module}`, documented under their top-level name: "
                    + ", ".join(f"[`{n}`][{PACKAGE}.{n}]" for n in also) + ".",
                    "",
                ]
        for name in page.names:
            if name in gone:
                continue
            lines.append(_entry(f"{PACKAGE}.{name}"))
        for module in page.extra_modules:
            lines += [
                f"::: {PACKAGE}.{module}",
                "    options:",
                "      show_root_heading: true",
                "      heading_level: 2",
                "",
            ]
        out[f"api/{page.slug}.md"] = "\n".join(lines)
    # The index: every public name and module, with its page.
    index = [
        "# API reference",
        "",
        f"Generated from the docstrings of the public names: every name in `{PACKAGE}.__all__` "
        f"({len(top)} names) and the public modules "
        + ", ".join(f"`{PACKAGE}.{m}`" for m in MODULES)
        + ". Import everything from these paths; other modules are internal and may move.",
        "",
        "Docstrings say which ranks call what: *(all ranks)* is a collective call, "
        "*(coordinator)* runs on rank 0 only.",
        "",
        "| name | kind | page |",
        "|---|---|---|",
    ]
    titles = {p.slug: p.title for p in pages}
    mod = importlib.import_module(PACKAGE)
    for name in top:
        obj = getattr(mod, name)
        kind = "exception" if isinstance(obj, type) and issubclass(obj, BaseException) else \
            "class" if isinstance(obj, type) else "function" if callable(obj) else "data"
        index.append(f"| [`{PACKAGE}.{name}`][{PACKAGE}.{name}] | {kind} | [{titles[placed[name]]}]({placed[name]}.md) |")
    for m in MODULES:
        page = next(p.slug for p in pages if p.module == m)
        index.append(f"| [`{PACKAGE}.{m}`][{PACKAGE}.{m}] | module | [{titles[page]}]({page}.md) |")
    out["api/index.md"] = "\n".join(index) + "\n"
    return out


def nav() -> list[dict[str, str] | str]:
    """The API section of the navigation."""
    return ["api/index.md", *[{p.title: f"api/{p.slug}.md"} for p in PAGES]]
