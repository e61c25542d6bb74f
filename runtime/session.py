"""Closed-loop sessions: a bundle, a device, the real-time loop between them.

``run_session`` opens the device URL (a serial port, ``sim://`` emulator, ``replay://``
recording, ``loop://``, ``socket://``; the session cannot tell them apart), does the
handshake, refuses a device that does not match the bundle (naming both values),
then runs one step per period: read everything that arrived, act on the newest
input frame (or on every frame in order, for families that need every bin), run
the model, send the clipped command, and record. A watchdog sends the safe command
when input stops for ``watchdog_s`` and the session resumes when frames return; a
lost transport is reopened every ``reconnect_interval_s``. A device HELLO that does
not answer the host's own is a device that restarted behind an open port: the session
re-handshakes (checks it against the bundle as at the start, answers it, resets the
family's state) and acts on its new stream. A model input (after the
family's preprocessing), model output or command that is not finite is never acted
on: the safe command goes out instead, counted, and state that became non-finite is
reset (``FamilyPlugin.guarded_step``, ``recover_nonfinite``). A live status line and a
summary report rate, latency, missed deadlines and link errors.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from closedloop.firmware_bridge import (
    DeviceNotConnectedError,
    Frame,
    Heartbeat,
    Hello,
    Link,
    Message,
    ParserStats,
    Status,
    Transport,
    WriteBlockedError,
    open_transport,
    redact_device_url,
)
from closedloop.runtime.protect.scrubber import session_scrubber

from .backends.registry import get_backend_class
from .bundle import Bundle, load_bundle
from .families import FamilyPlugin, get_family
from .loop import LoopConfig, OverrunPolicy, RealTimeLoop, overrun_policy
from .manifest import GraphSpec
from .model import Model
from .observe.event_log import EventLog
from .observe.record_steps import StepRecorder
from .observe.ring import FLAG_DISCONNECTED, FLAG_WATCHDOG
from .observe.tap import SessionTap
from .realtime import (
    DEFAULT_PRIORITY,
    RealtimeConfig,
    RealtimeGrant,
    emulator_realtime,
    format_grant,
    realtime,
)
from .recording import RecordingWriter, RecordType
from .stats import LoopSummary, RingRecorder

# A device answers every host HELLO with its own (docs/devices.md). A device HELLO this soon after the host's
# is taken as that answer; any other is a device that restarted and waits for a host HELLO (it repeats its
# own once a second, so the window stays under a second: a restart inside it is answered at the repeat).
HELLO_ANSWER_S = 0.75
#: In a pipe or a CI log (stderr not a terminal), the status line is a plain line this often.
PLAIN_STATUS_S = 10.0
#: characters of typed text a status update carries (its newest): the updates must fit the step ring's event slot
#: (2,048 bytes) in a session of any length; `typed` events carry every character, the recording keeps them all
STATUS_TEXT_CHARS = 1000
# STATUS codes of docs/devices.md: the host asks for a REPORT, the device answers with one (JSON text).
REQUEST_REPORT, REPORT = 1, 2


_log = logging.getLogger("closedloop.session")


class SessionError(RuntimeError):
    """The session could not start (no handshake, device does not match the bundle)."""


class DeviceMismatchError(SessionError, ValueError):
    """The device's Hello contradicts the bundle (channels, rate, limits)."""


class DeviceChangedError(DeviceMismatchError):
    """Mid-session, the device came back as another that does not match the bundle: a safety stop."""


