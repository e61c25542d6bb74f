"""The non-finite guard: a NaN or inf in a model's input or output is never acted on.

A device on a real pty pair (a thread speaking the wire protocol) streams plant
measurements, some with NaN or inf, in lockstep: one frame, then the command it
produced. On both the Numba backend (which propagates a NaN) and ONNX Runtime (whose
GRU turns a NaN into ordinary numbers), the session sends the safe command for each bad
frame, counts it, records one event per run of bad frames, and the recurrent state is
untouched, so later finite frames give exactly what they give when the bad ones never
came. ``Model.step`` itself does not raise and recovers from a poisoned state.
"""

from __future__ import annotations

import threading
import time
import warnings

import numpy as np
import pytest
import torch

from closedloop.export import export_bundle
from closedloop.firmware_bridge import (
    ActuatorCommand,
    FrameParser,
    Hello,
    Link,
    PlantMeasurement,
    open_pty_pair,
    register_transport,
)
from closedloop.runtime import (
    Model,
    RecordingReader,
    RecordType,
    Session,
    SessionConfig,
    get_family,
    replay_recording,
)
from closedloop.sdk.models import GRUDecoder, MLPPolicy

pytestmark = pytest.mark.timing  # wall-clock bounds: make test runs this file alone, after the parallel part

BACKENDS = ("numba", "onnxruntime")
RATE_HZ = 100.0
SAFE = 0.5
N_IN, N_OUT = 4, 3


@pytest.fixture(scope="module")
def gru_bundle(tmp_path_factory):
    torch.manual_seed(3)
    return export_bundle(
        GRUDecoder(N_IN, 8, 1, N_OUT).eval(), tmp_path_factory.mktemp("nf") / "gru", kind="recurrent",
        example_input=torch.zeros(1, N_IN), rate_hz=RATE_HZ, name="nf-gru",
        postprocess={"safe_output": [SAFE] * N_OUT},
        extra={"session": {"input": "plant_measurement", "command": "actuator_command"}},
        variants=(), tensorrt=False, report=lambda s: None,
    )


@pytest.fixture(scope="module")
def overflow_bundle(tmp_path_factory):
    """y = 1.6e37 * relu(x): finite for x = 0.1, +inf in float32 for x = 100, clipped to [-1, 1]."""
    net = MLPPolicy(1, 1, (8,)).eval()
    net.net[-1] = torch.nn.Identity()
    with torch.no_grad():
        net.net[0].weight.fill_(1.0), net.net[0].bias.zero_()
        net.net[2].weight.fill_(2e36), net.net[2].bias.zero_()
    return export_bundle(
        net, tmp_path_factory.mktemp("nf") / "overflow", kind="feedforward", example_input=torch.zeros(1, 1),
        rate_hz=RATE_HZ, name="nf-overflow", postprocess={"low": [-1.0], "high": [1.0], "safe_output": [SAFE]},
        extra={"session": {"input": "plant_measurement", "command": "actuator_command"}},
        variants=(), tensorrt=False, report=lambda s: None,
    )


def _run(bundle, url, backend, record, dev):
    # overrun "skip": on a loaded machine "hold" would re-send the last command for a missed period, and the
    # lockstep device would take that re-send for the reply to its next frame
    cfg = SessionConfig(device=url, backend=backend, duration_s=10.0, status=False, watchdog_s=30.0,
                        record=str(record), prewarm=True, overrun="skip")
    with Session(bundle, cfg) as s:
        s.start()
        # the session ends once the device has had a reply to its last frame (or after 10 s)
        threading.Thread(target=lambda: (dev.thread.join(10.0), s.stop()), daemon=True).start()
        return s.run()


