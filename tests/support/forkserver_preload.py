"""What the suite's fork server imports besides torch (``tests/conftest.py``
adds this module to :data:`tests.support.dist.FORKSERVER_PRELOAD`).

dcp_ext itself, so that no rank, forked job or forked command
(``tests/support/forked.py``) imports it again: 0.15-0.45 s of CPU each
(more without ``.pyc`` files, e.g. under ``PYTHONDONTWRITEBYTECODE``), for
well over a hundred processes per run. dcp_ext starts no thread at import.

The only settings dcp_ext reads from the environment at import are its
failure points (``DCP_EXT_CRASH_AT``, ``DCP_EXT_FAIL_AT``, ``DCP_EXT_PAUSE_AT``,
``dcp_ext._runtime.failpoints``); they are imported here disarmed, whatever
the test process's environment holds when the fork server starts. Rank code
arms them as it always has, by setting the variable and calling
``failpoints.reload()`` (a rank's worker module is imported when its
process is unpickled, before ``run_world`` hands it the caller's
environment, so that was already the only way); ``forked.start`` re-reads
them from the environment it gives its process. Everything else dcp_ext
reads from the environment (``IOConfig``, node ranks, ``MASTER_ADDR``) it reads
when called, after the rank took the caller's environment.

And what torch imports lazily on a rank's first ``fully_shard`` (FSDP2
wraps its DTensor conversions in ``torch._disable_dynamo``, whose first call
imports ``torch._dynamo`` and with it ``torch._inductor``, ``torch.onnx``
and parts of numpy): 0.8-1.2 s of CPU in every forked rank that shards a
model, measured 0.99 -> 0.14-0.20 s for a rank's FSDP2 set-up and training
step (2 ranks, forked). Importing them starts no thread, so forking after
them is as safe as after ``import torch``.
"""

from __future__ import annotations

import os

_FAILPOINT_VARIABLES = ("DCP_EXT_CRASH_AT", "DCP_EXT_FAIL_AT", "DCP_EXT_PAUSE_AT", "DCP_EXT_PAUSE_FILE")

_saved = {name: os.environ.pop(name) for name in _FAILPOINT_VARIABLES if name in os.environ}
try:
    import dcp_ext  # noqa: F401
finally:
    os.environ.update(_saved)

import torch._dynamo  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
