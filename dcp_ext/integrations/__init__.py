"""dcp_ext inside the frameworks people train with.

Each module imports its framework when it is imported itself, never from here,
so ``import dcp_ext`` (and ``import dcp_ext.integrations``) needs none of them:

* :mod:`dcp_ext.integrations.torchtitan`: ``DcpExtCheckpointManager``, a
  torchtitan checkpoint manager (and its ``Config``) saving and loading
  through dcp_ext (``pip install -e '.[torchtitan]'``, then torchtitan
  itself with ``--no-deps``: see that module).
* :mod:`dcp_ext.integrations.lightning` (``lightning.pytorch``) and
  :mod:`dcp_ext.integrations.pytorch_lightning` (``pytorch_lightning``):
  ``DcpExtCheckpointIO`` and ``DcpExtModelParallelStrategy``
  (``pip install -e '.[lightning]'``).
* :mod:`dcp_ext.integrations.accelerate`: FSDP2 sharded save/load of models
  and optimizers through dcp_ext, drop-in for accelerate's
  ``save_fsdp_model`` & co. (``pip install -e '.[accelerate]'``).

dcp-ext is not on PyPI: each extra is installed from a clone of the repository,
into its environment (``.venv/bin/pip install -e '.[lightning]'``).

For code that calls ``dcp.save(checkpoint_id=...)`` itself, see
:func:`dcp_ext.dcp_default.use_for_dcp`.
"""

__all__ = ()  # each framework module is imported by its own name, never from here
