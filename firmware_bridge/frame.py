"""Frame layout: header, payload, optional signature, CRC-32C, all COBS-framed.

This module is the single place that knows the bytes of a frame (``docs/protocol.md``
is the normative description).  A raw frame is a 20-byte little-endian header
(magic ``"CL"``, protocol version, message type, flags, reserved byte, payload length,
u32 sequence number, u64 device timestamp in microseconds), the payload, the signature
(u64 counter + 16-byte tag) when flag bit 0 is set, and the CRC-32C of everything
before it.  On the wire a frame is ``COBS(raw) + b"\\x00"``.  :func:`encode_frame`
builds wire bytes; :func:`decode_frame` checks one frame strictly and raises;
:func:`check_raw_frame` is the non-raising core shared with the streaming parser.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .cobs import _decode_or_none, cobs_encode, cobs_max_encoded_len
from .crc import crc32c, crc_residue_ok
from .errors import FrameError, MessageError, SignatureError
from .messages import MESSAGE_TYPES, PROTOCOL_VERSION, Message, UnknownMessage
from .signing import SIGNATURE_LEN, FrameSigner, FrameVerifier

__all__ = [
    "Frame", "encode_frame", "decode_frame", "check_raw_frame", "finish_raw_frame",
    "MAGIC", "HEADER_LEN", "CRC_LEN", "MAX_PAYLOAD_LEN", "MAX_RAW_FRAME_LEN", "MAX_ENCODED_FRAME_LEN",
    "FLAG_SIGNED", "SEQ_MODULUS",
]

MAGIC = b"CL"
HEADER_LEN = 20
CRC_LEN = 4
#: Largest payload any receiver must accept (and the largest a sender may send).
MAX_PAYLOAD_LEN = 4096
MAX_RAW_FRAME_LEN = HEADER_LEN + MAX_PAYLOAD_LEN + SIGNATURE_LEN + CRC_LEN  # 4144
MAX_ENCODED_FRAME_LEN = cobs_max_encoded_len(MAX_RAW_FRAME_LEN)  # 4161, delimiter excluded
FLAG_SIGNED = 0x01
SEQ_MODULUS = 2**32

# magic, version, type, flags, reserved, payload_len, seq, timestamp_us
_HEADER = struct.Struct("<2sBBBBHIQ")
_U64 = struct.Struct("<Q")
_RESERVED_TYPES = (0x00, 0xFF)
_SIGNATURE_REASONS = ("bad_tag", "replayed", "unsigned")
#: The rejection of a frame whose CRC does not match (shared with the C-backed parser).
CRC_MISMATCH = ("crc_errors", "CRC-32C does not match: bytes were corrupted in transit")


@dataclass(slots=True)
class Frame:
    """One received (or sent) frame: header fields plus the decoded message."""

    msg_type: int
    seq: int
    timestamp_us: int
    message: Message
    flags: int = 0
    sign_counter: int | None = None

    @property
    def signed(self) -> bool:
        return bool(self.flags & FLAG_SIGNED)


def encode_frame(message: Message, seq: int, timestamp_us: int, signer: FrameSigner | None = None) -> bytes:
    """Wire bytes of one frame: ``COBS(header + payload [+ signature] + crc) + b"\\x00"``.

    Parameters
    ----------
    message : Message
        What to send.
    seq : int
        Sequence number; taken modulo 2**32.
    timestamp_us : int
        Sender's clock in microseconds (u64).
    signer : FrameSigner, optional
        Sign the frame (sets flag bit 0 and uses the signer's next counter).

    Raises
    ------
    MessageError
        When the payload is longer than ``MAX_PAYLOAD_LEN`` or the timestamp is not a u64.
    """
    payload = message.encode_payload()
    if len(payload) > MAX_PAYLOAD_LEN:
        raise MessageError(f"{type(message).__name__} payload is {len(payload)} bytes; the protocol allows "
                           f"at most {MAX_PAYLOAD_LEN}: split it over several messages")
    if not 0 <= timestamp_us < 2**64:
        raise MessageError(f"timestamp_us {timestamp_us} does not fit in a u64 (microseconds, >= 0)")
    flags = FLAG_SIGNED if signer is not None else 0
    body = _HEADER.pack(MAGIC, PROTOCOL_VERSION, message.type_id, flags, 0, len(payload),
                        seq % SEQ_MODULUS, timestamp_us) + payload
    if signer is not None:
        body += signer.signature(body)
    cobs, crc = _encoders()
    body += crc(body).to_bytes(4, "little")
    return cobs(body) + b"\x00"


_ENCODERS: tuple | None = None


def _encoders() -> tuple:
    """COBS and CRC-32C for sending: the C library's where it loads (a 192-channel frame's COBS is ~30 us
    in Python), else the Python reference; ``CLOSEDLOOP_PARSER=python`` keeps to Python for both directions."""
    global _ENCODERS
    if _ENCODERS is None:
        import os

        _ENCODERS = (cobs_encode, crc32c)
        if os.environ.get("CLOSEDLOOP_PARSER", "auto").strip().lower() != "python":
            from .c_library import CParserUnavailableError, frame_encoders

            try:
                _ENCODERS = frame_encoders()
            except CParserUnavailableError:
                pass
    return _ENCODERS


def check_raw_frame(raw: bytes | bytearray, verifier: FrameVerifier | None = None,
                    max_payload_len: int = MAX_PAYLOAD_LEN) -> Frame | tuple[str, str]:
    """Validate one COBS-decoded frame; return a :class:`Frame` or ``(reason, detail)``.

    Never raises.  ``reason`` is one of ``"oversize"``, ``"malformed"``,
    ``"crc_errors"``, ``"bad_tag"``, ``"replayed"``, ``"unsigned"``.  Checks run in the
    order given in the spec, so every implementation reports the same reason.
    """
    n = len(raw)
    if n > HEADER_LEN + max_payload_len + SIGNATURE_LEN + CRC_LEN:
        return ("oversize", f"decoded frame is {n} bytes; the limit is {MAX_RAW_FRAME_LEN}")
    if n < HEADER_LEN + CRC_LEN:
        return ("malformed", f"decoded frame is {n} bytes; a header and CRC need {HEADER_LEN + CRC_LEN}")
    if not crc_residue_ok(raw):
        return CRC_MISMATCH
    magic, version, msg_type, flags, reserved, plen, seq, ts = _HEADER.unpack_from(raw)
    if magic != MAGIC or version != PROTOCOL_VERSION:
        return ("malformed", f"magic/version {magic.hex()}/{version}; expected {MAGIC.hex()}/{PROTOCOL_VERSION}")
    if flags & ~FLAG_SIGNED or reserved or msg_type in _RESERVED_TYPES:
        return ("malformed", f"reserved bits set (flags 0x{flags:02X}, reserved 0x{reserved:02X}) "
                             f"or reserved type 0x{msg_type:02X}")
    if plen > max_payload_len:
        return ("oversize", f"payload_len {plen} exceeds the limit {max_payload_len}")
    signed = flags & FLAG_SIGNED
    if n != HEADER_LEN + plen + (SIGNATURE_LEN if signed else 0) + CRC_LEN:
        return ("malformed", f"payload_len {plen} (signed={bool(signed)}) does not match the {n}-byte frame")
    return finish_raw_frame(raw, msg_type, flags, plen, seq, ts, verifier)


def finish_raw_frame(raw: bytes | bytearray | memoryview, msg_type: int, flags: int, plen: int, seq: int, ts: int,
                     verifier: FrameVerifier | None = None) -> Frame | tuple[str, str]:
    """The checks after the header's (signature, then payload layout) on a frame whose length,
    CRC and header fields already passed; return a :class:`Frame` or ``(reason, detail)``.

    :func:`check_raw_frame` ends here, and so does the C-backed parser, so both give the
    same frames and reasons.
    """
    end = HEADER_LEN + plen
    counter = None
    if flags & FLAG_SIGNED:
        counter = _U64.unpack_from(raw, end)[0]
        if verifier is None:
            return ("bad_tag", "signed frame on a link without a key; configure the shared key")
        bad = verifier.check(memoryview(raw)[: end + 8], counter, bytes(raw[end + 8 : end + SIGNATURE_LEN]))
        if bad is not None:
            return bad
    elif verifier is not None and verifier.required:
        return ("unsigned", "unsigned frame on a link that requires signing")
    payload = memoryview(raw)[HEADER_LEN:end]
    cls = MESSAGE_TYPES.get(msg_type)
    if cls is None:
        message: Message = UnknownMessage(msg_type, payload)
    else:
        try:
            message = cls.decode_payload(payload)
        except Exception as exc:  # noqa: BLE001 - a registered class may raise anything; never propagate
            return ("malformed", f"{cls.__name__} payload: {exc}")
    return Frame(msg_type, seq, ts, message, flags, counter)


def decode_frame(data: bytes | bytearray | memoryview, verifier: FrameVerifier | None = None) -> Frame:
    """Decode exactly one wire frame (its trailing 0x00 is optional).

    No sequence-number checks (those need a stream: use :class:`FrameParser`).

    Raises
    ------
    FrameError
        With ``reason`` set to the parser counter the frame would be counted under.
    """
    enc = bytes(data)
    if enc.endswith(b"\x00"):
        enc = enc[:-1]
    if b"\x00" in enc:
        raise FrameError("malformed", "more than one frame: 0x00 inside; feed a stream to FrameParser")
    if not enc:
        raise FrameError("malformed", "empty frame")
    if len(enc) > MAX_ENCODED_FRAME_LEN:
        raise FrameError("oversize", f"encoded frame is {len(enc)} bytes; the limit is {MAX_ENCODED_FRAME_LEN}")
    raw = _decode_or_none(enc)
    if raw is None:
        raise FrameError("malformed", "not valid COBS (truncated or corrupted frame)")
    result = check_raw_frame(raw, verifier)
    if isinstance(result, tuple):
        raise (SignatureError if result[0] in _SIGNATURE_REASONS else FrameError)(*result)
    return result
