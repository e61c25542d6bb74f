"""Frame layout: header fields, CRC placement, limits, and the strict decoder's reasons."""

from __future__ import annotations

import struct

import pytest

from closedloop.firmware_bridge import (
    HEADER_LEN,
    MAX_PAYLOAD_LEN,
    ActuatorCommand,
    FrameError,
    Heartbeat,
    MessageError,
    NeuralFrame,
    SignatureError,
    UnknownMessage,
    cobs_decode,
    cobs_encode,
    crc32c,
    decode_frame,
    encode_frame,
)


def test_header_is_20_little_endian_bytes_then_payload_then_crc() -> None:
    wire = encode_frame(Heartbeat(), seq=0x01020304, timestamp_us=0x1122334455667788)
    assert wire.endswith(b"\x00") and b"\x00" not in wire[:-1]
    raw = cobs_decode(wire[:-1])
    assert raw[:HEADER_LEN] == (b"CL" + bytes([1, 0x02, 0, 0]) + struct.pack("<HIQ", 1, 0x01020304,
                                                                               0x1122334455667788))
    assert raw[HEADER_LEN:-4] == b"\x01"  # HEARTBEAT payload: state RUNNING
    assert raw[-4:] == crc32c(raw[:-4]).to_bytes(4, "little")


def test_sequence_numbers_wrap_modulo_2_32() -> None:
    assert decode_frame(encode_frame(Heartbeat(), 2**32 + 5, 0)).seq == 5


def test_largest_payload_is_accepted_and_one_more_byte_is_refused() -> None:
    biggest = UnknownMessage(0xE0, bytes(range(256)) * (MAX_PAYLOAD_LEN // 256))
    assert decode_frame(encode_frame(biggest, 0, 0)).message.payload == biggest.payload
    with pytest.raises(MessageError, match="at most 4096"):
        encode_frame(UnknownMessage(0xE0, bytes(MAX_PAYLOAD_LEN + 1)), 0, 0)


def test_timestamp_must_be_a_u64() -> None:
    with pytest.raises(MessageError, match="u64"):
        encode_frame(Heartbeat(), 0, -1)


def _raw(flags: int = 0, version: int = 1, msg_type: int = 2, payload: bytes = b"\x01", plen: int | None = None,
         reserved: int = 0) -> bytes:
    body = struct.pack("<2sBBBBHIQ", b"CL", version, msg_type, flags, reserved,
                       len(payload) if plen is None else plen, 0, 0) + payload
    return cobs_encode(body + crc32c(body).to_bytes(4, "little"))


@pytest.mark.parametrize(("wire", "reason"), [
    (_raw(version=2), "malformed"),
    (_raw(flags=0x80), "malformed"),
    (_raw(reserved=3), "malformed"),
    (_raw(msg_type=0xFF), "malformed"),
    (_raw(plen=9), "malformed"),
    (_raw(msg_type=0x21, payload=bytes(4097)), "oversize"),
    (_raw(payload=b"\x09"), "malformed"),  # HEARTBEAT state 9 is not a DeviceState
    (_raw()[:-1], "malformed"),
    (cobs_encode(b"\x01" * 10), "malformed"),
    (_raw(flags=1, payload=b"\x01" + bytes(24), plen=1), "bad_tag"),
], ids=["version", "flag", "reserved", "type_ff", "length", "payload_4097", "bad_state",
        "truncated", "bad_cobs", "signed_no_key"])
def test_decode_frame_reports_the_reason(wire: bytes, reason: str) -> None:
    with pytest.raises(FrameError) as info:
        decode_frame(wire)
    assert info.value.reason == reason
    if reason == "bad_tag":
        assert isinstance(info.value, SignatureError)


def test_decode_frame_detects_a_flipped_bit_as_crc_error() -> None:
    raw = bytearray(cobs_decode(encode_frame(NeuralFrame(1, [1, 2, 3]), 0, 0)[:-1]))
    raw[25] ^= 0x10
    with pytest.raises(FrameError, match="crc_errors"):
        decode_frame(cobs_encode(bytes(raw)))


def test_decode_frame_wants_exactly_one_frame() -> None:
    two = encode_frame(ActuatorCommand([1.0]), 0, 0) * 2
    with pytest.raises(FrameError, match="more than one frame"):
        decode_frame(two)
