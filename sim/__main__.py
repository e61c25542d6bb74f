"""``python -m closedloop.sim NAME --port PATH ...``: see :mod:`closedloop.sim.cli`."""

from .cli import cli_main

raise SystemExit(cli_main())
