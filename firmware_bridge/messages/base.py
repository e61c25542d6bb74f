"""Message base class, the type-id registry, and payload packing helpers.

A message is one dataclass that knows its wire type id (``TYPE_ID``) and how to turn
itself into a payload and back (``encode_payload`` / ``decode_payload``).  Message
classes are registered by type id with :func:`register_message`, so adding a message
type is one class plus one decorator, and the frame decoder looks classes up in
:data:`MESSAGE_TYPES` instead of branching on ids.  Payload fields are little-endian;
vectors are numpy arrays (float32, or uint16 for spike counts).  Frames whose type id
nobody registered decode to :class:`UnknownMessage`, so a newer device does not break
an older host.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import ClassVar, TypeVar

import numpy as np

from ..errors import MessageError, PayloadError

__all__ = [
    "Message",
    "UnknownMessage",
    "MESSAGE_TYPES",
    "register_message",
    "message_class",
    "PayloadReader",
    "as_f32_vector",
    "utf8_field",
]

M = TypeVar("M", bound="type[Message]")
E = TypeVar("E", bound=IntEnum)

#: Registered message classes keyed by wire type id.
MESSAGE_TYPES: dict[int, type[Message]] = {}


class Message:
    """Base class of every message; subclasses are dataclasses with ``TYPE_ID`` set.

    Two messages are equal when they have the same class and the same payload bytes,
    which gives value semantics even though fields hold numpy arrays.
    """

    TYPE_ID: ClassVar[int]
    NAME: ClassVar[str]

    @property
    def type_id(self) -> int:
        """Wire type id of this message."""
        return self.TYPE_ID

    def encode_payload(self) -> bytes:
        """Payload bytes of this message (fixed layout, little-endian)."""
        raise NotImplementedError

    @classmethod
    def decode_payload(cls, payload: bytes | bytearray | memoryview) -> Message:
        """Build a message from payload bytes; raises :class:`PayloadError` on a bad layout."""
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Message):
            return NotImplemented
        return (type(self) is type(other) and self.type_id == other.type_id
                and self.encode_payload() == other.encode_payload())

    __hash__ = None  # type: ignore[assignment]  # mutable arrays inside


def register_message(cls: M) -> M:
    """Class decorator: register ``cls`` under its ``TYPE_ID`` (1..254).

    Raises
    ------
    MessageError
        When the id is out of range or already taken by another class.
    """
    type_id = getattr(cls, "TYPE_ID", None)
    if not isinstance(type_id, int) or not 1 <= type_id <= 254:
        raise MessageError(f"{cls.__name__}.TYPE_ID is {type_id!r}; expected an int in 1..254 "
                           "(0 and 255 are reserved)")
    taken = MESSAGE_TYPES.get(type_id)
    if taken is not None and taken is not cls:
        raise MessageError(f"type id 0x{type_id:02X} of {cls.__name__} is already used by "
                           f"{taken.__name__}; pick a free id (vendor messages use 0xE0..0xFE)")
    if not hasattr(cls, "NAME"):
        cls.NAME = cls.__name__
    MESSAGE_TYPES[type_id] = cls
    return cls


def message_class(type_id: int) -> type[Message] | None:
    """The class registered for ``type_id``, or ``None``."""
    return MESSAGE_TYPES.get(type_id)


class UnknownMessage(Message):
    """A frame whose type id has no registered class: the payload is kept verbatim."""

    NAME = "UNKNOWN"

    def __init__(self, raw_type_id: int, payload: bytes | bytearray | memoryview) -> None:
        if not 0 <= raw_type_id <= 255:
            raise MessageError(f"type id {raw_type_id} does not fit in a u8 (0..255)")
        self.raw_type_id = raw_type_id
        self.payload = bytes(payload)

    @property
    def type_id(self) -> int:
        return self.raw_type_id

    def encode_payload(self) -> bytes:
        return self.payload

    def __repr__(self) -> str:
        return f"UnknownMessage(raw_type_id=0x{self.raw_type_id:02X}, payload={self.payload.hex()!r})"


#: the most values a message's float vector may hold unless its class says otherwise
MAX_VECTOR_LEN = 1024


def as_f32_vector(name: str, value: object, max_len: int = MAX_VECTOR_LEN) -> np.ndarray:
    """``value`` as a 1-D little-endian float32 array, or a :class:`MessageError` naming ``name``."""
    try:
        arr = np.asarray(value, dtype="<f4")
    except (TypeError, ValueError) as exc:
        raise MessageError(f"{name} must be a 1-D array of numbers; got {value!r} ({exc})") from None
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise MessageError(f"{name} must be 1-D; got shape {arr.shape}: flatten it first")
    if arr.size > max_len:
        raise MessageError(f"{name} has {arr.size} elements; at most {max_len} fit in one payload")
    return np.ascontiguousarray(arr)


def utf8_field(name: str, text: str, max_bytes: int) -> bytes:
    """``text`` encoded as UTF-8, checked against the field's length prefix."""
    if not isinstance(text, str):
        raise MessageError(f"{name} must be a str; got {type(text).__name__}")
    raw = text.encode("utf-8")
    if len(raw) > max_bytes:
        raise MessageError(f"{name} is {len(raw)} UTF-8 bytes; at most {max_bytes} fit: shorten it")
    return raw


