"""One overwrite, for tests/test_overwrite.py: ``python -m tests.support.overwrite_job KIND PATH VALUE [OPTIONS_JSON]``.

KIND ``plain`` saves :func:`state` ``(VALUE)`` to PATH with
``dcp_ext.save(..., overwrite=True, files_per_rank=2)``; KIND ``manager``
saves it as tag ``last`` of the root PATH with ``CheckpointManager.save(...,
overwrite=True, user_content={"value": VALUE})`` (partition.json and user
content written beside the data). With ``DCP_EXT_CRASH_AT`` set the process
kills itself there (``dcp_ext/_runtime/failpoints.py``).
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn


def state(value: float) -> dict[str, torch.Tensor]:
    """Enough bytes that ``mid_data`` falls inside the data (3 MiB)."""
    return {"w": torch.full((512, 512), value), "v": torch.arange(256 * 1024, dtype=torch.float32) + value,
            "b": torch.full((7,), value)}


def model(value: float) -> nn.Module:
    layer = nn.Linear(512, 512)
    with torch.no_grad():
        layer.weight.fill_(value)
        layer.bias.fill_(-value)
    return layer


def main(argv: list[str]) -> int:
    import dcp_ext

    kind, path, value = argv[0], argv[1], float(argv[2])
    options = json.loads(argv[3]) if len(argv) > 3 else {}
    if kind == "plain":
        dcp_ext.save(state(value), path, overwrite=True, files_per_rank=2, storage_options=options)
    else:
        manager = dcp_ext.CheckpointManager(path, storage_options=options)
        manager.save("last", model(value), user_content={"value": value}, overwrite=True)
        manager.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
