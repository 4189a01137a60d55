"""Jobs on one checkpoint root, for the tests of the root's one rule (tests/test_deletion_rule.py).

``python -m tests.support.root_jobs ROOT OPTIONS_JSON TAG STEP [KEEP]`` (from
the repository root) is one training job's save: a single process (no
process group) with ``CheckpointManager(ROOT, incremental=True)`` saves the
model of :func:`model_at` ``(STEP)`` as ``TAG``, with ``KeepLast(KEEP)`` if
given, and exits 0 (1 with the error on stderr). ``OPTIONS_JSON`` is the
storage options (``{}`` for local paths). With ``DCP_EXT_PAUSE_AT`` and
``DCP_EXT_PAUSE_FILE`` set (see ``dcp_ext/_failpoints.py``) the save waits at
that point until the test says go, so the test can run another job or a CLI
command while it is in flight.
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

LAYERS = 5
WIDTH = 512


def model_at(step: int) -> nn.Sequential:
    """The model after ``step`` steps, a pure function of ``step``: layer 4's
    weight gains 1 at every step, layer 3's only at step 2 (the issue's
    reproducer: most frames stay, so incremental saves refer to earlier ones)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
    with torch.no_grad():
        model[4].weight += step
        if step >= 2:
            model[3].weight += 1
    return model


def main(argv: list[str]) -> int:
    import dcp_ext

    root, options, tag, step = argv[0], json.loads(argv[1]), argv[2], int(argv[3])
    keep = int(argv[4]) if len(argv) > 4 else None
    manager = dcp_ext.CheckpointManager(root, storage_options=options, incremental=True,
                                        retention=dcp_ext.KeepLast(keep) if keep else None)
    try:
        manager.save(tag, model_at(step))
    except Exception as err:  # noqa: BLE001 - reported to the test
        print(f"{type(err).__name__}: {err}", file=sys.stderr)
        return 1
    finally:
        manager.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
