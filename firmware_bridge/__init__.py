"""closedloop wire protocol: framing, messages, signing, parser, transports, links.

``firmware_bridge`` is the layer between the real-time runtime and a device (a BCI
headstage, a plant, a robot arm, or a simulator that pretends to be one).  It defines
a versioned binary protocol (COBS-framed, CRC-32C-checked frames with sequence
numbers, device timestamps and optional HMAC signing; see ``docs/protocol.md``),
one dataclass per message type, a streaming :class:`FrameParser` that never raises (and
:class:`CFrameParser`, the same parser with its per-byte work in C, which :func:`make_parser`
picks when it can be built),
transports addressed by URL (serial ports, pty pairs, pyserial's ``loop://`` and
``socket://``, extensible by scheme), and a :class:`Link` that ties them together.
A portable C99 implementation for firmware lives in ``firmware_bridge/c``.  It
depends only on the standard library, numpy and pyserial.
"""

from .c_library import CParserUnavailableError
from .c_parser import CFrameParser, ParserBackend, make_parser, parser_backend
from .cobs import cobs_decode, cobs_encode
from .crc import crc32c
from .errors import (
    DeviceNotConnectedError,
    FrameError,
    MessageError,
    PayloadError,
    ProtocolError,
    SignatureError,
    TransportError,
    UnknownTransportError,
    WriteBlockedError,
)
from .frame import (
    FLAG_SIGNED,
    HEADER_LEN,
    MAX_ENCODED_FRAME_LEN,
    MAX_PAYLOAD_LEN,
    MAX_RAW_FRAME_LEN,
    Frame,
    decode_frame,
    encode_frame,
)
from .link import Link, LinkStats, open_link
from .messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    ActuatorCommand,
    DecoderOutput,
    DeviceState,
    Heartbeat,
    Hello,
    JointCommand,
    JointMode,
    JointState,
    Message,
    NeuralFrame,
    PlantMeasurement,
    Severity,
    Status,
    UnknownMessage,
    register_message,
)
from .parser import REJECTION_REASONS, FrameParser, ParserStats
from .signing import FrameSigner, FrameVerifier, derive_link_keys
from .transports import (
    FdTransport,
    SerialTransport,
    SpyTransport,
    Transport,
    open_pty_pair,
    open_transport,
    redact_device_url,
    register_transport,
    registered_schemes,
)

__all__ = [
    # framing
    "cobs_encode", "cobs_decode", "crc32c", "Frame", "encode_frame", "decode_frame",
    "FLAG_SIGNED", "HEADER_LEN", "MAX_PAYLOAD_LEN", "MAX_RAW_FRAME_LEN", "MAX_ENCODED_FRAME_LEN",
    "PROTOCOL_VERSION",
    # messages
    "MESSAGE_TYPES", "Message", "UnknownMessage", "register_message", "Hello", "Heartbeat", "Status",
    "DeviceState", "Severity", "NeuralFrame", "DecoderOutput", "PlantMeasurement", "ActuatorCommand",
    "JointState", "JointCommand", "JointMode",
    # parsing and signing
    "FrameParser", "ParserStats", "REJECTION_REASONS", "CFrameParser", "make_parser", "parser_backend",
    "ParserBackend", "CParserUnavailableError", "FrameSigner", "FrameVerifier", "derive_link_keys",
    # transports and links
    "Transport", "open_transport", "redact_device_url", "register_transport", "registered_schemes", "open_pty_pair",
    "SerialTransport", "FdTransport", "SpyTransport", "Link", "LinkStats", "open_link",
    # errors
    "ProtocolError", "FrameError", "PayloadError", "MessageError", "SignatureError", "TransportError",
    "DeviceNotConnectedError", "UnknownTransportError", "WriteBlockedError",
]
