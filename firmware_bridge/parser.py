"""Streaming frame parser: bytes in, validated frames out, never an exception.

:class:`FrameParser` is a small protocol object, independent of any port: feed it
byte chunks of any size as they arrive and it returns the frames completed by that
chunk.  It splits the stream on the 0x00 delimiter (so it resynchronises at the next
0x00 after garbage), COBS-decodes, and applies the checks of
:func:`~closedloop.firmware_bridge.frame.check_raw_frame`; every rejected frame is counted by
reason, never raised.  It then tracks sequence numbers: gaps are counted as lost
frames, and duplicated or out-of-order (late) frames are counted and dropped, so a
control loop only ever sees newer data.  Its counters are in :class:`ParserStats`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .cobs import _decode_or_none
from .frame import MAX_ENCODED_FRAME_LEN, MAX_PAYLOAD_LEN, Frame, check_raw_frame
from .messages import Hello, UnknownMessage
from .signing import FrameVerifier

__all__ = ["FrameParser", "ParserStats", "SequenceTracker", "REJECTION_REASONS"]

#: Counter names under which a frame can be rejected (ParserStats fields).
REJECTION_REASONS = ("crc_errors", "malformed", "oversize", "bad_tag", "replayed", "unsigned")

_WINDOW = 64
_MASK = (1 << _WINDOW) - 1
_HALF = 2**31
_HELLO = Hello.TYPE_ID

# Rejections decided before a segment is decoded (shared with the C-backed parser).
NOT_COBS = ("malformed", "not valid COBS (truncated or corrupted frame)")
NO_DELIMITER = ("oversize", f"more than {MAX_ENCODED_FRAME_LEN} bytes without a delimiter")


def segment_oversize(size: int) -> tuple[str, str]:
    return ("oversize", f"{size}-byte segment exceeds {MAX_ENCODED_FRAME_LEN}")


@dataclass
class ParserStats:
    """Counters kept by :class:`FrameParser` (all start at 0)."""

    accepted: int = 0          # frames delivered by feed()
    crc_errors: int = 0        # CRC-32C mismatch
    malformed: int = 0         # bad COBS, short, bad header, length mismatch, bad payload layout
    oversize: int = 0          # longer than the maximum frame, dropped unread
    bad_tag: int = 0           # signature did not verify (or signed frame, no key)
    replayed: int = 0          # signing counter not increasing
    unsigned: int = 0          # unsigned frame on a link that requires signing
    lost: int = 0              # frames missing from the sequence (gaps), net of late arrivals
    duplicate: int = 0         # same sequence number seen again: dropped
    out_of_order: int = 0      # older sequence number arriving late: dropped
    seq_resets: int = 0        # sender restarted its sequence (HELLO, or a jump back by >= 64)
    unknown_type: int = 0      # accepted frames with an unregistered message type
    bytes_in: int = 0          # every byte fed
    bytes_discarded: int = 0   # bytes of rejected frames and of garbage between delimiters

    @property
    def rejected(self) -> int:
        """Frames refused for integrity or format reasons (not counting sequence drops)."""
        return sum(getattr(self, r) for r in REJECTION_REASONS)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class SequenceTracker:
    """Classifies u32 sequence numbers as new, duplicate or late (serial-number arithmetic).

    A number is newer than the highest seen when ``(seq - top) mod 2**32`` is in
    ``1 .. 2**31 - 1``; the ``d - 1`` numbers skipped by a jump of ``d`` are counted
    lost.  Older numbers within the last 64 are duplicates (seen) or out-of-order (a
    gap being filled late, which un-counts one lost frame); a jump back by 64 or more
    means the sender restarted, and starts a new stream.
    """

    __slots__ = ("top", "seen", "lost_bits")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.top: int | None = None
        self.seen = 0
        self.lost_bits = 0

    def observe(self, seq: int, stats: ParserStats) -> bool:
        """Record ``seq``; ``True`` when the frame is new and should be delivered."""
        top = self.top
        if top is None:
            self.top, self.seen, self.lost_bits = seq, 1, 0
            return True
        d = (seq - top) & 0xFFFFFFFF
        if d == 1:  # the common case
            self.top = seq
            self.seen = ((self.seen << 1) | 1) & _MASK
            self.lost_bits = (self.lost_bits << 1) & _MASK
            return True
        if d == 0:
            stats.duplicate += 1
            return False
        if d < _HALF:
            stats.lost += d - 1
            self.top = seq
            if d < _WINDOW:
                self.seen = ((self.seen << d) | 1) & _MASK
                self.lost_bits = ((self.lost_bits << d) | ((1 << d) - 2)) & _MASK
            else:
                self.seen, self.lost_bits = 1, _MASK - 1
            return True
        back = (top - seq) & 0xFFFFFFFF
        if back >= _WINDOW:
            stats.seq_resets += 1
            self.top, self.seen, self.lost_bits = seq, 1, 0
            return True
        bit = 1 << back
        if self.seen & bit:
            stats.duplicate += 1
            return False
        self.seen |= bit
        if self.lost_bits & bit:
            self.lost_bits &= ~bit
            stats.lost -= 1
        stats.out_of_order += 1
        return False


class FrameParser:
    """Turns a byte stream into validated :class:`Frame` objects.

    Parameters
    ----------
    verifier : FrameVerifier, optional
        Checks signed frames (and refuses unsigned ones when it requires signing).
        Without one, signed frames are refused as ``bad_tag``.
    max_payload_len : int, optional
        Refuse larger payloads as ``oversize`` (at most the protocol's 4096).

    Examples
    --------
    >>> from closedloop.firmware_bridge import FrameParser, Heartbeat, encode_frame
    >>> wire = encode_frame(Heartbeat(), seq=0, timestamp_us=10)
    >>> parser = FrameParser()
    >>> [f.seq for f in parser.feed(b"noise\\x00" + wire[:5])] + [f.seq for f in parser.feed(wire[5:])]
    [0]
    >>> parser.stats.accepted, parser.stats.malformed, parser.stats.bytes_discarded
    (1, 1, 5)
    """

    def __init__(self, verifier: FrameVerifier | None = None, max_payload_len: int = MAX_PAYLOAD_LEN) -> None:
        if not 0 <= max_payload_len <= MAX_PAYLOAD_LEN:
            raise ValueError(f"max_payload_len {max_payload_len} is outside 0..{MAX_PAYLOAD_LEN}")
        self.verifier = verifier
        self.max_payload_len = max_payload_len
        self.stats = ParserStats()
        self.sequence = SequenceTracker()
        #: ``(reason, detail)`` of the most recent rejection, for diagnostics.
        self.last_rejection: tuple[str, str] | None = None
        self._pending = bytearray()
        self._skipping = False  # inside an oversize segment: drop until the next 0x00

    def reset(self) -> None:
        """Forget buffered bytes and sequence history (counters are kept)."""
        self._pending.clear()
        self._skipping = False
        self.sequence.reset()

    def feed(self, chunk: bytes | bytearray | memoryview) -> list[Frame]:
        """Consume ``chunk``; return the frames it completed, oldest first.  Never raises."""
        chunk = bytes(chunk)
        stats = self.stats
        stats.bytes_in += len(chunk)
        if chunk.find(b"\x00") < 0:
            self._hold(chunk)
            return []
        if self._pending:
            chunk = bytes(self._pending) + chunk
            self._pending.clear()
        segments = chunk.split(b"\x00")
        tail = segments.pop()
        if self._skipping:
            stats.bytes_discarded += len(segments[0])
            segments[0] = b""
            self._skipping = False
        frames: list[Frame] = []
        verifier, max_payload = self.verifier, self.max_payload_len
        for seg in segments:
            if not seg:
                continue
            if len(seg) > MAX_ENCODED_FRAME_LEN:
                self._reject(segment_oversize(len(seg)), len(seg))
                continue
            raw = _decode_or_none(seg)
            if raw is None:
                self._reject(NOT_COBS, len(seg))
                continue
            result = check_raw_frame(raw, verifier, max_payload)
            if result.__class__ is tuple:
                self._reject(result, len(seg))
                continue
            frame: Frame = result  # type: ignore[assignment]  # mypy narrows `__class__ is` only when true
            if self._is_new(frame):
                frames.append(frame)
        self._hold(tail)
        return frames

    def _is_new(self, frame: Frame) -> bool:
        """Sequence checks on a frame that passed every frame check; ``True`` when it is delivered."""
        sequence, stats = self.sequence, self.stats
        if frame.msg_type == _HELLO and sequence.top is not None:
            sequence.reset()
            stats.seq_resets += 1
        if sequence.observe(frame.seq, stats):
            stats.accepted += 1
            if isinstance(frame.message, UnknownMessage):
                stats.unknown_type += 1
            return True
        return False

    def _hold(self, data: bytes) -> None:
        if self._skipping:
            self.stats.bytes_discarded += len(data)
            return
        self._pending += data
        if len(self._pending) > MAX_ENCODED_FRAME_LEN:
            self._reject(NO_DELIMITER, len(self._pending))
            self._pending.clear()
            self._skipping = True

    def _reject(self, why: tuple[str, str], size: int) -> None:
        stats = self.stats
        setattr(stats, why[0], getattr(stats, why[0]) + 1)
        stats.bytes_discarded += size
        self.last_rejection = why
