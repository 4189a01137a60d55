"""``dcp-ext`` / ``python -m dcp_ext``: command-line entry point (see :mod:`dcp_ext.cli`)."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
