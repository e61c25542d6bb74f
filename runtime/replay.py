"""Replaying recordings: as a device (``replay://RECORDING``) and offline through a bundle.

``replay://PATH?speed=1`` is a transport that plays back the bytes a session
received, with their original timing counted from the first read (``speed=2``
twice as fast, ``speed=0`` as fast as they are read); whatever the host writes is accepted and dropped. A
session over it cannot tell it from the device that was recorded.

``replay_recording(recording, bundle)`` re-runs a bundle offline over the input
frames that produced each recorded model output, in the recorded order (state
resets where the device said Hello again; a step with a non-finite value refused,
as the session refused it), and compares the outputs: the same bundle reproduces
them; a new bundle (say, recalibrated) shows how it would have answered the same
session.  By default it re-runs on the backend and variant the session ran on (the
recording's META names them), so the same bundle reproduces every output exactly; where
that backend cannot run here it re-runs on the fastest one that can, and the report says
so (backends differ in rounding, by about 1e-6 on float32 outputs).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import numpy as np

from closedloop.firmware_bridge import Hello, Message, Transport, make_parser, register_transport
from closedloop.firmware_bridge.signing import FrameVerifier, UnverifiedTags, derive_link_keys

from .bundle import Bundle, load_bundle
from .errors import BackendUnavailableError
from .families import get_family
from .model import Model
from .recording import RecordingReader, RecordType


class ReplayTransport(Transport):
    """Plays back a recording's received bytes with their original timing."""

    def __init__(self, url: str, path: str | Path, speed: float = 1.0):
        super().__init__(url)
        self.reader = RecordingReader(path)
        rx = self.reader.of_type(RecordType.RX)
        if not rx:
            raise ValueError(f"recording {path} holds no received bytes to replay")
        self._chunks = [r.payload for r in rx]
        t0 = rx[0].host_ns
        self._offsets_ns = [r.host_ns - t0 for r in rx]
        self._speed = speed
        # the clock starts at the session's first read, not when the transport is opened: a session that
        # spends a while setting up (loading, prewarming) must not find a burst of overdue frames waiting,
        # all but the newest of which it would skip
        self._start: int | None = None
        self._next = 0

    def _due(self) -> int:
        if self._speed <= 0:
            return len(self._chunks)
        if self._start is None:
            self._start = time.monotonic_ns()
        elapsed = (time.monotonic_ns() - self._start) * self._speed
        n = self._next
        while n < len(self._chunks) and self._offsets_ns[n] <= elapsed:
            n += 1
        return n

    @property
    def finished(self) -> bool:
        return self._next >= len(self._chunks)

    def _read(self, max_bytes: int, timeout: float | None) -> bytes:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            n = self._due()
            if n > self._next:
                data = b"".join(self._chunks[self._next : n])
                self._next = n
                return data
            if self.finished or (deadline is not None and time.monotonic() >= deadline):
                return b""
            time.sleep(0.0005)

    def _write(self, data: bytes) -> int:
        return len(data)

    def _close(self) -> None:
        self._chunks = []


def open_replay(url: str, **_options) -> ReplayTransport:
    parts = urlsplit(url)
    path = (parts.netloc + parts.path) if parts.netloc else parts.path
    params = dict(parse_qsl(parts.query))
    unknown = set(params) - {"speed"}
    if unknown:
        raise ValueError(f"replay:// takes only 'speed'; got {sorted(unknown)}")
    try:
        speed = float(params.get("speed", 1.0))
    except ValueError:
        raise ValueError(f"replay:// speed must be a number, got {params['speed']!r}") from None
    return ReplayTransport(url, path, speed)


register_transport("replay", open_replay, replace=True)


