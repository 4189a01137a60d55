"""The dcp_ext test suite.

A package, so that pytest puts the repository root (not ``tests/``) on
``sys.path`` and test modules, spawned ranks, subprocess jobs
(``python -m tests.support.crash_job``) and ``bench/`` all import the shared
helpers the same way: ``from tests.support.dist import run_world``.
"""
