"""A session fed by an LSL stream (lsl://NAME) from an outlet in this process: decoded, recorded, replayed."""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from closedloop.firmware_bridge import FrameParser, NeuralFrame
from closedloop.firmware_bridge.transports.lsl import STATUS_LSL_CLOCK, STATUS_LSL_STREAM_LOST
from closedloop.runtime import RecordingReader, RecordType, SessionConfig, replay_recording, run_session

pytestmark = pytest.mark.timing  # wall-clock bounds: make test runs this file alone, after the parallel part

try:
    import pylsl
except (ImportError, RuntimeError) as exc:
    pytest.skip(f"pylsl with liblsl is needed for lsl:// ({exc}); pip install 'closedloop[lsl]'",
                allow_module_level=True)


@pytest.fixture(scope="module")
def neural_bundle(tmp_path_factory):
    import torch

    from closedloop.export import export_bundle
    from closedloop.sdk.models import GRUDecoder

    torch.manual_seed(0)
    return export_bundle(
        GRUDecoder(12, 16, 1, 5).eval(), tmp_path_factory.mktemp("lsl") / "neural", kind="recurrent",
        example_input=torch.zeros(1, 12), rate_hz=50.0, name="neural",
        extra={"session": {"input": "neural_frame", "command": "decoder_output"}},
        variants=(), tensorrt=False, report=lambda s: None,
    )


class _Source(threading.Thread):
    """A 50 Hz, 12-channel spike-count outlet that goes away for ``gone_s`` at ``gone_at_s`` and comes back."""

    def __init__(self, name: str, gone_at_s: float, gone_s: float, run_s: float):
        super().__init__(daemon=True)
        self.name_ = name
        self.gone_at_s, self.gone_s, self.run_s = gone_at_s, gone_s, run_s
        self.sent: dict[int, np.ndarray] = {}  # timestamp in us -> counts
        self.outlet = self._outlet()

    def _outlet(self):
        return pylsl.StreamOutlet(pylsl.StreamInfo(self.name_, "Spikes", 12, 50, "int32", f"{self.name_}-src"))

    def run(self) -> None:
        rng = np.random.default_rng(0)
        self.outlet.wait_for_consumers(30.0)  # the timeline starts when the session has opened its inlet
        t0 = time.monotonic()
        k = 0
        while (t := time.monotonic() - t0) < self.run_s:
            gone = self.gone_at_s <= t < self.gone_at_s + self.gone_s
            if gone and self.outlet is not None:
                self.outlet = None  # the source disappears from the network
            elif not gone and self.outlet is None:
                self.outlet = self._outlet()
            if self.outlet is not None:
                x = rng.integers(0, 6, 12).astype(np.int32)
                x[0] = k % 1000
                ts = pylsl.local_clock()
                self.outlet.push_sample(x, ts)
                self.sent[round(ts * 1e6)] = x
            k += 1
            time.sleep(max(0.0, t0 + k / 50 - time.monotonic()))


