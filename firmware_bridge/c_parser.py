"""The C-backed frame parser for high frame rates, and the choice between it and the Python one.

:class:`CFrameParser` is a :class:`~closedloop.firmware_bridge.parser.FrameParser` whose
``feed`` crosses into C once per chunk: ``clp_scan`` (``c/closedloop_scan.c``, built by
:mod:`~closedloop.firmware_bridge.c_library`) splits the chunk on 0x00, COBS-decodes and
runs the length, CRC and header checks of the project's C implementation on every
segment, and returns one record per segment.  What stays in Python is what the Python
parser does after those checks, with the same code: signatures go to the same
:class:`~closedloop.firmware_bridge.signing.FrameVerifier`, payloads to the same message
classes (:func:`~closedloop.firmware_bridge.frame.finish_raw_frame`), sequence numbers to
the same :class:`~closedloop.firmware_bridge.parser.SequenceTracker`.  So both parsers
give the same frames, the same :class:`ParserStats` counters and the same
``last_rejection`` for any bytes in any chunking; tests and the protocol benchmark check
this on the shared vectors and under fuzzing.

:func:`make_parser` picks one: ``backend`` (or ``$CLOSEDLOOP_PARSER``) ``"auto"`` takes the
C parser when its library builds or is cached and the Python parser otherwise; ``"c"``
insists (and raises, saying why, when it cannot); ``"python"`` takes the reference.
:func:`parser_backend` says which one ``make_parser`` gives, and why.
"""

from __future__ import annotations

import ctypes
import os
import struct
from dataclasses import dataclass

import numpy as np

from .c_library import RECORD_SIZE, CParserUnavailableError, load_scanner
from .frame import (
    CRC_MISMATCH,
    HEADER_LEN,
    MAX_ENCODED_FRAME_LEN,
    MAX_PAYLOAD_LEN,
    Frame,
    check_raw_frame,
    finish_raw_frame,
)
from .messages import MESSAGE_TYPES, Hello, Message, NeuralFrame, UnknownMessage
from .parser import _MASK, NO_DELIMITER, NOT_COBS, FrameParser, segment_oversize
from .signing import FrameVerifier

__all__ = ["CFrameParser", "ParserBackend", "make_parser", "parser_backend", "PARSER_ENV", "BACKENDS"]

#: Environment variable that chooses the parser when no ``backend`` is passed.
PARSER_ENV = "CLOSEDLOOP_PARSER"
BACKENDS = ("auto", "c", "python")

# clp_scan_record_t in closedloop_scan.h, field for field: result, seg_len, raw_off, raw_len, seq,
# payload_len, msg_type, flags, timestamp_us
_RECORD = struct.Struct("=5IH2BQ")  # native byte order, standard sizes, no padding (as the C struct)
if _RECORD.size != RECORD_SIZE:  # pragma: no cover - a mismatch here is a bug in this file
    raise ImportError(f"record layout is {_RECORD.size} bytes; clp_scan_record_t is {RECORD_SIZE}")
_HELLO = Hello.TYPE_ID
_NEURAL = NeuralFrame
_NEURAL_HEAD = struct.Struct("<IH")  # NEURAL_FRAME's bin_index, n_channels
_U16 = np.dtype("<u2")
_new_neural = object.__new__
_frombuffer = np.frombuffer
_FRAME, _CRC, _MALFORMED, _OVERSIZE = 1, 2, 3, 4  # clp_result_t
_SEGMENT_OVERSIZE, _NO_DELIMITER, _BAD_COBS = 32, 33, 34
_AFTER_DECODE = {_CRC: "crc_errors", _MALFORMED: "malformed", _OVERSIZE: "oversize"}
_FALLBACK_DETAIL = {"crc_errors": "CRC-32C does not match", "malformed": "frame checks failed",
                    "oversize": "frame longer than the limit"}


