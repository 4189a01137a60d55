"""The SageMaker-style checkpoint API: CheckpointManager and the save_checkpoint / resume_from_checkpoint functions.

A facade (:mod:`._manager`) over parts with one job each: partial
checkpoints in the root (:mod:`._partial`), tiered ones (:mod:`._tiered`,
only with ``local_tier``), full ones (:mod:`._full`), the save in flight
(:mod:`._in_flight`); options (:mod:`._options`), what parts share
(:mod:`._context`), requests and results (:mod:`._requests`), the SMP
functions and their managers (:mod:`._smp`), the registered model
(:mod:`._registry`). May import every other subpackage; only the package
root, the CLI and the integrations import it.
"""

from __future__ import annotations

from ._manager import CheckpointManager
from ._options import FullSaveOptions, IncrementalOptions, TierOptions
from ._registry import register_model, registered_model
from ._requests import ResumeResult
from ._smp import close_checkpoints, resume_from_checkpoint, save_checkpoint

__all__ = [
    "FullSaveOptions",
    "IncrementalOptions",
    "TierOptions",
    "CheckpointManager",
    "ResumeResult",
    "close_checkpoints",
    "register_model",
    "registered_model",
    "resume_from_checkpoint",
    "save_checkpoint",
]
