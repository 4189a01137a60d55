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
"""

from __future__ import annotations

import os

_FAILPOINT_VARIABLES = ("DCP_EXT_CRASH_AT", "DCP_EXT_FAIL_AT", "DCP_EXT_PAUSE_AT", "DCP_EXT_PAUSE_FILE")

_saved = {name: os.environ.pop(name) for name in _FAILPOINT_VARIABLES if name in os.environ}
try:
    import dcp_ext  # noqa: F401
finally:
    os.environ.update(_saved)
