"""Each injected fault has the effect a host can observe: gaps, rejections, duplicates, delay, silence, disconnect."""

from __future__ import annotations

import time

import numpy as np
import pytest

from closedloop.firmware_bridge import (
    ActuatorCommand,
    DeviceNotConnectedError,
    FrameError,
    Hello,
    NeuralFrame,
    PlantMeasurement,
    decode_frame,
    encode_frame,
)
from closedloop.sim import StatusCode
from closedloop.sim.faults import corrupt_one_bit

pytestmark = pytest.mark.timing  # wall-clock bounds: make test runs this file alone, after the parallel part

FAST = "sim://headstage?channels=4&rate=200&seed=1"


def test_corrupt_one_bit_keeps_delimiters_and_flips_exactly_one_bit():
    rng = np.random.default_rng(0)
    wire = encode_frame(NeuralFrame(7, np.arange(32)), seq=1, timestamp_us=5)
    for _ in range(500):
        bad = corrupt_one_bit(wire, rng)
        diff = np.frombuffer(bad, np.uint8) ^ np.frombuffer(wire, np.uint8)
        assert np.unpackbits(diff).sum() == 1
        assert bad.count(0) == wire.count(0) and bad.endswith(b"\x00")
        with pytest.raises(FrameError):
            decode_frame(bad)


def test_drop_shows_as_sequence_gaps(host):
    h = host(FAST + "&drop=0.2")
    h.handshake()
    frames = h.collect(1.0, NeuralFrame)
    lost, got = h.stats.lost, h.stats.accepted
    assert 0.1 < lost / (lost + got) < 0.3
    bins = [f.message.bin_index for _, f in frames]
    assert np.all(np.diff(bins) >= 1) and np.any(np.diff(bins) > 1)
    assert h.stats.rejected == 0
    assert h.report()["faults"]["dropped"] >= lost


def test_corrupt_shows_as_crc_rejections_and_no_bad_frame_gets_through(host):
    h = host(FAST + "&corrupt=0.2")
    h.handshake()
    frames = h.collect(1.0, NeuralFrame)
    assert h.stats.crc_errors > 5
    assert h.stats.crc_errors + h.stats.malformed >= 0.1 * (h.stats.accepted + h.stats.rejected)
    bins = [f.message.bin_index for _, f in frames]
    assert bins == sorted(set(bins)) and all(f.message.n_channels == 4 for _, f in frames)


def test_a_misbehaving_device_sends_well_framed_frames_of_the_wrong_size_or_with_nonfinite_values(host):
    h = host("sim://plant?model=msd&rate=200&seed=2&glitch=0.3&nonfinite=0.3")
    hello = h.handshake()
    frames = [f.message for _, f in h.collect(1.0, PlantMeasurement)]
    assert h.stats.crc_errors == 0 and h.stats.malformed == 0  # the wire is clean: only the contents are wrong
    sizes = np.array([m.y.size for m in frames])
    finite = np.array([bool(np.isfinite(m.y).all()) for m in frames])
    assert set(sizes) <= {hello.n_channels - 1, hello.n_channels, hello.n_channels + 1} and hello.n_channels > 0
    assert 0.15 < np.mean(sizes != hello.n_channels) < 0.45  # about 30% glitched
    assert 0.15 < np.mean(~finite) < 0.45  # about 30% with a NaN or an infinity
    faults = h.report()["faults"]
    assert faults["glitched"] >= np.sum(sizes != hello.n_channels) and faults["nonfinite"] >= np.sum(~finite)


def test_nonfinite_is_refused_for_a_device_whose_data_are_integers():
    from closedloop.firmware_bridge import open_transport
    from closedloop.sim.params import ParamError

    with pytest.raises(ParamError, match="nonfinite=0.1: this device's data are integers .*headstage"):
        open_transport(FAST + "&nonfinite=0.1")


def test_duplicate_shows_as_duplicates(host):
    h = host(FAST + "&duplicate=0.2")
    h.handshake()
    frames = h.collect(1.0, NeuralFrame)
    assert h.stats.duplicate > 10
    bins = [f.message.bin_index for _, f in frames]
    assert len(bins) == len(set(bins)) and h.stats.lost == 0


