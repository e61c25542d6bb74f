"""Closed-loop sessions over real pty pairs against each device emulator.

Normal runs, device/bundle mismatch, frame loss, corruption, silence (the watchdog
sends the safe command within its configured time), disconnect and reconnect,
replay of the recording, and a SIGKILLed host whose recording is recovered.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from closedloop.export import export_bundle
from closedloop.firmware_bridge import (
    ActuatorCommand,
    DecoderOutput,
    FrameParser,
    Hello,
    JointCommand,
    JointState,
    Link,
    NeuralFrame,
    PlantMeasurement,
    open_pty_pair,
    open_transport,
)
from closedloop.runtime import (
    DeviceMismatchError,
    RecordingReader,
    RecordType,
    Session,
    SessionConfig,
    SessionError,
    SessionObserver,
    replay_recording,
    run_session,
)
from closedloop.sdk.models import GRUDecoder, MLPPolicy

pytestmark = pytest.mark.timing  # wall-clock bounds: make test runs this file alone, after the parallel part

ROOT = Path(__file__).resolve().parents[2]


class _Statuses(SessionObserver):
    """Keeps every status update a session gives its observers."""

    def __init__(self):
        self.got = []

    def on_event(self, event):
        if event.get("event") == "status":
            self.got.append(event)


@pytest.fixture(scope="module")
def neural_bundle(tmp_path_factory):
    torch.manual_seed(0)
    return export_bundle(
        GRUDecoder(12, 16, 1, 5).eval(), tmp_path_factory.mktemp("s") / "neural", kind="recurrent",
        example_input=torch.zeros(1, 12), rate_hz=50.0, name="neural",
        preprocess={"mean": [8 * 0.02] * 12, "std": [1.0] * 12},
        extra={"session": {"input": "neural_frame", "command": "decoder_output"}},
        variants=(), tensorrt=False, report=lambda s: None,
    )


@pytest.fixture(scope="module")
def plant_bundle(tmp_path_factory):
    torch.manual_seed(1)
    return export_bundle(
        MLPPolicy(1, 1, (8,)).eval(), tmp_path_factory.mktemp("s") / "plant", kind="feedforward",
        example_input=torch.zeros(1, 1), rate_hz=200.0, name="plant-ctl",
        postprocess={"scale": [5.0], "offset": [3.0], "low": [-2.0], "high": [2.0]},
        extra={"session": {"input": "plant_measurement", "command": "actuator_command"}},
        variants=(), tensorrt=False, report=lambda s: None,
    )


def _cfg(url, tmp_path=None, **kw):
    kw.setdefault("duration_s", 1.5)
    kw.setdefault("status", False)
    kw.setdefault("backend", "onnxruntime")
    if tmp_path is not None:
        kw.setdefault("record", str(tmp_path / "s.clrec"))
    return SessionConfig(device=url, **kw)


def _frames(path, kind, direction=RecordType.TX):
    """``(host_ns, message)`` of every ``kind`` frame a recording holds in one direction (TX: sent, RX: read)."""
    p = FrameParser()
    out = []
    for rec in RecordingReader(path).of_type(direction):
        out += [(rec.host_ns, f.message) for f in p.feed(rec.payload) if isinstance(f.message, kind)]
    return out


def _commands_sent(path, kind):
    return _frames(path, kind, RecordType.TX)


def test_headstage_session_decodes_records_and_replays(neural_bundle, tmp_path, watchdog_rule):
    cfg = _cfg("sim://headstage?channels=12&seed=3", tmp_path)
    s = run_session(neural_bundle, cfg)
    assert s.device["kind"] == "headstage" and s.device["n_channels"] == 12
    # every frame of the 1.5 s stream arrives and is used or, when a newer one landed before the tick, skipped
    # (a loaded machine delivers bursts); each used frame is answered by one command
    assert s.frames_received >= 50 and s.inputs_used + s.inputs_skipped >= 50
    assert s.commands_sent == s.inputs_used > 0
    assert s.link["lost"] == 0 and s.link["crc_errors"] == 0
    watchdog_rule(cfg.record, cfg.watchdog_s, NeuralFrame, s.watchdog_trips)  # a trip only on a real silence
    r = RecordingReader(cfg.record)
    assert r.dropped_bytes == 0 and r.summary["commands_sent"] == s.commands_sent
    assert r.meta["device"]["kind"] == "headstage"
    # the same bundle re-run over the recorded frames reproduces every output
    rep = replay_recording(cfg.record, neural_bundle, backend="onnxruntime")
    assert rep.outputs_compared == s.inputs_used and rep.missing_inputs == 0
    assert rep.max_abs_diff <= 1e-6


def test_a_decoders_safe_outputs_name_the_newest_bin_read_never_one_the_device_did_not_send(neural_bundle, tmp_path):
    """docs/protocol.md: a safe DECODER_OUTPUT (all-zero probabilities) carries the newest NEURAL_FRAME's bin_index,
    during a silence of the headstage and at the session's stop, not the loop's step count."""
    from closedloop.firmware_bridge import DecoderOutput

    cfg = _cfg("sim://headstage?channels=12&seed=5&silence_at=0.4&silence_s=0.5", tmp_path, duration_s=1.2)
    s = run_session(neural_bundle, cfg)
    assert s.safe_commands_sent > 0 and s.stop_commands_sent == 1
    read = [(t, m.bin_index) for t, m in _frames(cfg.record, NeuralFrame, RecordType.RX)]
    safe = [(t, m.bin_index) for t, m in _commands_sent(cfg.record, DecoderOutput) if not np.any(m.char_probs)]
    assert len(safe) == s.safe_commands_sent + s.stop_commands_sent
    bins = {b for _, b in read}
    for t, b in safe:  # a bin read before it went out: the newest the loop had acted on
        assert b in bins and b <= max(bi for tr, bi in read if tr < t), (b, t)


def test_a_device_that_stops_reading_never_holds_the_loop_its_duration_or_its_stop(plant_bundle, tmp_path):
    """The emulator closes its port for 30 s: the commands the session sends fill the pty's buffer, and a write that
    waited for the device would hold the loop until it came back. The session ends at its duration, says the device
    was not reading and counts the frames not sent."""
    url = "sim://plant?model=msd&rate=200&seed=1&disconnect_at=0.5&disconnect_s=30"
    t0 = time.monotonic()
    s = run_session(plant_bundle, _cfg(url, tmp_path, duration_s=5.0))
    assert time.monotonic() - t0 < 15 and s.loop.stopped_by == "duration" and s.loop.duration_s < 6.0
    assert s.frames_unsent > 0 and s.loop.latency_max_us < 500_000
    kinds = [r.json()["event"] for r in RecordingReader(tmp_path / "s.clrec").of_type(RecordType.EVENT)]
    assert "disconnected" in kinds and "device_not_reading" in kinds


def test_replay_url_drives_a_session(neural_bundle, tmp_path):
    cfg = _cfg("sim://headstage?channels=12&seed=4", tmp_path, duration_s=1.0)
    first = run_session(neural_bundle, cfg)
    # long enough to play the whole recording whatever each run's set-up (gc freeze, prewarm) took
    again = run_session(neural_bundle, _cfg(f"replay://{cfg.record}", duration_s=3.0))
    assert again.device["kind"] == "headstage"
    assert again.frames_received == first.frames_received  # every recorded frame arrives again
    # and drives the model: each data frame is used or, when a newer one landed before the tick, counted as
    # skipped (more skips on a loaded machine, in either run), so only the sum is fixed
    assert again.inputs_used + again.inputs_skipped >= first.inputs_used + first.inputs_skipped
    assert again.inputs_used >= 0.7 * first.inputs_used


def test_mismatched_device_is_refused_naming_both_values(neural_bundle):
    with pytest.raises(DeviceMismatchError) as e:
        run_session(neural_bundle, _cfg("sim://headstage?channels=13"))
    assert "n_channels=13" in str(e.value) and "input 'x' takes frames of 12 values" in str(e.value)
    with pytest.raises(DeviceMismatchError, match="25 Hz, the bundle runs at 50 Hz"):
        run_session(neural_bundle, _cfg("sim://headstage?channels=12&rate=25"))


def test_a_plain_export_reads_what_the_device_streams(tmp_path, watchdog_rule):
    # README's workflow: export_bundle with no session block, then `closedloop run --device sim://headstage`.
    # The bundle takes its input and command from the device's HELLO kind; before, it waited for plant
    # measurements, used none of the neural frames and sent the safe command all session.
    torch.manual_seed(0)
    plain = export_bundle(GRUDecoder(12, 16, 1, 5).eval(), tmp_path / "plain", kind="recurrent",
                          example_input=torch.zeros(1, 12), rate_hz=50.0, variants=(), tensorrt=False,
                          report=lambda s: None)
    cfg = _cfg("sim://headstage?channels=12&seed=5", tmp_path)
    s = run_session(plain, cfg)
    assert s.inputs_used > 0 and s.commands_sent == s.inputs_used  # (safe commands only on a real silence, below)
    assert s.inputs_skipped == 0  # a decoder's state sees every bin, in order, however the frames bunch up
    watchdog_rule(cfg.record, cfg.watchdog_s, NeuralFrame, s.watchdog_trips)
    sent = _commands_sent(cfg.record, DecoderOutput)
    assert len(sent) >= s.commands_sent and sent[0][1].char_probs.size == 5  # (+ the safe command at the end)
    # and its recording replays through the same bundle (README: run --record, then replay): the replay reads
    # the neural frames too, from the recorded device kind
    rep = replay_recording(cfg.record, plain, backend="onnxruntime")
    assert rep.outputs_compared == s.inputs_used and rep.missing_inputs == 0 and rep.max_abs_diff <= 1e-6


def test_a_bundle_that_reads_what_the_device_does_not_stream_is_refused(plant_bundle, neural_bundle):
    # stated session blocks are checked against the known device kinds, naming both and the fix
    with pytest.raises(DeviceMismatchError) as e:
        run_session(plant_bundle, _cfg("sim://headstage?channels=1&rate=200"))
    msg = str(e.value)
    assert "streams neural_frame, the bundle reads plant_measurement" in msg
    assert "takes decoder_output, the bundle sends actuator_command" in msg and "extra={'session'" in msg
    # the device may be the wrong one: the devices that fit the bundle come first, the fix is said once
    assert "run it against a plant device (the emulator: sim://plant)" in msg and msg.count("extra={'session'") == 1
    with pytest.raises(DeviceMismatchError, match="streams plant_measurement, the bundle reads neural_frame; run it "
                                                  "against a headstage device"):
        run_session(neural_bundle, _cfg("sim://plant?model=msd&rate=50"))


def test_frames_of_another_type_are_named_when_the_watchdog_trips(plant_bundle, tmp_path):
    # a device of a kind the runtime does not know (a third party's board) is not checked by kind; when it
    # streams something other than the bundle's input, the watchdog trips and says what did arrive
    import io
    import threading

    board_end, port_end = open_pty_pair()
    out = io.StringIO()
    stop = threading.Event()

    def board():
        link = Link(board_end, role="device")
        hello = Hello(kind="acme-probe", name="third-party", n_channels=1, rate_hz=200.0)
        k = 0
        while not stop.is_set():
            for f in link.poll():
                if isinstance(f.message, Hello):
                    link.send(hello)
            link.send(NeuralFrame(bin_index=k, counts=np.zeros(1, dtype=np.uint16)))
            k += 1
            time.sleep(0.005)

    t = threading.Thread(target=board, daemon=True)
    t.start()
    try:
        s = run_session(plant_bundle, _cfg(port_end.path, duration_s=1.0, watchdog_s=0.2), out=out)
    finally:
        stop.set()
        t.join(2)
        board_end.close()
        port_end.close()
    assert s.inputs_used == 0 and s.watchdog_trips == 1
    assert "no PlantMeasurement from the device" in out.getvalue() and "NeuralFrame frames" in out.getvalue()


def test_plant_session_commands_are_clipped_and_applied(plant_bundle, tmp_path):
    cfg = _cfg("sim://plant?model=msd&rate=200&seed=1", tmp_path)
    s = run_session(plant_bundle, cfg)
    assert s.commands_sent > 200
    sent = np.array([m.u[0] for _, m in _commands_sent(cfg.record, ActuatorCommand)])
    assert np.all(np.abs(sent) <= 2.0 + 1e-6)
    assert np.isclose(np.abs(sent).max(), 2.0)  # offset 3 pushes the command to the limit: it was clipped
    # the plant reports the u it applied: the command we sent (zero-order hold), never more than the limit
    p = FrameParser()
    applied = [f.message.u[0] for rec in RecordingReader(cfg.record).of_type(RecordType.RX)
               for f in p.feed(rec.payload) if type(f.message).__name__ == "PlantMeasurement"]
    assert max(abs(u) for u in applied) <= 2.0 + 1e-6
    assert any(abs(u) > 1.0 for u in applied)


def test_each_command_goes_out_before_its_output_is_recorded(plant_bundle, tmp_path):
    """The recording (and the observers) copy a run after its command was sent, so they never delay it: every
    OUTPUT record follows the TX record of the command that run produced, in the same step (no read between)."""
    cfg = _cfg("sim://plant?model=msd&rate=200&seed=1", tmp_path, duration_s=1.0)
    summary = run_session(plant_bundle, cfg)
    # the summary says how long after its step began each command went out: never later than the step ended
    assert 0 < summary.command_latency_p50_us <= summary.command_latency_max_us <= summary.loop.latency_max_us
    assert "after its step began" in summary.format()
    p = FrameParser()
    sent_since_read, outputs, after_command = None, 0, 0
    for rec in RecordingReader(cfg.record):
        if rec.type == RecordType.RX:
            sent_since_read = None
        elif rec.type == RecordType.TX and any(isinstance(f.message, ActuatorCommand) for f in p.feed(rec.payload)):
            sent_since_read = rec.host_ns
        elif rec.type == RecordType.OUTPUT:
            outputs += 1
            if sent_since_read is not None and sent_since_read <= rec.host_ns:
                after_command += 1
            sent_since_read = None
    assert outputs > 100 and after_command == outputs


def test_stop_from_another_thread_ends_the_session_at_once_with_its_safe_command_and_summary(plant_bundle, tmp_path):
    import json
    import threading

    cfg = _cfg("sim://plant?model=msd&rate=200&seed=1", tmp_path, duration_s=60.0)
    session = Session(plant_bundle, cfg)
    try:
        session.start()
        timer = threading.Timer(0.5, session.stop)
        t0 = time.monotonic()
        timer.start()
        s = session.run()
        took = time.monotonic() - t0
    finally:
        session.close()
    assert took < 5.0 and s.loop.stopped_by == "stop" and s.loop.steps > 0
    assert s.stop_commands_sent == 1  # the plant is left with the safe command, as at any other end
    summary = json.loads(RecordingReader(cfg.record).of_type(RecordType.SUMMARY)[-1].payload)
    assert summary["loop"]["stopped_by"] == "stop"
    # asked before it ran: no step is taken, the reason given is the one recorded
    early = Session(plant_bundle, _cfg("sim://plant?model=msd&rate=200&seed=1", duration_s=60.0))
    try:
        early.stop("operator")
        s = early.run()
    finally:
        early.close()
    assert s.loop.stopped_by == "operator" and s.loop.steps == 0


def test_sigterm_ends_a_session_with_its_safe_command_and_summary(plant_bundle, tmp_path):
    """``systemctl stop`` of the packaged service (SIGTERM) is a stop like any other: the plant gets the safe
    command and the recording its SUMMARY (the loop's handler is in place while it runs, in the main thread)."""
    import json

    from closedloop.runtime import SessionObserver

    class TermAfterSteps(SessionObserver):  # the signal only once the loop runs (and its handler is in place)
        sent = False

        def on_steps(self, batch):
            if not self.sent and batch.step.size and batch.step[-1] >= 100:
                self.sent = True
                os.kill(os.getpid(), signal.SIGTERM)

    cfg = _cfg("sim://plant?model=msd&rate=200&seed=1", tmp_path, duration_s=60.0, observers=[TermAfterSteps()])
    before = signal.getsignal(signal.SIGTERM)
    t0 = time.monotonic()
    s = run_session(plant_bundle, cfg)
    assert time.monotonic() - t0 < 10.0 and s.loop.stopped_by == "terminated" and s.loop.steps > 0
    assert s.stop_commands_sent == 1
    last = _commands_sent(cfg.record, ActuatorCommand)[-1][1]
    assert np.all(last.u == 0.0)  # the plant family's safe command
    summary = json.loads(RecordingReader(cfg.record).of_type(RecordType.SUMMARY)[-1].payload)
    assert summary["loop"]["stopped_by"] == "terminated"
    assert signal.getsignal(signal.SIGTERM) == before  # the process's own handling is back once the loop ended


@pytest.mark.parametrize("fault,counter", [("drop=0.2", "lost"), ("corrupt=0.2", "crc_errors"), ("duplicate=0.2", "duplicate")])
def test_link_faults_are_counted_and_survived(plant_bundle, fault, counter):
    s = run_session(plant_bundle, _cfg(f"sim://plant?model=msd&rate=200&seed=2&{fault}"))
    assert s.link[counter] > 5, s.link
    assert s.commands_sent > 100  # the loop went on


def test_watchdog_sends_safe_command_within_its_time_and_resumes(plant_bundle, tmp_path):
    watchdog = 0.15
    cfg = _cfg("sim://plant?model=msd&rate=200&seed=5&silence_at=0.5&silence_s=0.8", tmp_path,
               duration_s=2.2, watchdog_s=watchdog)
    s = run_session(plant_bundle, cfg)
    assert s.watchdog_trips == 1 and s.safe_commands_sent > 0
    r = RecordingReader(cfg.record)
    events = [rec.json() | {"t": rec.host_ns} for rec in r.of_type(RecordType.EVENT)]
    trip = next(e for e in events if e["event"] == "watchdog")
    assert any(e["event"] == "input_resumed" and e["t"] > trip["t"] for e in events)
    # time from the last frame before the silence to the trip: the watchdog time plus at most two periods
    last_rx = max(rec.host_ns for rec in r.of_type(RecordType.RX) if rec.host_ns < trip["t"])
    assert (trip["t"] - last_rx) / 1e9 <= watchdog + 2 / 200 + 0.01
    # and the safe command (zero force) went out right then
    safe = [(t, m) for t, m in _commands_sent(cfg.record, ActuatorCommand) if t >= trip["t"]]
    assert safe and safe[0][1].u[0] == 0.0 and (safe[0][0] - trip["t"]) / 1e9 < 0.01


def test_a_big_process_collects_its_garbage_before_the_handshake_not_after(plant_bundle):
    """The device streams from the handshake on; the loop must start at once, not after a full garbage
    collection (a second in a long test suite, which once let an injected 0.6 s disconnect pass unseen)."""
    ballast = [[] for _ in range(1_500_000)]  # many tracked objects: a full collection takes a while
    t = time.perf_counter()
    gc.collect()
    full_s = time.perf_counter() - t
    s = run_session(plant_bundle, _cfg("sim://plant?model=msd&rate=200&seed=3", duration_s=0.3))
    del ballast
    period_s = 1 / 200  # the loop's first deadline is one period out
    assert s.loop.setup_s < period_s + full_s / 2, (s.loop.setup_s, full_s)


def test_disconnect_and_reconnect(plant_bundle, tmp_path):
    from closedloop.runtime import SessionObserver

    class States(SessionObserver):
        def __init__(self):
            self.seen = []

        def on_event(self, event):
            if event["event"] == "status":
                self.seen.append(event["state"])

    states = States()
    cfg = _cfg("sim://plant?model=msd&rate=200&seed=6&disconnect_at=0.5&disconnect_s=0.6", tmp_path,
               duration_s=2.5, watchdog_s=0.15, observers=[states])
    s = run_session(plant_bundle, cfg)
    assert "DISCONNECTED" in states.seen and states.seen[-1] == "running"  # what the monitor's status shows
    assert s.disconnects == 1 and s.reconnects == 1
    records = list(RecordingReader(cfg.record).of_type(RecordType.EVENT))
    events = [rec.json() for rec in records]
    kinds = [e["event"] for e in events]
    down, up = kinds.index("disconnected"), kinds.index("reconnected")
    assert down < up
    # Input stopped while the device was away: the watchdog must have tripped in between. The emulator
    # closes its port for 0.6 s, but on a loaded machine it can wake late inside that window and leave
    # a shorter gap, so the rule is checked on the gap the host saw (longer than the watchdog's 0.15 s
    # plus a period), which it is unless the emulator was starved (0.6 s in every run here alone).
    t_down, t_up = records[down].host_ns, records[up].host_ns
    if (t_up - t_down) / 1e9 > cfg.watchdog_s + 0.01:
        tripped = [r.host_ns for r, k in zip(records, kinds, strict=True) if k == "watchdog"]
        assert any(t_down - cfg.watchdog_s * 1e9 <= t <= t_up for t in tripped), ((t_up - t_down) / 1e9, kinds)
        assert s.watchdog_trips >= 1
    steps_after = [e["step"] for e in events if e["event"] == "reconnected"][0]
    assert s.loop.steps > steps_after + 100  # commands flowed again after the device came back
    # The loop kept its period while the device was away: polling the closed port costs a step nothing (at
    # most the first failure waits up to 50 ms to tell an emulator that exited from one that closed its port).
    from closedloop.runtime.recording_view import view_recording

    steps = view_recording(cfg.record).steps
    away = steps["latency_us"][(steps["flags"] & 8) != 0]
    assert away.size > 50 and np.sum(away > 1e6 / 200) <= 1 + away.size // 20, np.sort(away)[-10:]


def _panda_position_bundle(tmp_path, **post):
    """A joint-position policy for sim://panda (joint_state in), its limits from the emulator's HELLO."""
    t = open_transport("sim://panda?rate=50")
    try:
        link = Link(t)
        link.send(Hello(kind="host"))
        hello = None
        for _ in range(100):
            f = link.recv(0.1)
            if f is not None and isinstance(f.message, Hello):
                hello = f.message
                break
    finally:
        t.close()
    assert hello is not None
    low, high = hello.command_low, hello.command_high
    n = low.size
    torch.manual_seed(2)
    bundle = export_bundle(
        MLPPolicy(2 * n, n, (16,)).eval(), tmp_path / "pol", kind="feedforward", example_input=torch.zeros(1, 2 * n),
        rate_hz=50.0, postprocess={"scale": (high - low).tolist(), "offset": ((high + low) / 2).tolist(),
                                   "low": low.tolist(), "high": high.tolist(), **post},
        extra={"session": {"input": "joint_state", "command": "joint_position"}},
        variants=(), tensorrt=False, report=lambda s: None,
    )
    return bundle, low, high


def test_panda_session_clips_joint_commands(tmp_path, watchdog_rule):
    pytest.importorskip("pybullet")
    torch.manual_seed(2)
    bundle, low, high = _panda_position_bundle(tmp_path)
    cfg = _cfg("sim://panda?rate=50", tmp_path, duration_s=1.5)
    s = run_session(bundle, cfg)
    assert s.commands_sent > 40
    watchdog_rule(cfg.record, cfg.watchdog_s, JointState, s.watchdog_trips)  # a trip only on a real silence
    cmds = np.array([m.values for _, m in _commands_sent(cfg.record, JointCommand)])
    assert np.all(cmds >= low - 1e-6) and np.all(cmds <= high + 1e-6)


def test_a_joint_velocity_bundle_is_not_checked_against_the_arms_position_limits(tmp_path):
    """sim://panda's HELLO states its joint position limits (joint 4's excludes 0); a bundle that sends joint
    velocities within +-0.05 rad/s is not refused for them (it was: 'bundle high limit 0.05 is above the device's
    0'), and the arm gets VELOCITY commands."""
    pytest.importorskip("pybullet")
    from closedloop.firmware_bridge import JointMode

    torch.manual_seed(3)
    bundle = export_bundle(
        MLPPolicy(16, 8, (16,)).eval(), tmp_path / "vel", kind="feedforward", example_input=torch.zeros(1, 16),
        rate_hz=50.0, postprocess={"scale": [0.05] * 8, "low": [-0.05] * 8, "high": [0.05] * 8},
        extra={"session": {"input": "joint_state", "command": "joint_velocity"}},
        variants=(), tensorrt=False, report=lambda s: None)
    cfg = _cfg("sim://panda?rate=50", tmp_path, duration_s=1.0)
    s = run_session(bundle, cfg)
    assert s.commands_sent > 20
    sent = [m for _, m in _commands_sent(cfg.record, JointCommand)]
    assert sent and all(m.mode == JointMode.VELOCITY and np.all(np.abs(m.values) <= 0.05 + 1e-6) for m in sent)


def test_a_joint_position_command_without_a_safe_pose_holds_the_measured_one(tmp_path):
    """Zeros, the default safe command, would drive every joint of an arm to 0 rad: a joint-position bundle that
    states no safe pose holds the joints where they were last measured, and sends none before it has seen them."""
    pytest.importorskip("pybullet")
    from closedloop.runtime import load_bundle
    from closedloop.runtime.families import get_family
    from closedloop.runtime.model import Model

    torch.manual_seed(2)
    bundle, low, high = _panda_position_bundle(tmp_path)
    b = load_bundle(bundle)
    fam = get_family("generic")(b, Model(b, backend="onnxruntime"))
    assert fam.safe_message(0) is None  # nothing measured yet: no pose to hold
    n = low.size
    q = np.linspace(low, high, 3)[1] + 0.1
    fam.on_message(JointState(q=q.astype(np.float32), dq=np.zeros(n, np.float32)))
    np.testing.assert_allclose(fam.safe_message(0).values, np.clip(q, low, high), rtol=0, atol=1e-6)
    fam.reset()  # a re-handshake: the arm may have moved while the board rebooted
    assert fam.safe_message(0) is None

    # live: a silence trips the watchdog; every safe command and the stop command hold the last measured pose
    cfg = _cfg("sim://panda?rate=50&silence_at=0.6&silence_s=0.8", tmp_path, duration_s=2.0, watchdog_s=0.2)
    s = run_session(bundle, cfg)
    assert s.watchdog_trips >= 1 and s.safe_commands_sent >= 1
    states = _frames(cfg.record, JointState, RecordType.RX)
    sent = _commands_sent(cfg.record, JointCommand)
    last_q = None
    held = 0
    i = 0
    for t, m in sent:
        while i < len(states) and states[i][0] <= t:
            last_q = states[i][1].q
            i += 1
        assert last_q is not None  # no command before the first measurement
        if np.allclose(m.values, np.clip(last_q, low, high), atol=1e-6):
            held += 1
    assert held >= s.safe_commands_sent + s.stop_commands_sent  # each of them held the pose; none went to zeros
    assert not any(np.allclose(m.values, 0.0) for _, m in sent)

    # a bundle that states its safe pose gets it
    bundle2, _, _ = _panda_position_bundle(tmp_path / "stated", safe_output=((low + high) / 2).tolist())
    b2 = load_bundle(bundle2)
    fam2 = get_family("generic")(b2, Model(b2, backend="onnxruntime"))
    np.testing.assert_allclose(fam2.safe_message(0).values, (low + high) / 2, atol=1e-6)


HOST = """
import sys, sim
from closedloop.runtime import SessionConfig, run_session
run_session(sys.argv[1], SessionConfig(device="sim://headstage?channels=12", record=sys.argv[2], status=False,
                                       backend="onnxruntime"))
"""


def test_sigkill_of_host_keeps_the_recording(neural_bundle, tmp_path):
    rec = tmp_path / "killed.clrec"
    proc = subprocess.Popen([sys.executable, "-c", HOST, str(neural_bundle), str(rec)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (not rec.exists() or rec.stat().st_size < 20000):
            time.sleep(0.1)
        time.sleep(1.0)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    r = RecordingReader(rec)
    assert r.meta["device"]["kind"] == "headstage"
    assert r.summary is None  # it never ended cleanly
    outputs = r.of_type(RecordType.OUTPUT)
    assert len(outputs) >= 50
    # everything recovered is consistent: replay reproduces every recovered output
    rep = replay_recording(rec, neural_bundle, backend="onnxruntime")
    assert rep.outputs_compared >= len(outputs) - 1 and rep.max_abs_diff <= 1e-6
    assert os.path.getsize(rec) == r.valid_bytes + r.dropped_bytes


def test_wake_on_input_steps_at_the_devices_pace_and_replays(neural_bundle, tmp_path):
    # the headstage streams 50 bins a second; the bundle's clock is set to 5 Hz, the watchdog's tick. Stepping on
    # arrival answers every bin at the device's pace; on the clock alone each tick would find several bins
    cfg = _cfg("sim://headstage?channels=12&seed=5", tmp_path, rate_hz=5.0, wake_on_input=True, watchdog_s=1.0,
               duration_s=1.5)
    s = run_session(neural_bundle, cfg)
    assert s.loop.steps >= 3 * 5.0 * 1.5, s.loop  # far more steps than the 5 Hz clock alone gives
    assert s.loop.achieved_rate_hz > 3 * 5.0, s.loop  # the device's pace, not the clock's
    assert s.commands_sent == s.inputs_used and s.inputs_used >= 40 and s.inputs_skipped <= s.inputs_used // 4
    assert RecordingReader(cfg.record).meta["config"]["wake_on_input"] is True
    rep = replay_recording(cfg.record, neural_bundle, backend="onnxruntime")
    assert rep.outputs_compared == s.inputs_used and rep.missing_inputs == 0 and rep.max_abs_diff <= 1e-6


def test_the_status_line_is_a_plain_line_in_a_pipe_or_log(plant_bundle):
    """In a CI log or a pipe, the live status line would be carriage returns and escape codes: plain lines instead
    (the first at once, then every PLAIN_STATUS_S)."""
    import io

    out = io.StringIO()
    run_session(plant_bundle, _cfg("sim://plant?model=msd&rate=200&seed=3", duration_s=0.5, status=True,
                                   status_interval_s=0.05), out=out)
    text = out.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = [ln for ln in text.splitlines() if " Hz | p99 " in ln]
    assert len(lines) == 1, text  # 0.5 s: only the first of a 10 s cadence


def test_status_updates_of_a_session_that_typed_for_hours_still_carry_every_field(typing_bundle):
    """A status update holds the text's newest characters, not all of it: with the whole text, an update outgrew
    the ring's event slot after about 1,900 characters and arrived as {event, step, truncated} (no state, no p99)."""
    from closedloop.runtime.session import STATUS_TEXT_CHARS

    obs = _Statuses()
    session = Session(typing_bundle, SessionConfig(device=f"sim://headstage?channels={12}&seed=4",
                                                   duration_s=1.0, status=False, backend="onnxruntime",
                                                   observers=[obs]))
    long_text = "the quick brown fox jumps over the lazy dog. " * 200  # 9,000 characters typed so far
    session.family.typed_tail = lambda n: long_text[-n:] if n > 0 else ""
    try:
        session.start()
        session.run()
    finally:
        session.close()
    assert obs.got and all("truncated" not in e and "state" in e and "p99_us" in e for e in obs.got)
    assert all(e["text"] == long_text[-STATUS_TEXT_CHARS:] for e in obs.got)


def test_the_status_line_and_status_updates_carry_how_soon_commands_went_out(plant_bundle):
    """The step's own latency includes its recording and observers' copies, made after the command: the status line
    and the monitor's status updates also say how long after its step began each command went out."""

    obs = _Statuses()
    session = Session(plant_bundle, _cfg("sim://plant?model=msd&rate=200&seed=3", duration_s=1.0, observers=[obs]))
    try:
        assert " out p99 " not in session.status_line()  # no command yet: nothing to say
        session.start()
        summary = session.run()
    finally:
        session.close()
    line = session.status_line()
    out_us = float(line.split(" out p99 ")[1].split(" us")[0])
    step_us = float(line.split(" | p99 ")[1].split(" us")[0])
    assert 0 < out_us <= summary.loop.latency_max_us and step_us > 0, line
    late = [e for e in obs.got if e.get("command_p99_us") is not None]
    assert late and all(0 < e["command_p99_us"] <= summary.loop.latency_max_us for e in late), obs.got


def test_a_numba_cache_the_session_cannot_write_is_said_before_anything_compiles(plant_bundle, tmp_path, monkeypatch):
    """A service pointed at a read-only cache compiles its kernels in every session (a minute or two on a board):
    the session says so, on its output, whatever the verbosity."""
    import io

    blocked = tmp_path / "a-file"
    blocked.write_text("")  # a cache folder that cannot be made
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(blocked / "cache"))
    out = io.StringIO()
    Session(plant_bundle, _cfg("sim://plant?model=msd&rate=50"), out=out).close()
    assert f"warning: NUMBA_CACHE_DIR={blocked / 'cache'} is not writable" in out.getvalue()
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "ok"))
    out = io.StringIO()
    Session(plant_bundle, _cfg("sim://plant?model=msd&rate=50"), out=out).close()
    assert "NUMBA_CACHE_DIR" not in out.getvalue()