def _events(record):
    return [r.json() for r in RecordingReader(record).of_type(RecordType.EVENT)
            if r.json()["event"] in ("nonfinite", "finite_resumed")]


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_input_sends_the_safe_command_and_leaves_the_state_alone(gru_bundle, lockstep, backend, tmp_path):
    rng = np.random.default_rng(0)
    frames = [rng.normal(size=N_IN).astype(np.float32) for _ in range(16)]
    bad = {5: np.nan, 9: np.nan, 10: np.inf, 11: -np.inf}  # one bad frame, then a run of three
    for i, v in bad.items():
        frames[i][i % N_IN] = v
    url, dev = lockstep(N_IN, frames)
    record = tmp_path / "nan.clrec"
    s = _run(gru_bundle, url, backend, record, dev)
    dev.thread.join(10.0)

    assert len(dev.replies) == len(frames) and all(r is not None for r in dev.replies)
    replies = np.array(dev.replies)
    assert np.all(np.isfinite(replies)), "a non-finite command reached the device"
    # the same backend stepping only the finite frames: the bad ones left no trace in the state
    ref = Model(gru_bundle, backend=backend)
    for i, (y, got) in enumerate(zip(frames, replies, strict=True)):
        if i in bad:
            np.testing.assert_array_equal(got, np.full(N_OUT, SAFE, np.float32))
        else:
            np.testing.assert_allclose(got, ref.step(y[None]).reshape(-1), rtol=0, atol=1e-6)
    assert (s.nonfinite_inputs, s.nonfinite_outputs) == (len(bad), 0)
    assert s.safe_commands_sent == len(bad) and s.commands_sent == len(frames) - len(bad)
    assert s.watchdog_trips == 0
    assert f"non-finite inputs {len(bad)}, outputs 0" in s.format()
    ev = _events(record)
    assert [e["event"] for e in ev] == ["nonfinite", "finite_resumed"] * 2  # once per run of bad frames
    assert [e["where"] for e in ev if e["event"] == "nonfinite"] == ["input", "input"]
    assert [e["steps_refused"] for e in ev if e["event"] == "finite_resumed"] == [1, 3]
    # replay refuses the same frames and so reproduces every recorded output
    rep = replay_recording(record, gru_bundle, backend=backend)
    assert rep.outputs_compared == len(frames) and rep.max_abs_diff <= 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_output_is_not_clipped_into_a_command(overflow_bundle, lockstep, backend, tmp_path):
    frames = [np.array([x], np.float32) for x in (0.1, 100.0, 100.0, 0.1)]
    url, dev = lockstep(1, frames)
    s = _run(overflow_bundle, url, backend, tmp_path / "inf.clrec", dev)
    dev.thread.join(10.0)
    # without the guard, clip(+inf, -1, 1) would have sent 1.0 for the overflowing frames
    assert [float(r[0]) for r in dev.replies] == [1.0, SAFE, SAFE, 1.0]
    assert (s.nonfinite_inputs, s.nonfinite_outputs, s.safe_commands_sent) == (0, 2, 2)
    assert [e["where"] for e in _events(tmp_path / "inf.clrec") if e["event"] == "nonfinite"] == ["output"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_model_step_does_not_raise_and_a_poisoned_state_is_reset(gru_bundle, backend):
    m, ref = Model(gru_bundle, backend=backend), Model(gru_bundle, backend=backend)
    state = m.inputs[m.spec.state_inputs[0].name]
    x = np.linspace(-1, 1, N_IN, dtype=np.float32)[None]
    first = ref.step(x).copy()
    np.testing.assert_allclose(m.step(x), first, atol=1e-6)
    before = state.copy()
    with np.errstate(all="raise"), warnings.catch_warnings():  # the guard itself neither raises nor warns
        warnings.simplefilter("error")
        y = m.step(np.full((1, N_IN), np.nan, np.float32))  # every backend alike: all NaN, the state not advanced
    assert np.all(np.isnan(y)) and np.array_equal(state, before)
    np.testing.assert_allclose(m.step(x), ref.step(x), atol=1e-6)
    # a state that is already non-finite (a flipped bit, say) shows as a NaN output once, then is zeroed
    state[...] = np.nan
    assert not np.all(np.isfinite(m.step(x)))
    assert np.all(state == 0)
    np.testing.assert_allclose(m.step(x), first, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_guarded_step_and_recovery_on_the_family(gru_bundle, backend):
    m = Model(gru_bundle, backend=backend)
    fam = get_family(m.bundle.manifest.family)(m.bundle, m)
    good = PlantMeasurement(np.ones(N_IN, np.float32), np.zeros(0, np.float32))
    cmd, bad = fam.guarded_step(good)
    assert bad is None and np.all(np.isfinite(cmd))
    cmd, bad = fam.guarded_step(PlantMeasurement(np.array([1, np.nan, 1, 1], np.float32), np.zeros(0, np.float32)))
    assert (cmd, bad) == (None, "input") and fam.recover_nonfinite() is False  # the state never saw it
    m.inputs[m.spec.state_inputs[0].name][0, 0, 0] = np.inf
    assert fam.guarded_step(good)[1] == "output" and fam.recover_nonfinite() is True


def test_a_nonfinite_measurement_never_reaches_the_observers_estimate(observer_bundle):
    """A NaN or an infinity in a measurement is refused and the estimate carries on as if that frame had not
    come: restarting it at z0 would throw away a converged estimate, and the controller would act on z0 while it
    converged again (with 2% NaN frames from a 1 kHz plant, the command sat at its limit)."""
    from closedloop.runtime import load_bundle

    b = load_bundle(observer_bundle)
    ny = Model(b, backend="onnxruntime").spec.inputs[0].shape[-1]
    fams = [get_family("observer")(b, Model(b, backend="onnxruntime")) for _ in range(2)]
    rng = np.random.default_rng(0)
    frames = [PlantMeasurement(rng.normal(0.0, 0.1, ny).astype(np.float32), np.zeros(0, np.float32))
              for _ in range(40)]
    bad = {10: np.nan, 20: np.inf, 30: -np.inf}
    for i, f in enumerate(frames):
        if i in bad:
            y = f.y.copy()
            y[0] = bad[i]
            cmd, why = fams[0].guarded_step(PlantMeasurement(y, f.u))
            assert (cmd, why) == (None, "input")
            assert fams[0].recover_nonfinite() is False  # nothing to reset: the estimate never saw it
            continue
        for fam in fams:
            cmd, why = fam.guarded_step(f)
            assert why is None
            fam.on_command_sent(cmd)
        np.testing.assert_array_equal(fams[0].z_hat, fams[1].z_hat)  # the same as without the bad frames
    assert np.all(np.isfinite(fams[0].z_hat))


def test_an_observer_catching_up_sends_one_command_a_step_when_an_older_measurement_is_bad(observer_bundle):
    """An observer step that finds several measurements runs the update on each and commands once, from the newest.
    A non-finite measurement among the older ones is refused (counted, the estimate kept) without a command of its
    own: the step's one command is the newest's, or the safe one when the newest is the bad one."""
    from closedloop.firmware_bridge import encode_frame
    from closedloop.runtime import load_bundle

    b = load_bundle(observer_bundle)
    rate = b.manifest.rate_hz
    ny = Model(b, backend="onnxruntime").spec.inputs[0].shape[-1]
    host, device = open_pty_pair()
    link = Link(device, role="device")
    bursts = [(0.1, np.nan, 0.2), (0.1, 0.2, np.nan)] * 4  # the bad one older, then newest
    got: list[list[np.ndarray]] = []

    def serve():
        while (f := link.recv(5.0)) is not None and not isinstance(f.message, Hello):
            pass
        link.send(Hello(kind="plant", name="burst", n_channels=ny, rate_hz=rate))
        seq = link.next_seq
        for values in bursts:
            link.recv(0.05)  # what the host sends before the burst is not counted
            while link.poll():
                pass
            # one write: the host's next step finds the whole burst waiting
            wire = b"".join(encode_frame(PlantMeasurement(np.full(ny, v, np.float32), np.zeros(0, np.float32)),
                                         (seq + i) % 65536, int(time.monotonic() * 1e6)) for i, v in enumerate(values))
            seq += len(values)
            link.transport.write(wire)
            deadline, cmds = time.monotonic() + 0.1, []
            while (left := deadline - time.monotonic()) > 0:
                f = link.recv(left)
                if f is not None and isinstance(f.message, ActuatorCommand):
                    cmds.append(f.message.u.copy())
            got.append(cmds)

    register_transport("nfburst", lambda url, **_: host, replace=True)
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    cfg = SessionConfig(device="nfburst://", backend="onnxruntime", duration_s=10.0, status=False, watchdog_s=30.0,
                        overrun="skip")
    with Session(observer_bundle, cfg) as s:
        s.start()
        threading.Thread(target=lambda: (thread.join(10.0), s.stop()), daemon=True).start()
        summary = s.run()
    link.close()
    assert len(got) == len(bursts)
    assert [len(c) for c in got] == [1] * len(bursts), "one command a step, not one per refused measurement"
    fam = get_family("observer")(b, Model(b, backend="onnxruntime"))
    safe = fam.safe_output()
    for values, (cmd,) in zip(bursts, got, strict=True):
        assert np.all(np.isfinite(cmd))
        if np.isnan(values[-1]):
            np.testing.assert_array_equal(cmd, safe)
    assert summary.nonfinite_inputs == len(bursts)
    assert summary.safe_commands_sent == len(bursts) // 2  # only the steps whose newest measurement was bad
    assert summary.commands_sent == len(bursts) // 2


def test_a_safe_output_outside_the_limits_is_sent_clipped_to_them(tmp_path, lockstep):
    """docs/protocol.md: the safe command is ``postprocess.safe_output`` clipped to the limits, like every command;
    a bundle that states safe_output 5 with limits [-1, 1] sends 1, at a refused frame and at the stop."""
    net = MLPPolicy(1, 1, (4,)).eval()
    bundle = export_bundle(
        net, tmp_path / "safe5", kind="feedforward", example_input=torch.zeros(1, 1), rate_hz=RATE_HZ,
        name="safe5", postprocess={"low": [-1.0], "high": [1.0], "safe_output": [5.0]},
        extra={"session": {"input": "plant_measurement", "command": "actuator_command"}},
        variants=(), tensorrt=False, report=lambda s: None,
    )
    frames = [np.array([x], np.float32) for x in (0.1, np.nan, 0.2)]
    url, dev = lockstep(1, frames)
    s = _run(bundle, url, "onnxruntime", tmp_path / "safe5.clrec", dev)
    dev.thread.join(10.0)
    assert float(dev.replies[1][0]) == 1.0 and s.safe_commands_sent == 1
    stop = [f.message.u for r in RecordingReader(tmp_path / "safe5.clrec").of_type(RecordType.TX)
            for f in FrameParser().feed(r.payload) if isinstance(f.message, ActuatorCommand)][-1]
    assert s.stop_commands_sent == 1 and float(stop[0]) == 1.0


def test_a_frame_of_another_size_than_the_hello_is_refused_and_the_session_goes_on(gru_bundle, lockstep, tmp_path):
    """One glitched frame (3 values, or a single value numpy would broadcast, on a 4-channel link) is refused like a
    non-finite one: the safe command instead, counted, an event and a warning; the session goes on, the state
    untouched, and replay still reproduces every output."""
    rng = np.random.default_rng(1)
    frames = [rng.normal(size=N_IN).astype(np.float32) for _ in range(6)]
    frames[2] = frames[2][:3]
    frames[4] = frames[4][:1]
    url, dev = lockstep(N_IN, frames)
    record = tmp_path / "size.clrec"
    s = _run(gru_bundle, url, "onnxruntime", record, dev)
    dev.thread.join(10.0)
    ref = Model(gru_bundle, backend="onnxruntime")
    for y, got in zip(frames, dev.replies, strict=True):
        if y.size != N_IN:
            np.testing.assert_array_equal(got, np.full(N_OUT, SAFE, np.float32))
        else:
            np.testing.assert_allclose(got, ref.step(y[None]).reshape(-1), rtol=0, atol=1e-6)
    assert s.inputs_refused == 2 and s.safe_commands_sent == 2 and s.commands_sent == 4
    assert s.loop.stopped_by != "error" and "inputs of the wrong size 2" in s.format()
    events = [r.json() for r in RecordingReader(record).of_type(RecordType.EVENT)]
    refused = [e for e in events if e["event"] == "input_refused"]
    assert [e["reason"] for e in refused] == [
        "PlantMeasurement refused: 3 measured outputs (ny) where the device's HELLO said 4",
        "PlantMeasurement refused: 1 measured outputs (ny) where the device's HELLO said 4"]
    rep = replay_recording(record, gru_bundle, backend="onnxruntime")
    assert rep.outputs_compared == 4 and rep.max_abs_diff <= 1e-6
