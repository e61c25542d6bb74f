"""Property tests: the parser never raises, and never accepts a frame that was not sent."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from closedloop.firmware_bridge import FrameParser, Heartbeat, NeuralFrame, PlantMeasurement, encode_frame

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _stream(messages: list) -> tuple[list[bytes], dict[int, bytes]]:
    wires = [encode_frame(m, seq=i, timestamp_us=1000 * i) for i, m in enumerate(messages)]
    return wires, {i: m.encode_payload() for i, m in enumerate(messages)}


def _chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


@SETTINGS
@given(st.binary(max_size=3000), st.lists(st.integers(0, 3000), max_size=8))
def test_arbitrary_bytes_never_raise(data: bytes, cuts: list[int]) -> None:
    parser = FrameParser()
    for chunk in _chunks(data, cuts):
        for frame in parser.feed(chunk):
            assert frame.message is not None
    assert parser.stats.bytes_in == len(data)


@SETTINGS
@given(data=st.data())
def test_corrupted_streams_never_yield_a_frame_that_was_not_sent(messages: st.SearchStrategy,
                                                                 data: st.DataObject) -> None:
    sent = data.draw(st.lists(messages, min_size=1, max_size=8))
    wires, payloads = _stream(sent)
    stream = bytearray(b"".join(wires))
    for _ in range(data.draw(st.integers(1, 6))):
        kind = data.draw(st.sampled_from(["flip", "insert", "delete", "swap", "zero"]))
        pos = data.draw(st.integers(0, len(stream) - 1)) if stream else 0
        if not stream:
            break
        if kind == "flip":
            stream[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "insert":
            stream[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del stream[pos : pos + data.draw(st.integers(1, 8))]
        elif kind == "swap" and pos + 1 < len(stream):
            stream[pos], stream[pos + 1] = stream[pos + 1], stream[pos]
        else:
            stream[pos] = 0
    parser = FrameParser()
    for chunk in _chunks(bytes(stream), data.draw(st.lists(st.integers(0, len(stream)), max_size=5))):
        for frame in parser.feed(chunk):
            # accepted => identical to the frame sent with that sequence number
            assert frame.seq in payloads
            assert frame.message.encode_payload() == payloads[frame.seq]
            assert frame.timestamp_us == 1000 * frame.seq
            assert frame.msg_type == sent[frame.seq].type_id


@SETTINGS
@given(data=st.data())
def test_delimited_garbage_between_frames_loses_no_frame(messages: st.SearchStrategy, data: st.DataObject) -> None:
    sent = data.draw(st.lists(messages, min_size=1, max_size=8))
    wires, payloads = _stream(sent)
    parts = []
    for wire in wires:
        parts.append(data.draw(st.binary(max_size=40)) + b"\x00")  # garbage, then a delimiter
        parts.append(wire)
    stream = b"".join(parts) + data.draw(st.binary(max_size=40))
    parser = FrameParser()
    got = []
    for chunk in _chunks(stream, data.draw(st.lists(st.integers(0, len(stream)), max_size=10))):
        got += parser.feed(chunk)
    assert [f.seq for f in got] == list(range(len(sent)))
    assert [f.message.encode_payload() for f in got] == [payloads[i] for i in range(len(sent))]


@SETTINGS
@given(st.lists(st.integers(1, 500), min_size=1, max_size=30))
def test_chunking_does_not_change_the_result(sizes: list[int]) -> None:
    rng = np.random.default_rng(len(sizes))
    msgs = [NeuralFrame(i, rng.poisson(1.0, 96)) if i % 3 else PlantMeasurement(rng.normal(size=4), [0.5])
            for i in range(20)]
    stream = b"".join(encode_frame(m, i, i) for i, m in enumerate(msgs)) + encode_frame(Heartbeat(), 20, 20)
    whole = FrameParser().feed(stream)
    parser, pieces, pos, i = FrameParser(), [], 0, 0
    while pos < len(stream):
        size = sizes[i % len(sizes)]
        pieces += parser.feed(stream[pos : pos + size])
        pos, i = pos + size, i + 1
    assert [(f.seq, f.message) for f in pieces] == [(f.seq, f.message) for f in whole]
    assert len(whole) == 21 and parser.stats.as_dict() == FrameParser().stats.as_dict() | {
        "accepted": 21, "bytes_in": len(stream)}
