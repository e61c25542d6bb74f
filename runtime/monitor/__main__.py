"""The monitor's server process: ``python -m closedloop.runtime.monitor RING HOST PORT`` (started by the session)."""

from .server import main

main()
