"""Link and device management messages: HELLO, HEARTBEAT and STATUS.

HELLO is the first frame a device sends after it starts (and on request): it says
what the device is, which protocol version it speaks, its channel count and rate,
and the limits of the commands it accepts, so the host can check a bundle against
the hardware before a loop starts.  A HELLO also starts a new sequence-number
stream at the receiver.  HEARTBEAT carries the sender's state for watchdogs;
STATUS carries a coded, human-readable event (an error, a warning, a mode change).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from ..errors import MessageError
from .base import Message, PayloadReader, as_f32_vector, register_message, utf8_field

__all__ = ["Hello", "Heartbeat", "Status", "DeviceState", "Severity", "PROTOCOL_VERSION"]

#: Protocol version spoken by this implementation (header byte 2 and HELLO field).
PROTOCOL_VERSION = 1


class DeviceState(IntEnum):
    """State carried by HEARTBEAT."""

    IDLE = 0
    RUNNING = 1
    SAFE_STOP = 2
    FAULT = 3


class Severity(IntEnum):
    """Severity carried by STATUS."""

    DEBUG = 0
    INFO = 1
    WARNING = 2
    ERROR = 3
    CRITICAL = 4


def _empty_f32() -> np.ndarray:
    return np.zeros(0, dtype="<f4")


@register_message
@dataclass(eq=False)
class Hello(Message):
    """HELLO (0x01): the device describes itself.

    Payload: ``u8 kind_len, kind[kind_len] (UTF-8), u8 protocol_version,
    u16 n_channels, f32 rate_hz, u16 n_dims, f32 command_low[n_dims],
    f32 command_high[n_dims], u8 name_len, name[name_len] (UTF-8)``.
    """

    TYPE_ID = 0x01
    NAME = "HELLO"

    kind: str
    name: str = ""
    protocol_version: int = PROTOCOL_VERSION
    n_channels: int = 0
    rate_hz: float = 0.0
    command_low: np.ndarray = field(default_factory=_empty_f32)
    command_high: np.ndarray = field(default_factory=_empty_f32)

    def __post_init__(self) -> None:
        utf8_field("Hello.kind", self.kind, 255)
        utf8_field("Hello.name", self.name, 255)
        if not 0 <= int(self.protocol_version) <= 255:
            raise MessageError(f"Hello.protocol_version {self.protocol_version} does not fit in a u8")
        if not 0 <= int(self.n_channels) <= 0xFFFF:
            raise MessageError(f"Hello.n_channels {self.n_channels} does not fit in a u16 (0..65535)")
        self.command_low = as_f32_vector("Hello.command_low", self.command_low, 500)
        self.command_high = as_f32_vector("Hello.command_high", self.command_high, 500)
        if self.command_low.shape != self.command_high.shape:
            raise MessageError(f"Hello.command_low has {self.command_low.size} dims but command_high has "
                               f"{self.command_high.size}; give one low and one high limit per dim")
        bad = np.flatnonzero(~(self.command_low <= self.command_high))
        if bad.size:
            i = int(bad[0])
            raise MessageError(f"Hello command limit {i}: low {self.command_low[i]} > high "
                               f"{self.command_high[i]} (or NaN); swap or fix the limits")

    @property
    def n_dims(self) -> int:
        """Number of actuator or joint dimensions (length of the limit arrays)."""
        return int(self.command_low.size)

    def encode_payload(self) -> bytes:
        kind = utf8_field("Hello.kind", self.kind, 255)
        name = utf8_field("Hello.name", self.name, 255)
        return b"".join((
            struct.pack("<B", len(kind)), kind,
            struct.pack("<BHfH", self.protocol_version, self.n_channels, self.rate_hz, self.n_dims),
            self.command_low.tobytes(), self.command_high.tobytes(),
            struct.pack("<B", len(name)), name,
        ))

    @classmethod
    def decode_payload(cls, payload: bytes | bytearray | memoryview) -> Hello:
        r = PayloadReader(payload, "HELLO")
        kind = r.str8("kind")
        version = r.u8("protocol_version")
        n_channels = r.u16("n_channels")
        rate_hz = r.f32("rate_hz")
        n_dims = r.u16("n_dims")
        low = r.f32s(n_dims, "command_low")
        high = r.f32s(n_dims, "command_high")
        name = r.str8("name")
        r.finish()
        try:
            return cls(kind=kind, name=name, protocol_version=version, n_channels=n_channels,
                       rate_hz=rate_hz, command_low=low, command_high=high)
        except MessageError as exc:
            raise r.error(str(exc)) from None


@register_message
@dataclass(eq=False)
class Heartbeat(Message):
    """HEARTBEAT (0x02): "I am alive, and in this state".  Payload: ``u8 state``."""

    TYPE_ID = 0x02
    NAME = "HEARTBEAT"

    state: DeviceState = DeviceState.RUNNING

    def __post_init__(self) -> None:
        try:
            self.state = DeviceState(self.state)
        except ValueError:
            raise MessageError(f"Heartbeat.state {self.state!r} is not a DeviceState "
                               f"({', '.join(s.name for s in DeviceState)})") from None

    def encode_payload(self) -> bytes:
        return bytes((int(self.state),))

    @classmethod
    def decode_payload(cls, payload: bytes | bytearray | memoryview) -> Heartbeat:
        r = PayloadReader(payload, "HEARTBEAT")
        state = r.enum(r.u8("state"), DeviceState, "state")
        r.finish()
        return cls(state)


@register_message
@dataclass(eq=False)
class Status(Message):
    """STATUS (0x03): a coded event.  Payload: ``u16 code, u8 severity, u16 text_len, text``."""

    TYPE_ID = 0x03
    NAME = "STATUS"

    code: int
    severity: Severity = Severity.INFO
    text: str = ""

    def __post_init__(self) -> None:
        if not 0 <= int(self.code) <= 0xFFFF:
            raise MessageError(f"Status.code {self.code} does not fit in a u16 (0..65535)")
        try:
            self.severity = Severity(self.severity)
        except ValueError:
            raise MessageError(f"Status.severity {self.severity!r} is not a Severity "
                               f"({', '.join(s.name for s in Severity)})") from None
        utf8_field("Status.text", self.text, 4000)

    def encode_payload(self) -> bytes:
        text = utf8_field("Status.text", self.text, 4000)
        return struct.pack("<HBH", self.code, int(self.severity), len(text)) + text

    @classmethod
    def decode_payload(cls, payload: bytes | bytearray | memoryview) -> Status:
        r = PayloadReader(payload, "STATUS")
        code = r.u16("code")
        severity = r.enum(r.u8("severity"), Severity, "severity")
        text = r.str16("text")
        r.finish()
        return cls(code, severity, text)
