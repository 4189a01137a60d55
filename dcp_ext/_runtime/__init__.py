"""Process plumbing every layer may use: torch compatibility, the process-group view, watched collectives, node topology, GC pauses, memory release, torch's notices, crash points, the name validator."""

from __future__ import annotations

from .compat import (
    FLATTEN_MAPPING,
    ExtensionRegistry,
    StreamTransformExtension,
    _create_chunk_list,
    _create_read_items,
    _StorageInfo,
    flatten_state_dict,
    narrow_tensor_by_index,
    set_element,
)
from .failpoints import crash_point, fail_point
from .gc_pause import LEASE_SECONDS, GcLease, HookPause, gc_paused
from .group import GroupView
from .names import validate_name_part, validate_relative_name
from .nodes import NodeMap, local_node_identity
from .rank_watch import LOAD_PHASES, SAVE_PHASES, RankWatch, WatchedGroup, watched_group
from .release_memory import release_free_memory
from .torch_notices import torch_notices_quieted

__all__ = [
    "ExtensionRegistry",
    "FLATTEN_MAPPING",
    "GcLease",
    "HookPause",
    "GroupView",
    "LEASE_SECONDS",
    "LOAD_PHASES",
    "RankWatch",
    "SAVE_PHASES",
    "WatchedGroup",
    "watched_group",
    "NodeMap",
    "StreamTransformExtension",
    "_StorageInfo",
    "_create_chunk_list",
    "_create_read_items",
    "crash_point",
    "fail_point",
    "flatten_state_dict",
    "gc_paused",
    "local_node_identity",
    "narrow_tensor_by_index",
    "release_free_memory",
    "set_element",
    "torch_notices_quieted",
    "validate_name_part",
    "validate_relative_name",
]
