"""Sending through the C library: COBS and CRC-32C byte for byte the Python reference's, frames unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from closedloop.firmware_bridge import FrameParser, NeuralFrame, encode_frame
from closedloop.firmware_bridge.c_library import CParserUnavailableError, frame_encoders
from closedloop.firmware_bridge.cobs import cobs_encode
from closedloop.firmware_bridge.crc import crc32c

try:
    C_COBS, C_CRC = frame_encoders()
except CParserUnavailableError as exc:  # pragma: no cover - a machine without a C compiler
    pytest.skip(f"C library unavailable: {exc}", allow_module_level=True)


@pytest.mark.parametrize("n", [0, 1, 2, 253, 254, 255, 256, 507, 508, 509, 1000, 4161])
def test_cobs_and_crc_equal_the_python_reference(n):
    rng = np.random.default_rng(n)
    for alphabet in (256, 2, 1):  # random bytes, mostly zeros, all zeros (the COBS corner cases)
        for _ in range(20):
            data = rng.integers(0, alphabet, n, dtype=np.uint8).tobytes()
            assert C_COBS(data) == cobs_encode(data)
            assert C_CRC(data) == crc32c(data)


def test_crc_check_value():
    assert C_CRC(b"123456789") == 0xE3069283  # CRC-32C's published check value


def test_an_encoded_frame_is_the_reference_frame():
    from closedloop.firmware_bridge import frame as frame_module

    msg = NeuralFrame(7, np.arange(192, dtype=np.uint16))
    sent = encode_frame(msg, 5, 123)
    saved = frame_module._ENCODERS
    try:
        frame_module._ENCODERS = (cobs_encode, crc32c)
        assert encode_frame(msg, 5, 123) == sent
    finally:
        frame_module._ENCODERS = saved
    (f,) = FrameParser().feed(sent)
    assert f.seq == 5 and f.timestamp_us == 123 and np.array_equal(f.message.counts, msg.counts)
