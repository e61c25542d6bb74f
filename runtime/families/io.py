"""Message <-> vector adapters for sessions: what a family reads from and sends to a device.

Each input kind names the message a device streams and how it becomes the model's
input vector; each command kind names the message sent back and how a command
vector becomes it. Registries keyed by name, so a family (or a bundle's
``extra.session`` block, for the generic family) selects them by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from closedloop.firmware_bridge import (
    ActuatorCommand,
    DecoderOutput,
    JointCommand,
    JointMode,
    JointState,
    Message,
    NeuralFrame,
    PlantMeasurement,
)

_M = TypeVar("_M", bound=Message)


@dataclass(frozen=True)
class InputKind(Generic[_M]):
    message: type[_M]
    #: Write the vector for this message into ``out`` (preallocated, float32).
    to_vector: Callable[[_M, np.ndarray], None]
    #: The device's Hello field that must equal the vector length (or None).
    size_field: str | None = "n_channels"


@dataclass(frozen=True)
class CommandKind:
    message: type[Message] | None
    build: Callable[[np.ndarray, int], Message | None]
    #: The values a sent message of this kind carries (what ``build`` was given), or None for a message that is
    #: not this kind's (another joint mode): replay reads the commands a recording's TX records hold with it.
    values: Callable[[Message], np.ndarray | None] = lambda m: None
    #: Whether a device HELLO's ``command_low/high`` bound this kind's values. A joint-space device states its
    #: joint position limits there; joint velocities it clips to its own velocity limits, so a bundle's velocity
    #: limits are not compared with the HELLO's.
    hello_limits: bool = True


def _sized(values: np.ndarray, out: np.ndarray, what: str) -> None:
    """Copy ``values`` into the frame ``out``, refusing another size (numpy would broadcast a single value)."""
    if values.size != out.size:
        raise ValueError(f"{values.size} {what} where the device's HELLO said {out.size}")
    np.copyto(out.reshape(-1), values, casting="unsafe")


def _counts(m: NeuralFrame, out: np.ndarray) -> None:
    _sized(m.counts, out, "channels")


def _plant_y(m: PlantMeasurement, out: np.ndarray) -> None:
    _sized(m.y, out, "measured outputs (ny)")


def _joint_q_dq(m: JointState, out: np.ndarray) -> None:
    flat = out.reshape(-1)
    n = m.q.size
    if 2 * n != flat.size:
        raise ValueError(f"{n} joints (positions and velocities: {2 * n} values) where the bundle takes {flat.size}")
    flat[:n] = m.q
    flat[n:] = m.dq


INPUT_KINDS: dict[str, InputKind[Any]] = {
    "neural_frame": InputKind(NeuralFrame, _counts),
    "plant_measurement": InputKind(PlantMeasurement, _plant_y),
    "joint_state": InputKind(JointState, _joint_q_dq, size_field=None),
}


def _joint_values(mode: JointMode) -> Callable[[Message], np.ndarray | None]:
    return lambda m: m.values if isinstance(m, JointCommand) and m.mode == mode else None


COMMAND_KINDS: dict[str, CommandKind] = {
    "actuator_command": CommandKind(ActuatorCommand, lambda v, k: ActuatorCommand(u=v.reshape(-1)),
                                    lambda m: m.u if isinstance(m, ActuatorCommand) else None),
    "joint_position": CommandKind(JointCommand, lambda v, k: JointCommand(JointMode.POSITION, v.reshape(-1)),
                                  _joint_values(JointMode.POSITION)),
    "joint_velocity": CommandKind(JointCommand, lambda v, k: JointCommand(JointMode.VELOCITY, v.reshape(-1)),
                                  _joint_values(JointMode.VELOCITY), hello_limits=False),
    "decoder_output": CommandKind(DecoderOutput, lambda v, k: DecoderOutput(bin_index=k, char_probs=v.reshape(-1)),
                                  lambda m: m.char_probs if isinstance(m, DecoderOutput) else None),
    "none": CommandKind(None, lambda v, k: None),
}


#: What the devices of docs/devices.md stream (input kinds) and accept (command kinds), by HELLO ``kind``.
#: A device of another kind (a third party's board) is not checked against it.
DEVICE_STREAMS: dict[str, tuple[str, ...]] = {
    "headstage": ("neural_frame",),
    "plant": ("plant_measurement",),
    "panda": ("joint_state", "plant_measurement"),  # the task observation comes as PLANT_MEASUREMENT
}
DEVICE_ACCEPTS: dict[str, tuple[str, ...]] = {
    "headstage": ("decoder_output", "none"),
    "plant": ("actuator_command", "none"),
    "panda": ("joint_position", "joint_velocity", "none"),
}
#: What a bundle that does not say (a plain export, family ``generic``) reads from and sends to a device of
#: this kind: one input kind and one command kind. Absent kinds keep the family's defaults.
DEVICE_SESSION_DEFAULTS: dict[str, tuple[str, str]] = {
    "headstage": ("neural_frame", "decoder_output"),
    "plant": ("plant_measurement", "actuator_command"),
}


def input_kind(name: str) -> InputKind[Any]:
    try:
        return INPUT_KINDS[name]
    except KeyError:
        raise ValueError(f"unknown session input {name!r}; known: {sorted(INPUT_KINDS)}") from None


def command_kind(name: str) -> CommandKind:
    try:
        return COMMAND_KINDS[name]
    except KeyError:
        raise ValueError(f"unknown session command {name!r}; known: {sorted(COMMAND_KINDS)}") from None