def test_a_recording_that_cannot_be_made_or_is_left_by_a_refusal_is_said_with_what_to_do(plant_bundle, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SessionError, match=r"--record .*a-file/s.clrec: cannot create it \(.+\); record into a folder"):
        Session(plant_bundle, _cfg("sim://plant?model=msd&rate=50", record=str(blocker / "s.clrec")))
    rec = tmp_path / "s.clrec"
    with pytest.raises(DeviceMismatchError) as e:
        run_session(plant_bundle, _cfg("sim://headstage?channels=1&rate=200", record=str(rec)))
    assert f"the recording {rec} keeps the handshake's bytes" in str(e.value) and "give --record another path" in str(e.value)


def test_the_summarys_link_counters_cover_every_connection_of_a_session(plant_bundle):
    """A TCP device that drops the connection and is reconnected: the summary's ``link`` counts the frames of both
    connections (before, only the last one's: ``frames_received`` 274 beside ``link.accepted`` 222)."""
    import socket
    import threading

    from closedloop.firmware_bridge import encode_frame

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    sent = []

    def serve():
        for n in (40, 30):  # two connections, each a HELLO then n measurements at 200 Hz
            conn, _ = server.accept()
            conn.settimeout(5.0)
            conn.recv(4096)  # the host's HELLO first, as a device answers it
            seq = 0
            conn.sendall(b"\x00" + encode_frame(Hello(kind="plant", name="tcp", n_channels=1, rate_hz=200.0), seq, 0))
            for i in range(n):
                seq += 1
                conn.sendall(encode_frame(PlantMeasurement(np.array([0.1 * i], np.float32),
                                                           np.zeros(0, np.float32)), seq, 1000 * i) + b"\x00")
                time.sleep(0.005)
            sent.append(n + 1)
            conn.settimeout(0.1)
            try:  # read what the host sent (its commands) before closing: unread data would reset the connection
                while conn.recv(65536):
                    pass
            except TimeoutError:
                pass
            conn.close()
        server.close()

    threading.Thread(target=serve, daemon=True).start()
    s = run_session(plant_bundle, _cfg(f"socket://127.0.0.1:{port}", duration_s=2.0, watchdog_s=5.0))
    assert sent == [41, 31] and s.reconnects == 1
    assert s.link["accepted"] == sum(sent) and s.link["crc_errors"] == 0
    assert s.frames_received == s.link["accepted"] - 1  # all but the first handshake's HELLO, read before the loop