_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_F32 = struct.Struct("<f")


class PayloadReader:
    """Reads fixed-layout payload fields in order; every shortfall is a :class:`PayloadError`."""

    __slots__ = ("buf", "pos", "what")

    def __init__(self, payload: bytes | bytearray | memoryview, what: str) -> None:
        self.buf = bytes(payload)
        self.pos = 0
        self.what = what

    def _take(self, size: int, field: str) -> int:
        start = self.pos
        if start + size > len(self.buf):
            raise PayloadError(f"{self.what} payload is {len(self.buf)} bytes; field {field!r} needs "
                               f"{size} bytes at offset {start}")
        self.pos = start + size
        return start

    def u8(self, field: str) -> int:
        return _U8.unpack_from(self.buf, self._take(1, field))[0]

    def u16(self, field: str) -> int:
        return _U16.unpack_from(self.buf, self._take(2, field))[0]

    def u32(self, field: str) -> int:
        return _U32.unpack_from(self.buf, self._take(4, field))[0]

    def f32(self, field: str) -> float:
        return _F32.unpack_from(self.buf, self._take(4, field))[0]

    def f32s(self, count: int, field: str) -> np.ndarray:
        start = self._take(4 * count, field)
        return np.frombuffer(self.buf, dtype="<f4", count=count, offset=start).copy()

    def u16s(self, count: int, field: str) -> np.ndarray:
        start = self._take(2 * count, field)
        return np.frombuffer(self.buf, dtype="<u2", count=count, offset=start).copy()

    def text(self, size: int, field: str) -> str:
        start = self._take(size, field)
        try:
            return self.buf[start : start + size].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PayloadError(f"{self.what} field {field!r} is not valid UTF-8 ({exc})") from None

    def str8(self, field: str) -> str:
        return self.text(self.u8(field + " length"), field)

    def str16(self, field: str) -> str:
        return self.text(self.u16(field + " length"), field)

    def finish(self) -> None:
        """Check that every byte was used: a longer payload is malformed, not ignored."""
        extra = len(self.buf) - self.pos
        if extra:
            raise PayloadError(f"{self.what} payload has {extra} unexpected trailing bytes after "
                               f"offset {self.pos} (layout is fixed; check the sender's version)")

    def error(self, detail: str) -> PayloadError:
        """A :class:`PayloadError` about this payload (for checks beyond the layout)."""
        return PayloadError(f"{self.what} payload: {detail}")

    def enum(self, value: int, enum_cls: type[E], field: str) -> E:
        """``value`` as a member of ``enum_cls``; an undefined value makes the payload malformed."""
        try:
            return enum_cls(value)
        except ValueError:
            allowed = ", ".join(f"{m.value}={m.name}" for m in enum_cls)
            raise PayloadError(f"{self.what} field {field!r} is {value}; expected one of {allowed}") from None
