"""Exceptions raised by the wire protocol and its transports.

Every error subclasses a built-in (``ValueError``, ``ConnectionError``, ``OSError``)
so a caller may catch either the precise class or the familiar one.  Messages name
the bad value, what was expected, and what to do about it.  The streaming
:class:`~closedloop.firmware_bridge.parser.FrameParser` never raises any of these: it counts
rejections instead; the strict helpers (``decode_frame``, message constructors,
transport openers) raise them.
"""

from __future__ import annotations

__all__ = [
    "ProtocolError",
    "FrameError",
    "PayloadError",
    "MessageError",
    "SignatureError",
    "TransportError",
    "DeviceNotConnectedError",
    "UnknownTransportError",
    "WriteBlockedError",
]


class ProtocolError(ValueError):
    """Base class for anything wrong with protocol bytes or protocol values."""


class FrameError(ProtocolError):
    """A frame's bytes are not a valid frame.

    ``reason`` is the parser counter the frame would be counted under
    (``"crc_errors"``, ``"malformed"``, ``"oversize"``, ``"bad_tag"``,
    ``"replayed"``, ``"unsigned"``).
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class PayloadError(FrameError):
    """A payload does not match the fixed layout of its message type."""

    def __init__(self, detail: str) -> None:
        super().__init__("malformed", detail)


class SignatureError(FrameError):
    """A signed frame failed verification, or an unsigned frame reached a signing link."""


class MessageError(ProtocolError):
    """A message was built with a value that cannot be put on the wire."""


class TransportError(OSError):
    """A transport could not be opened or used."""


class WriteBlockedError(TransportError):
    """A bounded write (``Transport.bound_writes``) could not put any of a frame on the wire in time: the device is
    not reading and its input buffer is full. Nothing of the frame was written; the transport stays open."""


class DeviceNotConnectedError(ConnectionError):
    """The device is not connected: the transport is closed, unplugged or never opened."""


class UnknownTransportError(ValueError):
    """No transport is registered for a device URL's scheme."""
