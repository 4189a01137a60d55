"""``python -m bench.scale``: the scale simulator of issue 16, in one process per case.

For a Llama-style model (:mod:`bench.scale.shapes`) saved by N ranks (FSDP2,
optionally x TP) with Adam state, it synthesizes what the coordinator of a
``dcp.save`` receives, every rank's local ``SavePlan``, without tensor data
(:mod:`bench.scale.plans`), runs the real planners and metadata encoders and
decoders on it and measures (:mod:`bench.scale.cases`):

* the coordinator's global planning (``create_global_plan``) and metadata
  encoding time, the metadata's bytes (the global document, and per-data-file
  indexes separately), and the coordinator's peak RSS;
* one rank of a resharded load (N -> M, default M = N / 2): metadata decode
  time, its load planning time (``create_local_plan``) and its peak RSS;

for dcp_ext (``LayoutSavePlanner``, its JSON metadata, ``LayoutLoadPlanner``)
and for torch DCP (``DefaultSavePlanner``, pickled ``Metadata``,
``DefaultLoadPlanner``) as the baseline. Every save and every load runs in a
fresh child process (so its ``ru_maxrss`` is its own), on one thread, killed
after ``--timeout`` seconds or above ``--memory-limit``. ``--profile`` runs
the coordinator's planning under ``cProfile`` at the given N.

Every call into dcp_ext's metadata format goes through the adapter
(:mod:`bench.scale.adapter`: :func:`~bench.scale.adapter.finish_data_file`,
:func:`~bench.scale.adapter.encode_dcp_ext`, :func:`~bench.scale.adapter.decode_dcp_ext`,
:func:`~bench.scale.adapter.attach_dcp_ext_indexes`),
which follows the version dcp_ext's writer writes: change it, and nothing
else, when the format changes.

Modules: :mod:`~bench.scale.shapes` (the models), :mod:`~bench.scale.plans`
(every rank's plan and write results as DCP objects), :mod:`~bench.scale.fast`
(the same as dcp_ext's compact bytes, fast), :mod:`~bench.scale.adapter`,
:mod:`~bench.scale.cases` (the measured steps of one case),
:mod:`~bench.scale.simulator` (each step in a child process under limits, and
the command line; ``python -m bench.scale`` runs its ``main``) and
:mod:`~bench.scale.report` (the markdown).
"""

