"""``--lsl-out NAME``: a session observer that publishes the session as LSL streams.

Three outlets (four for a family that publishes its state), so any LSL consumer (LabRecorder, a BCI display, another lab's
pipeline) can follow a live session next to the streams it already records:

=================  ===========  ===========================  ====================================
outlet             type         channels                     one sample per
=================  ===========  ===========================  ====================================
``NAME-outputs``   ModelOutput  every data output, in order  model run (every frame the model ran on)
``NAME-commands``  Command      the command's values         command sent (safe too)
``NAME-text``      Markers      one string (irregular rate)  step that typed text (its characters)
``NAME-state``     State        the family's state values    step that ran the model (an observer's
                                (``info["state"]`` labels)   estimate; absent for other families)
=================  ===========  ===========================  ====================================

A graph with several data outputs (a click head beside a velocity) puts them one after another in
``NAME-outputs``; its description's ``channels`` name each channel (``velocity[0]``, ``click``), the
XDF convention LabRecorder and pyxdf read.

An output sample's LSL timestamp is when the model's output was ready (the ring's run record);
a command's is when it was written to the device (the ring's sent record), and a state sample's the end of the
step that computed it. All are the loop's monotonic clock mapped onto
``pylsl.local_clock()`` with an offset measured once at the start, so outputs and commands line
up with the input stream's timestamps on one clock.
On Linux both clocks are ``CLOCK_MONOTONIC`` and the offset is about a microsecond.
The observer runs on its own thread (``ObserverHub``); a slow consumer costs the outlet,
never the loop.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from closedloop.firmware_bridge.transports.lsl import import_pylsl

from .hub import SessionObserver
from .ring import CommandBatch, RunBatch, StepBatch

log = logging.getLogger("closedloop.lsl")

#: what each outlet's timestamps are (its ``desc/clock``), all on ``local_clock()``
_CLOCKS = {
    "outputs": "when the model output was ready (the step ring's run record), on local_clock()",
    "commands": "when the command was written to the device, on local_clock()",
    "state": "end of the session step whose model run computed the state, on local_clock()",
    "text": "when the model output that typed the sample's last character was ready (a reset: when the session "
            "noticed it), on local_clock()",
}


def clock_offset_s(pylsl: Any, reads: int = 9) -> tuple[float, float]:
    """``(local_clock() - time.monotonic(), uncertainty)`` in seconds, from the tightest of ``reads`` bracketed reads."""
    best = (0.0, float("inf"))
    for _ in range(reads):
        t0 = time.monotonic_ns()
        lsl = pylsl.local_clock()
        t1 = time.monotonic_ns()
        width = (t1 - t0) / 1e9
        if width < best[1]:
            best = (lsl - (t0 + t1) / 2e9, width)
    return best


#: How long ``--lsl-out NAME`` looks on the network for outlets of that name already there (another session's).
NAME_CHECK_S = 0.3

#: How long the outlets stay after the session's last sample when an inlet is connected, so it is delivered.
END_LINGER_S = 0.1


class LslOutlets(SessionObserver):
    """Publish a session's model outputs, commands and typed text as LSL outlets named ``NAME-...``.

    Parameters
    ----------
    name : str
        The outlets' name prefix (``--lsl-out NAME``).
    source_id : str, optional
        Prefix of the outlets' source ids (default ``closedloop:NAME``), so a consumer
        reconnects to the same streams when the session restarts.
    wait_s : float
        ``--lsl-out-wait``: when the outlets open, publish nothing until every one has a consumer (an inlet), for
        at most ``wait_s`` seconds, so a recorder that resolves the streams once they appear gets the session from
        its first step. The loop runs meanwhile; its steps wait in the step ring (8,192 steps: 8 s at 1 kHz) and are
        then published with their own timestamps; steps beyond the ring's capacity are lost (``lost``).

    Attributes
    ----------
    pushed : dict
        Samples pushed per outlet (``outputs``, ``commands``, ``text``, ``state``).
    lost : int
        Step records the ring overwrote before this observer read them (states not published).
    lost_outputs : int
        Model-run records the ring overwrote before this observer read them (outputs not published).
    lost_commands : int
        Sent-command records the ring overwrote before this observer read them (commands not published).
    offset_s : float
        ``local_clock() - time.monotonic()`` measured at the start.
    waited_s : float
        How long ``wait_s`` held the publishing back (0 without it).
    without_consumer : list of str
        The outlets that still had no consumer when ``wait_s`` ran out.
    """

    def __init__(self, name: str, source_id: str | None = None, wait_s: float = 0.0):
        if not name or any(c in name for c in "'\"\n"):
            raise ValueError(f"--lsl-out {name!r}: give a plain stream name prefix, like 'closedloop'")
        if not wait_s >= 0:
            raise ValueError(f"--lsl-out-wait {wait_s!r}: give the seconds to wait for consumers, 0 or more")
        self.wait_s = float(wait_s)
        self.waited_s = 0.0
        self.without_consumer: list[str] = []
        self.name = name
        self.source_id = source_id or f"closedloop:{name}"
        self._lsl = import_pylsl()  # fail at construction (the CLI's argument check), not in the session
        self._refuse_a_name_in_use()
        self.offset_s, self.offset_uncertainty_s = clock_offset_s(self._lsl)
        self.info: dict[str, Any] = {}
        self.outlets: dict[str, Any] = {}
        self.pushed = {"outputs": 0, "commands": 0, "text": 0, "state": 0}
        self.lost = 0
        self.lost_outputs = 0
        self.lost_commands = 0
        self._stop_command: dict[str, Any] | None = None

    def _refuse_a_name_in_use(self) -> None:
        """Outlets of this name already on the network (another session's ``--lsl-out`` of the same name): a
        consumer could not tell the two sessions' streams apart (same names, same source ids), so it is refused."""
        pred = " or ".join(f"name='{self.name}-{w}'" for w in ("outputs", "commands", "text", "state"))
        found = self._lsl.resolve_bypred(pred, 1, NAME_CHECK_S)
        if found:
            i = found[0]
            raise ValueError(f"--lsl-out {self.name}: the LSL stream {i.name()!r} is already on the network (source_id "
                             f"{i.source_id()!r}, host {i.hostname()!r}): another session publishes under this name, "
                             "and a consumer could not tell the two apart; give --lsl-out another name")

    # --- outlets ----------------------------------------------------------------------------

    def _outlet(self, which: str, stream_type: str, n: int, rate_hz: float, fmt: str,
                labels: list[str] | None = None) -> Any:
        lsl = self._lsl
        info = lsl.StreamInfo(f"{self.name}-{which}", stream_type, n, rate_hz, fmt, f"{self.source_id}:{which}")
        desc = info.desc()
        desc.append_child_value("producer", "closedloop")
        for key in ("bundle_name", "family", "backend", "device_url"):
            if self.info.get(key) is not None:
                desc.append_child_value(key, str(self.info[key]))
        desc.append_child_value("clock", _CLOCKS[which])
        if labels is not None and len(labels) == n:
            channels = desc.append_child("channels")
            for label in labels:
                channels.append_child("channel").append_child_value("label", label)
        return lsl.StreamOutlet(info)

    def output_labels(self) -> list[str] | None:
        """A channel label per output value: the output's name, with ``[j]`` where it has several values."""
        outputs = self.info.get("outputs")
        if not isinstance(outputs, list):
            return None
        return [o["name"] if o["size"] == 1 else f"{o['name']}[{j}]" for o in outputs for j in range(o["size"])]

    def _open(self, n_out: int, n_cmd: int, n_state: int = 0) -> None:
        rate = float(self.info.get("rate_hz") or 0.0)
        if n_out and "outputs" not in self.outlets:
            self.outlets["outputs"] = self._outlet("outputs", "ModelOutput", n_out, rate, "float32",
                                                   self.output_labels())
        if n_cmd and "commands" not in self.outlets:
            self.outlets["commands"] = self._outlet("commands", "Command", n_cmd, rate, "float32")
        labels = self.info.get("state")
        if n_state and "state" not in self.outlets and isinstance(labels, list) and len(labels) == n_state:
            self.outlets["state"] = self._outlet("state", "State", n_state, rate, "float32", [str(x) for x in labels])
        if "text" not in self.outlets and self.info.get("types_text", True):  # only a family that types has text
            self.outlets["text"] = self._outlet("text", "Markers", 1, self._lsl.IRREGULAR_RATE, "string")

    def lsl_time(self, t_ns: np.ndarray) -> np.ndarray:
        """``time.monotonic_ns`` values on the LSL clock, in seconds."""
        return np.asarray(t_ns, dtype=np.float64) / 1e9 + self.offset_s

    # --- SessionObserver --------------------------------------------------------------------

    def on_start(self, info: dict[str, Any]) -> None:
        self.info = dict(info)
        n_out, n_cmd = info.get("n_out"), info.get("n_cmd")
        if isinstance(n_out, int) and isinstance(n_cmd, int):
            self._open(n_out, n_cmd, len(info.get("state") or []))
            if self.wait_s > 0:
                self._wait_for_consumers()

    def _wait_for_consumers(self) -> None:
        """Hold publishing back until every outlet has an inlet, at most ``wait_s`` (this observer's thread: the
        loop's steps wait in the ring)."""
        names = ", ".join(f"{self.name}-{w}" for w in self.outlets)
        log.info("lsl-out: waiting up to %g s for a consumer of %s", self.wait_s, names)
        t0 = time.monotonic()
        for which, outlet in self.outlets.items():
            left = t0 + self.wait_s - time.monotonic()
            if not outlet.wait_for_consumers(max(0.0, left)):
                self.without_consumer.append(f"{self.name}-{which}")
        self.waited_s = time.monotonic() - t0
        if self.without_consumer:
            log.warning("lsl-out: no consumer of %s after %g s; publishing anyway",
                        ", ".join(self.without_consumer), self.wait_s)
        else:
            # the loop's steps waited in the step ring, which keeps its newest ring_capacity: beyond, the first are lost
            rate, capacity = float(self.info.get("rate_hz") or 0.0), int(self.info.get("ring_capacity") or 0)
            over = int(self.waited_s * rate) - capacity if rate and capacity else 0
            if over > 0:
                log.warning("lsl-out: every outlet has a consumer after %.2f s; the step ring holds the last %d steps, "
                            "so about the first %d steps (%.1f s) are not published (counted as lost)",
                            self.waited_s, capacity, over, over / rate)
            else:
                log.info("lsl-out: every outlet has a consumer after %.2f s; publishing from the first step",
                         self.waited_s)

    def _push(self, which: str, values: np.ndarray, stamps: np.ndarray) -> None:
        outlet = self.outlets.get(which)
        if outlet is None:
            return
        rows = np.flatnonzero(~np.isnan(values).all(axis=1))  # NaN rows: nothing was sent (or a refused input)
        if rows.size:
            outlet.push_chunk(np.ascontiguousarray(values[rows]), stamps[rows].tolist())
            self.pushed[which] += int(rows.size)

    def on_steps(self, batch: StepBatch) -> None:
        self.lost += batch.lost
        if not len(batch):
            return
        self._open(batch.outputs.shape[1], batch.command.shape[1], batch.state.shape[1])
        self._push("state", batch.state, self.lsl_time(batch.t_ns + batch.latency_ns))

    def on_commands(self, batch: CommandBatch) -> None:
        """Every command sent, several in one step included, stamped when it was written to the device."""
        self.lost_commands += batch.lost
        if not len(batch):
            return
        self._open(int(self.info.get("n_out") or 0), batch.command.shape[1])
        self._push("commands", batch.command, self.lsl_time(batch.t_ns))

    def on_runs(self, batch: RunBatch) -> None:
        """Every model output, a step that ran the model on several frames included, stamped when it was ready."""
        self.lost_outputs += batch.lost
        if not len(batch):
            return
        self._open(batch.outputs.shape[1], int(self.info.get("n_cmd") or 0))
        self._push("outputs", batch.outputs, self.lsl_time(batch.t_ns))

    def on_event(self, event: dict[str, Any]) -> None:
        """A ``typed`` event: the characters a step typed, stamped when the model output that typed them was
        ready (the same stamp as that output's sample on ``NAME-outputs``)."""
        text, t_ns = event.get("text"), event.get("t_ns")
        if event.get("event") == "stop_command":  # the safe command the session sent as it ended: pushed in on_stop,
            self._stop_command = event             # after the steps' commands (events are delivered before steps)
            return
        if event.get("event") != "typed" or not isinstance(text, str) or "text" not in self.outlets:
            return
        stamp = t_ns / 1e9 + self.offset_s if isinstance(t_ns, int) and t_ns > 0 else self._lsl.local_clock()
        # a reset (a new trial, a re-handshake) is a sample of its own, "\n": the text after it starts again
        for sample in (["\n"] if event.get("reset") else []) + ([text] if text else []):
            self.outlets["text"].push_sample([sample], stamp)
            self.pushed["text"] += 1

    def on_stop(self, summary: dict[str, Any]) -> None:
        stop, outlet = self._stop_command, self.outlets.get("commands")
        if stop is not None and outlet is not None:
            values, t_ns = np.asarray(stop.get("values") or [], dtype=np.float32), stop.get("t_ns")
            if values.size == outlet.channel_count and isinstance(t_ns, int):
                outlet.push_sample(values.tolist(), t_ns / 1e9 + self.offset_s)
                self.pushed["commands"] += 1
        if any(o.have_consumers() for o in self.outlets.values()):
            time.sleep(END_LINGER_S)  # liblsl sends in the background: let the last samples leave first
        self.outlets.clear()  # liblsl withdraws a stream when its outlet is destroyed
