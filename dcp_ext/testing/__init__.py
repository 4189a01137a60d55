"""Test suites that third-party code can reuse (imports pytest; ``import dcp_ext`` never imports it).

* :mod:`dcp_ext.testing.store`: :class:`~dcp_ext.testing.store.StoreTests`,
  the contract every storage backend passes (as zarr ships
  ``zarr.testing.store.StoreTests``).
"""
