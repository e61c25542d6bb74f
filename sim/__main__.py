"""``python -m sim NAME --port PATH ...``: see :mod:`sim.cli`."""

from .cli import cli_main

raise SystemExit(cli_main())