@dataclass
class ReplayReport:
    outputs_compared: int
    max_abs_diff: float
    mean_abs_diff: float
    missing_inputs: int
    backend: str
    recording_note: str
    variant: str = "fp32"
    #: where the re-run's backend or variant differs from the session's, why (empty when they match)
    backend_note: str = ""
    signed_frames_refused: int = 0  # with a key: frames whose tag did not verify, left out as the session left them
    per_output_max: list[float] = field(default_factory=list, repr=False)  # the first data output, per step
    #: per data output of the bundle (graph order): ``compared`` (recorded values compared), ``max_abs_diff``,
    #: ``mean_abs_diff``; the first from OUTPUT records, the others from MORE_OUTPUT records
    outputs: dict[str, dict[str, float | int | None]] = field(default_factory=dict)
    #: MORE_OUTPUT and FAMILY_STATE records that had nothing to compare with (an output this bundle lacks, or a step
    #: not re-run)
    unmatched_outputs: int = 0
    #: the family's state (FAMILY_STATE records: an observer's estimate) against the re-run's, as ``outputs``;
    #: ``compared`` 0 for a recording without them
    family_state: dict[str, float | int | None] = field(default_factory=dict)
    #: recorded outputs on input frames where this bundle's window was not due (a bundle with another window or hop
    #: than the session's): their frames were fed to the window, but this bundle computed nothing to compare there
    outputs_not_due: int = 0

    def format(self) -> str:
        lines = [
            f"re-ran {self.outputs_compared} recorded steps on {self.backend}"
            + (f" ({self.variant})" if self.variant != "fp32" else "") + ": "
            f"max |difference| {self.max_abs_diff:.3g}, mean {self.mean_abs_diff:.3g}"
            + (f"; {self.missing_inputs} outputs had no recorded input frame" if self.missing_inputs else "")
        ]
        if self.outputs_not_due:
            lines.append(f"  {self.outputs_not_due} recorded outputs fall on input frames where this bundle's window "
                         "was not due (another window or hop than the session's bundle): not compared")
        if self.backend_note:
            lines.append(f"  {self.backend_note}")
        if len(self.outputs) > 1:
            for name, d in self.outputs.items():
                lines.append(f"  output {name}: " + (f"{d['compared']} compared, max |difference| "
                                                     f"{d['max_abs_diff']:.3g}" if d["compared"] else
                                                     "not in this recording"))
        if self.family_state.get("compared"):
            lines.append(f"  family state: {self.family_state['compared']} compared, max |difference| "
                         f"{self.family_state['max_abs_diff']:.3g}")
        if self.unmatched_outputs:
            lines.append(f"  {self.unmatched_outputs} recorded values of the other outputs or the family state had "
                         "nothing to compare with (an output this bundle lacks, or a step whose input frame was not "
                         "recorded)")
        return "\n".join(lines + [self.recording_note])


class _OutputDiff:
    """Differences of one data output between the re-run and the recording."""

    def __init__(self) -> None:
        self.count, self.max, self.total = 0, 0.0, 0.0

    def add(self, y: np.ndarray, recorded: np.ndarray, name: str) -> float:
        """Compare one recorded output with the re-run one; returns the step's max |difference|."""
        y = y.reshape(-1)
        if y.size != recorded.size:
            raise ValueError(f"bundle output {name!r} has {y.size} values but the recording's has {recorded.size}; "
                             "replay a bundle with the same output layout")
        # NaN where the recording has NaN (a refused step) agrees; NaN on one side only is a difference
        d = np.nan_to_num(np.where(np.isnan(y) & np.isnan(recorded), 0.0, np.abs(y - recorded)), nan=np.inf)
        worst = float(d.max())
        self.count += 1
        self.max = max(self.max, worst)
        self.total += float(d.mean())
        return worst

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else float("nan")

    def report(self) -> dict[str, float | int | None]:
        """``compared``, ``max_abs_diff`` and ``mean_abs_diff`` (None where nothing was compared: JSON has no NaN)."""
        return {"compared": self.count, "max_abs_diff": self.max if self.count else None,
                "mean_abs_diff": self.mean if self.count else None}


def _replay_verifier(key: bytes | str | None) -> FrameVerifier:
    if key is None:
        return UnverifiedTags()
    try:
        secret = bytes.fromhex(key) if isinstance(key, str) else bytes(key)
    except ValueError:
        raise ValueError("replay key must be the link's shared secret in hex (as given to run --key)") from None
    return FrameVerifier(derive_link_keys(secret)[1], required=False)  # the device-to-host direction


def _replay_model(b: Bundle, meta: dict, backend: str, variant: str | None) -> tuple[Model, str]:
    """The model to re-run on, and a note where it is not the session's backend and variant.

    ``backend="recorded"`` takes the backend and variant the recording's META names (a variant this bundle
    lacks, or a backend that cannot run here, falls back to fp32 / the fastest backend here, said in the note);
    any other value is used as given, as ``Model`` takes it.
    """
    if backend != "recorded":
        return Model(b, backend=backend, variant=variant), ""
    ran_on, ran_variant = str(meta.get("backend") or ""), str(meta.get("variant") or "fp32")
    want = variant or ran_variant
    notes = []
    if variant and variant != "fp32" and variant not in b.graph("main").variants:  # asked for by name: a typo
        raise ValueError(f"--variant {variant}: bundle {b.source} holds {', '.join(['fp32', *b.graph('main').variants])}")
    if want != "fp32" and want not in b.graph("main").variants:
        notes.append(f"{'the session ran' if want == ran_variant else 'asked for'} variant {want}, which this bundle "
                     "does not hold: re-ran fp32")
        want = "fp32"
    if want != ran_variant:  # its outputs differ from the session's by what the variant changes
        notes.append(f"re-ran variant {want} where the session ran {ran_variant}: outputs differ by what the "
                     "variant changes, not by rounding alone")
    # "fp32" given to auto rules out its automatic variant choice: the session's variant is the one compared
    if not ran_on:
        model = Model(b, backend="auto", variant=want)
        return model, "the recording does not name the session's backend: re-ran on the fastest here"
    try:
        model = Model(b, backend=ran_on, variant=None if want == "fp32" else want)
    except BackendUnavailableError as exc:
        model = Model(b, backend="auto", variant=want)
        notes.append(f"the session ran on {ran_on}, which cannot run here ({exc}): re-ran on {model.backend_name}, "
                     "so outputs also differ by the backends' rounding (about 1e-6 on float32)")
    return model, "; ".join(notes)


