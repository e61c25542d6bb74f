"""Manipulator messages: JOINT_STATE (arm to host) and JOINT_COMMAND (host to arm).

An arm reports joint positions and velocities, optionally with its end-effector pose
``[x, y, z, qx, qy, qz, qw]`` (metres; unit quaternion, scalar last as in PyBullet);
the host commands joint positions, joint velocities, or an end-effector target.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from ..errors import MessageError
from .base import Message, PayloadReader, as_f32_vector, register_message

__all__ = ["JointState", "JointCommand", "JointMode"]


class JointMode(IntEnum):
    """What JOINT_COMMAND values mean."""

    POSITION = 0
    VELOCITY = 1
    END_EFFECTOR = 2


@register_message
@dataclass(eq=False)
class JointState(Message):
    """JOINT_STATE (0x30).

    Payload: ``u16 n, u8 has_pose (0 or 1), f32 q[n], f32 dq[n]``, then
    ``f32 ee_pose[7]`` when ``has_pose == 1``.
    """

    TYPE_ID = 0x30
    NAME = "JOINT_STATE"

    q: np.ndarray
    dq: np.ndarray
    ee_pose: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.q = as_f32_vector("JointState.q", self.q, 500)
        self.dq = as_f32_vector("JointState.dq", self.dq, 500)
        if self.q.size != self.dq.size:
            raise MessageError(f"JointState.q has {self.q.size} joints but dq has {self.dq.size}; "
                               "give one velocity per joint")
        if self.ee_pose is not None:
            self.ee_pose = as_f32_vector("JointState.ee_pose", self.ee_pose, 7)
            if self.ee_pose.size != 7:
                raise MessageError(f"JointState.ee_pose has {self.ee_pose.size} values; expected 7 "
                                   "([x, y, z, qx, qy, qz, qw]) or None")

    def encode_payload(self) -> bytes:
        pose = b"" if self.ee_pose is None else self.ee_pose.tobytes()
        return struct.pack("<HB", self.q.size, 1 if pose else 0) + self.q.tobytes() + self.dq.tobytes() + pose

    @classmethod
    def decode_payload(cls, payload: bytes | bytearray | memoryview) -> JointState:
        r = PayloadReader(payload, "JOINT_STATE")
        n, has_pose = r.u16("n"), r.u8("has_pose")
        if has_pose > 1:
            raise r.error(f"has_pose is {has_pose}; expected 0 or 1")
        q, dq = r.f32s(n, "q"), r.f32s(n, "dq")
        pose = r.f32s(7, "ee_pose") if has_pose else None
        r.finish()
        return cls(q, dq, pose)


@register_message
@dataclass(eq=False)
class JointCommand(Message):
    """JOINT_COMMAND (0x31).  Payload: ``u8 mode, u16 n, f32 values[n]``.

    For ``JointMode.END_EFFECTOR`` the values are ``[x, y, z]`` (n = 3) or
    ``[x, y, z, qx, qy, qz, qw]`` (n = 7); n = 4 and n = 8 add the gripper opening in
    metres as the last value (docs/protocol.md, "Gripper channel").
    """

    TYPE_ID = 0x31
    NAME = "JOINT_COMMAND"

    mode: JointMode
    values: np.ndarray

    def __post_init__(self) -> None:
        try:
            self.mode = JointMode(self.mode)
        except ValueError:
            raise MessageError(f"JointCommand.mode {self.mode!r} is not a JointMode "
                               f"({', '.join(m.name for m in JointMode)})") from None
        self.values = as_f32_vector("JointCommand.values", self.values, 500)
        if self.mode is JointMode.END_EFFECTOR and self.values.size not in (3, 4, 7, 8):
            raise MessageError(f"an END_EFFECTOR JointCommand needs 3 ([x,y,z]) or 7 ([x,y,z,qx,qy,qz,qw]) "
                               f"values, or 4 / 8 with the gripper opening (m) last; got {self.values.size}")

    def encode_payload(self) -> bytes:
        return struct.pack("<BH", int(self.mode), self.values.size) + self.values.tobytes()

    @classmethod
    def decode_payload(cls, payload: bytes | bytearray | memoryview) -> JointCommand:
        r = PayloadReader(payload, "JOINT_COMMAND")
        mode = r.enum(r.u8("mode"), JointMode, "mode")
        values = r.f32s(r.u16("n"), "values")
        r.finish()
        try:
            return cls(mode, values)
        except MessageError as exc:
            raise r.error(str(exc)) from None


