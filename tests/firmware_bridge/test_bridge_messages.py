"""Message payloads: round trips for every type, fixed layouts, validation, the registry."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from closedloop.firmware_bridge import (
    MESSAGE_TYPES,
    ActuatorCommand,
    DecoderOutput,
    FrameParser,
    Heartbeat,
    Hello,
    JointCommand,
    JointMode,
    JointState,
    Message,
    MessageError,
    NeuralFrame,
    PayloadError,
    PlantMeasurement,
    Status,
    UnknownMessage,
    decode_frame,
    encode_frame,
    register_message,
)
from closedloop.firmware_bridge.messages import PayloadReader


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_every_message_round_trips_through_payload_and_frame(messages: st.SearchStrategy, data: st.DataObject
                                                             ) -> None:
    message = data.draw(messages)
    payload = message.encode_payload()
    if isinstance(message, UnknownMessage):
        assert payload == message.payload
    else:
        again = type(message).decode_payload(payload)
        assert again == message and again.encode_payload() == payload
    frame = decode_frame(encode_frame(message, seq=7, timestamp_us=99))
    assert frame.message == message
    assert (frame.msg_type, frame.seq, frame.timestamp_us) == (message.type_id, 7, 99)


def test_type_ids_are_the_documented_ones() -> None:
    ids = {cls.NAME: type_id for type_id, cls in MESSAGE_TYPES.items()}
    assert ids == {"HELLO": 0x01, "HEARTBEAT": 0x02, "STATUS": 0x03, "NEURAL_FRAME": 0x10,
                   "DECODER_OUTPUT": 0x11, "PLANT_MEASUREMENT": 0x20, "ACTUATOR_COMMAND": 0x21,
                   "JOINT_STATE": 0x30, "JOINT_COMMAND": 0x31}


def test_neural_frame_layout_is_u32_u16_u16s() -> None:
    msg = NeuralFrame(0x01020304, np.array([1, 0x0A0B], dtype=np.uint16))
    assert msg.encode_payload() == struct.pack("<IHHH", 0x01020304, 2, 1, 0x0A0B)


def test_fields_come_back_as_numpy_arrays() -> None:
    m = PlantMeasurement.decode_payload(PlantMeasurement([1, 2], [3]).encode_payload())
    assert m.y.dtype == np.float32 and m.u.tolist() == [3.0]
    m.y[0] = 5  # decoded arrays are writable copies
    n = NeuralFrame.decode_payload(NeuralFrame(1, [1, 2, 3]).encode_payload())
    assert n.counts.dtype == np.uint16 and n.counts.flags.writeable


@pytest.mark.parametrize(("build", "words"), [
    (lambda: NeuralFrame(1, [-1, 2]), "clip"),
    (lambda: NeuralFrame(1, [70000]), "u16"),
    (lambda: NeuralFrame(1, [0.5]), "integers"),
    (lambda: NeuralFrame(2**32, [1]), "u32"),
    (lambda: Hello("x", command_low=[1.0], command_high=[0.0]), "low 1.0 > high 0.0"),
    (lambda: Hello("x", command_low=[1.0, 2.0], command_high=[3.0]), "one low and one high"),
    (lambda: Hello("k" * 300), "255"),
    (lambda: JointState([1, 2], [1]), "one velocity per joint"),
    (lambda: JointState([1], [1], [0, 0, 0]), "expected 7"),
    (lambda: JointCommand(JointMode.END_EFFECTOR, [1, 2]), "3"),
    (lambda: JointCommand(9, [1]), "JointMode"),
    (lambda: ActuatorCommand(np.zeros((2, 2))), "1-D"),
    (lambda: ActuatorCommand(np.zeros(2000)), "at most"),
    (lambda: Status(70000), "u16"),
    (lambda: Heartbeat(7), "DeviceState"),
])
def test_bad_values_raise_message_error_naming_the_problem(build, words: str) -> None:
    with pytest.raises(MessageError, match=words) as info:
        build()
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(("cls", "payload", "words"), [
    (NeuralFrame, struct.pack("<IH", 1, 3) + b"\x00\x00", "3 channels"),
    (NeuralFrame, b"\x01\x02", "at least 6"),
    (ActuatorCommand, struct.pack("<Hf", 1, 1.0) + b"\x00", "trailing"),
    (PlantMeasurement, struct.pack("<HH", 2, 0) + b"\x00" * 4, "needs 8 bytes"),
    (JointCommand, struct.pack("<BH", 7, 0), "mode"),
    (JointState, struct.pack("<HB", 0, 2), "has_pose"),
    (Status, struct.pack("<HBH", 1, 1, 2) + b"\xff\xfe", "UTF-8"),
    (Hello, b"\x01x" + struct.pack("<BHfH", 1, 0, 1.0, 1) + struct.pack("<ff", 2.0, 1.0) + b"\x00", "low"),
    (DecoderOutput, struct.pack("<IH", 1, 5) + b"ab", "text"),
])
def test_bad_payloads_raise_payload_error(cls: type[Message], payload: bytes, words: str) -> None:
    with pytest.raises(PayloadError, match=words):
        cls.decode_payload(payload)


@pytest.mark.parametrize(("cls", "payload", "error", "words"), [
    # well-formed layouts past a limit, invalid text, a byte too many: each decoder reads a good payload in one
    # piece, and these must still meet the same checks as a message built in Python
    (PlantMeasurement, struct.pack("<HH", 1025, 0) + b"\x00" * 4100, MessageError, "at most 1024"),
    (ActuatorCommand, struct.pack("<H", 1025) + b"\x00" * 4100, MessageError, "at most 1024"),
    (DecoderOutput, struct.pack("<IH", 1, 0) + struct.pack("<H", 1001) + b"\x00" * 4004, MessageError, "at most 1000"),
    (DecoderOutput, struct.pack("<IH", 1, 4001) + b"a" * 4001 + struct.pack("<H", 0), MessageError, "at most 4000"),
    (DecoderOutput, struct.pack("<IH", 1, 2) + b"\xff\xfe" + struct.pack("<H", 0), PayloadError, "UTF-8"),
    (DecoderOutput, struct.pack("<IHBH", 1, 1, 97, 0) + b"\x00", PayloadError, "trailing"),
    (PlantMeasurement, struct.pack("<HHf", 0, 1, 1.0) + b"\x00", PayloadError, "trailing"),
])
def test_payloads_at_the_limits_are_refused_like_messages_built_in_python(cls, payload, error, words) -> None:
    with pytest.raises(error, match=words):
        cls.decode_payload(payload)


@pytest.mark.parametrize("payload", [bytearray(PlantMeasurement([1.5, -2.0], [0.25]).encode_payload()),
                                     memoryview(bytearray(PlantMeasurement([1.5, -2.0], [0.25]).encode_payload()))])
def test_a_measurement_decodes_from_any_buffer_into_its_own_arrays(payload) -> None:
    m = PlantMeasurement.decode_payload(payload)
    assert m.y.tolist() == [1.5, -2.0] and m.u.tolist() == [0.25]
    payload[4:8] = b"\x00" * 4  # the decoded values are copies, not views of the buffer
    assert m.y[0] == 1.5


def test_decoder_output_without_probabilities() -> None:
    out = DecoderOutput(3, "a", np.zeros(0))
    assert out.char_probs is None
    assert DecoderOutput.decode_payload(out.encode_payload()).char_probs is None


def test_new_message_type_is_one_class_and_a_decorator() -> None:
    @register_message
    @dataclass(eq=False)
    class Temperature(Message):
        TYPE_ID = 0xE7
        celsius: float

        def encode_payload(self) -> bytes:
            return struct.pack("<f", self.celsius)

        @classmethod
        def decode_payload(cls, payload: bytes) -> Temperature:
            r = PayloadReader(payload, "TEMPERATURE")
            value = r.f32("celsius")
            r.finish()
            return cls(value)

    try:
        frames = FrameParser().feed(encode_frame(Temperature(36.5), 0, 0))
        assert frames[0].message == Temperature(36.5)
        with pytest.raises(MessageError, match="already used by Temperature"):
            register_message(type("Other", (Temperature,), {}))
    finally:
        del MESSAGE_TYPES[0xE7]


@pytest.mark.parametrize("type_id", [0, 255, 300, "x"])
def test_register_refuses_reserved_ids(type_id: object) -> None:
    with pytest.raises(MessageError, match="1..254"):
        register_message(type("Bad", (Message,), {"TYPE_ID": type_id}))


def test_unregistered_type_arrives_as_unknown_message_with_its_payload() -> None:
    parser = FrameParser()
    frame = parser.feed(encode_frame(UnknownMessage(0xF0, b"\x01\x02"), 0, 0))[0]
    assert isinstance(frame.message, UnknownMessage) and frame.message.payload == b"\x01\x02"
    assert parser.stats.unknown_type == 1


def test_registered_class_that_raises_anything_is_counted_not_raised() -> None:
    @register_message
    class Fragile(Message):
        TYPE_ID = 0xE8

        def encode_payload(self) -> bytes:
            return b"\x01"

        @classmethod
        def decode_payload(cls, payload: bytes) -> Fragile:
            raise ZeroDivisionError("bug in a plug-in")

    try:
        parser = FrameParser()
        assert parser.feed(encode_frame(Fragile(), 0, 0)) == []
        assert parser.stats.malformed == 1 and "bug in a plug-in" in parser.last_rejection[1]
    finally:
        del MESSAGE_TYPES[0xE8]
