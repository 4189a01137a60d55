"""The benchmark harness: what several suites share, below every suite.

``machine`` (the machine facts every results JSON records), ``world`` (a
function on N spawned gloo ranks), ``state`` (the synthetic transformer-like
state dict), ``systems`` (the storage systems compared), ``worker`` (what each
rank of ``python -m bench`` runs: the throughput loop and the RSS probe),
``report`` (medians, ratios, markdown, results files), ``chart`` (PNG charts),
``training`` (the FSDP2 training job that ``bench.blocking`` and
``bench.tiers`` checkpoint) and ``storage`` (where one of their runs saves).

The rule (checked by tests/test_bench_layout.py): ``bench.cli`` imports
suites, suites import the harness, the harness imports no suite and nothing
imports ``bench.cli``. Import the module you need (``from bench.harness.state
import make_spec``); this package imports nothing, so a suite pays only for
the modules it uses.
"""
