"""Quiet torch's notices that say nothing to a dcp_ext user.

When dcp_ext calls ``dcp.save`` / ``dcp.load`` on the user's behalf
(``dcp_ext.save``, ``load``, ``save_checkpoint``, ``resume_from_checkpoint``,
``load_pretrained``), two of torch's messages are noise:

* the ``UserWarning`` that torch.distributed is not initialized and the call
  runs in one process: a documented way to use dcp_ext;
* the root-logger warning "Global metadata is not found. Falling back to rank
  local metadata." with a traceback, logged before the reader's own clear
  error (dcp_ext does not write rank-local metadata, so the fallback never
  applies).

Both are silenced only inside :func:`torch_notices_quieted`; calls of stock
``dcp.save`` / ``dcp.load`` elsewhere keep torch's behaviour.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

__all__ = ["torch_notices_quieted"]

_SINGLE_PROCESS = r"torch\.distributed is (disabled, )?(unavailable|uninitialized)"


def _not_metadata_fallback(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Global metadata is not found")


@contextlib.contextmanager
def torch_notices_quieted() -> Iterator[None]:
    """Within the block, drop torch's single-process warning and metadata-fallback log."""
    root = logging.getLogger()  # torch.distributed.checkpoint logs on the root logger
    root.addFilter(_not_metadata_fallback)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS, category=UserWarning)
            yield
    finally:
        root.removeFilter(_not_metadata_fallback)
