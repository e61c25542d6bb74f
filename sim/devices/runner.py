"""Runs one :class:`~closedloop.sim.devices.base.Device` on a serial port: handshake, pacing, heartbeats, faults.

:class:`DeviceRunner` is the emulator's firmware main loop.  It opens the port with
the same transports a host uses (pyserial for a device path), wraps it in a
:class:`~closedloop.sim.faults.FaultyTransport` and a device-role :class:`~closedloop.firmware_bridge.Link`,
and then, in one thread: announces the device's HELLO once per second until a host
HELLO arrives, answers every host HELLO with a fresh HELLO, streams the device's
ticks at its rate on an absolute schedule (catching up after a hiccup, skipping
ahead after a long stall), sends a HEARTBEAT every second, answers report requests,
and plays the scheduled silence, disconnect and reset faults.  A reset is a board that
reboots behind a port that stays open (a USB-serial adapter): it goes quiet for
``reset_s``, then starts again as from power-on, on a fresh link (seq 0, a new signing
counter, no memory of the host's numbers), announcing its HELLO once a second until a
host HELLO answers it.  The device model itself carries on (the plant's physics and the
neural source do not reboot with the board).  Frame timestamps are the
device's own clock: microseconds since the runner was created.
"""

from __future__ import annotations

import json
import math
import os
import select
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from closedloop.firmware_bridge import (
    DeviceNotConnectedError,
    DeviceState,
    Heartbeat,
    Hello,
    Link,
    Message,
    Severity,
    Status,
    TransportError,
    open_transport,
)

from ..faults import FaultConfig, FaultyTransport, misbehave
from .base import Device, StatusCode

__all__ = ["DeviceRunner", "PortGoneError", "stderr_log"]

_MAX_WAIT_S = 0.05
_STALL_S = 1.0  # further behind than this: skip ahead instead of bursting the backlog
_MAX_TICKS_PER_PASS = 64


class PortGoneError(ConnectionError):
    """The serial port went away and could not be reopened."""


