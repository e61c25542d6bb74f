"""The session's side of the hooks: one object the loop calls a few times per step.

``SessionTap`` owns the step ring, the observer hub (user observers on their own
threads) and the browser monitor's process. The session calls ``begin`` at the start
of a step, ``acted`` / ``command`` / ``flag`` as the step goes, and the loop calls
``publish`` with the step's latency and lateness; events and status updates go through
``event`` and ``status``. Every call is a few array writes: nothing allocates, nothing
waits for a reader.
"""

from __future__ import annotations

import logging
import secrets
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

import numpy as np

from .hub import ObserverHub, SessionObserver
from .ring import FLAG_ACTED, FLAG_COMMAND, FLAG_SAFE, StepRing

log = logging.getLogger("closedloop.session")


class MonitorAddressError(ValueError):
    """``--monitor`` asks for an address the session will not bind without being told it may."""


class SessionTap:
    def __init__(self, info: dict[str, Any], n_in: int, n_out: int, n_cmd: int, n_state: int = 0,
                 observers: list[SessionObserver] | None = None, monitor: str | None = None,
                 monitor_public: bool = False, status_interval_s: float = 0.25, out: TextIO | None = None,
                 capacity: int = 8192, monitor_avoid_cpu: int | None = None):
        self.out = out if out is not None else sys.stderr
        self.info = dict(info, t0_ns=time.monotonic_ns())
        self.ring = StepRing.create(n_in, n_out, n_cmd, capacity=capacity, n_state=n_state)
        self.info["ring"] = self.ring.name  # /dev/shm/NAME, for readers in other processes (docs/monitor.md)
        self.info["ring_capacity"] = capacity  # step records it holds: an observer further behind loses the oldest
        log.info("step ring: /dev/shm/%s (%d records, %d inputs, %d outputs, %d command values, %d state values "
                 "per record)", self.ring.name, capacity, n_in, n_out, n_cmd, n_state)
        self.hub = ObserverHub(self.ring, observers or [])
        self.monitor = None
        self.status_interval_ns = int(status_interval_s * 1e9)
        self._next_status_ns = 0
        self._closed = False
        self.last_run_ns = 0  # when the newest model output was ready (the last run record's time)
        self.monitor_exit: int | None = None  # the monitor server's exit status, had it ended mid-session
        try:
            if monitor is not None:
                self.monitor = _start_monitor(self.ring, monitor, monitor_public, self.info, self.out,
                                              monitor_avoid_cpu)
        except BaseException:
            self.ring.close()
            raise

    def start(self, more_info: dict[str, Any]) -> None:
        """The session is about to run (the device answered): start the observers; tell the monitor."""
        self.info.update(more_info)
        self.hub.start(self.info)  # the observers' cursors start here: session_info is their first event
        self.ring.event({"event": "session_info", "step": -1, **more_info})

    @property
    def monitor_url(self) -> str | None:
        return self.monitor.url if self.monitor is not None else None

    # --- per step (the loop's thread) -------------------------------------------------------

    def begin(self, step: int, t_ns: int | None = None) -> None:
        """A step starts at ``t_ns`` (``time.monotonic_ns``; default now)."""
        self.ring.begin(step, time.monotonic_ns() if t_ns is None else t_ns)

    def acted(self, seq: int, frame: np.ndarray, output: np.ndarray,
              more: Sequence[tuple[int, np.ndarray]] = (), state: np.ndarray | None = None,
              t_ns: int | None = None) -> None:
        """The model ran on input frame ``seq``: its first data output, ``(offset, values)`` of the others, and the
        family's state after the run (``FamilyPlugin.state_vector``); ``t_ns``: when the outputs were ready
        (monotonic; default now)."""
        r = self.ring
        r.set_input_seq(seq)
        row = r.input_row()
        if row.size == frame.size:
            np.copyto(row, frame.reshape(-1), casting="unsafe")
        r.set_output(output)
        for offset, values in more:
            r.set_output(values, offset)
        if state is not None:
            r.set_state(state)
        r.add_flags(FLAG_ACTED)
        self.last_run_ns = time.monotonic_ns() if t_ns is None else t_ns
        r.publish_run(self.last_run_ns)

    def command(self, values: np.ndarray, t_ns: int, safe: bool = False) -> None:
        """A command went to the device at ``t_ns`` (monotonic, right after the write): the model's, or with
        ``safe`` the safe command."""
        self.ring.publish_command(values, t_ns, FLAG_SAFE if safe else FLAG_COMMAND)

    def flag(self, flags: int) -> None:
        self.ring.add_flags(flags)

    def publish(self, step: int, latency_ns: int, lateness_ns: int) -> None:  # noqa: ARG002 (the loop's signature)
        self.ring.publish(latency_ns, lateness_ns)

    def event(self, record: dict[str, Any]) -> None:
        self.ring.event(record)

    def status_due(self) -> bool:
        now = time.monotonic_ns()
        if now < self._next_status_ns:
            return False
        self._next_status_ns = now + self.status_interval_ns
        self._check_monitor()
        return True

    def _check_monitor(self) -> None:
        """A monitor server that ended mid-session (killed, crashed) is said once: its page stops updating, and the
        session goes on without it."""
        mon = self.monitor
        if mon is None or self.monitor_exit is not None:
            return
        code = mon.exit_code()
        if code is not None:
            self.monitor_exit = code
            self.ring.event({"event": "monitor_gone", "step": -1, "exit_code": code})
            self.out.write(f"\nwarning: the monitor's server (pid {mon.pid}) exited (status {code}): {mon.url} no "
                           "longer updates; the session goes on without it\n")

    # --- end --------------------------------------------------------------------------------

    def close(self, summary: dict[str, Any] | None = None, reason: str | None = None) -> dict[str, Any]:
        """Stop observers (each gets ``on_stop``) and the monitor; free the ring. Returns per-observer counts.

        ``reason``: how the session ended (``session_end``'s ``reason``), so a reader tells a refused handshake or
        a safety stop from a session that ran its course."""
        if self._closed:
            return {}
        self._closed = True
        try:
            end: dict[str, Any] = {"event": "session_end", "step": -1}
            if reason:
                end["reason"] = reason
            self.ring.event(end)
            report = self.hub.stop(summary or {}) if self.hub.started else {}
        finally:
            if self.monitor is not None:
                self.monitor.stop()
            self.ring.close()
        return report


def _start_monitor(ring: StepRing, address: str, public: bool, info: dict[str, Any], out: TextIO,
                   avoid_cpu: int | None = None) -> Any:
    from closedloop.runtime.monitor.server import MonitorProcess, is_loopback, parse_address

    host, port = parse_address(address)
    token = None
    if not is_loopback(host):
        if not public:
            raise MonitorAddressError(
                f"--monitor {address}: {host} is reachable from other machines, and the monitor shows the live "
                "session; bind 127.0.0.1 (--monitor PORT), or pass --monitor-public to serve it there with a token")
        token = secrets.token_urlsafe(16)
    mon = MonitorProcess(ring, host, port, token, info, avoid_cpu=avoid_cpu)
    if token is not None:
        out.write(f"warning: the monitor listens on {host}:{mon.port}, reachable from other machines; it asks for "
                  "the token in this URL\n")
    out.write(f"monitor: {mon.url}\n")
    if getattr(mon, "remote_url", None):
        out.write(f"monitor from other machines: {mon.remote_url}\n")
    out.flush()
    return mon