@pytest.mark.parametrize("wake_on_input", [False, True], ids=["clocked", "wake-on-input"])
def test_an_lsl_stream_drives_a_session_is_recorded_with_its_clocks_and_replays(neural_bundle, tmp_path,
                                                                                 wake_on_input):
    # clocked: the session's 50 Hz clock; wake-on-input: a step as each sample arrives, the clock only the
    # watchdog's tick while the source is gone
    name = f"cltest-{uuid.uuid4().hex[:10]}"
    src = _Source(name, gone_at_s=2.0, gone_s=0.5, run_s=7.0)  # outlives the 6-s session
    src.start()
    rec = tmp_path / "lsl.clrec"
    cfg = SessionConfig(device=f"lsl://{name}?timeout=3&lost_s=0.3", duration_s=6.0, status=False,
                        record=str(rec), backend="onnxruntime", wake_on_input=wake_on_input)
    s = run_session(neural_bundle, cfg)
    src.join()
    assert s.device["kind"] == "headstage" and s.device["n_channels"] == 12 and s.device["rate_hz"] == 50
    assert s.commands_sent == s.inputs_used > 50, s.to_dict()
    assert s.link["lost"] == 0 and s.link["crc_errors"] == 0
    # every recorded frame carries a pushed sample's LSL timestamp and exactly its values
    reader, parser = RecordingReader(rec), FrameParser()
    frames = [f for r in reader.of_type(RecordType.RX) for f in parser.feed(r.payload)
              if isinstance(f.message, NeuralFrame)]
    assert len(frames) >= s.inputs_used
    for f in frames:
        assert f.timestamp_us in src.sent, f.timestamp_us
        np.testing.assert_array_equal(f.message.counts, src.sent[f.timestamp_us])
    # the second clock: the inlet's correction and this host's LSL and monotonic clocks, read together
    events = [r.json() for r in reader.of_type(RecordType.EVENT)]
    clocks = [json.loads(e["text"]) for e in events
              if e["event"] == "device_status" and e["code"] == STATUS_LSL_CLOCK]
    assert len(clocks) >= 2 and all(abs(c["time_correction_s"]) < 0.01 for c in clocks)
    # the source went away: reported by the transport, the watchdog tripped, and input resumed when it came back
    # (liblsl reconnects within about a second of the source's return)
    kinds = [e["event"] for e in events]
    lost = [e for e in events if e["event"] == "device_status" and e["code"] == STATUS_LSL_STREAM_LOST]
    assert lost and name in lost[0]["text"], events  # (a loaded machine may starve the inlet once more)
    assert s.watchdog_trips >= 1 and "watchdog" in kinds
    assert "input_resumed" in kinds[kinds.index("watchdog"):], kinds
    # the recording replays exactly through the bundle
    rep = replay_recording(rec, neural_bundle, backend="onnxruntime")
    assert rep.outputs_compared == s.inputs_used and rep.missing_inputs == 0 and rep.max_abs_diff <= 1e-6


def _session_takes_observers() -> bool:
    import dataclasses

    return any(f.name == "observers" for f in dataclasses.fields(SessionConfig))


@pytest.mark.skipif(not _session_takes_observers(), reason="SessionConfig has no observers field in this tree")
def test_lsl_out_publishes_the_commands_a_session_sends_stamped_just_after_they_went_out(neural_bundle, tmp_path):
    from closedloop.firmware_bridge import DecoderOutput
    from closedloop.runtime.observe import LslOutlets

    name = f"cltest-{uuid.uuid4().hex[:10]}"
    src = _Source(name, gone_at_s=1e9, gone_s=0.0, run_s=4.0)  # outlives the 3-s session that it feeds
    src.start()
    obs = LslOutlets(f"{name}-out")
    got: dict[str, list] = {"x": [], "t": []}

    def consume() -> None:
        found = pylsl.resolve_byprop("name", f"{name}-out-commands", 1, 10.0)
        if not found:
            return
        inlet = pylsl.StreamInlet(found[0])
        inlet.open_stream(timeout=5.0)
        got["text_outlet"] = pylsl.resolve_byprop("name", f"{name}-out-text", 1, 1.0)  # a decoder that types no text
        end = time.monotonic() + 10.0
        while time.monotonic() < end and not (ended.is_set() and time.monotonic() > ended_at[0] + 1.0):
            x, t = inlet.pull_chunk(timeout=0.1)
            got["x"] += x
            got["t"] += t

    ended, ended_at = threading.Event(), [0.0]  # the consumer reads until a second after the session has ended
    reader_thread = threading.Thread(target=consume, daemon=True)
    reader_thread.start()
    rec = tmp_path / "out.clrec"
    s = run_session(neural_bundle, SessionConfig(device=f"lsl://{name}?timeout=3", duration_s=3.0, status=False,
                                                 record=str(rec), backend="onnxruntime", observers=[obs]))
    ended_at[0] = time.monotonic()
    ended.set()
    reader_thread.join()
    src.join()
    assert s.commands_sent > 50 and len(got["t"]) > 0.5 * s.commands_sent, (len(got["t"]), s.commands_sent)
    # each published command is one the session wrote, stamped at the end of its step: after the write
    parser = FrameParser()
    sent = [(r.host_ns / 1e9 + obs.offset_s, f.message.char_probs) for r in RecordingReader(rec).of_type(RecordType.TX)
            for f in parser.feed(r.payload) if isinstance(f.message, DecoderOutput)]
    times = np.array([t for t, _ in sent])
    for x, t in zip(got["x"], got["t"], strict=True):
        i = int(np.searchsorted(times, t, side="right")) - 1  # the last command written before the stamp
        assert i >= 0 and 0 <= t - times[i] < 0.05, (t, times[max(i, 0)])
        np.testing.assert_allclose(x, sent[i][1], rtol=1e-6)
    # the last sample is the stop's safe command, the command in force after the session (zeros for a decoder)
    assert s.stop_commands_sent == 1 and got["x"][-1] == [0.0] * len(got["x"][-1])
    np.testing.assert_array_equal(got["x"][-1], sent[-1][1])
    assert got["text_outlet"] == []  # no NAME-text outlet for a family that types nothing


