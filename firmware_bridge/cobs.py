"""Consistent Overhead Byte Stuffing (COBS) for frame delimiting.

Every frame goes on the wire as ``COBS(frame) + b"\\x00"``: COBS removes every zero
byte from the frame so that 0x00 can only mean "end of frame", which lets a receiver
resynchronise at the next 0x00 after any garbage.  The encoding is the canonical one
of Cheshire & Baker (the form produced by the usual C reference code): a code byte
``c`` (1..255) is followed by ``c - 1`` non-zero data bytes, and stands for those
bytes plus one zero, except that ``c == 0xFF`` implies no zero and the zero implied
by the last block is dropped; the encoder always emits the final block's code, even
when that block is empty.  Decoding is written so the Python loop runs once per code
byte (not per data byte), with a numpy fast path for encoding.
"""

from __future__ import annotations

import numpy as np

from .errors import FrameError

__all__ = ["cobs_encode", "cobs_decode", "cobs_max_encoded_len"]


def cobs_max_encoded_len(raw_len: int) -> int:
    """Longest canonical COBS encoding of ``raw_len`` bytes (delimiter not included)."""
    return raw_len + 1 + raw_len // 254


def _encode_general(data: bytes) -> bytes:
    out = bytearray()
    for block in data.split(b"\x00"):
        while len(block) >= 254:
            out.append(0xFF)
            out += block[:254]
            block = block[254:]
        out.append(len(block) + 1)
        out += block
    return bytes(out)


def cobs_encode(data: bytes | bytearray | memoryview) -> bytes:
    """Encode ``data`` with COBS (canonical form; the 0x00 delimiter is not appended).

    Examples
    --------
    >>> cobs_encode(b"\\x11\\x00\\x22").hex(" ")
    '02 11 02 22'
    >>> cobs_encode(b"").hex()
    '01'
    """
    raw = np.frombuffer(data, dtype=np.uint8)
    n = raw.size
    zeros = np.flatnonzero(raw == 0)
    # code of each block = its length + 1 = distance between consecutive zeros
    codes = np.diff(zeros, prepend=-1, append=n)
    if codes.size and int(codes.max()) > 254:
        return _encode_general(bytes(data))
    out = np.empty(n + 1, dtype=np.uint8)
    out[1:] = raw
    out[0] = codes[0]
    out[zeros + 1] = codes[1:]
    return out.tobytes()


def _decode_or_none(enc: bytes | bytearray) -> bytearray | None:
    """Decode one segment (no 0x00 inside); ``None`` when it is not valid COBS."""
    n = len(enc)
    if n == 0:
        return None
    if 0xFF not in enc:
        # Without 0xFF codes the frame is the encoding minus its first byte, with each
        # later code byte replaced by the zero it stands for.
        out = bytearray(enc)
        p = 0
        while p < n:
            out[p] = 0
            p += enc[p]
        if p != n:
            return None
        del out[0]
        return out
    parts = []
    p = 0
    while p < n:
        c = enc[p]
        q = p + c
        if c == 0 or q > n:
            return None
        parts.append(enc[p + 1 : q])
        if c != 0xFF and q < n:
            parts.append(b"\x00")
        p = q
    return bytearray(b"".join(parts))


def cobs_decode(data: bytes | bytearray | memoryview) -> bytes:
    """Decode one COBS segment (without its 0x00 delimiter).

    Raises
    ------
    FrameError
        With reason ``"malformed"`` when ``data`` contains 0x00 or its code bytes do
        not end exactly at the end of the segment (a truncated or corrupted frame).

    Examples
    --------
    >>> cobs_decode(bytes.fromhex("02110222")).hex(" ")
    '11 00 22'
    """
    enc = bytes(data)
    if b"\x00" in enc:
        raise FrameError("malformed", f"COBS segment contains 0x00 at offset {enc.index(0)}; "
                         "split the stream on 0x00 before decoding")
    out = _decode_or_none(enc)
    if out is None:
        raise FrameError("malformed", f"{len(enc)}-byte segment is not valid COBS (a code byte "
                         "points past the end, or the segment is empty); the frame was truncated or corrupted")
    return bytes(out)
