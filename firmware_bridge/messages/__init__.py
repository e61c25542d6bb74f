"""Message types of the closedloop wire protocol, one dataclass each, registered by type id.

Importing this package registers every standard message in :data:`MESSAGE_TYPES`.
Type id ranges: 0x01-0x0F link and device management, 0x10-0x1F neural, 0x20-0x2F
plant and control, 0x30-0x3F manipulators, 0x40-0xDF future standard messages,
0xE0-0xFE vendor and experimental messages; 0x00 and 0xFF are reserved.
"""

from .base import (
    MESSAGE_TYPES,
    Message,
    PayloadReader,
    UnknownMessage,
    as_f32_vector,
    message_class,
    register_message,
    utf8_field,
)
from .control import ActuatorCommand, PlantMeasurement
from .device import PROTOCOL_VERSION, DeviceState, Heartbeat, Hello, Severity, Status
from .neural import DecoderOutput, NeuralFrame
from .robot import JointCommand, JointMode, JointState

__all__ = [
    "MESSAGE_TYPES", "Message", "PayloadReader", "UnknownMessage", "as_f32_vector", "message_class",
    "register_message", "utf8_field", "ActuatorCommand", "PlantMeasurement", "PROTOCOL_VERSION",
    "DeviceState", "Heartbeat", "Hello", "Severity", "Status", "DecoderOutput", "NeuralFrame",
    "JointCommand", "JointMode", "JointState",
]
