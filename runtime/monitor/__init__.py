"""The browser monitor of a live session (``closedloop run ... --monitor PORT``); needs the ``[monitor]`` extra."""

from .server import MonitorApp, MonitorProcess, is_loopback, parse_address, steps_message

__all__ = ["MonitorApp", "MonitorProcess", "is_loopback", "parse_address", "steps_message"]