@dataclass
class SessionConfig:
    """How to run a session; only ``device`` is required.

    ``device``: the device URL (``serial:///dev/ttyACM0``, ``sim://headstage``, ``lsl://NAME``, ``replay://FILE``;
    docs/devices.md). ``backend``: ``"auto"`` (time each available backend, keep the fastest p99) or a name;
    ``variant``: a bundle variant (``fp16``, ``int8``...; None: fp32). ``duration_s`` / ``max_steps``: when to end
    (None: until stopped). ``rate_hz``: the loop's rate (None: the bundle's). ``record``: a new ``.clrec`` file to
    write (an existing one is refused). ``watchdog_s``: seconds without input before the safe command goes out;
    ``watchdog_limit_s``: seconds without input before the session ends (a safety stop; None: never).
    ``handshake_timeout_s``: seconds to wait for the device's HELLO. ``overrun``: what a period the loop missed does,
    ``"skip"``, ``"hold"`` (re-send the last command) or ``"stop"`` (end the session). ``key``: the link's shared
    secret (hex) for signed frames. ``status``: the live status line on ``out`` (stderr); False for library use.
    ``inputs``: values of the data inputs the device does not stream (a goal). ``trust``: public key files or folders;
    a bundle none of them signed is refused. ``observers``: ``SessionObserver`` objects (per-step hooks).
    ``monitor``: ``[HOST:]PORT`` of the browser monitor. ``lsl_out``: NAME of the LSL outlets. ``rt``, ``rt_cpu``,
    ``rt_priority``: SCHED_FIFO, the CPU to pin to and the priority (docs/realtime.md). ``wake_on_input``: step as
    each frame arrives. The other fields are documented where they are declared. Wrong values are refused here.
    """

    device: str
    backend: str = "auto"
    variant: str | None = None
    duration_s: float | None = None
    max_steps: int | None = None
    rate_hz: float | None = None  # default: the bundle's
    record: str | None = None  # recording path
    watchdog_s: float = 0.25
    handshake_timeout_s: float = 10.0
    reconnect_interval_s: float = 0.2
    overrun: str = "hold"
    key: str | None = None  # hex shared secret for a signed link
    status: bool = True  # live status line on stderr
    status_interval_s: float = 1.0  # on a terminal; in a pipe or log, a plain line every PLAIN_STATUS_S
    prewarm: bool = True  # run the model once just before each deadline (warm caches)
    # Weight scrubbing of protected bundles (runtime/protect/, docs/robustness.md): "auto" (when the
    # bundle is protected) or "off"; idle-time budget per period; on an unrepairable block, "fallback"
    # (restore it from the last-good copy) or "stop" (safe output, end the session).
    scrub: str = "auto"
    scrub_budget_us: float = 200.0
    scrub_policy: str = "fallback"
    weights_key_file: str | None = None
    # Values of the data inputs the device does not stream (a goal, a mode): {input name: values}.
    # Each is held until a message mapped to it (extra.session.inputs) sets it again.
    inputs: dict[str, Any] = field(default_factory=dict)
    # Public key files or folders of *.pub files: refuse a bundle none of them signed (docs/bundle.md).
    trust: list[str] = field(default_factory=list)
    # Per-step hooks (runtime/observe/, docs/monitor.md): SessionObserver objects, each on its own thread.
    observers: list[Any] = field(default_factory=list)
    # Serve the browser monitor on [HOST:]PORT (127.0.0.1 unless monitor_public; then a token is required).
    monitor: str | None = None
    monitor_public: bool = False
    # Publish outputs, commands and typed text as LSL outlets NAME-outputs, NAME-commands, NAME-text.
    lsl_out: str | None = None
    # Hold the LSL outlets' publishing until each has a consumer, at most this many seconds (the steps wait in the
    # step ring meanwhile, then go out with their own timestamps): a recorder gets the session from its first step.
    lsl_out_wait_s: float = 0.0
    # End the session (a safety stop, stopped_by "watchdog_limit") after this many seconds without input.
    watchdog_limit_s: float | None = None
    # Real-time settings of the loop's thread for the loop's duration (runtime/realtime.py, docs/realtime.md):
    # SCHED_FIFO at rt_priority, pinned to CPU rt_cpu (None: not pinned), memory locked; refused with RealtimeError.
    rt: bool = False
    rt_cpu: int | None = None
    rt_priority: int = DEFAULT_PRIORITY
    # Step as soon as a frame arrives rather than on the next tick of the rate's clock (runtime/loop.py): the
    # device's clock sets the rate, the bundle's rate is the watchdog's tick when none comes (docs/runtime.md).
    wake_on_input: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.device, str) and self.device.strip()):
            raise ValueError(f"SessionConfig.device {self.device!r}: give the device's URL, like "
                             "'serial:///dev/ttyACM0', 'sim://headstage' or 'lsl://NAME' (docs/devices.md)")
        # None stands for the default here too, as the messages below say
        for name in ("watchdog_s", "handshake_timeout_s", "reconnect_interval_s"):
            if getattr(self, name) is None:
                setattr(self, name, next(f.default for f in fields(self) if f.name == name))
        # 0 or a negative number here is a mistake, never "the default" (None is): refuse it by name
        for name, value in (("rate_hz", self.rate_hz), ("duration_s", self.duration_s),
                            ("reconnect_interval_s", self.reconnect_interval_s),
                            ("watchdog_s", self.watchdog_s), ("watchdog_limit_s", self.watchdog_limit_s),
                            ("handshake_timeout_s", self.handshake_timeout_s)):
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"SessionConfig.{name} {value!r}: must be a positive number of "
                                 f"{'Hz' if name == 'rate_hz' else 'seconds'} (None: the default)")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"SessionConfig.max_steps {self.max_steps!r}: must be at least 1 (None: no limit)")
        # a misspelt switch must not leave scrubbing on (scrub=False scrubbed) or fail only once the session runs
        if self.scrub not in ("auto", "off"):
            raise ValueError(f"SessionConfig.scrub {self.scrub!r}: expected 'auto' (scrub a protected bundle) or 'off'")
        if not (isinstance(self.lsl_out_wait_s, (int, float)) and self.lsl_out_wait_s >= 0):
            raise ValueError(f"SessionConfig.lsl_out_wait_s {self.lsl_out_wait_s!r}: give the seconds to wait for "
                             "LSL consumers, 0 (do not wait) or more")
        if self.lsl_out_wait_s and not self.lsl_out:
            raise ValueError("SessionConfig.lsl_out_wait_s (--lsl-out-wait) waits for consumers of the LSL outlets; "
                             "give lsl_out (--lsl-out NAME) too")
        overrun_policy(self.overrun)  # a misspelt policy is refused here, naming the choices, not once the loop starts
        if not (isinstance(self.backend, str) and self.backend):
            raise ValueError(f"SessionConfig.backend {self.backend!r}: give a backend's name, or 'auto'")
        if self.backend != "auto":
            get_backend_class(self.backend)  # an unknown name: BackendUnavailableError, naming the known ones
        for name, want in (("observers", "SessionObserver objects"), ("trust", "public key files or folders")):
            value = getattr(self, name)
            if isinstance(value, (str, bytes, Path)) or not isinstance(value, (list, tuple)):
                raise TypeError(f"SessionConfig.{name} {value!r}: give a list of {want}")
        for obs in self.observers:
            if isinstance(obs, type):
                raise TypeError(f"SessionConfig.observers holds the class {obs.__name__}, not an object of it: give "
                                f"{obs.__name__}(...)")
        if not isinstance(self.inputs, dict):
            raise TypeError(f"SessionConfig.inputs {self.inputs!r}: give a dict {{input name: values}}")
        if self.scrub_policy not in ("fallback", "stop"):
            raise ValueError(f"SessionConfig.scrub_policy {self.scrub_policy!r}: expected 'fallback' (restore an "
                             "unrepairable block from the last good copy) or 'stop' (safe command, end the session)")

    def record_dict(self) -> dict[str, Any]:
        """The settings as a recording's META keeps them: no secret, observers by class name."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "observers"}
        d["key"] = "***" if self.key else None
        d["device"] = redact_device_url(self.device)  # a sim:// URL may carry the link's secret (key=...)
        d["observers"] = [type(o).__name__ for o in self.observers]
        return d


@dataclass
class SessionSummary:
    """What a session did, as ``run()`` returns it and the recording's SUMMARY keeps it (``to_dict()``).

    ``loop``: the loop's timing (``LoopSummary``: steps, latency and lateness percentiles in microseconds, missed
    deadlines, ``stopped_by``). Counts: frames received, inputs used or skipped, commands sent (the model's, safe,
    re-sent on overrun, at stop), watchdog trips, non-finite or refused inputs, disconnects and reconnects. ``link``:
    the connection's counters (frames lost, CRC errors, ...). ``error``: what ended the session, or None.
    docs/recording.md lists every field.
    """

    loop: LoopSummary
    device: dict[str, Any]
    backend: str
    frames_received: int = 0
    inputs_used: int = 0
    inputs_skipped: int = 0  # older frames dropped because a newer one was there
    commands_sent: int = 0
    safe_commands_sent: int = 0
    commands_resent: int = 0  # overrun policy "hold": the last command sent again for a skipped period
    stop_commands_sent: int = 0  # the safe command sent as the session ends (1 unless the link was down)
    watchdog_trips: int = 0
    nonfinite_inputs: int = 0  # model inputs (after preprocessing) with a NaN/inf: safe command sent instead
    nonfinite_outputs: int = 0  # model outputs or commands with a NaN/inf: safe command sent instead
    inputs_refused: int = 0  # input frames of another size than the device's HELLO said: safe command sent instead
    disconnects: int = 0
    # frames not sent because the device was not reading (its input buffer full): the loop did not wait for it
    frames_unsent: int = 0
    reconnects: int = 0
    link: dict[str, Any] = field(default_factory=dict)
    family: dict[str, Any] = field(default_factory=dict)
    recording: str | None = None
    # why the recording stopped mid-session (a full disk), with how much it kept; None when it was written whole
    recording_error: str | None = None
    scrub: dict[str, Any] = field(default_factory=dict)
    monitor_url: str | None = None
    # the monitor server's exit status where it ended mid-session (killed, crashed: its page stopped updating there)
    monitor_exit: int | None = None
    # per observer (class name): records delivered, records lost to a slow observer, its error if it failed
    observers: dict[str, Any] = field(default_factory=dict)
    # with SessionConfig.rt: {"asked": ..., "granted": ...} (RealtimeGrant.to_dict); empty without
    realtime: dict[str, Any] = field(default_factory=dict)
    # the error that ended the session (loop.stopped_by "error"), as "Type: message"; None when it ended normally
    error: str | None = None
    # how long after its step began each command went out (microseconds; None without a command): the path from
    # the device's frame to the next command, without what the step records afterwards (the loop's latency has it)
    command_latency_p50_us: float | None = None
    command_latency_p99_us: float | None = None
    command_latency_max_us: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["loop"] = self.loop.to_dict()
        return d

    def format(self) -> str:
        lk = self.link
        lines = [
            self.loop.format(),
            f"  device {self.device.get('kind')} {self.device.get('name', '')!r} on backend {self.backend}",
            f"  frames received {self.frames_received}, used {self.inputs_used}, skipped for newer {self.inputs_skipped}; "
            f"commands sent: from the model {self.commands_sent}, safe {self.safe_commands_sent}, re-sent on overrun "
            f"{self.commands_resent}, safe at stop {self.stop_commands_sent} ({self.commands_sent + self.safe_commands_sent + self.commands_resent + self.stop_commands_sent} in all)"
            + (f"; each out p50 {self.command_latency_p50_us:.0f} us, p99 {self.command_latency_p99_us:.0f} us "
               "after its step began" if self.command_latency_p99_us is not None else ""),
            f"  link: lost {lk.get('lost', 0)}, crc errors {lk.get('crc_errors', 0)}, duplicates {lk.get('duplicate', 0)}, "
            f"out of order {lk.get('out_of_order', 0)}, bad tag {lk.get('bad_tag', 0)}",
            f"  watchdog trips {self.watchdog_trips}, disconnects {self.disconnects}, reconnects {self.reconnects}"
            + (f"; frames not sent, the device not reading {self.frames_unsent}" if self.frames_unsent else ""),
            f"  non-finite inputs {self.nonfinite_inputs}, outputs {self.nonfinite_outputs} (safe command sent instead)"
            + (f"; inputs of the wrong size {self.inputs_refused}" if self.inputs_refused else ""),
        ]
        for k, v in self.family.items():  # 4 significant digits, as people read them (--json keeps every digit)
            lines.append(f"  {k}: {v:.4g}" if isinstance(v, float) else f"  {k}: {v}")
        if self.scrub:
            sc = self.scrub
            lines.append(f"  weights scrubbed: {sc['full_passes']} full passes, repaired {sc['repaired']}, restored "
                         f"{sc['restored']}, unrepairable {sc['unrepairable']} (full scrub {sc['full_scrub_us']:.0f} us)")
        if self.realtime:
            lines.append(f"  {format_grant(self.realtime)}")
        if self.recording:
            lines.append(f"  recorded to {self.recording}")
        return "\n".join(lines)


class _Tap(Transport):
    """Records every byte read and written, exactly as it crossed the transport."""

    def __init__(self, inner: Transport, writer: RecordingWriter | None):
        super().__init__(inner.url)
        self.inner = inner
        self.writer = writer

    def _read(self, max_bytes: int, timeout: float | None) -> bytes:
        data = self.inner.read(max_bytes, timeout)
        if data and self.writer is not None:
            self.writer.append(RecordType.RX, data)
        return data

    def _write(self, data: bytes) -> int:
        n = self.inner.write(data)
        if self.writer is not None:
            self.writer.append(RecordType.TX, data)
        return n

    def _close(self) -> None:
        self.inner.close()

    @property
    def is_open(self) -> bool:
        return self._open and self.inner.is_open

    def fileno(self) -> int | None:
        return self.inner.fileno()

    def emulator_pid(self) -> int | None:
        return self.inner.emulator_pid()


def recorded_outputs(spec: GraphSpec) -> list[dict[str, Any]]:
    """META ``outputs`` and observers' ``info["outputs"]``: every data output of the graph in order, as OUTPUT (the
    first) and MORE_OUTPUT records (the others, by this list's index) hold them: name, shape (batch 1), role, and
    ``size`` and ``offset``, its values' place in an observer's output row (the outputs one after another)."""
    out, offset = [], 0
    for t in spec.data_outputs:
        shape = [1 if d == "batch" else int(d) for d in t.shape]
        size = int(np.prod(shape))
        out.append({"name": t.name, "shape": shape, "role": spec.role_of(t), "size": size, "offset": offset})
        offset += size
    return out


def _hello_dict(h: Hello) -> dict[str, Any]:
    return {
        "kind": h.kind,
        "name": h.name,
        "protocol_version": h.protocol_version,
        "n_channels": h.n_channels,
        "rate_hz": h.rate_hz,
        "command_low": h.command_low.tolist(),
        "command_high": h.command_high.tolist(),
    }


class Session:
    """One closed-loop session. Use ``run()``; see ``run_session`` for the one-call form."""

    def __init__(self, bundle: Bundle | str | Path, config: SessionConfig, out: TextIO | None = None):
        if not isinstance(config, SessionConfig):
            raise TypeError(f"config: give a SessionConfig(device=...), not {type(config).__name__}"
                            + (" (SessionConfig(**settings) builds one from a dict)" if isinstance(config, dict) else ""))
        self.config = config
        self._device_shown = redact_device_url(config.device)  # what recordings, the monitor and messages show
        self.out = out if out is not None else sys.stderr
        _warn_unwritable_numba_cache(self.out)
        self.bundle = bundle if isinstance(bundle, Bundle) else load_bundle(bundle, trust=config.trust or None)
        self.model = Model(self.bundle, backend=config.backend, variant=config.variant, trust=config.trust or None)
        if _log.isEnabledFor(logging.INFO):
            choice = self.model.choice
            _log.info("backend %s (%s)%s", self.model.backend_name, self.model.variant or "fp32",
                      " chosen by timing each that runs here" if config.backend == "auto" else "")
            if config.backend == "auto":
                _log.debug("backend timings, p99 us: %s; not timed: %s", choice.p99_us, choice.skipped or "none")
        self.family: FamilyPlugin = get_family(self.bundle.manifest.family)(self.bundle, self.model)
        recipe = self.bundle.manifest.provenance.get("recipe") if isinstance(self.bundle.manifest.provenance, dict) else None
        if isinstance(recipe, dict) and recipe.get("learned") is False:  # informational, never a check: said loudly
            self.out.write(f"warning: {self.bundle.source} was written NOT LEARNED by its training ("
                           + "; ".join(str(p) for p in (recipe.get("problems") or [])[:2])
                           + "): its outputs are not usable; the session runs it as asked\n")
        try:
            self.family.set_held_inputs(dict(config.inputs))
        except (ValueError, KeyError) as exc:
            raise SessionError(str(exc).strip('"')) from None
        # what the family computes outside the graph (an observer's estimate): FAMILY_STATE records, the step ring
        self._state_labels = [str(x) for x in self.family.state_labels()]
        n_state = self.family.state_vector.size
        if len(self._state_labels) != n_state:
            raise SessionError(f"family {self.bundle.manifest.family!r} names {len(self._state_labels)} state values "
                               f"but publishes {n_state} (state_labels and state_vector must agree)")
        self.scrubber = session_scrubber(self.model, config)  # None unless the bundle is protected
        self.rate_hz = config.rate_hz or self.bundle.manifest.rate_hz
        try:
            self.writer = RecordingWriter(config.record) if config.record else None
        except OSError as exc:  # a folder this user cannot write, a path through a file
            raise SessionError(f"--record {config.record}: cannot create it ({exc.strerror or exc}); record into a "
                               "folder this user can write") from None
        # the graph's other data outputs, recorded beside the first (MORE_OUTPUT records, docs/recording.md) and
        # given to observers after it in each step's output row (at their offsets in info["outputs"])
        self._outputs_info = recorded_outputs(self.model.spec)
        self._more_outputs = [(i, self.model.outputs[o["name"]]) for i, o in enumerate(self._outputs_info) if i]
        self._more_offsets = [(o["offset"], self.model.outputs[o["name"]]) for o in self._outputs_info[1:]]
        self._key = bytes.fromhex(config.key) if config.key else None
        self.link: Link | None = None
        self.hello: Hello | None = None
        self._stop_reason: str | None = None  # a stop() that came before run() made its loop
        self.summary_counts: dict[str, Any] = dict(
            frames_received=0, inputs_used=0, inputs_skipped=0, commands_sent=0, safe_commands_sent=0,
            commands_resent=0, stop_commands_sent=0,
            watchdog_trips=0, nonfinite_inputs=0, nonfinite_outputs=0, inputs_refused=0, disconnects=0, reconnects=0,
            frames_unsent=0,
        )
        self._unsent_run = 0  # frames not sent in a row because the device was not reading
        self._recording_failed_said = False
        self._last_input_ns = 0
        self._safe = False
        self._nonfinite_run = 0  # consecutive steps refused for a non-finite value (0: acting normally)
        self._disconnected = False
        self._next_reconnect_ns = 0
        self._past_link_stats = ParserStats()  # the counters of connections closed during the session
        self._next_status_ns = 0
        self._status_tty = bool(getattr(self.out, "isatty", lambda: False)())
        self._next_report_ns = 0
        self._last_cmd: Message | None = None
        self._hello_sent_ns = 0  # when the host last sent its HELLO
        self._side_messages = self.family.side_messages
        self._step = 0
        self._unused_type: type[Message] | None = None
        self._unused, self._warned_unused = 0, False  # frames not of the input's type
        self._unused_ns = 0  # when the last of them came
        self._tap: SessionTap | None = None  # per-step hooks: made in start() when anything listens
        self._typed = 0  # characters the family had typed at the last "typed" event (idle time)
        self._typed_ns = 0  # when the output of the last run that typed was ready
        self._typed_resets = 0  # the family's text resets at the last "typed" event
        self.monitor_url: str | None = None
        # how long after its step began each command went out (the step's own latency also counts what it
        # records after the command); preallocated like the loop's recorders
        self.command_latency = RingRecorder(LoopConfig.capacity)
        self._t_step = 0

    # --- connection -------------------------------------------------------------

    def _open_link(self) -> Link:
        inner = open_transport(self.config.device)
        # A device that stops reading fills its input buffer; a write must not then hold the loop (its watchdog,
        # its deadline, its stop) until the device reads again: wait a quarter period at most (5 ms at most)
        inner.bound_writes(min(0.005, 0.25 / self.rate_hz))
        # A sim:// URL with key=... carries its secret; --key overrides.
        key = self._key if self._key is not None else getattr(inner, "shared_secret", None)
        return Link(_Tap(inner, self.writer), shared_secret=key, role="host")

    def _host_hello(self) -> Hello:
        self._hello_sent_ns = time.monotonic_ns()
        return Hello(kind="host", name="closedloop", rate_hz=self.rate_hz)

    def _handshake(self, link: Link, timeout_s: float) -> Hello:
        deadline = time.monotonic() + timeout_s
        next_hello = 0.0
        while time.monotonic() < deadline:
            if time.monotonic() >= next_hello:
                with contextlib.suppress(WriteBlockedError):  # a device not reading yet: the HELLO goes again in 0.5 s
                    link.send(self._host_hello())
                next_hello = time.monotonic() + 0.5
            frame = link.recv(timeout=0.1)
            if frame is not None and isinstance(frame.message, Hello):
                if frame.message.kind == "host":  # what a host sends (docs/protocol.md): no device answered
                    raise SessionError(
                        f"{self._device_shown} answered with a host's HELLO (kind 'host'), not a device's: the link "
                        "echoes what the session sends (loop:// does) or another host is on it; connect a device or "
                        "an emulator (sim://headstage, sim://plant, sim://panda; closedloop device --list)")
                return frame.message
        raise SessionError(f"no Hello from {self._device_shown} within {timeout_s:g} s; " + _no_hello_reason(link)
                           + self._kept_recording())

    def _mismatch(self, problems: list[str], mid_session: bool = False) -> DeviceMismatchError:
        text = f"device at {self._device_shown} does not match bundle {self.bundle.source}:\n  - " + "\n  - ".join(problems)
        if mid_session:  # the session ran: its recording holds it all, nothing to retry
            return DeviceChangedError(text)
        return DeviceMismatchError(text + self._kept_recording())

    def _kept_recording(self) -> str:
        """For a session refused before it ran: the recording it leaves (its handshake's bytes), and how to retry."""
        if self.writer is None:
            return ""
        return (f"\n(the recording {self.config.record} keeps the handshake's bytes, and recordings are never "
                "overwritten: give --record another path to try again)")

    def _event(self, kind: str, **fields: Any) -> None:
        record = {"event": kind, "step": self._step, **fields}
        if self.writer is not None:
            self.writer.append_json(RecordType.EVENT, record)
        if self._tap is not None:
            self._tap.event(record)

    def start(self) -> Hello:
        """Open the device and handshake (``run()`` does it where it was not done); return the device's HELLO."""
        # The loop freezes the garbage collector; the full collection before that is done here, while the
        # device is still idle. After the handshake it streams, and a collection in a big process (a notebook,
        # a test suite) can take a second: frames pile up unread, and timed device events pass unseen.
        gc.collect()
        self._open_tap()  # the monitor's server starts here, not once the device streams
        try:
            self.link = self._open_link()
            hello = self._handshake(self.link, self.config.handshake_timeout_s)
        except BaseException as exc:  # the device could not be opened, or did not answer: the page says why
            if self.link is not None:
                self.link.close()
            self.close_tap(f"no session: {type(exc).__name__}: {exc}")
            raise
        self.family.adopt_device(hello.kind)
        problems = self.family.check_device(hello)
        if problems:
            self.link.close()
            self.close_tap("refused at the handshake: the device does not match the bundle: " + "; ".join(problems))
            raise self._mismatch(problems)
        self.hello = hello
        if self.writer is not None:
            mpath = self.bundle.root / "manifest.json"
            self.writer.append_json(
                RecordType.META,
                {
                    "format": "closedloop-recording",
                    "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    # the wall clock at this record (its host_ns), to the nanosecond: maps the host clock onto UTC
                    "started_unix_ns": time.time_ns(),
                    "device_url": self._device_shown,
                    "device": _hello_dict(hello),
                    "bundle": str(self.bundle.source),
                    "bundle_name": self.bundle.manifest.name,
                    "family": self.bundle.manifest.family,
                    "manifest_sha256": hashlib.sha256(mpath.read_bytes()).hexdigest(),
                    "rate_hz": self.rate_hz,
                    "backend": self.model.backend_name,
                    "variant": self.model.variant or "fp32",
                    "output_shape": list(self.model.output.shape),
                    "outputs": self._outputs_info,
                    "family_state": self._state_labels,
                    "config": self.config.record_dict(),
                },
            )
        self.family.reset()
        self._typed, self._typed_resets = 0, self.family.typed_resets()  # typed events count from here
        if self._tap is not None:  # observers start with the device known
            self._tap.start({"device": _hello_dict(hello)})
        if self.scrubber is not None:  # the load pass ran before there was a recording: its findings go in now
            self.scrubber.load_events(self._event)
        self._last_input_ns = time.monotonic_ns()
        return hello

    def _open_tap(self) -> None:
        """The step ring and whoever reads it: given observers, the monitor, LSL outlets, the recording's STEPS."""
        cfg = self.config
        observers = list(cfg.observers)
        if self.writer is not None:
            observers.append(StepRecorder(self.writer))
        if _log.isEnabledFor(logging.INFO):  # -v: the start, the events and the end as log messages, off the loop
            observers.append(EventLog())
        if cfg.lsl_out:
            from .observe.lsl_out import LslOutlets

            observers.append(LslOutlets(cfg.lsl_out, wait_s=cfg.lsl_out_wait_s))
        if not observers and cfg.monitor is None:
            return
        info = {
            "bundle": str(self.bundle.source), "bundle_name": self.bundle.manifest.name,
            "family": self.bundle.manifest.family, "device_url": self._device_shown, "backend": self.model.backend_name,
            "rate_hz": self.rate_hz, "input": self.family.measurement.name,
            "output_shape": list(self.model.output.shape), "outputs": self._outputs_info,
            "state": self._state_labels,
            "types_text": self.family.typed_count() >= 0,  # a family that types (a handwriting decoder)
        }
        safe = np.asarray(self.family.safe_output())
        n_out = sum(o["size"] for o in self._outputs_info)  # every data output, the first first
        info.update(n_in=int(self.family.frame_vector.size), n_out=n_out, n_cmd=int(safe.size))
        try:
            self._tap = SessionTap(info, n_in=self.family.frame_vector.size, n_out=n_out,
                                   n_cmd=safe.size, n_state=len(self._state_labels), observers=observers,
                                   monitor=cfg.monitor,
                                   monitor_public=cfg.monitor_public, out=self.out,
                                   monitor_avoid_cpu=cfg.rt_cpu if cfg.rt else None)
        except (RuntimeError, ValueError, OSError) as exc:
            raise SessionError(f"monitor: {exc}") from None
        self.monitor_url = self._tap.monitor_url

    def close_tap(self, reason: str | None = None) -> None:
        if self._tap is not None:
            self._tap.close(reason=reason)
            self._tap = None

    # --- one period -------------------------------------------------------------

    def _poll(self) -> list[Frame]:
        counts = self.summary_counts
        if self.link is None:
            # The transport closed itself (the device is gone for good): reopen the URL.
            now = time.monotonic_ns()
            if now >= self._next_reconnect_ns:
                self._next_reconnect_ns = now + int(self.config.reconnect_interval_s * 1e9)
                try:
                    self.link = self._open_link()
                except (OSError, DeviceNotConnectedError, ValueError):
                    return []
                self._on_reconnect()
            return []
        try:
            frames = self.link.poll()
        except (DeviceNotConnectedError, OSError) as exc:
            # The device's end is gone. A transport that stays open (a pty whose peer
            # closed, a USB adapter mid-replug) may come back: keep polling it. One that
            # closed itself is reopened from its URL.
            if not self._disconnected:
                self._disconnected = True
                counts["disconnects"] += 1
                self._event("disconnected", reason=str(exc))
            if not self.link.transport.is_open:
                self._drop_link()
            return []
        if self._disconnected:
            self._on_reconnect()
        return frames

    def _wait_input(self, timeout_s: float) -> bool:
        """The loop's wait with ``wake_on_input``: True once a frame is waiting. A link that is down or fails
        is the next step's to handle (reconnect, watchdog), so that time is slept instead."""
        link = self.link
        if link is not None and not self._disconnected:
            try:
                return link.wait(timeout_s)
            except (DeviceNotConnectedError, OSError):
                pass
        time.sleep(timeout_s)
        return False

    def _drop_link(self) -> None:
        """Close a link whose transport closed itself, keeping its parser's counters: the summary's ``link`` covers
        every connection of the session, not only the last."""
        assert self.link is not None
        self._past_link_stats = _sum_stats(self._past_link_stats, self.link.parser.stats)
        self.link.close()
        self.link = None

    def _on_reconnect(self) -> None:
        self._disconnected = False
        self.summary_counts["reconnects"] += 1
        self._event("reconnected")
        self._send(self._host_hello())

    def _send(self, message) -> bool:
        if message is None or self.link is None:
            return False
        try:
            self.link.send(message)
            if self._unsent_run:  # the device reads again
                self._event("device_reading", frames_unsent=self._unsent_run)
                self._unsent_run = 0
            return True
        except WriteBlockedError as exc:  # the device is not reading: this frame is not sent; the loop goes on
            self.summary_counts["frames_unsent"] += 1
            if not self._unsent_run:
                self._event("device_not_reading", reason=str(exc))
            self._unsent_run += 1
            return False
        except (DeviceNotConnectedError, OSError) as exc:
            if not self._disconnected:
                self._disconnected = True
                self.summary_counts["disconnects"] += 1
                self._event("disconnected", reason=str(exc))
            if not self.link.transport.is_open:
                self._drop_link()
            return False

    def _send_safe(self, k: int) -> bool:
        """Send the safe command (counted, and marked in the step record)."""
        if not self._send(self.family.safe_message(k)):
            return False
        t_sent = time.monotonic_ns() if self._tap is not None else 0
        self.summary_counts["safe_commands_sent"] += 1
        sent = self.family.safe_output()  # as just sent: a policy's holds the hand where it is now, not at the start
        self.family.on_command_sent(sent)
        if self._tap is not None:
            self._tap.command(sent, t_sent, safe=True)
        return True

    def _act(self, frame: Frame, k: int, send: bool = True) -> bool:
        """Run the family on one input frame; ``send``: also send its command (False: an older frame of a step whose
        family commands only from the newest, ``command_each_frame``: its run updates the state and is recorded).
        False for a frame refused for its size (not used: ``inputs_refused`` counts it)."""
        fam = self.family
        fam.frame_time_us = frame.timestamp_us
        cmd, bad = fam.guarded_step(frame.message)
        if cmd is None and bad is None:  # the model did not run on this frame (a window not yet due)
            return True
        if bad == "held":  # a held input (a goal) has no value yet: the safe command until it comes
            if send:
                self._send_safe(k)
            return True
        if bad == "size":  # not the frame the handshake promised: refused like a non-finite one, the model not run
            self._refuse(bad, k, send)
            return False
        # the outputs are ready (the observers' run record and a typed event say so); only observers read it
        t_ready = time.monotonic_ns() if self._tap is not None else 0
        sent, t_sent = None, 0  # the command values sent and when, for the observers
        if bad is None and send:
            assert cmd is not None  # guarded_step: no problem, so a command
            # the command goes out first: the recording and the observers' copies of this run come after it,
            # off the path from the frame to the device (the buffers they copy stay as they are until the next run)
            if self._nonfinite_run:
                self._event("finite_resumed", steps_refused=self._nonfinite_run)
                self._nonfinite_run = 0
            out = fam.command_message(cmd, k)
            if self._send(out):
                t_sent = time.monotonic_ns()  # the step record's clock: sent_t_ns - t_ns is this latency exactly
                self.command_latency.add(t_sent - self._t_step)
                self.summary_counts["commands_sent"] += 1
                self._last_cmd = out
                sent = cmd
                fam.on_command_sent(cmd)
        if self.writer is not None:
            t_rec = time.monotonic_ns()  # one time for the run's records, after the TX record: the file stays in time order
            self.writer.append_output(k, frame.seq, self.model.output, t_rec)
            for i, y in self._more_outputs:
                self.writer.append_output(k, frame.seq, y, t_rec, index=i)
            if self._state_labels:
                self.writer.append_state(k, frame.seq, fam.state_vector, t_rec)
        if self._tap is not None:
            self._tap.acted(frame.seq, fam.frame_vector, self.model.output, self._more_offsets,
                            fam.state_vector if self._state_labels else None, t_ready)
            if fam.typed_last():  # this run typed: its output's time stamps the "typed" event (idle time)
                self._typed_ns = t_ready
            if sent is not None:
                self._tap.command(sent, t_sent)
        if bad is not None:
            self._refuse(bad, k, send)
        return True

    def _refuse(self, where: str, k: int, send: bool = True) -> None:
        """A run refused (``where``: ``"input"`` or ``"output"``, not finite; ``"size"``, an input frame of another
        size than the HELLO's): counted, bad state reset, and the safe command sent instead, unless ``send`` is False (an older frame of a step that commands once, from its newest: that
        frame's command, or the safe one if it is refused too, is the step's one command)."""
        counts = self.summary_counts
        first_size = False
        if where == "size":
            counts["inputs_refused"] += 1
            if not self._nonfinite_run:
                self._event("input_refused", reason=self.family.refused_reason)
            first_size = counts["inputs_refused"] == 1  # the first of the session on stderr too: a device's bug
        else:
            counts["nonfinite_inputs" if where == "input" else "nonfinite_outputs"] += 1
            state_reset = self.family.recover_nonfinite()
            if not self._nonfinite_run:
                self._event("nonfinite", where=where, state_reset=state_reset)
        self._nonfinite_run += 1
        sent = self._send_safe(k) if send else False
        if first_size:
            what = ("the safe command went out instead" if sent else
                    "no command went out: the bundle's safe command holds what it last measured, and it has measured "
                    "nothing yet" if send else "the step's command comes from its newest frame")
            self.out.write(f"\nwarning: {self.family.refused_reason}; {what}\n")

    def step(self, k: int) -> None:
        self._t_step = time.monotonic_ns()
        self._step = k
        tap = self._tap
        if tap is not None:
            tap.begin(k, self._t_step)
        frames = self._poll()
        counts = self.summary_counts
        counts["frames_received"] += len(frames)
        want = self.family.input.message
        every_frame = self.family.consume == "all"  # once per period, not per frame (a family may derive it)
        side = self._side_messages
        unused_now = False  # a frame the bundle does not read came this step (its time: the step's clock read below)
        newest = None
        last = -1  # the newest input frame: the one a family that commands once a step commands from
        if every_frame and not self.family.command_each_frame:
            for i in range(len(frames) - 1, -1, -1):  # from the end, no generator: the loop's thread, every step
                if isinstance(frames[i].message, want):
                    last = i
                    break
        for i, f in enumerate(frames):
            m = f.message
            if isinstance(m, want):
                if every_frame:
                    counts["inputs_used"] += self._act(f, k, send=last < 0 or i == last)
                else:
                    if newest is not None:
                        counts["inputs_skipped"] += 1
                    newest = f
                self._last_input_ns = time.monotonic_ns()
                self._unused = 0
            elif type(m) in side:
                self.family.on_side_message(m)
                self._last_input_ns = time.monotonic_ns()
            elif isinstance(m, Hello):
                self._on_hello(f)
            elif isinstance(m, Status):
                self._event("device_status", code=int(m.code), severity=int(m.severity), text=m.text)
            elif not isinstance(m, Heartbeat):
                self._unused += 1  # data the bundle does not read (a panda's joint states beside its task observation)
                self._unused_type = type(m)
                unused_now = True
        if newest is not None:
            counts["inputs_used"] += self._act(newest, k)
        now = time.monotonic_ns()
        if unused_now:
            self._unused_ns = now
        if now - self._last_input_ns > self.config.watchdog_s * 1e9:
            if not self._safe:
                self._safe = True
                counts["watchdog_trips"] += 1
                other = self._unused_type.__name__ if self._unused and self._unused_type is not None else ""
                self._event("watchdog", silent_s=(now - self._last_input_ns) / 1e9, other_frames=self._unused,
                            other_type=other)
                still_talking = now - self._unused_ns < self.config.watchdog_s * 0.5e9
                if self._unused and still_talking and not self._warned_unused:
                    # Frames keep coming but none is the bundle's input: say so once, or the session looks
                    # like a silent device (one that fell silent altogether is not told its input may not match).
                    self._warned_unused = True
                    self.out.write(f"\nwarning: no {self.family.input.message.__name__} from the device for "
                                   f"{self.config.watchdog_s:g} s, but it sent {self._unused} {other} "
                                   "frames: the bundle's session input (manifest extra.session.input) may not "
                                   "match this device\n")
            self._send_safe(k)
            limit = self.config.watchdog_limit_s
            if limit is not None and now - self._last_input_ns > limit * 1e9:
                self._event("watchdog_limit", silent_s=(now - self._last_input_ns) / 1e9, limit_s=limit)
                self._loop.stop("watchdog_limit")
            if tap is not None:
                tap.flag(FLAG_WATCHDOG)
        elif self._safe:
            self._safe = False
            self._event("input_resumed")
        if tap is not None and (self.link is None or self._disconnected):
            tap.flag(FLAG_DISCONNECTED)

    def _on_hello(self, frame: Frame) -> None:
        """A device HELLO mid-session: the answer to the host's own, or a device that restarted (re-handshake).

        Either way it is checked against the bundle as at the first handshake, and the family's state starts
        again with the device's new stream (the parser restarted its sequence tracking at the HELLO).
        """
        hello = frame.message
        assert isinstance(hello, Hello)  # step() routes only HELLOs here
        problems = self.family.check_device(hello)
        first = self.hello
        if first is not None and hello.kind != first.kind:
            problems.insert(0, f"device kind changed from {first.kind!r} to {hello.kind!r} mid-session; "
                               "the session was set up for the first")
        if first is not None:  # the same kind with another shape is another device too (a 3-axis arm back as 8)
            if hello.n_channels != first.n_channels:
                problems.append(f"device n_channels changed from {first.n_channels} to {hello.n_channels} "
                                "mid-session")
            if hello.command_low.size != first.command_low.size:
                problems.append(f"device command limits changed from {first.command_low.size} to "
                                f"{hello.command_low.size} values mid-session")
        answer = time.monotonic_ns() - self._hello_sent_ns < HELLO_ANSWER_S * 1e9
        self._event("device_hello", device=_hello_dict(hello), problems=problems, answer=answer)
        if problems:
            # Another device came back on this port: refuse it as the first handshake would, unanswered, so it
            # never streams to a session that will not act on it (the safe command goes out on the way out).
            raise self._mismatch(problems, mid_session=True)
        self.hello = hello
        self.family.reset()
        if not answer:
            self._event("rehandshake", seq=frame.seq, silent_s=(time.monotonic_ns() - self._last_input_ns) / 1e9)
            self._send(self._host_hello())

    def hold(self, k: int) -> None:
        """Overrun policy 'hold': re-send the last command for a skipped period."""
        if self._last_cmd is not None and not self._safe and not self._nonfinite_run and self._send(self._last_cmd):
            self.summary_counts["commands_resent"] += 1

    def idle(self, k: int, budget_ns: int) -> None:
        if self.scrubber is not None and self.scrubber.on_idle(budget_ns, self._event) == "stop":
            self._send_safe(k)
            self._loop.stop("weights_unrepairable")
        now = time.monotonic_ns()
        fam = self.family
        if self._tap is not None and (fam.typed_count() != self._typed or fam.typed_resets() != self._typed_resets):
            self._typed_event(fam.typed_count(), fam.typed_resets())
        if self.writer is not None and self.writer.error is not None and not self._recording_failed_said:
            self._recording_failed_said = True  # once: the session goes on (its device stays controlled)
            said = (f"the recording stopped: {self.writer.error}; the session goes on without it ({self.config.record} "
                    f"holds its first {self.writer.bytes_written:,} bytes)")
            self.out.write(f"\nwarning: {said}\n")
            if self._tap is not None:
                self._tap.event({"event": "recording_failed", "step": k, "reason": said})
        if self._tap is not None and self._tap.status_due():
            self._tap.event(self._status_event())
            if self.config.monitor is not None and now >= self._next_report_ns:
                # the page shows what the device plays (a prompted sentence) from its REPORT, once a second
                self._next_report_ns = now + 1_000_000_000
                self._send(Status(code=REQUEST_REPORT, text="monitor"))
        if self.config.status and now >= self._next_status_ns:
            if self._status_tty:  # a terminal: one line, rewritten in place
                self._next_status_ns = now + int(self.config.status_interval_s * 1e9)
                self.out.write("\r" + self.status_line() + "\x1b[K")
            else:  # a pipe or a CI log: a plain line every PLAIN_STATUS_S, no carriage returns or escapes
                self._next_status_ns = now + int(max(self.config.status_interval_s, PLAIN_STATUS_S) * 1e9)
                self.out.write(self.status_line() + "\n")
            self.out.flush()

    def _typed_event(self, count: int, resets: int) -> None:
        """Text the family typed since the last event, stamped when the output that typed its last character was
        ready; sent in the idle time of the step that typed it (or of the next step with idle time, where steps
        overran), so the LSL text outlet and other observers get it within a period or so. A reset of the text (a
        new trial, a re-handshake) is said with ``reset``, stamped when it was noticed if nothing was typed since."""
        reset = resets != self._typed_resets
        added = count if reset else count - self._typed
        reset = reset and self._typed > 0  # a reset that discards no text (the device's answer HELLO) says nothing
        self._typed, self._typed_resets = count, resets
        if (added > 0 or reset) and self._tap is not None:
            self._tap.event({"event": "typed", "step": self._step,
                             "t_ns": self._typed_ns if added > 0 else time.monotonic_ns(),
                             "text": self.family.typed_tail(added), "chars": count, "reset": reset})

    def _state(self) -> str:
        if self.link is None or self._disconnected:
            return "DISCONNECTED"
        return "SAFE" if (self._safe or self._nonfinite_run) else "running"

    def _status_event(self) -> dict[str, Any]:
        """What the monitor's status bar shows, a few times a second (idle time, never the step)."""
        lat, cmd = self._loop.latency, self.command_latency
        c = self.summary_counts
        metrics = dict(self.family.live_metrics())
        if "text" in metrics:  # the typed text's newest STATUS_TEXT_CHARS, not the status line's short tail
            metrics["text"] = self.family.typed_tail(STATUS_TEXT_CHARS) or metrics["text"]
        return {"event": "status", "step": self._step, "t_ns": time.monotonic_ns(), "state": self._state(),
                "p99_us": lat.recent_percentile_us(99) if lat.count else None,
                "command_p99_us": cmd.recent_percentile_us(99) if cmd.count else None, "missed": self._loop.missed,
                "lost": self.link.parser.stats.lost if self.link is not None else 0,
                "watchdog_trips": c["watchdog_trips"], "reconnects": c["reconnects"],
                "inputs_used": c["inputs_used"], "commands_sent": c["commands_sent"],
                "safe_commands_sent": c["safe_commands_sent"], "frames_unsent": c["frames_unsent"], **metrics}

    def status_line(self) -> str:
        lat = self._loop.latency if hasattr(self, "_loop") else None
        p99 = lat.recent_percentile_us(99) if lat is not None and lat.count else float("nan")
        missed = self._loop.missed if hasattr(self, "_loop") else 0
        lost = self.link.parser.stats.lost if self.link is not None else 0
        cmd = self.command_latency
        parts = [f"{self.rate_hz:g} Hz", f"p99 {p99:.0f} us"]
        if cmd.count:  # how long after its step began the command went out (the step goes on to record it)
            parts.append(f"out p99 {cmd.recent_percentile_us(99):.0f} us")
        parts += [f"missed {missed}", f"lost {lost}"]
        if self.summary_counts["frames_unsent"]:  # the device stopped reading at some point: frames not sent
            parts.append(f"unsent {self.summary_counts['frames_unsent']}")
        parts.append(self._state())
        parts += [f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in self.family.live_metrics().items()]
        return " | ".join(parts)

    def stop(self, reason: str = "stop") -> None:
        """End the session after its current step, from any thread (a GUI's stop button, a hook, a timer).

        The loop finishes the step it is in, sends the safe command and writes its SUMMARY as at any other
        end; ``loop.stopped_by`` is ``reason`` (``stop`` by default; the CLI's exit code 0, docs/cli.md). Called
        before :meth:`run`, the loop ends before its first step. Either way it ends within one period.
        """
        self._stop_reason = reason
        loop = getattr(self, "_loop", None)
        if loop is not None:
            loop.stop(reason)

    def run(self) -> SessionSummary:
        """Run the loop until the duration, ``max_steps``, ``stop()``, a safety stop or Ctrl-C; send the safe
        command; return the summary (also the recording's last record)."""
        if self.hello is None:
            self.start()
        cfg = self.config
        self._loop = RealTimeLoop(
            LoopConfig(rate_hz=self.rate_hz, duration_s=cfg.duration_s, max_steps=cfg.max_steps, overrun=OverrunPolicy(cfg.overrun),
                       collect_gc=False,  # collected in start(), before the handshake
                       wake_on_input=cfg.wake_on_input)
        )
        if self._stop_reason is not None:  # asked to stop before the loop existed
            self._loop.stop(self._stop_reason)
        grant: RealtimeGrant | None = None
        error: Exception | None = None
        try:
            # the loop's thread gets the real-time settings for the loop only; they are restored when it ends
            # and a device emulator this session started (sim://) runs as a device's own clock would, off the
            # loop's CPU, for the loop only (realtime.emulator_realtime)
            emulator_pid = self.link.transport.emulator_pid() if cfg.rt and self.link is not None else None
            with (realtime(RealtimeConfig(priority=cfg.rt_priority, cpu=cfg.rt_cpu)) if cfg.rt
                  else contextlib.nullcontext()) as grant, emulator_realtime(emulator_pid, cfg.rt_cpu) as emulator:
                if grant is not None:
                    grant.gc_frozen = self._loop.config.freeze_gc
                    grant.emulator = emulator
                    self._event("realtime", **grant.to_dict())
                try:
                    loop_summary = self._loop.run(
                        self.step, on_hold=self.hold, on_idle=self.idle,
                        prewarm=self.model.prewarm if cfg.prewarm else None,
                        on_step_end=self._tap.publish if self._tap is not None else None,
                        wait_input=self._wait_input if cfg.wake_on_input else None,
                    )
                except Exception as exc:  # a safety stop (a device that came back as another) or a fault:
                    if self._loop.last_summary is None:  # the loop never started
                        raise
                    error = exc  # the recording still ends with a SUMMARY that says why
                    loop_summary = self._loop.last_summary
                    if isinstance(exc, DeviceChangedError):  # a safety stop, named as one (exit 1)
                        loop_summary.stopped_by = "device_changed"
        finally:
            # the stop's safe command is on the wire and in the recording: counted on its own, so that
            # safe_commands_sent still says how often a safety rule acted during the session
            if self.link is not None and self._send(self.family.safe_message(self._step)):
                self.summary_counts["stop_commands_sent"] += 1
                if self._tap is not None:  # observers see it too: an LSL consumer's last command is the one in force
                    self._tap.event({"event": "stop_command", "step": self._step, "t_ns": time.monotonic_ns(),
                                     "values": np.asarray(self.family.safe_output(), dtype=float).ravel().tolist()})
        if cfg.status and self._status_tty:
            self.out.write("\n")
        stats = self._past_link_stats  # the connections closed during the session, and the one open at its end
        if self.link is not None:
            stats = _sum_stats(stats, self.link.parser.stats)
        summary = SessionSummary(
            loop=loop_summary,
            device=_hello_dict(self.hello) if self.hello else {},
            backend=self.model.backend_name,
            link=asdict(stats),
            family=dict(self.family.summary_metrics()),
            recording=str(cfg.record) if cfg.record else None,
            scrub=self.scrubber.summary() if self.scrubber is not None else {},
            monitor_url=redact_device_url(self.monitor_url) if self.monitor_url else None,  # token=***: the session is over
            monitor_exit=self._tap.monitor_exit if self._tap is not None else None,
            realtime=grant.to_dict() if grant is not None else {},
            error=f"{type(error).__name__}: {error}" if error is not None else None,
            **self.summary_counts,
        )
        lat = self.command_latency
        if lat.count:
            summary.command_latency_p50_us = round(lat.percentile_us(50), 3)
            summary.command_latency_p99_us = round(lat.percentile_us(99), 3)
            summary.command_latency_max_us = round(lat.max / 1e3, 3)
        if self._tap is not None:  # observers drain and stop first: their last STEPS come before SUMMARY
            reason = f"stopped by {loop_summary.stopped_by}" + (f": {summary.error}" if summary.error else "")
            summary.observers = self._tap.close(summary.to_dict(), reason=reason)
            self._tap = None
        if self.writer is not None:
            self.writer.append_json(RecordType.SUMMARY, summary.to_dict())
            self.writer.flush()  # the SUMMARY on disk, or the write's failure known now
            if self.writer.error is not None:
                summary.recording_error = (f"{self.writer.error} ({self.writer.bytes_written:,} bytes kept; "
                                           f"{self.writer.records_dropped:,} records, the SUMMARY among them, not written)")
        if error is not None:
            error.summary = summary  # type: ignore[attr-defined]  # what the session did before it stopped
            raise error
        return summary

    def close(self) -> None:
        """Close the device, the monitor and the LSL outlets (``with Session(...)`` does it on the way out)."""
        self.close_tap()
        if self.link is not None:
            self.link.close()
            self.link = None
        if self.writer is not None:
            self.writer.close()
        self.model.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _warn_unwritable_numba_cache(out: TextIO) -> None:
    """A service pointed at a cache it cannot write compiles its Numba kernels in every session (a minute or two on
    a board) and would say nothing: say it, before the bundle loads (a warning shows with --quiet too)."""
    folder = os.environ.get("NUMBA_CACHE_DIR")
    if not folder:
        return
    from .doctor import _writable

    ok, why = _writable(Path(folder))
    if not ok:
        out.write(f"warning: NUMBA_CACHE_DIR={folder} is not writable ({why}): Numba's kernels compile afresh in every "
                  "session (up to a minute or two on a board) and are not kept; give the session's user a writable "
                  "folder (closedloop doctor checks it)\n")


def _sum_stats(a: ParserStats, b: ParserStats) -> ParserStats:
    """Two connections' parser counters added up."""
    return ParserStats(**{f.name: getattr(a, f.name) + getattr(b, f.name) for f in fields(a)})


def _no_hello_reason(link: Link) -> str:
    """Why no HELLO came, from what the host's parser saw: a key mismatch, a wrong baud rate, or nothing at all."""
    st = link.parser.stats
    keyed = link.signer is not None
    if st.unsigned:
        return (f"{st.unsigned} frames arrived but were refused: unsigned frame on a link that requires signing; "
                "the device does not sign its frames: give the device the key, or run without --key "
                "(SessionConfig.key) (docs/protocol.md section 7)")
    if st.bad_tag and not keyed:
        return (f"{st.bad_tag} frames arrived but were refused: bad tag (signed frames on a link without a key); "
                "the device signs its frames: give the host its key with --key HEX (SessionConfig.key), or turn "
                "signing off on the device (docs/protocol.md section 7)")
    if st.bad_tag:
        return (f"{st.bad_tag} frames arrived but were refused: bad tag (the HMAC tag does not verify); the device "
                "signs with another key: give both ends the same --key (SessionConfig.key) (docs/protocol.md section 7)")
    garbled = st.crc_errors + st.malformed + st.oversize
    last = link.parser.last_rejection
    if st.malformed and not st.crc_errors and not st.oversize:  # the bytes arrive intact: the layout is wrong
        header = last is not None and str(last[1]).startswith("magic/version")
        advice = ("check the raw frame's header against docs/protocol.md section 4: magic 'CL' (bytes 43 4C), "
                  "then the protocol version byte 01" if header else
                  "check each message's layout against docs/protocol.md, field by field (a HELLO takes exactly its "
                  "fields: extra bytes make it malformed)")
        return (f"{st.malformed} frames arrived intact (their CRC-32C checks, so the baud rate is right) but "
                f"malformed" + (f" (the last: {last[1]})" if last else "") + ": " + advice)
    if garbled:
        return (f"{garbled} frames arrived but were refused (crc errors {st.crc_errors}, malformed {st.malformed}, "
                f"oversize {st.oversize}): check the baud rate and that the device speaks closedloop protocol "
                "version 1 (docs/protocol.md)")
    if st.accepted:
        return (f"{st.accepted} frames arrived, none of them a HELLO: the device must answer the host's HELLO "
                "with its own (docs/devices.md, 'Session semantics')")
    return "check the port, baud rate and that the device speaks closedloop protocol (docs/protocol.md)"


def run_session(bundle: Bundle | str | Path, config: SessionConfig, out: TextIO | None = None) -> SessionSummary:
    """Open, handshake, run until the duration or Ctrl-C, send the safe command, close. ``out``: where the status
    line and warnings go (default stderr; ``SessionConfig.status=False`` turns the status line off)."""
    with Session(bundle, config, out) as s:
        s.start()
        return s.run()

