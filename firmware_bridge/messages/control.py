"""Control-loop messages: PLANT_MEASUREMENT (y and u out of a plant) and ACTUATOR_COMMAND.

The neural observer runs inside a control loop: the plant reports its measured
outputs ``y`` together with the inputs ``u`` it actually applied (after its own
saturation), and the host answers with the next actuator command.  Both are plain
float32 vectors whose lengths travel in the payload.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from .base import MAX_VECTOR_LEN, Message, PayloadReader, as_f32_vector, register_message

__all__ = ["PlantMeasurement", "ActuatorCommand"]

_H, _HH = struct.Struct("<H"), struct.Struct("<HH")
_F32 = np.dtype("<f4")  # a dtype object: np.frombuffer parses a dtype string on every call


@register_message
@dataclass(eq=False)
class PlantMeasurement(Message):
    """PLANT_MEASUREMENT (0x20).  Payload: ``u16 ny, u16 nu, f32 y[ny], f32 u[nu]``."""

    TYPE_ID = 0x20
    NAME = "PLANT_MEASUREMENT"

    y: np.ndarray
    u: np.ndarray

    def __post_init__(self) -> None:
        self.y = as_f32_vector("PlantMeasurement.y", self.y)
        self.u = as_f32_vector("PlantMeasurement.u", self.u)

    def encode_payload(self) -> bytes:
        return struct.pack("<HH", self.y.size, self.u.size) + self.y.tobytes() + self.u.tobytes()

    @classmethod
    def decode_payload(cls, payload: bytes | bytearray | memoryview) -> PlantMeasurement:
        # every plant step of a session parses one: a well-formed payload is read in one piece and not
        # validated again; anything else takes the field-by-field reader below, which says what is wrong
        if len(payload) >= 4:
            ny, nu = _HH.unpack_from(payload, 0)
            if len(payload) == 4 + 4 * (ny + nu) and ny <= MAX_VECTOR_LEN and nu <= MAX_VECTOR_LEN:
                values = np.frombuffer(payload, _F32, ny + nu, 4).copy()
                msg = cls.__new__(cls)
                msg.y, msg.u = values[:ny], values[ny:]
                return msg
        r = PayloadReader(payload, "PLANT_MEASUREMENT")
        ny, nu = r.u16("ny"), r.u16("nu")
        y, u = r.f32s(ny, "y"), r.f32s(nu, "u")
        r.finish()
        return cls(y, u)


@register_message
@dataclass(eq=False)
class ActuatorCommand(Message):
    """ACTUATOR_COMMAND (0x21).  Payload: ``u16 nu, f32 u[nu]``."""

    TYPE_ID = 0x21
    NAME = "ACTUATOR_COMMAND"

    u: np.ndarray

    def __post_init__(self) -> None:
        self.u = as_f32_vector("ActuatorCommand.u", self.u)

    def encode_payload(self) -> bytes:
        return struct.pack("<H", self.u.size) + self.u.tobytes()

    @classmethod
    def decode_payload(cls, payload: bytes | bytearray | memoryview) -> ActuatorCommand:
        if len(payload) >= 2:  # the well-formed payload in one piece, as PlantMeasurement's
            (nu,) = _H.unpack_from(payload, 0)
            if len(payload) == 2 + 4 * nu and nu <= MAX_VECTOR_LEN:
                msg = cls.__new__(cls)
                msg.u = np.frombuffer(payload, _F32, nu, 2).copy()
                return msg
        r = PayloadReader(payload, "ACTUATOR_COMMAND")
        u = r.f32s(r.u16("nu"), "u")
        r.finish()
        return cls(u)