class DeviceRunner:
    """The main loop of one emulated device on one port.

    Parameters
    ----------
    device : Device
        What to emulate.
    port : str
        Serial port path or device URL the device writes to (one end of a pty, or a real port).
    faults : FaultConfig
        Faults to inject into what the device writes.
    seed : int
        Seed of the fault decisions (the device seeds its own data).
    shared_secret : bytes, optional
        Sign every frame and require signed frames from the host.
    log : callable, optional
        Receives one line per notable event (``--verbose``).
    reopen_s : float
        After the port fails unexpectedly, keep trying to reopen it this long, then give up.
    """

    def __init__(self, device: Device, port: str, *, faults: FaultConfig | None = None, seed: int = 0,
                 shared_secret: bytes | None = None, log: Callable[[str], None] | None = None,
                 reopen_s: float = 2.0, host_pid: int | None = None) -> None:
        self.device = device
        self.port = port
        self.faults = faults or FaultConfig()
        self.shared_secret = shared_secret
        self.reopen_s = reopen_s
        #: The pid of the process that started this emulator behind a pty (sim://), if any.
        self.host_pid = host_pid
        self._log = log
        self._t0_ns = time.monotonic_ns()
        self._fault_rng = np.random.default_rng(np.random.SeedSequence([seed, 0xFA17]))
        self._misbehave_rng = np.random.default_rng(np.random.SeedSequence([seed, 0xBAD]))  # glitch, nonfinite
        self._misbehaves = bool(self.faults.glitch or self.faults.nonfinite)
        self.faulty: FaultyTransport | None = None
        self.link: Link | None = None
        self.streaming = False
        self.stream_start_s = 0.0
        self.tick_index = 0
        self.ticks_skipped = 0
        self.host_hellos = 0
        self.host_heartbeats = 0
        self.resets = 0
        self._period_s = 1.0 / device.rate_hz
        self._next_heartbeat_s = 0.0
        self._next_announce_s = 0.0
        self._silence: tuple[float, float] | None = None
        self._disconnect: tuple[float, float] | None = None
        self._reset: tuple[float, float] | None = None
        self._rebooting = False
        self._faults_armed = False  # the scheduled faults play once, from the first streaming start
        self._stop = False

    # -- clock -------------------------------------------------------------------------------
    def now_s(self) -> float:
        """Device time in seconds since start."""
        return (time.monotonic_ns() - self._t0_ns) * 1e-9

    def clock_us(self) -> int:
        """Device time in microseconds since start (frame timestamps)."""
        return (time.monotonic_ns() - self._t0_ns) // 1000

    def log(self, text: str) -> None:
        if self._log is not None:
            self._log(f"[{self.device.NAME} {self.now_s():8.3f}s] {text}")

    # -- lifecycle ---------------------------------------------------------------------------
    def open(self) -> None:
        """Open the port; the device announces its HELLO right away."""
        self.faulty = FaultyTransport(open_transport(self.port), self.faults, self._fault_rng, self.now_s)
        self.link = self._new_link()
        self.log(f"serving on {self.port}")

    def _new_link(self) -> Link:
        # A fresh Link is what a booted board has: seq 0, a signing counter from the clock, no host history.
        return Link(self.faulty, shared_secret=self.shared_secret, role="device",  # type: ignore[arg-type]
                    clock_us=self.clock_us)

    def stop(self) -> None:
        """Ask the loop to end (safe from a signal handler)."""
        self._stop = True

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
        self.device.close()

    def run(self, duration_s: float | None = None) -> None:
        """Serve until :meth:`stop` (or for ``duration_s``).

        Raises
        ------
        PortGoneError
            When the port failed and did not come back within ``reopen_s``.
        """
        if self.link is None:
            self.open()
        end_s = math.inf if duration_s is None else self.now_s() + duration_s
        while not self._stop and self.now_s() < end_s:
            now = self.now_s()
            try:
                self._scheduled_faults(now)
                if self._rebooting:
                    self.faulty.read(65536, 0.0)  # type: ignore[union-attr]  # a board that is off hears nothing
                else:
                    self._receive(now)
                    self._stream(now)
                    self._housekeeping(now)
                self.faulty.flush_due()  # type: ignore[union-attr]
            except DeviceNotConnectedError as exc:
                self._recover(exc)
            self._wait()

    # -- sending -----------------------------------------------------------------------------
    def send(self, message: Message, t_s: float | None = None) -> None:
        ts = self.clock_us() if t_s is None else int(round(t_s * 1e6))
        self.link.send(message, ts)  # type: ignore[union-attr]

    def _flush_outbox(self) -> None:
        outbox, self.device.outbox = self.device.outbox, []
        for message in outbox:
            if isinstance(message, Status):
                self.log(f"status {_code_name(message.code)}: {message.text}")
            self.send(message)

    # -- receiving ---------------------------------------------------------------------------
    def _receive(self, now: float) -> None:
        for frame in self.link.poll():  # type: ignore[union-attr]
            message = frame.message
            if isinstance(message, Hello):
                self._on_host_hello(message, now)
            elif isinstance(message, Heartbeat):
                self.host_heartbeats += 1
            elif isinstance(message, Status) and message.code == StatusCode.REQUEST_REPORT:
                self.send(Status(int(StatusCode.REPORT), Severity.INFO, self.report_text()))
            else:
                self.device.on_message(message, now)
        self._flush_outbox()

    def _on_host_hello(self, hello: Hello, now: float) -> None:
        if hello.kind != "host":
            self.device.notify(StatusCode.BAD_COMMAND, Severity.WARNING,
                               f"ignored a HELLO of kind {hello.kind!r}; a host introduces itself with "
                               "Hello(kind='host')", now)
            return
        self.host_hellos += 1
        self.send(self.device.hello())
        if self.streaming:
            self.log(f"host HELLO again ({hello.name or 'unnamed'}): streaming continues")
            self.device.notify(StatusCode.HOST_RECONNECTED, Severity.INFO,
                               f"host HELLO #{self.host_hellos}: streaming continues at tick {self.tick_index}",
                               now, min_interval_s=0.0)
            return
        self.streaming = True
        self.stream_start_s = now
        self.tick_index = 0
        cfg = self.faults
        if not self._faults_armed:  # after a reset the stream starts again; the faults stay played
            self._faults_armed = True
            if cfg.silence_at is not None:
                self._silence = (now + cfg.silence_at, now + cfg.silence_at + cfg.silence_s)
            if cfg.disconnect_at is not None:
                self._disconnect = (now + cfg.disconnect_at, now + cfg.disconnect_at + cfg.disconnect_s)
            if cfg.reset_at is not None:
                self._reset = (now + cfg.reset_at, now + cfg.reset_at + cfg.reset_s)
        self.device.start(now)
        active = cfg.active()
        text = f"streaming at {self.device.rate_hz:g} Hz" + (f"; fault injection: {active}" if active else "")
        self.log(f"host HELLO ({hello.name or 'unnamed'}): {text}")
        self.device.notify(StatusCode.STREAMING, Severity.WARNING if active else Severity.INFO, text, now,
                           min_interval_s=0.0)

    # -- streaming and housekeeping ----------------------------------------------------------
    def _tick_time(self, index: int) -> float:
        return self.stream_start_s + index * self._period_s

    def _stream(self, now: float) -> None:
        if not self.streaming:
            return
        behind = now - self._tick_time(self.tick_index)
        if behind > _STALL_S:
            skip = int(behind / self._period_s)
            self.tick_index += skip
            self.ticks_skipped += skip
            self.device.notify(StatusCode.OVERRUN, Severity.WARNING,
                               f"fell {behind:.3f} s behind real time; skipped {skip} ticks", now)
        for _ in range(_MAX_TICKS_PER_PASS):  # bounded, so host messages are read even when behind
            if self._tick_time(self.tick_index) > now:
                break
            t_tick = self._tick_time(self.tick_index)
            for message in self.device.tick(self.tick_index, t_tick):
                self.send(misbehave(message, self.faults, self._misbehave_rng, self.faulty.counters)  # type: ignore[union-attr]
                          if self._misbehaves else message, t_tick)
            self.tick_index += 1
            self._flush_outbox()

    def _housekeeping(self, now: float) -> None:
        if not self.streaming and now >= self._next_announce_s:  # first: a device's first frame is HELLO
            self.send(self.device.hello())
            self._next_announce_s = now + 1.0
        if now >= self._next_heartbeat_s:
            state = self.device.state() if self.streaming else DeviceState.IDLE
            self.send(Heartbeat(state))
            self._next_heartbeat_s = now + 1.0

    def _scheduled_faults(self, now: float) -> None:
        faulty = self.faulty
        if self._silence is not None:
            begin, end = self._silence
            if not faulty.muted and begin <= now < end:
                self.log(f"fault: silent for {end - begin:g} s")
                faulty.muted = True
            elif now >= end:
                faulty.muted = False
                self._silence = None
                self.log("fault: silence over")
                self.device.notify(StatusCode.FAULT_SILENCE, Severity.WARNING,
                                   f"fault injected: was silent for {end - begin:g} s", now, min_interval_s=0.0)
        if self._disconnect is not None:
            begin, end = self._disconnect
            if faulty.connected and begin <= now < end:
                self.send(Status(int(StatusCode.FAULT_DISCONNECT), Severity.WARNING,
                                 f"fault injected: closing the port for {end - begin:g} s"))
                self.log(f"fault: port closed for {end - begin:g} s")
                faulty.detach()
            elif now >= end:
                self._disconnect = None
                self._reopen(f"after the injected {end - begin:g} s disconnect")
        if self._reset is not None:
            begin, end = self._reset
            if not self._rebooting and begin <= now < end:
                self.log(f"fault: resetting; silent for {end - begin:g} s, then HELLO at seq 0")
                self._rebooting = True
                self.streaming = False
            elif now >= end:
                self._reset = None
                self._boot(now)

    def _boot(self, now: float) -> None:
        """Start again as a board does after a reset: new link, not streaming, HELLO first."""
        self._rebooting = False
        self.streaming = False
        self.resets += 1
        self.link = self._new_link()
        self._next_announce_s = now
        self._next_heartbeat_s = now
        self.log("fault: restarted (seq 0); announcing HELLO until a host answers")

    def _reopen(self, why: str) -> None:
        deadline = self.now_s() + self.reopen_s
        while True:
            try:
                self.faulty.attach(open_transport(self.port))  # type: ignore[union-attr]
                break
            except (TransportError, DeviceNotConnectedError, OSError) as exc:
                if self.now_s() >= deadline or self._stop:
                    raise PortGoneError(f"{self.port} could not be reopened for {self.reopen_s:g} s ({exc}); "
                                        "the other end is gone, so the emulator stops") from exc
                time.sleep(0.05)
        self.log(f"port reopened {why}")
        self.send(Status(int(StatusCode.RECONNECTED), Severity.INFO, f"port reopened {why}"))

    def _recover(self, exc: Exception) -> None:
        if self.host_pid is not None:
            # Started behind a sim:// host's pty: the device end fails only when the host closed
            # the master (its session ended) or died, and a pty whose master is closed is gone
            # for good. Its number may already belong to another host's new pty (a test suite
            # opens many), so reopening the path would take that one over: stop instead.
            alive = os.getppid() == self.host_pid
            raise PortGoneError(f"{self.port} failed ({exc}); the host that started this emulator "
                                + ("closed its end" if alive else "is gone"))
        self.log(f"port lost ({exc}); reopening")
        self.faulty.detach()  # type: ignore[union-attr]
        self._reopen("after the port failed")

    def _wait(self) -> None:
        now = self.now_s()
        deadline = self._next_heartbeat_s
        if self._rebooting:  # nothing is due until the board is up again (the reset's end, below)
            deadline = math.inf
        elif self.streaming:
            deadline = min(deadline, self._tick_time(self.tick_index))
        else:
            deadline = min(deadline, self._next_announce_s)
        for pending in (self.faulty.next_release_s(),  # type: ignore[union-attr]
                        *(self._silence or ()), *(self._disconnect or ()), *(self._reset or ())):
            if pending is not None and pending > now:
                deadline = min(deadline, pending)
        timeout = min(max(deadline - now, 0.0), _MAX_WAIT_S)
        fd = self.faulty.fileno()  # type: ignore[union-attr]
        if fd is None:
            time.sleep(timeout)
        elif timeout > 0:
            select.select([fd], [], [], timeout)

    # -- reporting ---------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """Counters and state for a REPORT status."""
        link = self.link
        return {
            "device": self.device.NAME, "kind": self.device.KIND, "uptime_s": round(self.now_s(), 3),
            "params": {k: v for k, v in self.device.params.items() if k != "key"},
            "streaming": self.streaming, "ticks": self.tick_index, "ticks_skipped": self.ticks_skipped,
            "host_hellos": self.host_hellos, "host_heartbeats": self.host_heartbeats, "resets": self.resets,
            "frames_sent": link.stats.frames_sent if link else 0,
            "received": link.stats.received.as_dict() if link else {},
            "faults": self.faulty.counters.as_dict() if self.faulty else {},
            **self.device.report(),
        }

    def report_text(self) -> str:
        text = json.dumps(self.report(), separators=(",", ":"), default=float)
        if len(text.encode()) > 4000:
            text = json.dumps({"truncated": True, **{k: v for k, v in self.report().items()
                                                     if k in ("device", "kind", "streaming", "ticks")}})
        return text


def _code_name(code: int) -> str:
    try:
        return StatusCode(code).name
    except ValueError:
        return str(code)


def stderr_log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
