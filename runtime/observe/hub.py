"""Session observers: what attaches to a live session without slowing it.

A ``SessionObserver`` receives the session's start information, batches of step
records (``StepBatch``: step index, time, latency, lateness, the input used, the
model output, the command sent, flags), of model runs (``RunBatch``) and of commands
sent (``CommandBatch``) where it asks for them, events and the summary. The loop only writes
records into a ``StepRing``; an ``ObserverHub`` gives every in-process observer a thread
of its own that drains the ring at ``interval_s``, so a slow observer loses records
(counted in ``lost``) and never delays the loop or another observer.

An observer's work runs in the session's process and so shares its GIL: keep it
light (append to a list, put on a queue, write a socket). The browser monitor runs its
server in another process that attaches to the ring by name (``StepRing.attach``).

Example
-------
>>> from closedloop.runtime.observe import SessionObserver
>>> class Counter(SessionObserver):
...     def __init__(self):
...         self.steps = 0
...     def on_steps(self, batch):
...         self.steps += len(batch)
"""

from __future__ import annotations

import sys
import threading
import traceback
from typing import Any

from .ring import CommandBatch, RunBatch, StepBatch, StepRing


class SessionObserver:
    """Override what you need; every method runs on the observer's own thread, never on the loop's."""

    #: Records per delivery at most (None: everything since the last one).
    max_batch: int | None = None

    def on_start(self, info: dict[str, Any]) -> None:
        """The session started: bundle, family, device, backend, rate, and the names of inputs/outputs/command."""

    def on_steps(self, batch: StepBatch) -> None:
        """Records since the last call, oldest first; ``batch.lost`` counts those that were overwritten first."""

    def on_runs(self, batch: RunBatch) -> None:
        """Every model run since the last call (step, input frame, time, outputs), oldest first: a step that ran
        the model on several frames gives a run each, where ``on_steps`` gets the step's last. Only called for an
        observer that overrides it."""

    def on_commands(self, batch: CommandBatch) -> None:
        """Every command a step sent since the last call (step, time, flags, values), oldest first, the safe command
        included: a step that sent several (a decoder answering each frame of a backlog) gives one each, where
        ``on_steps`` gets the step's last (the loop's re-sends under ``--overrun hold`` and the stop's safe command,
        a ``stop_command`` event, have none). Only called for an observer that overrides it."""

    def on_event(self, event: dict[str, Any]) -> None:
        """A session event (watchdog, reconnect, device HELLO, scrub repair...), as recorded."""

    def on_stop(self, summary: dict[str, Any]) -> None:
        """The session ended; ``summary`` is ``SessionSummary.to_dict()``."""


class _Runner(threading.Thread):
    def __init__(self, hub: ObserverHub, observer: SessionObserver):
        super().__init__(name=f"closedloop-observer-{type(observer).__name__}", daemon=True)
        self.hub = hub
        self.observer = observer
        self.cursor = hub.ring.published
        self.event_cursor = hub.ring.events_published
        self.run_cursor = hub.ring.runs_published
        self.sent_cursor = hub.ring.commands_published
        # an object that does not subclass SessionObserver works too: a method it lacks is the base's (nothing)
        cls = type(observer)
        self.wants_runs = getattr(cls, "on_runs", SessionObserver.on_runs) is not SessionObserver.on_runs
        self.wants_commands = getattr(cls, "on_commands", SessionObserver.on_commands) is not SessionObserver.on_commands
        self.max_batch = getattr(observer, "max_batch", None)
        base = SessionObserver()
        self.on = {name: getattr(observer, name, None) or getattr(base, name)
                   for name in ("on_start", "on_steps", "on_runs", "on_commands", "on_event", "on_stop")}
        self.lost = 0
        self.runs_lost = 0
        self.commands_lost = 0
        self.delivered = 0
        self.error: str | None = None
        self._wake = threading.Event()

    def drain(self) -> None:
        ring = self.hub.ring
        events, self.event_cursor, _ = ring.read_events(self.event_cursor)
        for ev in events:
            self.on["on_event"](ev)
        batch, self.cursor = ring.read(self.cursor, self.max_batch)
        self.lost += batch.lost
        if len(batch) or batch.lost:
            self.delivered += len(batch)
            self.on["on_steps"](batch)
        if self.wants_runs:
            runs, self.run_cursor = ring.read_runs(self.run_cursor, self.max_batch)
            self.runs_lost += runs.lost
            if len(runs) or runs.lost:
                self.on["on_runs"](runs)
        if self.wants_commands:
            sent, self.sent_cursor = ring.read_commands(self.sent_cursor, self.max_batch)
            self.commands_lost += sent.lost
            if len(sent) or sent.lost:
                self.on["on_commands"](sent)

    def run(self) -> None:
        try:
            self.on["on_start"](self.hub.info)
            while not self.hub.stopping.is_set():
                self.drain()
                self.hub.stopping.wait(self.hub.interval_s)
            self.drain()  # what the loop wrote before it stopped
        except Exception:  # noqa: BLE001  (an observer's bug must not reach the session)
            self.error = traceback.format_exc(limit=4)
            sys.stderr.write(f"\nwarning: session observer {type(self.observer).__name__} failed and was detached:\n"
                             f"{self.error}")


class ObserverHub:
    """Owns the ring and one thread per observer. The session calls ``start``, writes the ring, then ``stop``."""

    def __init__(self, ring: StepRing, observers: list[SessionObserver], interval_s: float = 0.02):
        self.ring = ring
        self.observers = list(observers)
        self.interval_s = interval_s
        self.info: dict[str, Any] = {}
        self.stopping = threading.Event()
        self._runners: list[_Runner] = []

    @property
    def started(self) -> bool:
        return bool(self._runners) or not self.observers

    def start(self, info: dict[str, Any]) -> None:
        self.info = info
        self._runners = [_Runner(self, o) for o in self.observers]
        for r in self._runners:
            r.start()

    def stop(self, summary: dict[str, Any], timeout_s: float = 5.0) -> dict[str, dict[str, Any]]:
        """Deliver what is left, call ``on_stop``, join; return per-observer counts (delivered, lost, error), by the
        observer's class name (``NAME#2`` for a second observer of the same class, in the order given)."""
        self.stopping.set()
        report = {}
        for r in self._runners:
            r.join(timeout_s)
            if r.error is None and not r.is_alive():
                try:
                    r.on["on_stop"](summary)
                except Exception:  # noqa: BLE001
                    r.error = traceback.format_exc(limit=4)
            name = type(r.observer).__name__  # the class's name; a second observer of one class: NAME#2, and so on
            name = next(n for n in (name, *(f"{name}#{i}" for i in range(2, len(self._runners) + 2))) if n not in report)
            report[name] = {"delivered": r.delivered, "lost": r.lost, "error": r.error,
                            "still_running": r.is_alive()}
            if r.wants_runs:
                report[name]["runs_lost"] = r.runs_lost
            if r.wants_commands:
                report[name]["commands_lost"] = r.commands_lost
        return report
