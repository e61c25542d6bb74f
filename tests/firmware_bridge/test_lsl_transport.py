"""lsl://NAME: an LSL stream read as a device, fed by an outlet in this process (pylsl's wheel carries liblsl)."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

from closedloop.firmware_bridge import (
    Hello,
    Link,
    NeuralFrame,
    PlantMeasurement,
    Severity,
    Status,
    open_transport,
)
from closedloop.firmware_bridge.transports.lsl import (
    STATUS_LSL_CLOCK,
    STATUS_LSL_NOT_COUNTS,
    STATUS_LSL_STREAM,
    STATUS_LSL_STREAM_BACK,
    STATUS_LSL_STREAM_CHANGED,
    STATUS_LSL_STREAM_LOST,
    LslParams,
    LslStreamNotFoundError,
)

pytestmark = pytest.mark.timing  # wall-clock bounds: make test runs this file alone, after the parallel part

try:
    import pylsl
except (ImportError, RuntimeError) as exc:  # RuntimeError: pylsl without a loadable liblsl
    pytest.skip(f"pylsl with liblsl is needed for lsl:// ({exc}); pip install 'closedloop[lsl]'",
                allow_module_level=True)


def _name() -> str:
    return f"cltest-{uuid.uuid4().hex[:10]}"  # other test runs may share this machine's LSL network


def _outlet(name, n, rate, fmt="float32", stype="EEG", source_id=None):
    return pylsl.StreamOutlet(pylsl.StreamInfo(name, stype, n, rate, fmt, source_id or f"{name}-src"))


def _poll(link, seconds, push=None, until=None):
    frames, t_end = [], time.monotonic() + seconds
    while time.monotonic() < t_end and not (until is not None and until(frames)):
        if push is not None:
            push()
        frames += link.poll()
        time.sleep(0.005)
    return frames


def test_url_parameters_are_checked_before_anything_is_resolved():
    p = LslParams.from_url("lsl://Amp?type=EEG&kind=plant&timeout=0.5&buffer_s=3")
    assert (p.name, p.type, p.kind, p.timeout_s, p.buffer_s) == ("Amp", "EEG", "plant", 0.5, 3)
    assert p.predicate() == "name='Amp' and type='EEG'"
    with pytest.raises(ValueError, match=r"does not take \['rate'\]"):
        LslParams.from_url("lsl://Amp?rate=100")
    with pytest.raises(ValueError, match="kind='arm'"):
        LslParams.from_url("lsl://Amp?kind=arm")
    with pytest.raises(ValueError, match="timeout='soon' is not a number"):
        LslParams.from_url("lsl://Amp?timeout=soon")


def test_no_stream_of_that_name_names_it_and_lists_what_answered():
    other = _name()
    keep = _outlet(other, 2, 10)
    missing = _name()
    with pytest.raises(LslStreamNotFoundError) as err:
        open_transport(f"lsl://{missing}?timeout=0.3")
    msg = str(err.value)
    assert f"name='{missing}'" in msg and "0.3 s" in msg and other in msg, msg
    assert isinstance(err.value, ConnectionError)  # callers catching DeviceNotConnectedError catch it too
    del keep


def test_counts_arrive_intact_with_their_lsl_timestamps_and_the_clocks():
    name = _name()
    out = _outlet(name, 5, 100, fmt="int32", stype="Spikes")
    t = open_transport(f"lsl://{name}?timeout=3")
    assert t.kind == "headstage" and t.n_channels == 5 and t.rate_hz == 100
    link = Link(t)
    link.send(Hello(kind="host", name="test", rate_hz=100))
    sent = []

    def push():
        k = len(sent)
        x = [k, k + 1, 3 * k, 65535 if k % 2 else 0, 7]
        ts = pylsl.local_clock()
        out.push_sample(x, ts)
        sent.append((x, ts))

    frames = _poll(link, 0.5, push) + _poll(link, 0.1)
    hellos = [f.message for f in frames if isinstance(f.message, Hello)]
    assert len(hellos) == 1 and hellos[0].kind == "headstage" and hellos[0].n_channels == 5
    assert hellos[0].rate_hz == 100 and hellos[0].name == f"lsl:{name}" and hellos[0].command_low.size == 0
    data = [f for f in frames if isinstance(f.message, NeuralFrame)]
    assert len(data) == len(sent) > 20
    for i, (f, (x, ts)) in enumerate(zip(data, sent, strict=True)):
        assert f.message.bin_index == i
        np.testing.assert_array_equal(f.message.counts, x)
        # the source's clock in microseconds (the stream is in this process: the same clock)
        assert abs(f.timestamp_us - ts * 1e6) <= 1
    clocks = [f.message for f in frames if isinstance(f.message, Status) and f.message.code == STATUS_LSL_CLOCK]
    assert clocks, [type(f.message).__name__ for f in frames[:5]]
    import json

    c = json.loads(clocks[0].text)
    assert set(c) >= {"time_correction_s", "local_clock_s", "monotonic_ns"}
    assert abs(c["time_correction_s"]) < 0.01  # one machine
    link.close()


@pytest.mark.parametrize("stype", ["MoCap", "EEG", "ECoG"])
def test_float_measurements_arrive_as_plant_frames_and_commands_are_counted(stype):
    name = _name()
    out = _outlet(name, 3, 200, stype=stype)
    t = open_transport(f"lsl://{name}?timeout=3")
    assert t.kind == "plant"  # not spike counts: voltages (EEG in microvolts) and positions pass as they are
    link = Link(t)
    link.send(Hello(kind="host", name="test", rate_hz=200))
    x = np.array([0.125, -3.5e-3, 1e6], dtype=np.float32)
    frames = _poll(link, 0.2, lambda: out.push_sample(x.tolist()))
    ys = [f.message.y for f in frames if isinstance(f.message, PlantMeasurement)]
    assert len(ys) > 5 and all(np.array_equal(y, x) for y in ys)
    from closedloop.firmware_bridge import ActuatorCommand

    link.send(ActuatorCommand(u=np.array([1.0])))
    link.send(Status(code=1))  # REQUEST_REPORT
    frames = _poll(link, 0.1)
    assert t.stats.commands == {"ActuatorCommand": 1}
    reports = [f.message for f in frames if isinstance(f.message, Status) and f.message.code == 2]
    assert reports and '"ActuatorCommand": 1' in reports[0].text
    link.close()


def _headstage_frames(stype: str, sample: list[float]):
    """A float32 stream of ``stype`` read as a headstage, pushing ``sample`` repeatedly: (transport, link, frames,
    the counts of each NEURAL_FRAME)."""
    name = _name()
    out = _outlet(name, len(sample), 100, stype=stype)
    t = open_transport(f"lsl://{name}?timeout=3")
    link = Link(t)
    link.send(Hello(kind="host", name="test", rate_hz=100))
    frames = _poll(link, 0.15, lambda: out.push_sample(sample))
    return t, link, frames, [f.message.counts for f in frames if isinstance(f.message, NeuralFrame)]


def test_rounding_rule_for_float_counts():
    t, link, frames, counts = _headstage_frames("Neural", [2.5, 3.49, -4.0, float("nan"), 70000.0])
    assert counts
    np.testing.assert_array_equal(counts[0], [2, 3, 0, 0, 65535])  # round half to even, clip, NaN -> 0
    assert t.stats.clipped_values == 3 * len(counts) and t.stats.rounded_values == 2 * len(counts)
    # values that are not counts (voltages read as a headstage) are said once, loudly, with the fix
    warnings = [f.message for f in frames if isinstance(f.message, Status) and f.message.code == STATUS_LSL_NOT_COUNTS]
    assert len(warnings) == 1 and "kind=plant" in warnings[0].text and warnings[0].severity == Severity.WARNING
    link.close()


def test_float_counts_that_are_whole_numbers_pass_without_a_warning():
    t, link, frames, counts = _headstage_frames("SpikeCounts", [0.0, 7.0, 65535.0])
    assert counts and all(c.tolist() == [0, 7, 65535] for c in counts)
    assert t.stats.clipped_values == t.stats.rounded_values == 0
    assert not [f for f in frames if isinstance(f.message, Status) and f.message.code == STATUS_LSL_NOT_COUNTS]
    link.close()


@pytest.mark.parametrize("source_id", ["with-id", ""])
def test_a_stream_that_disappears_is_reported_and_frames_resume_when_it_returns(source_id):
    name = _name()
    sid = f"{name}-src" if source_id else ""
    info = lambda: pylsl.StreamInfo(name, "SpikeCounts", 2, 100, "float32", sid)  # noqa: E731
    out = pylsl.StreamOutlet(info())
    t = open_transport(f"lsl://{name}?timeout=3&lost_s=0.2")
    link = Link(t)
    link.send(Hello(kind="host", name="test", rate_hz=100))
    before = _poll(link, 0.3, lambda: out.push_sample([1.0, 2.0]))
    assert any(isinstance(f.message, NeuralFrame) for f in before)
    del out  # the source goes away
    gone = _poll(link, 0.6)
    lost = [f.message for f in gone if isinstance(f.message, Status) and f.message.code == STATUS_LSL_STREAM_LOST]
    assert len(lost) == 1 and name in lost[0].text
    # samples the source pushed just before it went may still be pulled late (a loaded machine); none after
    at = next(i for i, f in enumerate(gone) if f.message is lost[0])
    assert not any(isinstance(f.message, NeuralFrame) for f in gone[at:])
    out = pylsl.StreamOutlet(info())
    def resumed(frames):
        codes = [f.message.code for f in frames if isinstance(f.message, Status)]
        return STATUS_LSL_STREAM_BACK in codes and isinstance(frames[-1].message, NeuralFrame)

    # liblsl reconnects within about a second of the source's return; a loaded machine may take longer
    back = _poll(link, 15.0, lambda: out.push_sample([3.0, 4.0]), until=resumed)
    codes = [f.message.code for f in back if isinstance(f.message, Status)]
    assert STATUS_LSL_STREAM_BACK in codes, codes
    again = [f.message.counts for f in back if isinstance(f.message, NeuralFrame)]
    assert again and list(again[-1]) == [3, 4]
    assert t.stats.losses == 1
    link.close()


@pytest.mark.parametrize("source_id", ["with-id", ""])
def test_a_source_restarted_with_another_layout_answers_as_the_device_it_now_is(source_id):
    """A 3-channel source killed and restarted with 2 channels: its samples never fill the old 3-value frames
    (a stale third value); the transport says what changed and sends a HELLO of 2 channels, which a session checks
    against its bundle as for any device that came back as another."""
    name = _name()
    sid = f"{name}-src" if source_id else ""
    out = pylsl.StreamOutlet(pylsl.StreamInfo(name, "SpikeCounts", 3, 100, "float32", sid))
    t = open_transport(f"lsl://{name}?timeout=3&lost_s=0.2")
    link = Link(t)
    link.send(Hello(kind="host", name="test", rate_hz=100))
    first = _poll(link, 0.3, lambda: out.push_sample([1.0, 2.0, 3.0]))
    said = [f.message.text for f in first if isinstance(f.message, Status) and f.message.code == STATUS_LSL_STREAM]
    assert said and "3 float32 channels" in said[0] and "uid" in said[0]  # which stream answered, in the recording
    del out
    _poll(link, 0.6)
    out = pylsl.StreamOutlet(pylsl.StreamInfo(name, "SpikeCounts", 2, 100, "float32", sid))

    def seen(frames):
        return any(isinstance(f.message, Hello) for f in frames) and isinstance(frames[-1].message, NeuralFrame)

    after = _poll(link, 15.0, lambda: out.push_sample([7.0, 8.0]), until=seen)
    changed = [f.message.text for f in after
               if isinstance(f.message, Status) and f.message.code == STATUS_LSL_STREAM_CHANGED]
    hello = [f.message for f in after if isinstance(f.message, Hello)]
    assert changed and "3 float32 channels" in changed[0] and "is now" in changed[0] and "2 float32 channels" in changed[0]
    assert hello and hello[0].n_channels == 2
    counts = [list(f.message.counts) for f in after if isinstance(f.message, NeuralFrame)]
    at = next(i for i, f in enumerate(after) if isinstance(f.message, Hello))
    assert counts and all(c == [7, 8] for c in
                          [list(f.message.counts) for f in after[at:] if isinstance(f.message, NeuralFrame)])
    assert t.stats.streams_changed == 1
    link.close()


def test_two_streams_of_one_name_are_refused_listing_both():
    name = _name()
    a = _outlet(name, 2, 100, source_id=f"{name}-a")  # noqa: F841  (kept alive while resolving)
    b = _outlet(name, 2, 100, source_id=f"{name}-b")  # noqa: F841
    time.sleep(0.3)
    with pytest.raises(LslStreamNotFoundError) as e:
        open_transport(f"lsl://{name}?timeout=3")
    msg = str(e.value)
    assert "2 LSL streams match" in msg and f"{name}-a" in msg and f"{name}-b" in msg
    assert f"source_id={name}-a" in msg  # how to name one
    t = open_transport(f"lsl://{name}?timeout=3&source_id={name}-b")
    assert t.info.source_id() == f"{name}-b"
    t.close()


def test_liblsl_says_only_warnings_unless_the_user_configured_it_or_asked_for_debug(tmp_path):
    import os
    import subprocess
    import sys

    code = ("from closedloop.firmware_bridge.transports.lsl import import_pylsl\n"
            "import logging, sys\n"
            "if '-vv' in sys.argv: logging.getLogger('closedloop').setLevel(logging.DEBUG)\n"
            "import_pylsl().resolve_byprop('name', 'no-such-stream', timeout=0.1)\n")
    env = {k: v for k, v in os.environ.items() if k != "LSLAPICFG"} | {"HOME": str(tmp_path)}

    def stderr(*args, **extra):
        return subprocess.run([sys.executable, "-c", code, *args], cwd=tmp_path, env=env | extra,
                              capture_output=True, text=True, timeout=60).stderr

    assert "Loaded default config" not in stderr()
    assert "Loaded default config" in stderr("-vv")  # closedloop's debug logging lets liblsl's INFO through
    cfg = tmp_path / "mine.cfg"  # a user's own liblsl configuration decides
    cfg.write_text("[log]\nlevel = 0\n")
    assert "mine.cfg" in stderr(LSLAPICFG=str(cfg))


def test_while_its_stream_is_lost_another_source_of_the_name_is_never_switched_to():
    """Amplifier A goes silent while amplifier B of the same name is on the network: the session stays with A
    (it says once that B is there, and takes nothing of it), and takes A again when it comes back."""
    from closedloop.firmware_bridge.transports.lsl import STATUS_LSL_OTHER_SOURCE

    name = _name()
    a = _outlet(name, 2, 100, source_id=f"{name}-A")
    t = open_transport(f"lsl://{name}?timeout=3&lost_s=0.2")
    link = Link(t)
    link.send(Hello(kind="host", name="test", rate_hz=100))
    _poll(link, 0.3, lambda: a.push_sample([1.0, 1.0]))
    b = _outlet(name, 2, 100, source_id=f"{name}-B")  # a second amplifier, same name, same layout
    frames = _poll(link, 2.0, lambda: b.push_sample([9.0, 9.0]))  # A silent: only B pushes
    said = [f.message.text for f in frames if isinstance(f.message, Status) and f.message.code == STATUS_LSL_OTHER_SOURCE]
    values = [list(f.message.y) for f in frames if isinstance(f.message, PlantMeasurement)]
    assert said and f"{name}-B" in said[0] and "not taken" in said[0]
    assert [9.0, 9.0] not in values and t.info.source_id() == f"{name}-A"
    back = _poll(link, 3.0, lambda: (a.push_sample([2.0, 2.0]), b.push_sample([9.0, 9.0])),
                 until=lambda fr: any(isinstance(f.message, PlantMeasurement) for f in fr))
    got = [list(f.message.y) for f in back if isinstance(f.message, PlantMeasurement)]
    assert got and all(v == [2.0, 2.0] for v in got)  # A's samples, never B's
    assert t.stats.other_sources == 1
    link.close()


def test_a_sample_stamped_nan_or_before_zero_is_counted_and_the_stream_goes_on():
    from closedloop.firmware_bridge.transports.lsl import STATUS_LSL_BAD_TIMESTAMP

    name = _name()
    out = _outlet(name, 2, 100)
    t = open_transport(f"lsl://{name}?timeout=3")
    link = Link(t)
    link.send(Hello(kind="host", name="test", rate_hz=100))
    _poll(link, 0.3, lambda: out.push_sample([1.0, 1.0]))
    stamps = iter([pylsl.local_clock(), float("nan"), -5.0, pylsl.local_clock() + 0.01])
    frames = _poll(link, 1.0, lambda: out.push_sample([3.0, 3.0], next(stamps, pylsl.local_clock())))
    said = [f.message.text for f in frames if isinstance(f.message, Status) and f.message.code == STATUS_LSL_BAD_TIMESTAMP]
    data = [f for f in frames if isinstance(f.message, PlantMeasurement)]
    assert len(said) == 1 and "nan" in said[0] and t.stats.bad_timestamps == 2
    assert len(data) >= 4 and all(f.timestamp_us >= 0 for f in data)  # every sample went on as a frame
    link.close()


def test_a_stream_name_with_the_urls_own_characters_is_written_percent_encoded():
    assert LslParams.from_url("lsl://OpenBCI%232?type=EEG").name == "OpenBCI#2"
    assert LslParams.from_url("lsl://Amp%3FA%26B").name == "Amp?A&B"
    assert LslParams.from_url("lsl://BrainAmp Series 1").name == "BrainAmp Series 1"


def test_a_source_restarted_with_other_channel_labels_sends_its_new_descriptions():
    from closedloop.firmware_bridge.transports.lsl import STATUS_LSL_CHANNELS

    name, sid = _name(), f"{_name()}-src"

    def labelled(labels):
        info = pylsl.StreamInfo(name, "EEG", 2, 100, "float32", sid)
        chans = info.desc().append_child("channels")
        for label in labels:
            chans.append_child("channel").append_child_value("label", label)
        return pylsl.StreamOutlet(info)

    out = labelled(["Fz", "Cz"])
    t = open_transport(f"lsl://{name}?timeout=3&lost_s=0.2")
    link = Link(t)
    link.send(Hello(kind="host", name="test", rate_hz=100))
    _poll(link, 0.3, lambda: out.push_sample([1.0, 1.0]))
    del out
    _poll(link, 0.8)
    out = labelled(["C3", "C4"])  # the same source, another montage
    after = _poll(link, 10.0, lambda: out.push_sample([2.0, 2.0]),
                  until=lambda fr: any(isinstance(f.message, Status) and f.message.code == STATUS_LSL_CHANNELS
                                       for f in fr))
    texts = {f.message.code: f.message.text for f in after if isinstance(f.message, Status)}
    assert '"C3"' in texts.get(STATUS_LSL_CHANNELS, "") and t.channels["label"] == ["C3", "C4"]
    assert "other channel descriptions" in texts.get(STATUS_LSL_STREAM_CHANGED, "")
    link.close()
