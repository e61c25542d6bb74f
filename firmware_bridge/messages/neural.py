"""iBCI messages: NEURAL_FRAME (binned spike counts in) and DECODER_OUTPUT (text out).

A headstage sends one NEURAL_FRAME per time bin (20 ms in the handwriting decoder):
the bin's running index and one spike count per channel.  Counts are u16, so wide
bins and multi-unit channels never saturate.  This is the hottest message on the
wire (50-1000 frames/s per device, and the benchmark's yardstick), so its decoder
avoids the generic field reader.  DECODER_OUTPUT goes the other way, or to a
display: the text the decoder added for a bin, with optional per-character
probabilities.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from ..errors import MessageError, PayloadError
from .base import Message, PayloadReader, as_f32_vector, register_message, utf8_field

__all__ = ["NeuralFrame", "DecoderOutput"]

_NEURAL_HEAD = struct.Struct("<IH")
# a dtype object and positional arguments: np.frombuffer parses keywords and dtype strings at
# about half a microsecond per call, as long as the rest of the decode
_U16 = np.dtype("<u2")
_F32 = np.dtype("<f4")
_U16_FIELD = struct.Struct("<H")
_TEXT_MAX, _PROBS_MAX = 4000, 1000  # DecoderOutput: UTF-8 bytes of text, probabilities


@register_message
@dataclass(eq=False)
class NeuralFrame(Message):
    """NEURAL_FRAME (0x10): spike counts of one time bin.

    Payload: ``u32 bin_index, u16 n_channels, u16 counts[n_channels]``.

    Parameters
    ----------
    bin_index : int
        Running bin number since the recording started (wraps at 2**32).
    counts : array_like of int
        One count per channel, each 0..65535.
    """

    TYPE_ID = 0x10
    NAME = "NEURAL_FRAME"

    bin_index: int
    counts: np.ndarray

    def __post_init__(self) -> None:
        if not 0 <= int(self.bin_index) <= 0xFFFFFFFF:
            raise MessageError(f"NeuralFrame.bin_index {self.bin_index} does not fit in a u32; "
                               "wrap it modulo 2**32")
        counts = np.asarray(self.counts)
        if counts.dtype != np.dtype("<u2"):
            if counts.dtype.kind not in "iub":
                raise MessageError(f"NeuralFrame.counts must be integers; got dtype {counts.dtype} "
                                   "(round or cast spike counts before sending)")
            if counts.size and (counts.min() < 0 or counts.max() > 0xFFFF):
                raise MessageError(f"NeuralFrame.counts range {counts.min()}..{counts.max()} does not fit "
                                   "in u16 (0..65535); clip the counts")
            counts = counts.astype("<u2")
        if counts.ndim != 1:
            raise MessageError(f"NeuralFrame.counts must be 1-D (one count per channel); got shape {counts.shape}")
        if counts.size > 2045:
            raise MessageError(f"NeuralFrame has {counts.size} channels; at most 2045 fit in one payload")
        self.counts = np.ascontiguousarray(counts)

    @property
    def n_channels(self) -> int:
        return int(self.counts.size)

    def encode_payload(self) -> bytes:
        return _NEURAL_HEAD.pack(self.bin_index, self.counts.size) + self.counts.tobytes()

    @classmethod
    def decode_payload(cls, payload: bytes | bytearray | memoryview) -> NeuralFrame:
        size = len(payload)
        if size < 6:
            raise PayloadError(f"NEURAL_FRAME payload is {size} bytes; at least 6 (bin_index, n_channels) needed")
        bin_index, n = _NEURAL_HEAD.unpack_from(payload)
        if size != 6 + 2 * n:
            raise PayloadError(f"NEURAL_FRAME says {n} channels ({6 + 2 * n} bytes) but the payload is {size} bytes")
        msg = cls.__new__(cls)  # fields are already the right types: skip re-validation
        msg.bin_index = bin_index
        msg.counts = np.frombuffer(payload, _U16, n, 6).copy()
        return msg


@register_message
@dataclass(eq=False)
class DecoderOutput(Message):
    """DECODER_OUTPUT (0x11): text the decoder emitted for a bin.

    Payload: ``u32 bin_index, u16 text_len, text[text_len] (UTF-8), u16 n_probs,
    f32 char_probs[n_probs]``; ``n_probs == 0`` means no probabilities
    (``char_probs is None``).
    """

    TYPE_ID = 0x11
    NAME = "DECODER_OUTPUT"

    bin_index: int
    text: str = ""
    char_probs: np.ndarray | None = None

    def __post_init__(self) -> None:
        if not 0 <= int(self.bin_index) <= 0xFFFFFFFF:
            raise MessageError(f"DecoderOutput.bin_index {self.bin_index} does not fit in a u32")
        utf8_field("DecoderOutput.text", self.text, _TEXT_MAX)
        if self.char_probs is not None:
            probs = as_f32_vector("DecoderOutput.char_probs", self.char_probs, _PROBS_MAX)
            self.char_probs = probs if probs.size else None

    def encode_payload(self) -> bytes:
        text = utf8_field("DecoderOutput.text", self.text, _TEXT_MAX)
        probs = b"" if self.char_probs is None else self.char_probs.tobytes()
        return b"".join((struct.pack("<IH", self.bin_index, len(text)), text,
                         struct.pack("<H", len(probs) // 4), probs))

    @classmethod
    def decode_payload(cls, payload: bytes | bytearray | memoryview) -> DecoderOutput:
        # a session sends one every step: a well-formed payload within the limits is read in one piece and not
        # validated again; anything else takes the field-by-field reader, which says what is wrong
        n = len(payload)
        if n >= 8:
            bin_index, n_text = _NEURAL_HEAD.unpack_from(payload, 0)  # u32 bin_index, u16 text_len
            if n_text <= _TEXT_MAX and n >= 8 + n_text:
                (n_probs,) = _U16_FIELD.unpack_from(payload, 6 + n_text)
                if n == 8 + n_text + 4 * n_probs and n_probs <= _PROBS_MAX:
                    try:
                        text = bytes(payload[6 : 6 + n_text]).decode("utf-8")
                    except UnicodeDecodeError:
                        pass
                    else:
                        msg = cls.__new__(cls)
                        msg.bin_index, msg.text = bin_index, text
                        msg.char_probs = np.frombuffer(payload, _F32, n_probs, 8 + n_text).copy() if n_probs else None
                        return msg
        r = PayloadReader(payload, "DECODER_OUTPUT")
        bin_index = r.u32("bin_index")
        text = r.str16("text")
        probs = r.f32s(r.u16("n_probs"), "char_probs")
        r.finish()
        return cls(bin_index, text, probs if probs.size else None)
