"""CRC-32C and COBS: known values, a bit-by-bit reference, and round trips."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from closedloop.firmware_bridge import FrameError, cobs_decode, cobs_encode, crc32c
from closedloop.firmware_bridge.cobs import cobs_max_encoded_len


def crc32c_reference(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def test_crc32c_check_value() -> None:
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0


@pytest.mark.parametrize("size", [1, 3, 4, 5, 63, 414, 4199, 4200, 4201, 10_000])
def test_crc32c_matches_reference_at_table_boundaries(size: int) -> None:
    data = bytes((i * 131 + 7) % 256 for i in range(size))
    assert crc32c(data) == crc32c_reference(data)


@given(st.binary(max_size=600), st.integers(0, 600))
def test_crc32c_chains_like_one_call(data: bytes, cut: int) -> None:
    cut = min(cut, len(data))
    assert crc32c(data[cut:], crc32c(data[:cut])) == crc32c(data) == crc32c_reference(data)


@pytest.mark.parametrize(("raw", "encoded"), [
    (b"", "01"),
    (b"\x00", "01 01"),
    (b"\x11\x22\x00\x33", "03 11 22 02 33"),
    (b"\x11\x00\x00\x00", "02 11 01 01 01"),
])
def test_cobs_known_encodings(raw: bytes, encoded: str) -> None:
    assert cobs_encode(raw).hex(" ") == encoded
    assert cobs_decode(bytes.fromhex(encoded)) == raw


def test_cobs_long_runs_use_0xff_blocks() -> None:
    run = bytes(range(1, 255))  # 254 non-zero bytes
    assert cobs_encode(run) == b"\xff" + run + b"\x01"
    assert cobs_decode(b"\xff" + run) == run  # the trailing empty block may be omitted
    assert cobs_decode(cobs_encode(run + b"\x00" + run)) == run + b"\x00" + run


@given(st.binary(max_size=2000) | st.lists(st.sampled_from([0, 1, 255]), max_size=800).map(bytes))
def test_cobs_round_trip_has_no_zero_and_bounded_overhead(raw: bytes) -> None:
    enc = cobs_encode(raw)
    assert b"\x00" not in enc
    assert len(enc) <= cobs_max_encoded_len(len(raw))
    assert cobs_decode(enc) == raw


@pytest.mark.parametrize("bad", [b"", b"\x03\x11", b"\x05\x01\x02", b"\x02\x00\x01", b"\xff\x01"])
def test_cobs_decode_rejects_invalid_segments(bad: bytes) -> None:
    with pytest.raises(FrameError) as info:
        cobs_decode(bad)
    assert info.value.reason == "malformed"
    assert isinstance(info.value, ValueError)
