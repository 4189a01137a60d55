"""Helpers shared by the tests (and ``bench/``); none of these modules holds tests.

One job each:

* ``compare``: bit-exact comparison of nested state dicts and tensors.
* ``states``: load targets shaped like a state dict (``zeros_like_state``).
* ``hostile``: a pickle that would run a shell command if unpickled.
* ``metadata_edit``: deliberate, re-signed edits of ``dcp_ext.metadata.json``.
* ``s3_servers``: real moto and SeaweedFS S3 servers on 127.0.0.1.
* ``backends``: the storage backends the ``backend`` fixtures hand to tests.
* ``fault_proxy``: a fault-injecting HTTP proxy in front of an S3 server.
* ``dist``: ``run_world``, a function on every rank of a spawned gloo world.
* ``dist_workers``, ``api_workers``, ``reshard_workers``,
  ``torch_format_workers``, ``smp_workers``, ``hf_export_workers``: rank code of the multi-rank tests (importable by
  name, as spawned ranks need).
* ``crash_job`` / ``crash_torture``: killed 2-rank saves and their checks.
* ``damage_trials``: damaged checkpoint roots and their checks (``flip_byte``).
* ``resource_job``: repeated saves in a fresh interpreter, measured.

Scripts run as modules from the repository root, e.g.
``python -m tests.support.crash_job ROOT STEP CRASH``; :data:`REPO` is that
root (the ``cwd`` for such subprocesses).
"""

from pathlib import Path

#: The repository root: the working directory for ``python -m tests.support.*`` jobs.
REPO = Path(__file__).resolve().parents[2]
