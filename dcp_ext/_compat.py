"""Every private name of torch that dcp_ext uses, in one place.

These are not torch's public API and may move between releases; when one
does, this module is the only place to change. Each is checked against the
torch versions ``pyproject.toml`` admits (2.6 to 2.14).
"""

from __future__ import annotations

# The record torch's FileSystemWriter stores per item in ``.metadata``
# (file, offset, length): read when loading torch-written checkpoints, written
# for torch's readers of ours.
from torch.distributed.checkpoint.filesystem import _StorageInfo

# Narrows a whole stored tensor to the slice a ReadItem asks for (torch-written
# items are stored whole).
from torch.distributed._shard._utils import narrow_tensor_by_index

# The flattened-key mapping of DCP's planners, to put a loaded non-tensor value
# back into a nested state dict, and the flattening itself (full checkpoints
# store optimizer tensors under flattened keys).
from torch.distributed.checkpoint._nested_dict import FLATTEN_MAPPING, flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element

# The chunks a (D)Tensor holds locally, and DCP's read items for one tensor:
# what DefaultLoadPlanner does per key, reused for clearer resharding errors.
from torch.distributed.checkpoint.planner_helpers import _create_chunk_list, _create_read_items

__all__ = [
    "FLATTEN_MAPPING",
    "_StorageInfo",
    "_create_chunk_list",
    "_create_read_items",
    "flatten_state_dict",
    "narrow_tensor_by_index",
    "set_element",
]
