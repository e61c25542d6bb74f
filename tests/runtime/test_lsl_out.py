"""--lsl-out NAME: the LslOutlets observer publishes outputs, commands and typed text; an inlet here reads them."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

from closedloop.runtime.observe import FLAG_ACTED, FLAG_COMMAND, FLAG_SAFE, ObserverHub, StepRing

try:
    import pylsl
except (ImportError, RuntimeError) as exc:
    pytest.skip(f"pylsl with liblsl is needed for --lsl-out ({exc}); pip install 'closedloop[lsl]'",
                allow_module_level=True)

from closedloop.runtime.observe.lsl_out import LslOutlets, clock_offset_s  # noqa: E402

pytestmark = pytest.mark.timing  # wall-clock bounds: make test runs this file alone, after the parallel part


def _inlet(name: str):
    found = pylsl.resolve_byprop("name", name, 1, 5.0)
    assert found, f"no outlet {name!r}"
    inlet = pylsl.StreamInlet(found[0])
    inlet.open_stream(timeout=5.0)
    return inlet


def _labels(info) -> list[str]:
    channel = info.desc().child("channels").child("channel")
    out = []
    while not channel.empty():
        out.append(channel.child_value("label"))
        channel = channel.next_sibling()
    return out


def _pull_all(inlet, want: int, timeout_s: float = 5.0):
    samples, stamps = [], []
    end = time.monotonic() + timeout_s
    while len(stamps) < want and time.monotonic() < end:
        x, t = inlet.pull_chunk(timeout=0.1)
        samples += x
        stamps += t
    return samples, np.array(stamps)


class Recorded:
    """A real outlet, and every sample pushed into it with its stamp."""

    def __init__(self, outlet):
        self.outlet, self.samples, self.stamps = outlet, [], []

    def push_sample(self, x, stamp):
        self.samples.append(x[0] if isinstance(x[0], str) else list(x))  # a text marker, or a sample's values
        self.stamps.append(stamp)
        self.outlet.push_sample(x, stamp)

    def push_chunk(self, x, stamps):
        self.samples += list(x)
        self.stamps += list(stamps)
        self.outlet.push_chunk(x, stamps)

    def __getattr__(self, name):  # the rest of the outlet (channel_count, have_consumers) as it is
        return getattr(self.outlet, name)


def _run_recording_outlets(bundle, config, which: tuple[str, ...]):
    """Run a session with an LslOutlets observer whose named outlets are wrapped in ``Recorded``."""
    from closedloop.runtime import Session

    obs = LslOutlets(f"cltest-{uuid.uuid4().hex[:10]}")
    config.observers = [obs]
    session = Session(bundle, config)
    try:
        session.start()
        end = time.monotonic() + 10
        while not all(w in obs.outlets for w in which) and time.monotonic() < end:
            time.sleep(0.01)
        wrapped = {w: Recorded(obs.outlets[w]) for w in which}
        obs.outlets.update(wrapped)
        summary = session.run()
    finally:
        session.close()
    return obs, wrapped, summary


def test_the_clock_offset_is_small_on_one_machine():
    offset, width = clock_offset_s(pylsl)
    assert width < 1e-3
    assert abs(offset) < 0.05  # Linux: both CLOCK_MONOTONIC


def test_an_inlet_receives_every_output_every_command_and_the_text_each_stamped():
    name = f"cltest-{uuid.uuid4().hex[:10]}"
    obs = LslOutlets(name)
    ring = StepRing.create(n_in=3, n_out=2, n_cmd=1, capacity=256, event_capacity=8, event_slot=256)
    hub = ObserverHub(ring, [obs], interval_s=0.005)
    outputs = [{"name": "click", "shape": [1, 1], "role": "command", "size": 1, "offset": 0},  # two heads, one value
               {"name": "speed", "shape": [1, 1], "role": "output", "size": 1, "offset": 1}]  # each (info["outputs"])
    hub.start({"rate_hz": 100.0, "n_out": 2, "n_cmd": 1, "bundle_name": "tiny", "family": "generic",
               "outputs": outputs})
    try:
        end = time.monotonic() + 5
        while len(obs.outlets) < 3 and time.monotonic() < end:
            time.sleep(0.01)
        outs, cmds, text = _inlet(f"{name}-outputs"), _inlet(f"{name}-commands"), _inlet(f"{name}-text")
        assert outs.info().type() == "ModelOutput" and outs.info().channel_count() == 2
        assert _labels(outs.info(timeout=5.0)) == ["click", "speed"]  # the XDF channel labels LabRecorder keeps
        assert cmds.info().channel_count() == 1 and text.info().type() == "Markers"
        steps, runs, typed, sent = [], [], [], []
        for k in range(40):
            t_ns = time.monotonic_ns()
            ring.begin(k, t_ns)
            acted = k % 4 != 3  # every fourth step: no frame, the safe command on odd ones of those
            if acted:
                # every fifth step runs the model on two frames and answers each (a decoder catching up): both
                # outputs and both commands are published
                for frame in ((k, k + 0.5) if k % 5 == 0 else (k,)):
                    ring.set_input_seq(k)
                    ring.set_output(np.array([frame, -0.5 * frame], dtype=np.float32))
                    t_run = time.monotonic_ns()
                    ring.publish_run(t_run)
                    runs.append((frame, t_run))
                    ring.add_flags(FLAG_ACTED)
                    t_sent = time.monotonic_ns()
                    ring.publish_command(np.array([0.25 * frame], dtype=np.float32), t_sent, FLAG_COMMAND)
                    sent.append((0.25 * frame, t_sent))
            elif k % 8 == 7:
                t_sent = time.monotonic_ns()
                ring.publish_command(np.array([0.0], dtype=np.float32), t_sent, FLAG_SAFE)
                sent.append((0.0, t_sent))
            ring.publish(latency_ns=50_000, lateness_ns=1_000)
            steps.append((k, t_ns + 50_000, acted, k % 8 == 7))
            if k in (10, 30):  # the session's "typed" event: what the step typed, when its output was ready
                ring.event({"event": "typed", "step": k, "t_ns": runs[-1][1], "text": "he" if k == 10 else "llo"})
                typed.append(runs[-1][1])
            ring.event({"event": "status", "step": k, "text": "hello"})  # the status line's text is not published
            time.sleep(0.002)
        acted_steps = [s for s in steps if s[2]]
        x, ts = _pull_all(outs, len(runs))
        np.testing.assert_array_equal(np.array(x), [[f, -0.5 * f] for f, _ in runs])
        want = np.array([t for _, t in runs]) / 1e9 + obs.offset_s
        np.testing.assert_allclose(ts, want, atol=1e-6)  # when each output was ready, on the LSL clock
        c, cts = _pull_all(cmds, len(sent))
        np.testing.assert_array_equal(np.array(c)[:, 0], [v for v, _ in sent])  # each command, two in a step too
        np.testing.assert_allclose(cts, np.array([t for _, t in sent]) / 1e9 + obs.offset_s, atol=1e-6)  # when sent
        words, wts = _pull_all(text, 2)
        assert [w[0] for w in words] == ["he", "llo"]
        np.testing.assert_allclose(wts, np.array(typed) / 1e9 + obs.offset_s, atol=1e-6)  # its output's stamp
    finally:
        hub.stop({})
        ring.close()
    assert len(runs) > len(acted_steps) and len(sent) > len([s for s in steps if s[2] or s[3]])
    assert obs.pushed == {"outputs": len(runs), "commands": len(sent), "text": 2, "state": 0}
    assert obs.lost == 0 and obs.lost_outputs == 0 and obs.lost_commands == 0 and not obs.outlets


def test_a_bad_name_is_refused_with_what_to_give():
    with pytest.raises(ValueError, match="plain stream name prefix"):
        LslOutlets("")


def test_a_name_whose_outlets_another_session_publishes_is_refused():
    """Two sessions under one --lsl-out NAME would publish streams of the same names and source ids, which no
    consumer can tell apart: the second is refused, naming the stream it found."""
    name = f"cltest-{uuid.uuid4().hex[:10]}"
    pylsl = pytest.importorskip("pylsl")
    other = pylsl.StreamOutlet(pylsl.StreamInfo(f"{name}-commands", "Command", 1, 100, "float32",  # noqa: F841
                                                f"closedloop:{name}:commands"))
    time.sleep(0.3)
    with pytest.raises(ValueError, match=rf"--lsl-out {name}: the LSL stream '{name}-commands' is already on the "
                                         "network.*give --lsl-out another name"):
        LslOutlets(name)
    LslOutlets(f"{name}-2")  # another name is free


def test_a_session_publishes_every_output_and_command_a_step_that_ran_several_frames_included(gru_bundle, tmp_path):
    """A decoder consumes every frame; a step that finds two (frames bunched by the link's jitter) runs the model
    on both and answers each. A lab's LSL recorder must get each output and each command sent, as the session's
    recording does (its OUTPUT and TX records), each command stamped when it was written."""
    from closedloop.firmware_bridge import FrameParser
    from closedloop.firmware_bridge.messages import DecoderOutput
    from closedloop.runtime import RecordingReader, RecordType, SessionConfig

    record = tmp_path / "s.clrec"
    obs, wrapped, _ = _run_recording_outlets(gru_bundle, SessionConfig(
        device="sim://headstage?channels=12&delay_ms=10&jitter_ms=10&seed=2", duration_s=3.0, status=False,
        backend="onnxruntime", record=str(record)), ("outputs", "commands"))
    recorded = [rec.payload for rec in RecordingReader(record).of_type(RecordType.OUTPUT)]
    steps = [int.from_bytes(p[:4], "little") for p in recorded]
    assert len(steps) > len(set(steps)), "no step ran the model on two frames: the test shows nothing"
    values = np.array([np.frombuffer(p[8:], dtype="<f4") for p in recorded])
    assert obs.pushed["outputs"] == len(recorded) and obs.lost_outputs == 0
    np.testing.assert_array_equal(np.array(wrapped["outputs"].samples), values)
    parser = FrameParser()
    tx = [(rec.host_ns, f.message) for rec in RecordingReader(record).of_type(RecordType.TX)
          for f in parser.feed(rec.payload) if isinstance(f.message, DecoderOutput)]
    assert obs.pushed["commands"] == len(tx) and obs.lost_commands == 0  # the model's and the stop's safe one
    np.testing.assert_array_equal(np.array(wrapped["commands"].samples),
                                  np.array([m.char_probs for _, m in tx], dtype=np.float32))
    # stamped right after each write, the TX record's time taken just before it (the same clock, CLOCK_MONOTONIC)
    written = np.array([t for t, _ in tx]) / 1e9 + obs.offset_s
    gap = np.array(wrapped["commands"].stamps) - written
    assert np.all(gap > -1e-4) and np.median(gap) < 2e-3, gap


def test_typed_text_is_published_when_it_is_typed_with_the_stamp_of_the_output_that_typed_it(typing_bundle):
    """A lab aligns each typed character with the neural data: the text outlet's sample carries the time the
    character's model output was ready (the same stamp as that output's sample), not a status update's."""
    from closedloop.runtime import SessionConfig

    channels, bundle = 12, typing_bundle  # conftest's typing_bundle: a 12-channel decoder

    # link jitter bunches frames, so some steps run the model on two (the second often blank); the device restarts
    # at 2 s, which resets the text
    _, wrapped, summary = _run_recording_outlets(bundle, SessionConfig(
        device=f"sim://headstage?channels={channels}&seed=4&delay_ms=40&jitter_ms=40&reset_at=2&reset_s=0.2",
        duration_s=4.0, status=False, backend="onnxruntime"), ("text", "outputs"))
    text, outputs = wrapped["text"], wrapped["outputs"]
    typed = summary.family["text"]  # since the last reset
    before, marker, after = "".join(text.samples).rpartition("\n")
    assert marker and before and after == typed, (before, after, typed)  # the reset is a sample "\n" of its own
    assert len(typed) >= 3, "the decoder typed too little after the reset for the test to show anything"
    output_stamps, rows = np.array(outputs.stamps), np.array(outputs.samples)
    best = rows.argmax(axis=1)
    after_reset = False
    for sample, stamp in zip(text.samples, text.stamps, strict=True):
        if sample == "\n":
            after_reset = True
            continue
        # at the stamp of the model output that typed its last character: greedy CTC types where the best class
        # is not the blank (0) and differs from the previous output's (the first after a reset may repeat it)
        (j,) = np.flatnonzero(np.abs(output_stamps - stamp) < 1e-6)
        assert best[j] != 0, f"{sample!r} is stamped with a blank output's time"
        assert after_reset or j == 0 or best[j] != best[j - 1], f"{sample!r} is stamped with an output that typed nothing"
        after_reset = False



