"""Maximum frame size: oversize input is dropped and counted, memory stays bounded, and
the parser recovers at the next delimiter."""

from __future__ import annotations

import pytest

from closedloop.firmware_bridge import (
    MAX_ENCODED_FRAME_LEN,
    FrameParser,
    Heartbeat,
    UnknownMessage,
    encode_frame,
)
from closedloop.firmware_bridge.frame import MAX_PAYLOAD_LEN


@pytest.mark.parametrize("chunk", [1, 100, 5000, 100_000])
def test_endless_bytes_without_delimiter_are_dropped_then_parsing_resumes(chunk: int) -> None:
    junk = b"\x07" * 50_000
    parser = FrameParser()
    stream = junk + b"\x00" + encode_frame(Heartbeat(), 1, 1)
    frames = []
    for i in range(0, len(stream), chunk):
        frames += parser.feed(stream[i : i + chunk])
        assert len(parser._pending) <= MAX_ENCODED_FRAME_LEN  # bounded memory
    assert [f.seq for f in frames] == [1]
    assert parser.stats.oversize == 1
    assert parser.stats.bytes_discarded == len(junk)


def test_payload_limit_can_be_lowered_for_small_receivers() -> None:
    big = encode_frame(UnknownMessage(0xE0, bytes(600)), 0, 0)
    parser = FrameParser(max_payload_len=512)
    assert parser.feed(big + encode_frame(Heartbeat(), 1, 0)) != []
    assert parser.stats.oversize == 1 and parser.stats.accepted == 1
    with pytest.raises(ValueError, match="max_payload_len"):
        FrameParser(max_payload_len=MAX_PAYLOAD_LEN + 1)


def test_frame_at_the_limit_passes_and_longer_segment_is_oversize() -> None:
    at_limit = encode_frame(UnknownMessage(0xE0, b"\x01" * MAX_PAYLOAD_LEN), 0, 0)
    parser = FrameParser()
    assert len(parser.feed(at_limit)) == 1
    parser.feed(b"\x01" * (MAX_ENCODED_FRAME_LEN + 1) + b"\x00")
    assert parser.stats.oversize == 1