class CFrameParser(FrameParser):
    """A :class:`FrameParser` whose segment and frame checks run in C, one call per chunk.

    Same parameters, attributes and results as :class:`FrameParser`.

    Raises
    ------
    CParserUnavailableError
        When the C scanner library cannot be built or loaded (the message says why).
    """

    def __init__(self, verifier: FrameVerifier | None = None, max_payload_len: int = MAX_PAYLOAD_LEN) -> None:
        super().__init__(verifier, max_payload_len)
        found = load_scanner()
        self.library_path = found.path
        self._scan = found.lib.clp_scan
        self._init = found.lib.clp_scanner_init
        self._state = (ctypes.c_uint64 * ((found.scanner_size + 7) // 8))()
        self._state_ptr = ctypes.addressof(self._state)
        self._skipped = ctypes.c_uint64(0)
        self._skipped_ptr = ctypes.addressof(self._skipped)
        self._records = bytearray(0)
        self._records_cap = 0
        self._records_ptr = 0
        self._init(self._state_ptr)

    def reset(self) -> None:
        """Forget buffered bytes and sequence history (counters are kept)."""
        self._init(self._state_ptr)
        self.sequence.reset()

    def feed(self, chunk: bytes | bytearray | memoryview) -> list[Frame]:
        """Consume ``chunk``; return the frames it completed, oldest first.  Never raises."""
        data = chunk if chunk.__class__ is bytes else bytes(chunk)
        n = len(data)
        stats = self.stats
        stats.bytes_in += n
        need = n // 2 + 2  # clp_scan's bound on records per chunk
        if need > self._records_cap:
            self._records_cap = max(need, 2 * self._records_cap)
            self._records = bytearray(self._records_cap * RECORD_SIZE)
            self._records_ptr = ctypes.addressof(ctypes.c_char.from_buffer(self._records))
        # a fresh buffer per chunk: payload views handed to message classes must stay valid
        out = bytearray(n + MAX_ENCODED_FRAME_LEN)
        count = self._scan(self._state_ptr, data, n, self.max_payload_len,
                           ctypes.addressof(ctypes.c_char.from_buffer(out)), len(out),
                           self._records_ptr, self._records_cap, self._skipped_ptr)
        skipped = self._skipped.value
        if skipped:
            stats.bytes_discarded += skipped
        if count <= 0:
            return []
        frames: list[Frame] = []
        view = memoryview(out)
        verifier = self.verifier
        # unsigned frames skip the verifier unless it requires signing: decode them here, as
        # finish_raw_frame would, without its call (the per-frame cost is what this parser is for)
        plain = verifier is None or not verifier.required
        classes, sequence, append = MESSAGE_TYPES, self.sequence, frames.append
        fast_accepted = fast_unknown = 0  # added to stats once, after the loop
        for result, seg_len, off, raw_len, seq, plen, msg_type, flags, ts in _RECORD.iter_unpack(
                memoryview(self._records)[: count * RECORD_SIZE]):
            if result == _FRAME:
                if flags == 0 and plain:
                    cls = classes.get(msg_type)
                    message: Message | None = None
                    if cls is _NEURAL and plen >= 6:
                        # the commonest frame at high rates: its counts are a view of this chunk's own
                        # buffer (fresh per chunk, never reused), not a copy; other sizes take the
                        # class's own decoder and its error
                        bin_index, n_ch = _NEURAL_HEAD.unpack_from(out, off + HEADER_LEN)
                        if plen == 6 + 2 * n_ch:
                            neural = _new_neural(_NEURAL)
                            neural.bin_index = bin_index
                            neural.counts = _frombuffer(out, _U16, n_ch, off + HEADER_LEN + 6)
                            message = neural
                    if message is None:
                        payload = view[off + HEADER_LEN : off + HEADER_LEN + plen]
                        if cls is None:
                            message = UnknownMessage(msg_type, payload)
                        else:
                            try:
                                message = cls.decode_payload(payload)
                            except Exception as exc:  # noqa: BLE001 - as in finish_raw_frame
                                self._reject(("malformed", f"{cls.__name__} payload: {exc}"), seg_len)
                                continue
                    frame = Frame(msg_type, seq, ts, message, 0, None)
                else:
                    got = finish_raw_frame(view[off : off + raw_len], msg_type, flags, plen, seq, ts, verifier)
                    if got.__class__ is tuple:
                        self._reject(got, seg_len)
                        continue
                    frame = got  # type: ignore[assignment]
                if seq - 1 == sequence.top and msg_type != _HELLO:
                    # SequenceTracker.observe's common case (the next number, no wrap), inline;
                    # everything else goes through _is_new
                    sequence.top = seq
                    sequence.seen = ((sequence.seen << 1) | 1) & _MASK
                    sequence.lost_bits = (sequence.lost_bits << 1) & _MASK
                    fast_accepted += 1
                    if isinstance(frame.message, UnknownMessage):
                        fast_unknown += 1
                    append(frame)
                elif self._is_new(frame):
                    append(frame)
            elif result == _SEGMENT_OVERSIZE:
                self._reject(segment_oversize(seg_len), seg_len)
            elif result == _NO_DELIMITER:
                self._reject(NO_DELIMITER, seg_len)
            elif result == _BAD_COBS:
                self._reject(NOT_COBS, seg_len)
            elif result == _CRC:  # the commonest rejection on a noisy line: no need to ask the Python checks
                self._reject(CRC_MISMATCH, seg_len)
            else:
                self._reject(self._describe(bytes(view[off : off + raw_len]), _AFTER_DECODE[result]), seg_len)
        stats.accepted += fast_accepted
        stats.unknown_type += fast_unknown
        return frames

    def _describe(self, raw: bytes, reason: str) -> tuple[str, str]:
        """The Python checks' own words for a frame C refused (rejections are rare: no hurry)."""
        why = check_raw_frame(raw, None, self.max_payload_len)
        if isinstance(why, tuple) and why[0] == reason:
            return why
        return (reason, _FALLBACK_DETAIL[reason])


@dataclass(frozen=True)
class ParserBackend:
    """Which parser :func:`make_parser` gives, and why."""

    name: str  # "c" or "python"
    reason: str
    library: str | None = None  # the C scanner library, when name is "c"


def _choice(backend: str | None) -> tuple[str, str]:
    if backend is not None:
        choice, source = backend, f"backend={backend!r}"
    else:
        choice = os.environ.get(PARSER_ENV, "auto") or "auto"
        source = f"${PARSER_ENV}={choice}" if PARSER_ENV in os.environ else "the default (auto)"
    choice = choice.strip().lower()
    if choice not in BACKENDS:
        raise ValueError(f"parser backend {choice!r} (from {source}) is not one of {', '.join(BACKENDS)}")
    return choice, source


def parser_backend(backend: str | None = None) -> ParserBackend:
    """The parser :func:`make_parser` gives for ``backend`` (``None``: ``$CLOSEDLOOP_PARSER``, else
    ``"auto"``), with the reason; builds the C library if needed.

    Raises
    ------
    CParserUnavailableError
        When ``"c"`` is asked for and the C scanner cannot be built or loaded.
    """
    choice, source = _choice(backend)
    if choice == "python":
        return ParserBackend("python", f"chosen by {source}")
    try:
        found = load_scanner()
    except CParserUnavailableError as exc:
        if choice == "c":
            raise CParserUnavailableError(f"{source} asks for the C parser, but {exc}") from None
        return ParserBackend("python", f"the C parser is unavailable: {exc}")
    how = "built now" if found.built_now else "cached"
    return ParserBackend("c", f"chosen by {source}; C scanner library {how} at {found.path}", str(found.path))


def make_parser(verifier: FrameVerifier | None = None, max_payload_len: int = MAX_PAYLOAD_LEN,
                backend: str | None = None) -> FrameParser:
    """A :class:`CFrameParser` or a :class:`FrameParser` as :func:`parser_backend` decides.

    Parameters
    ----------
    verifier, max_payload_len
        As for :class:`FrameParser`.
    backend : {"auto", "c", "python"}, optional
        Default: ``$CLOSEDLOOP_PARSER``, else ``"auto"`` (C when available).
    """
    if parser_backend(backend).name == "c":
        return CFrameParser(verifier, max_payload_len)
    return FrameParser(verifier, max_payload_len)