@pytest.mark.parametrize("silent_after_s", [None, 0.3])
def test_the_wrong_input_warning_is_for_a_device_still_talking_not_one_gone_silent(plant_bundle, pty_board,
                                                                                  silent_after_s):
    """A device that keeps sending frames the bundle does not read (JOINT_STATE to a PLANT_MEASUREMENT bundle) is
    told its input may not match; one that sent both and then fell silent is not (it was only silent)."""
    import io

    def board(end, stop):
        link = Link(end, role="device")
        t0, hello = time.monotonic(), Hello(kind="myboard", n_channels=1, rate_hz=200.0)
        while not stop.is_set():
            for f in link.poll():
                if isinstance(f.message, Hello):
                    link.send(hello)
            t = time.monotonic() - t0
            if silent_after_s is None:
                link.send(JointState(q=np.zeros(2, np.float32), dq=np.zeros(2, np.float32)))
            elif t < silent_after_s:
                link.send(PlantMeasurement(np.array([0.1], np.float32), np.zeros(0, np.float32)))
                link.send(JointState(q=np.zeros(2, np.float32), dq=np.zeros(2, np.float32)))
            stop.wait(0.005)

    out = io.StringIO()
    s = run_session(plant_bundle, _cfg(pty_board(board), duration_s=1.0), out=out)
    assert s.watchdog_trips == 1
    warned = "may not match this device" in out.getvalue()
    assert warned == (silent_after_s is None), out.getvalue()