def test_an_lsl_stream_read_as_the_wrong_kind_is_refused_with_the_url_that_reads_it_right(neural_bundle):
    """An EEG-typed stream opens as a plant by default; a spike-count decoder's handshake refuses it and says how to
    read it as a headstage (the kind is the URL's, not the bundle's)."""
    from closedloop.firmware_bridge import Hello
    from closedloop.runtime import Model, get_family, load_bundle

    bundle = load_bundle(neural_bundle)
    family = get_family(bundle.manifest.family)(bundle, Model(bundle, backend="onnxruntime"))
    problems = family.check_device(Hello(kind="plant", name="lsl:Amp", n_channels=12, rate_hz=50.0))
    assert any("lsl://Amp?kind=headstage" in p for p in problems), problems


def test_the_sources_channel_labels_units_and_types_reach_the_recording_and_nwb(neural_bundle, tmp_path):
    """An LSL source that describes its channels (desc/channels/channel: label, unit, type) has them in the
    recording as LSL_CHANNELS device statuses, in parts where they exceed one STATUS text, and in the NWB export."""
    import pynwb

    from closedloop.firmware_bridge.transports.lsl import STATUS_LSL_CHANNELS
    from closedloop.runtime.recording_view import view_recording
    from closedloop.sdk.nwb_export import recording_to_nwb

    name = f"cltest-{uuid.uuid4().hex[:10]}"
    labels = [f"elec-{i:02d}-" + "é" * 190 for i in range(12)]  # 12 x 390 bytes: two parts
    info = pylsl.StreamInfo(name, "Spikes", 12, 50, "int32", f"{name}-src")
    chans = info.desc().append_child("channels")
    for i, label in enumerate(labels):
        ch = chans.append_child("channel")
        ch.append_child_value("label", label)
        ch.append_child_value("unit", "counts")
        if i % 2 == 0:
            ch.append_child_value("type", "spikes")
    outlet = pylsl.StreamOutlet(info)
    stop = threading.Event()

    def push():
        while not stop.is_set():
            outlet.push_sample(np.arange(12, dtype=np.int32))
            time.sleep(0.02)

    threading.Thread(target=push, daemon=True).start()
    rec = tmp_path / "chans.clrec"
    try:
        run_session(neural_bundle, SessionConfig(device=f"lsl://{name}?timeout=3", duration_s=1.0, status=False,
                                                 record=str(rec), backend="onnxruntime"))
    finally:
        stop.set()
    events = [r.json() for r in RecordingReader(rec).of_type(RecordType.EVENT)]
    parts = [e for e in events if e["event"] == "device_status" and e["code"] == STATUS_LSL_CHANNELS]
    assert len(parts) >= 2 and all(len(p["text"].encode()) <= 4000 for p in parts)
    want = {"label": labels, "unit": ["counts"] * 12, "type": ["spikes" if i % 2 == 0 else "" for i in range(12)]}
    assert view_recording(rec).channels == want
    with pynwb.NWBHDF5IO(str(recording_to_nwb(rec, tmp_path / "chans.nwb")), "r") as io:
        assert json.loads(io.read().acquisition["binned_spikes"].comments)["channels"] == want


