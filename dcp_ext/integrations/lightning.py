"""dcp_ext for Lightning (the ``lightning`` package: ``lightning.pytorch``).

* :class:`DcpExtCheckpointIO`: a ``CheckpointIO`` plug-in for Lightning's
  default strategies (single device, DDP): each checkpoint (``last.ckpt``,
  ``epoch=0-step=100.ckpt``) becomes a dcp_ext checkpoint directory, local or
  on S3/fsspec, saved again in place by default (``save_last=True``), loaded
  without a template with the optimizer's integer keys restored;
* :class:`DcpExtModelParallelStrategy`: ``ModelParallelStrategy`` (FSDP2 /
  tensor parallel), whose distributed checkpoints go through dcp_ext and keep
  ``s3://`` and fsspec URLs intact.

For ``pytorch_lightning`` use :mod:`dcp_ext.integrations.pytorch_lightning`
(the same classes on that namespace). Install: ``pip install
'dcp-ext[lightning]'``.

``ModelCheckpoint`` lists, checks and names its files itself with fsspec and
no options, so with a ``dirpath`` on S3 it needs credentials and endpoint
that fsspec finds on its own (the usual ``AWS_*`` environment, profiles,
instance roles); ``trainer.save_checkpoint(url)`` and
``fit(ckpt_path=url)`` use only the options given here.

Smallest use::

    import lightning.pytorch as L
    from dcp_ext.integrations.lightning import DcpExtCheckpointIO, DcpExtModelParallelStrategy

    s3 = {"client_kwargs": {"region_name": "us-east-1"}}
    # DDP (or one device): the plug-in
    trainer = L.Trainer(strategy="ddp", plugins=[DcpExtCheckpointIO(storage_options=s3, compression="zstd")],
                        callbacks=[L.callbacks.ModelCheckpoint(dirpath="ckpts", save_last=True)])
    trainer.fit(model, ckpt_path="ckpts/last.ckpt")
    # FSDP2 / tensor parallel: the strategy
    trainer = L.Trainer(strategy=DcpExtModelParallelStrategy(storage_options=s3, compression="zstd"))
    trainer.fit(model)
    trainer.save_checkpoint("s3://bucket/run1/step1000.ckpt")
    L.Trainer(strategy=DcpExtModelParallelStrategy(storage_options=s3)).fit(
        model, ckpt_path="s3://bucket/run1/step1000.ckpt")
"""

from __future__ import annotations

from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy

from ._lightning_common import CheckpointIOMixin, ModelParallelMixin

__all__ = ["DcpExtCheckpointIO", "DcpExtModelParallelStrategy"]


class DcpExtCheckpointIO(CheckpointIOMixin, CheckpointIO):
    __doc__ = CheckpointIOMixin.__doc__


class DcpExtModelParallelStrategy(ModelParallelMixin, ModelParallelStrategy):
    __doc__ = ModelParallelMixin.__doc__
