"""dcp_ext for PyTorch Lightning's ``pytorch_lightning`` package.

The same :class:`DcpExtCheckpointIO` and :class:`DcpExtModelParallelStrategy`
as :mod:`dcp_ext.integrations.lightning` (see there for what they do and the
smallest use), built on ``pytorch_lightning``'s base classes instead of
``lightning.pytorch``'s. Install, from a clone of the repository (dcp-ext is not
on PyPI): ``.venv/bin/pip install -e '.[lightning]'``.
"""

from __future__ import annotations

from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.plugins.io import CheckpointIO
from pytorch_lightning.strategies import ModelParallelStrategy

from ._lightning_common import CheckpointIOMixin, ModelParallelMixin
from ._lightning_resume import ModelCheckpointMixin, load_module

__all__ = ["DcpExtCheckpointIO", "DcpExtModelCheckpoint", "DcpExtModelParallelStrategy", "load_module"]


class DcpExtCheckpointIO(CheckpointIOMixin, CheckpointIO):
    """:class:`dcp_ext.integrations.lightning.DcpExtCheckpointIO` on ``pytorch_lightning``'s base classes (same arguments)."""


class DcpExtModelParallelStrategy(ModelParallelMixin, ModelParallelStrategy):
    """:class:`dcp_ext.integrations.lightning.DcpExtModelParallelStrategy` on ``pytorch_lightning``'s base classes (same arguments)."""


class DcpExtModelCheckpoint(ModelCheckpointMixin, ModelCheckpoint):
    """:class:`dcp_ext.integrations.lightning.DcpExtModelCheckpoint` on ``pytorch_lightning``'s ``ModelCheckpoint`` (same arguments)."""