def test_a_family_state_is_an_outlet_of_its_own_with_its_labels_one_sample_per_step_that_ran():
    """An observer's estimate (the ring's state block) reaches LSL as NAME-state, labelled as info["state"] names
    it, one sample per step that ran the model, stamped at the end of that step; a step that did not run sends none."""
    name = f"cltest-{uuid.uuid4().hex[:10]}"
    obs = LslOutlets(name)
    labels = ["state/x1", "disturbance/d1", "predicted/y1"]
    ring = StepRing.create(n_in=1, n_out=2, n_cmd=1, capacity=256, event_capacity=8, event_slot=256, n_state=3)
    hub = ObserverHub(ring, [obs], interval_s=0.005)
    hub.start({"rate_hz": 1000.0, "n_out": 2, "n_cmd": 1, "family": "observer", "state": labels})
    try:
        end = time.monotonic() + 5
        while "state" not in obs.outlets and time.monotonic() < end:
            time.sleep(0.01)
        inlet = _inlet(f"{name}-state")
        assert inlet.info().type() == "State" and _labels(inlet.info(timeout=5.0)) == labels
        sent = []
        for k in range(30):
            t_ns = time.monotonic_ns()
            ring.begin(k, t_ns)
            if k % 3:  # every third step found no measurement: no state
                ring.set_state(np.array([k, -k, 0.5 * k]))
                ring.add_flags(FLAG_ACTED)
                sent.append((k, t_ns + 20_000))
            ring.publish(latency_ns=20_000, lateness_ns=0)
            time.sleep(0.002)
        x, ts = _pull_all(inlet, len(sent))
        np.testing.assert_array_equal(np.array(x), [[k, -k, 0.5 * k] for k, _ in sent])
        np.testing.assert_allclose(ts, np.array([t for _, t in sent]) / 1e9 + obs.offset_s, atol=1e-6)
    finally:
        hub.stop({})
        ring.close()
    assert obs.pushed["state"] == len(sent)


def test_an_observer_sessions_estimate_is_published_as_recorded(observer_bundle, tmp_path):
    """`--lsl-out` of an observer session: NAME-state carries each step's estimate and prediction, the same values
    as the recording's FAMILY_STATE record of the step's last measurement (a step catching up runs the update on
    each, and the recording keeps each), with the labels the recording's META gives."""
    from closedloop.runtime import RecordingReader, RecordType, SessionConfig

    record = tmp_path / "obs.clrec"
    obs, wrapped, _ = _run_recording_outlets(observer_bundle, SessionConfig(
        device="sim://plant?model=flexible-joint&rate=1000&seed=5", duration_s=1.0, status=False,
        backend="onnxruntime", record=str(record)), ("state",))
    reader = RecordingReader(record)
    last_of_step = {}  # step -> the state after its last measurement
    for r in reader.of_type(RecordType.FAMILY_STATE):
        step, _seq, values = r.output()
        last_of_step[step] = values
    recorded = np.array(list(last_of_step.values()))
    assert len(recorded) > 20 and obs.pushed["state"] == len(recorded) and obs.lost == 0
    np.testing.assert_array_equal(np.array(wrapped["state"].samples), recorded)
    assert obs.info["state"] == reader.meta["family_state"]
