"""Handshake with each emulator over sim://: announced HELLO, answered HELLO fields, reconnect, signing."""

from __future__ import annotations

import secrets

import numpy as np
import pytest

from closedloop.firmware_bridge import PROTOCOL_VERSION, Heartbeat, Hello, NeuralFrame
from closedloop.sim import ParamError, open_sim


def test_device_announces_hello_before_the_host_speaks(host):
    h = host("sim://headstage?channels=4")
    first = h.recv(2.0)
    assert first is not None and isinstance(first.message, Hello) and first.seq == 0  # a device starts with HELLO
    again = h.wait_for(lambda f: isinstance(f.message, Hello), timeout=1.5)  # repeated once per second
    assert again.message.kind == "headstage" and 0.9e6 < again.timestamp_us - first.timestamp_us < 1.1e6
    assert not h.collect(0.3, NeuralFrame)  # nothing streams before a host HELLO


def test_headstage_hello_fields(host):
    hello = host("sim://headstage?channels=96&rate=40&seed=3").handshake()
    assert (hello.kind, hello.protocol_version, hello.n_channels) == ("headstage", PROTOCOL_VERSION, 96)
    assert hello.rate_hz == pytest.approx(40.0)
    assert hello.n_dims == 0 and hello.name == "headstage:poisson"


@pytest.mark.parametrize("model, n_out, limit", [("msd", 1, 10.0), ("dc-motor", 2, 12.0)])
def test_plant_hello_fields(host, model, n_out, limit):
    hello = host(f"sim://plant?model={model}&rate=500").handshake()
    assert (hello.kind, hello.name, hello.n_channels) == ("plant", model, n_out)
    assert hello.rate_hz == pytest.approx(500.0)
    np.testing.assert_allclose(hello.command_low, [-limit])
    np.testing.assert_allclose(hello.command_high, [limit])


def test_panda_hello_fields(host):
    pytest.importorskip("pybullet")
    hello = host("sim://panda").handshake(timeout=10.0)
    assert (hello.kind, hello.name, hello.n_channels, hello.n_dims) == ("panda", "franka-panda", 8, 8)
    assert hello.rate_hz == pytest.approx(50.0)
    np.testing.assert_allclose(hello.command_low[:2], [-2.9671, -1.8326], atol=1e-4)
    np.testing.assert_allclose(hello.command_high[7], 0.08, atol=1e-6)  # gripper opening in metres


def test_a_new_host_hello_gets_a_fresh_hello_and_streaming_continues(host):
    h = host("sim://headstage?channels=4")
    h.handshake()
    before = [f.message.bin_index for _, f in h.collect(0.3, NeuralFrame)]
    hello = h.handshake()
    after = [f.message.bin_index for _, f in h.collect(0.3, NeuralFrame)]
    assert hello.kind == "headstage"
    assert before and after and after[0] > before[-1]  # no restart from bin 0


def test_heartbeats_come_once_per_second(host):
    h = host("sim://headstage?channels=2")
    h.handshake()
    beats = h.collect(2.2, Heartbeat)
    assert 2 <= len(beats) <= 3
    states = [f.message.state.name for _, f in beats]
    # an IDLE beat sent just before our HELLO was handled may still arrive first
    assert states[-1] == "RUNNING" and set(states[1:]) == {"RUNNING"}, states


def test_signed_link_with_key(host):
    key = secrets.token_hex(32)
    h = host(f"sim://headstage?channels=4&key={key}")
    assert h.transport.shared_secret == bytes.fromhex(key)
    assert h.handshake().kind == "headstage"
    frames = h.collect(0.3, NeuralFrame)
    assert frames and all(f.signed for _, f in frames)
    assert h.stats.rejected == 0


def test_host_without_the_key_refuses_signed_frames(host):
    from closedloop.firmware_bridge import Link

    h = host(f"sim://headstage?channels=4&key={secrets.token_hex(16)}")
    unsigned = Link(h.transport)  # a host that forgot the key
    unsigned.recv(1.5)
    assert unsigned.stats.received.bad_tag >= 1 and unsigned.stats.received.accepted == 0


@pytest.mark.parametrize("url, words", [
    ("sim://plant?rat=3", ["'rat'", "allowed", "rate"]),
    ("sim://plant?rate=fast", ["rate='fast'", "number"]),
    ("sim://plant?drop=2", ["drop='2'", "[0, 1]"]),
    ("sim://plant?model=x29", ["model='x29'", "dc-motor", "msd"]),
    ("sim://headstage?source=nope", ["source='nope'", "poisson"]),
    ("sim://robot", ["robot", "headstage", "panda", "plant"]),
    ("sim://plant?key=abc", ["key", "hex"]),
    ("sim://plant?mass=-1", ["mass='-1'"]),
])
def test_bad_parameters_are_refused_before_anything_starts(url, words):
    with pytest.raises(ParamError) as info:
        open_sim(url)
    assert isinstance(info.value, ValueError)
    for word in words:
        assert word in str(info.value)