def test_channel_descriptions_split_into_status_texts_and_join_back():
    from closedloop.firmware_bridge.transports.lsl import STATUS_LSL_CHANNELS, channel_status_texts
    from closedloop.runtime.recording_view import channels_from_events

    desc = {"label": [f"ch{i:03d}" for i in range(192)], "unit": ["microvolts"] * 192, "type": ["EEG"] * 192}
    texts = channel_status_texts(desc)
    assert len(texts) > 1 and all(len(t.encode()) <= 3900 for t in texts)
    events = [{"event": "device_status", "code": STATUS_LSL_CHANNELS, "text": t} for t in texts]
    assert channels_from_events(events) == desc
    assert channels_from_events(events[1:]) is None  # a description without its first part is not guessed
    assert channels_from_events(events[:1] + events) == desc  # a repeat (a re-handshake) starts it again
    # a source restarted with another montage mid-session: both descriptions are seen, and the view says so
    from closedloop.runtime.recording_view import RecordingView, Series, channel_descriptions_over_time

    other = desc | {"label": [f"new{i:03d}" for i in range(192)]}
    later = [{"event": "device_status", "code": STATUS_LSL_CHANNELS, "text": t} for t in channel_status_texts(other)]
    assert channel_descriptions_over_time(events + events + later) == [desc, other]  # a repeat is not a change
    view = RecordingView(path=Path("x.clrec"), meta={"x": 1}, summary={}, t0_ns=0, inputs={}, commands=Series(),
                         outputs=Series(), typed=[], events=[(float(i), e) for i, e in enumerate(events + later)],
                         steps={})
    assert view.channels == desc
    assert any("channel descriptions changed during the session" in p for p in view.problems())


def test_lsl_out_wait_holds_publishing_until_a_recorder_connects_so_it_gets_every_step(neural_bundle):
    """``--lsl-out-wait``: a recorder that finds the outlets a second after they appear still gets the session's
    commands from its first step (they waited in the step ring), each once, with the step's own timestamps."""
    from closedloop.runtime.observe import FLAG_COMMAND, LslOutlets, SessionObserver

    class CommandSteps(SessionObserver):  # NAME-commands has a sample per command sent (several in a step catching up)
        n = 0

        def on_commands(self, batch):
            self.n += int(np.count_nonzero(batch.flags & FLAG_COMMAND))

    name = f"cltest-{uuid.uuid4().hex[:10]}"
    src = _Source(name, gone_at_s=1e9, gone_s=0.0, run_s=4.0)
    src.start()
    obs = LslOutlets(f"{name}-out", wait_s=5.0)
    got: dict[str, list] = {"commands": [], "outputs": []}

    def record() -> None:
        found = {which: pylsl.resolve_byprop("name", f"{name}-out-{which}", 1, 10.0) for which in got}
        time.sleep(1.0)  # a recorder that takes a second after the streams appear to connect
        inlets = {}
        for which in got:
            inlets[which] = pylsl.StreamInlet(found[which][0])
            inlets[which].open_stream(timeout=5.0)
        connected.append(pylsl.local_clock())
        end = time.monotonic() + 10.0
        while time.monotonic() < end and not (ended.is_set() and time.monotonic() > ended_at[0] + 1.0):
            for which, inlet in inlets.items():
                got[which] += inlet.pull_chunk(timeout=0.05)[1]

    connected: list[float] = []
    ended, ended_at = threading.Event(), [0.0]  # the recorder reads until a second after the session has ended
    recorder = threading.Thread(target=record, daemon=True)
    recorder.start()
    s = run_session(neural_bundle, SessionConfig(device=f"lsl://{name}?timeout=3", duration_s=2.0, status=False,
                                                 backend="onnxruntime", observers=[obs, steps := CommandSteps()]))
    ended_at[0] = time.monotonic()
    ended.set()
    recorder.join()
    src.join()
    assert obs.without_consumer == [] and 0.8 < obs.waited_s < 5.0
    assert obs.lost == 0 and s.commands_sent > 40
    # every command the session sent, and the stop's, from the first step on: none lost to the late recorder
    assert len(got["commands"]) == obs.pushed["commands"] == steps.n + s.stop_commands_sent
    assert steps.n == s.commands_sent
    assert len(got["outputs"]) == obs.pushed["outputs"] == s.inputs_used
    # stamped when each was sent, the first ones before the recorder connected
    assert got["commands"][0] < connected[0] - 0.5 and got["commands"][-1] > connected[0]


def test_lsl_out_wait_needs_lsl_out():
    with pytest.raises(ValueError, match="give lsl_out"):
        SessionConfig(device="sim://headstage", lsl_out_wait_s=2.0)
    with pytest.raises(ValueError, match="0 .do not wait. or more"):
        SessionConfig(device="sim://headstage", lsl_out="x", lsl_out_wait_s=-1.0)
