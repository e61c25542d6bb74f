"""``closedloop -v run ...``: the session's start, events and end as log messages, written by an observer.

A session attaches an :class:`EventLog` when the ``closedloop.session`` logger is enabled at INFO (``-v`` on the
command line, or ``logging.basicConfig(level=logging.INFO)`` in a program). Like every observer it runs on its own
thread and reads the step ring, so logging never runs on the loop's thread. INFO: what ran on what (bundle,
backend, rate, device and its HELLO), each event as recorded (watchdog trips, reconnects, refused inputs, scrub
repairs...) and the end; DEBUG (``-vv``) adds the periodic status updates and each ``typed`` event.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from .hub import SessionObserver

log = logging.getLogger("closedloop.session")

#: events said at DEBUG only: frequent, and the status line or the summary says them already
_CHATTY = {"status", "typed"}


class EventLog(SessionObserver):
    """Log the session's start, events and end (``closedloop.session``); attached by the session at INFO."""

    def on_start(self, info: dict[str, Any]) -> None:
        name, path = info.get("bundle_name"), info.get("bundle")
        log.info("session: bundle %s (family %s) on %s at %g Hz, device %s",
                 f"{name} ({path})" if name else path, info.get("family"), info.get("backend"),
                 info.get("rate_hz", 0.0), info.get("device_url"))

    def on_event(self, event: dict[str, Any]) -> None:
        kind = event.get("event", "?")
        level = logging.DEBUG if kind in _CHATTY else logging.INFO
        if not log.isEnabledFor(level):
            return
        if kind == "session_info":
            log.info("device: %s", json.dumps(event.get("device", {}), sort_keys=True, default=str))
            return
        rest = {k: v for k, v in event.items() if k not in ("event", "step")}
        log.log(level, "step %s: %s%s", event.get("step"), kind,
                (" " + json.dumps(rest, sort_keys=True, default=str)) if rest else "")

    def on_stop(self, summary: dict[str, Any]) -> None:
        loop = summary.get("loop", {})
        log.info("session ended (%s): %s steps, p99 %.0f us, %s missed deadlines, %s commands sent, %s safe, "
                 "%s watchdog trips, %s reconnects", loop.get("stopped_by"), loop.get("steps"),
                 loop.get("latency_p99_us") or 0.0, loop.get("missed_deadlines"), summary.get("commands_sent"),
                 summary.get("safe_commands_sent"), summary.get("watchdog_trips"), summary.get("reconnects"))
