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
(the same classes on that namespace). Install, from a clone of the repository
(dcp-ext is not on PyPI): ``.venv/bin/pip install -e '.[lightning]'``.

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

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy

from ._lightning_common import CheckpointIOMixin, ModelParallelMixin
from ._lightning_resume import ModelCheckpointMixin, load_module

__all__ = ["DcpExtCheckpointIO", "DcpExtModelCheckpoint", "DcpExtModelParallelStrategy", "load_module"]


class DcpExtCheckpointIO(CheckpointIOMixin, CheckpointIO):
    """A Lightning ``CheckpointIO`` that stores each checkpoint as a dcp_ext
    checkpoint directory (local, ``s3://`` or any fsspec URL).

    Lightning calls it on global rank 0 only to save and delete (its default
    strategies: single device, DDP), and on every rank to load; no call is
    collective: a save is a single-process ``dcp.save(no_dist=True)``, a load
    is :func:`dcp_ext.load_whole` on each rank.

    The whole checkpoint dict is saved: tensors as DCP items (checksummed,
    optionally compressed), everything else (loops, callbacks, hyper-
    parameters) as DCP byte items. Loading needs no template and gives the
    optimizer states their integer parameter keys back.

    ``LightningModule.load_from_checkpoint(path)`` opens ``path`` with
    ``torch.load`` itself (not through the plug-in) and fails on these
    directories; load ``dcp_ext.load_whole(path)["state_dict"]`` into the
    module instead.

    Args:
        storage_options: fsspec/s3fs options for every call; a per-call
            ``storage_options`` (``trainer.save_checkpoint(...,
            storage_options=...)``) is merged on top.
        compression: ``None`` or ``"zstd"`` (or a :class:`~dcp_ext.Codec`).
        overwrite: Replace an existing checkpoint of the same name (on by
            default: ``ModelCheckpoint(save_last=True)`` saves ``last.ckpt``
            again and again, as ``TorchCheckpointIO`` allows).
        **writer_options: More :class:`~dcp_ext.CheckpointWriter` arguments.
    """


class DcpExtModelParallelStrategy(ModelParallelMixin, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 / tensor parallel) saving
    and loading its distributed checkpoints through dcp_ext.

    The stock strategy ignores ``CheckpointIO`` for distributed checkpoints
    and runs the path through ``pathlib.Path``, so ``s3://bucket/x`` becomes
    the local directory ``./s3:/bucket/x``. This one keeps the path a string
    and writes Lightning's layout with dcp_ext: the DCP shards of
    ``state_dict`` and ``optimizer_{i}`` (every rank writes its own), and the
    rest of the checkpoint in ``meta.pt`` beside them, written by the
    coordinator before the commit, so a checkpoint is complete or absent.
    Checkpoints are interchangeable with the stock strategy's (uncompressed
    ones both ways; torch's reader cannot read compressed ones).

    ``save_distributed_checkpoint=False`` (a single full file assembled on
    rank 0) is the stock strategy's, on local paths only.

    Args:
        storage_options: fsspec/s3fs options; a per-call ``storage_options``
            (``trainer.save_checkpoint(..., storage_options=...)``) is merged on top.
        compression: ``None`` or ``"zstd"`` (or a :class:`~dcp_ext.Codec`).
        overwrite: Replace an existing checkpoint of the same name (default).
        io_options: :class:`~dcp_ext.IOConfig` fields for every save and load
            (``{"max_concurrency": 16, "part_size": "32MiB"}``).
        *args: The stock strategy's positional arguments.
        **kwargs: The stock strategy's keyword arguments (``data_parallel_size``,
            ``tensor_parallel_size``, ``save_distributed_checkpoint``...).
    """


class DcpExtModelCheckpoint(ModelCheckpointMixin, ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` for ``dirpath`` on S3 or any URL: ``fit(ckpt_path="last")``
    finds the newest ``last.ckpt`` there (stock Lightning finds none on an object store and
    starts over from step 0), and Lightning's own listing and checks get ``storage_options``.

    Args:
        storage_options: The ``dirpath`` store's options (endpoint, credentials), the same as
            the plug-in's or strategy's. Installed as fsspec's defaults for ``dirpath``'s
            scheme, since Lightning builds its file systems without options.

    Every other argument is ``ModelCheckpoint``'s, passed on unchanged.
    """
