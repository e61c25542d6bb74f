"""Signed links: wrong key, replay, reorder and unsigned frames are all refused."""

from __future__ import annotations

import hashlib
import hmac
import struct

import pytest

from closedloop.firmware_bridge import (
    FrameParser,
    FrameSigner,
    FrameVerifier,
    Heartbeat,
    MessageError,
    NeuralFrame,
    SignatureError,
    cobs_decode,
    decode_frame,
    derive_link_keys,
    encode_frame,
)

KEY = bytes(range(32))


def test_tag_is_truncated_hmac_sha256_over_header_payload_counter() -> None:
    wire = encode_frame(NeuralFrame(7, [3, 0, 1]), 5, 123, FrameSigner(KEY, counter_start=42))
    raw = cobs_decode(wire[:-1])
    plen = struct.unpack_from("<H", raw, 6)[0]
    end = 20 + plen
    assert raw[4] == 0x01
    assert struct.unpack_from("<Q", raw, end)[0] == 42
    assert raw[end + 8 : end + 24] == hmac.new(KEY, raw[: end + 8], hashlib.sha256).digest()[:16]
    assert len(raw) == end + 24 + 4


def test_verified_frame_carries_its_counter() -> None:
    signer = FrameSigner(KEY, counter_start=7)
    frame = decode_frame(encode_frame(Heartbeat(), 0, 0, signer), FrameVerifier(KEY))
    assert frame.signed and frame.sign_counter == 7 and signer.next_counter == 8


def test_wrong_key_is_refused() -> None:
    wire = encode_frame(Heartbeat(), 0, 0, FrameSigner(KEY))
    parser = FrameParser(FrameVerifier(bytes(32)))
    assert parser.feed(wire) == [] and parser.stats.bad_tag == 1
    with pytest.raises(SignatureError, match="bad_tag"):
        decode_frame(wire, FrameVerifier(b"x" * 32))


def test_tampered_frame_with_fixed_crc_is_refused() -> None:
    raw = bytearray(cobs_decode(encode_frame(NeuralFrame(1, [5, 5]), 0, 0, FrameSigner(KEY))[:-1]))
    raw[26] ^= 1  # change a count, then repair the CRC as an attacker would
    from closedloop.firmware_bridge import cobs_encode, crc32c

    raw[-4:] = crc32c(bytes(raw[:-4])).to_bytes(4, "little")
    parser = FrameParser(FrameVerifier(KEY))
    assert parser.feed(cobs_encode(bytes(raw)) + b"\x00") == [] and parser.stats.bad_tag == 1


def test_replayed_and_reordered_frames_are_refused() -> None:
    signer = FrameSigner(KEY, counter_start=100)
    a, b, c = (encode_frame(Heartbeat(), i, i, signer) for i in range(3))
    parser = FrameParser(FrameVerifier(KEY))
    assert [f.seq for f in parser.feed(a + b + b + a + c)] == [0, 1, 2]
    assert parser.stats.replayed == 2
    reorder = FrameParser(FrameVerifier(KEY))
    assert [f.seq for f in reorder.feed(b + a + c)] == [1, 2] and reorder.stats.replayed == 1


def test_signing_link_refuses_unsigned_frames_unless_optional() -> None:
    wire = encode_frame(Heartbeat(), 0, 0)
    strict = FrameParser(FrameVerifier(KEY))
    assert strict.feed(wire) == [] and strict.stats.unsigned == 1
    relaxed = FrameParser(FrameVerifier(KEY, required=False))
    assert len(relaxed.feed(wire)) == 1


def test_link_without_key_refuses_signed_frames() -> None:
    parser = FrameParser()
    assert parser.feed(encode_frame(Heartbeat(), 0, 0, FrameSigner(KEY))) == [] and parser.stats.bad_tag == 1


def test_persisted_last_counter_keeps_replay_protection_across_restarts() -> None:
    old = encode_frame(Heartbeat(), 0, 0, FrameSigner(KEY, counter_start=5))
    parser = FrameParser(FrameVerifier(KEY, last_counter=5))
    assert parser.feed(old) == [] and parser.stats.replayed == 1


def test_default_counter_start_is_the_clock_so_restarts_do_not_reuse_counters() -> None:
    first = FrameSigner(KEY).next_counter
    assert first > 1_600_000_000 * 10**6  # microseconds since the epoch
    assert FrameSigner(KEY).next_counter >= first


def test_per_direction_keys_stop_reflection() -> None:
    to_device, to_host = derive_link_keys(KEY)
    assert to_device != to_host and len(to_device) == 32
    assert to_device == hmac.new(KEY, b"closedloop/v1 host-to-device", hashlib.sha256).digest()
    reflected = encode_frame(Heartbeat(), 0, 0, FrameSigner(to_device))
    host_parser = FrameParser(FrameVerifier(to_host))
    assert host_parser.feed(reflected) == [] and host_parser.stats.bad_tag == 1


def test_short_keys_are_refused() -> None:
    with pytest.raises(MessageError, match="at least 16"):
        FrameSigner(b"short")