def test_delay_and_jitter_add_latency_but_keep_order(host):
    h = host(FAST + "&delay_ms=300&jitter_ms=50")
    h.wait_for(lambda f: isinstance(f.message, Hello), 2.0)  # announced: the device is up
    sent = time.monotonic()
    h.send(Hello(kind="host"))
    h.wait_status(StatusCode.STREAMING)  # sent right after the answering HELLO
    assert time.monotonic() - sent > 0.24
    h.collect(0.5)
    assert h.stats.out_of_order == 0 and h.stats.lost == 0


def test_silence_stops_frames_for_silence_s_then_they_come_back(host):
    h = host("sim://headstage?channels=4&silence_at=0.4&silence_s=1.0")
    h.handshake()
    arrivals = [t for t, _ in h.collect(2.2, NeuralFrame)]
    gaps = np.diff(arrivals)
    assert 0.85 < gaps.max() < 1.3, f"longest gap {gaps.max():.3f} s"
    assert arrivals[-1] - arrivals[int(gaps.argmax()) + 1] > 0.3  # streaming resumed
    assert 40 <= h.stats.lost <= 60  # the silent second's bins were numbered but never sent
    assert "silent for 1 s" in h.wait_status(StatusCode.FAULT_SILENCE).text


def test_disconnect_gives_a_read_error_then_frames_resume(host):
    h = host("sim://headstage?channels=4&disconnect_at=0.4&disconnect_s=1.0")
    h.handshake()
    error = h.read_until_error(2.0)
    assert isinstance(error, DeviceNotConnectedError) and isinstance(error, ConnectionError)
    assert "stays open" in str(error)
    lost_at = time.monotonic()
    assert h.transport.is_open and h.transport.device_running
    # During the disconnect every read fails; a session keeps trying.
    _, errors = h.first_frame_after_reconnect(NeuralFrame, 3.0)
    assert 0.7 < time.monotonic() - lost_at < 1.6 and errors > 5
    assert any(s.code == StatusCode.FAULT_DISCONNECT for s in h.statuses)  # sent before the port closed
    h.wait_status(StatusCode.RECONNECTED)
    assert h.handshake().kind == "headstage"  # a reconnecting host says HELLO again
    assert len(h.collect(0.3, NeuralFrame)) > 10


def test_plant_applies_zero_input_while_its_host_is_unreachable(host):
    h = host("sim://plant?model=msd&rate=500&disconnect_at=0.3&disconnect_s=0.5")
    h.handshake()
    h.send(ActuatorCommand([3.0]))
    assert h.wait_for(lambda f: isinstance(f.message, PlantMeasurement) and f.message.u[0] == 3.0, 1.0)
    assert h.read_until_error(1.5) is not None
    frame, _ = h.first_frame_after_reconnect(PlantMeasurement, 2.0)
    assert frame.message.u[0] == 0.0  # hold_s ran out while the port was closed
    h.wait_status(StatusCode.HOLD)


def test_reset_restarts_at_seq_0_and_says_hello_every_second_until_answered(host):
    # a board rebooting behind a USB-serial adapter: the port stays open, the stream stops, and the board
    # comes back as from power-on; it streams again only once a host answers its HELLO
    h = host("sim://headstage?channels=4&rate=100&reset_at=0.4&reset_s=0.3")
    h.handshake()
    assert len(h.collect(0.2, NeuralFrame)) > 5  # streaming (past the handshake's HELLOs)
    hello = h.wait_for(lambda f: isinstance(f.message, Hello), 2.0)  # the restarted board's first frame
    assert hello.seq == 0
    later = h.collect(1.3)
    hellos = [(t, f) for t, f in later if isinstance(f.message, Hello)]
    assert not any(isinstance(f.message, NeuralFrame) for _, f in later)  # nothing streams unanswered
    assert len(hellos) == 1 and hellos[0][1].seq > 0  # repeated about a second later, numbered on
    assert h.stats.seq_resets >= 2  # each HELLO starts a new stream at the host
    h.send(Hello(kind="host"))
    frames = h.collect(0.5, NeuralFrame)
    assert len(frames) > 20 and frames[0][1].message.bin_index == 0
    report = h.report()
    assert report["resets"] == 1 and report["streaming"]
    assert report["host_hellos"] == 2  # the handshake's and the answer to the restarted board
