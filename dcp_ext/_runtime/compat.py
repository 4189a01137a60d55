"""Every private name of torch that dcp_ext uses, in one place.

These are not torch's public API and may move between releases; when one
does, this module is the only place to change. Each comment says what dcp_ext
uses the name for and the torch release that has had it since; all exist in
the torch versions ``pyproject.toml`` admits (2.6 to 2.14). Every dcp_ext
module imports torch's private names from here, never from torch.

Not imports, so not here: the global names torch's pickles may hold, which
dcp_ext's restricted unpicklers match as strings (``.metadata`` in
:mod:`dcp_ext.metadata.torch_pickle`, ``torch.save`` files in
:mod:`dcp_ext.full._load`).
"""

from __future__ import annotations

# Narrows a whole stored tensor to the slice a ReadItem asks for (torch-written
# items are stored whole). Since torch 1.13.
from torch.distributed._shard._utils import narrow_tensor_by_index

# The flattened-key mapping of DCP's planners, to put a loaded non-tensor value
# back into a nested state dict, and the flattening itself (full checkpoints
# store optimizer tensors under flattened keys). Both modules since torch 2.1.
from torch.distributed.checkpoint._nested_dict import (
    FLATTEN_MAPPING,
    flatten_state_dict,
)
from torch.distributed.checkpoint._traverse import set_element

# The record torch's FileSystemWriter stores per item in ``.metadata``
# (file, offset, length): read when loading torch-written checkpoints, written
# for torch's readers of ours. Since torch 1.13 (DCP's first release).
from torch.distributed.checkpoint.filesystem import _StorageInfo

# The chunks a (D)Tensor holds locally, and DCP's read items for one tensor:
# what DefaultLoadPlanner does per key, reused for clearer resharding errors.
# _create_read_items since torch 1.13; _create_chunk_list since 2.3 at the
# latest (torch's own format_utils imports it there).
from torch.distributed.checkpoint.planner_helpers import (
    _create_chunk_list,
    _create_read_items,
)

# Torch's stream extensions (ZStandard, and any a user registers): decoding the
# items FileSystemWriter(_extensions=[...]) wrote. Since torch 2.7 (PR 143358);
# ``None`` before, where no writer could produce such items.
try:
    from torch.distributed.checkpoint._extension import (
        ExtensionRegistry,
        StreamTransformExtension,
    )
except ImportError:  # torch 2.6
    ExtensionRegistry = None  # type: ignore[assignment,misc]
    StreamTransformExtension = None  # type: ignore[assignment,misc]

__all__ = [
    "ExtensionRegistry",
    "FLATTEN_MAPPING",
    "StreamTransformExtension",
    "_StorageInfo",
    "_create_chunk_list",
    "_create_read_items",
    "flatten_state_dict",
    "narrow_tensor_by_index",
    "set_element",
]