def replay_recording(recording: str | Path, bundle: Bundle | str | Path, backend: str = "recorded",
                     key: bytes | str | None = None, variant: str | None = None) -> ReplayReport:
    """Re-run ``bundle`` over ``recording``'s input frames and compare its outputs with the recorded ones.

    ``backend``: ``"recorded"`` (default) re-runs on the backend and variant the session ran on, so the bundle
    that ran it reproduces its outputs exactly; ``"auto"`` or a backend name as ``Model`` takes it (with
    ``variant``, ``None`` being fp32 for a named backend). ``key`` is the link's shared secret (bytes or hex)
    when the session was signed: with it every signed frame's tag is checked again and a frame that fails is
    left out, as the session left it out; without it signed frames are replayed unchecked and the report says
    how many.
    """
    reader = RecordingReader(recording)
    b = bundle if isinstance(bundle, Bundle) else load_bundle(bundle)
    model, backend_note = _replay_model(b, reader.meta, backend, variant)
    fam = get_family(b.manifest.family)(b, model)
    fam.adopt_device(reader.meta.get("device", {}).get("kind", ""))  # what the session read from this device
    device = reader.meta.get("device") or {}
    if device.get("kind"):  # the bundle must take this device's frames, as a session checks at the handshake
        hello = Hello(kind=device["kind"], name=str(device.get("name", "")), n_channels=int(device.get("n_channels", 0)),
                      rate_hz=float(device.get("rate_hz", 0.0)),
                      command_low=np.asarray(device.get("command_low", []), dtype=np.float32),
                      command_high=np.asarray(device.get("command_high", []), dtype=np.float32))
        problems = fam.check_device(hello)
        if problems:
            raise ValueError(f"{recording}: its device does not fit bundle {b.source} (" + "; ".join(problems)
                             + f"); replay it with the bundle that ran the session ({reader.meta.get('bundle')})")
    try:  # the held inputs (a goal) had these values, as the session's config recorded them
        fam.set_held_inputs(dict((reader.meta.get("config") or {}).get("inputs") or {}))
    except ValueError as exc:
        raise ValueError(f"{recording}: cannot replay through this bundle: {exc}") from None
    fam.reset()
    verifier = _replay_verifier(key)
    parser = make_parser(verifier)  # the C-backed one where it builds: same frames, faster on 1 kHz recordings
    inputs: dict[int, tuple[Message, int]] = {}  # by sequence number: the frame's message and device time
    want, side = fam.input.message, fam.side_messages
    # A window over the stream saw every frame in order, outputs recorded only when it was due: replay feeds
    # every frame and compares the outputs of those steps.
    windowed = fam.measurement.window is not None
    ys = [model.outputs[t.name] for t in model.spec.data_outputs]  # the first, then those in MORE_OUTPUT records
    names = [t.name for t in model.spec.data_outputs]
    computed: dict[int, tuple[list[np.ndarray], np.ndarray]] = {}
    # the last OUTPUT's input, every output it computed and the family's state after it (float32, as recorded)
    current: tuple[int, list[np.ndarray], np.ndarray] | None = None
    state_diff = _OutputDiff()
    diffs: list[float] = []
    per_name = {name: _OutputDiff() for name in names}
    missing = 0
    not_due = 0
    fed: set[int] = set()  # windowed: the sequence numbers of the input frames fed to the window
    unmatched = 0  # MORE_OUTPUT records with no output of this bundle (or no re-run OUTPUT) to compare with
    in_loop = False  # the RX before META is the handshake; a HELLO after it reset the family (re-handshake)
    # The commands the session sent (TX records), given to the family where the session gave them (an observer of
    # a device that does not report its applied input takes the last one sent as applied): those written before
    # a run's input arrived, before the run; the one written just before a run's OUTPUT record, after the run
    # (the session sends a run's command and then records the run).
    # the host's own frames, signed on a signed link: read without checking (the key of that direction is not here)
    tx_parser, sent_values = make_parser(UnverifiedTags()), fam.command.values
    pending: list[np.ndarray] = []
    just_sent = False  # the previous record was a TX holding a command: the next OUTPUT's own, if one follows

    def give_sent(upto: int) -> None:
        for values in pending[:upto]:
            fam.on_command_sent(values)
        del pending[:upto]

    for rec in reader:
        after_tx, just_sent = just_sent, False
        if rec.type == RecordType.META:
            in_loop = True
        elif rec.type == RecordType.TX:
            for f in tx_parser.feed(rec.payload):
                values = sent_values(f.message) if in_loop else None
                if values is not None:
                    pending.append(np.asarray(values, dtype=np.float32))
                    just_sent = True
        elif rec.type == RecordType.RX:
            give_sent(len(pending))
            for f in parser.feed(rec.payload):
                if isinstance(f.message, Hello):
                    if in_loop:
                        fam.reset()
                elif isinstance(f.message, want):
                    if not windowed:
                        inputs[f.seq] = (f.message, f.timestamp_us)
                        continue
                    fam.frame_time_us = f.timestamp_us  # as the session set it (an observer's gaps: its clock)
                    fed.add(f.seq)
                    cmd, bad = fam.guarded_step(f.message)
                    if bad == "held":
                        continue
                    if bad is not None:
                        fam.recover_nonfinite()
                    if cmd is not None or bad is not None:
                        computed[f.seq] = ([y.copy() for y in ys], fam.state_vector.astype(np.float32))
                elif type(f.message) in side:
                    fam.on_side_message(f.message)
        elif rec.type == RecordType.OUTPUT:
            _, seq, recorded = rec.output()
            current = None
            if windowed:
                found = computed.pop(seq, None)
                if found is None:
                    if seq in fed:
                        not_due += 1
                    else:
                        missing += 1
                    continue
                current = (seq, *found)
            else:
                found_input = inputs.pop(seq, None)
                if found_input is None:
                    missing += 1
                    continue
                msg, frame_time_us = found_input
                fam.frame_time_us = frame_time_us
                give_sent(len(pending) - 1 if after_tx else len(pending))  # all but this run's own command
                _, bad = fam.guarded_step(msg)  # as the session did: a non-finite step is refused, bad state reset
                state = fam.state_vector.astype(np.float32)  # before a refused step's recovery, as recorded
                if bad is not None and bad != "held":
                    fam.recover_nonfinite()
                give_sent(len(pending))
                current = (seq, ys, state)
            diffs.append(per_name[names[0]].add(current[1][0], recorded, names[0]))
        elif rec.type == RecordType.MORE_OUTPUT:
            _, seq, recorded = rec.output()
            i = rec.output_index
            if current is None or current[0] != seq or i >= len(names):
                unmatched += 1
                continue
            per_name[names[i]].add(current[1][i], recorded, names[i])
        elif rec.type == RecordType.FAMILY_STATE:
            _, seq, recorded = rec.output()
            if current is None or current[0] != seq:
                unmatched += 1
                continue
            state_diff.add(current[2], recorded, "family state")
    count = len(diffs)
    model.close()
    compared = [d for d in [*per_name.values(), state_diff] if d.count]
    return ReplayReport(
        outputs_compared=count,
        max_abs_diff=max(d.max for d in compared) if compared else float("nan"),
        mean_abs_diff=per_name[names[0]].mean,
        missing_inputs=missing,
        outputs_not_due=not_due,
        backend=model.backend_name,
        variant=model.variant or "fp32",
        backend_note=backend_note,
        recording_note=reader.describe() + _signing_note(verifier, parser),
        signed_frames_refused=parser.stats.bad_tag + parser.stats.replayed,
        per_output_max=diffs,
        outputs={name: d.report() for name, d in per_name.items()},
        unmatched_outputs=unmatched,
        family_state=state_diff.report(),
    )


def _signing_note(verifier: FrameVerifier, parser) -> str:
    if isinstance(verifier, UnverifiedTags):
        return (f"\n{verifier.signed} signed frames replayed without checking their tags (no key given; "
                "pass the link's key to check them)") if verifier.signed else ""
    refused = parser.stats.bad_tag + parser.stats.replayed
    return f"\nsigned frames checked with the given key; {refused} refused" if refused else (
        "\nsigned frames checked with the given key")
