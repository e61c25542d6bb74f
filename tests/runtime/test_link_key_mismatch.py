"""A signing-key mismatch between host and device is reported as what it is, not as a missing device.

Each end refuses the other's frames, so no HELLO ever gets through; the handshake timeout says what the
host's parser refused and what to do: device unsigned and host keyed, device signing and host unkeyed,
both keyed with different keys.
"""

from __future__ import annotations

import time

import pytest
import torch

from closedloop.export import export_bundle
from closedloop.firmware_bridge import Heartbeat, Hello, Link
from closedloop.runtime import SessionConfig, SessionError, run_session
from closedloop.sdk.models import MLPPolicy

KEY_A = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"
KEY_B = "ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100"
PLANT = "sim://plant?model=msd&rate=100&seed=1"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    torch.manual_seed(1)
    return export_bundle(
        MLPPolicy(1, 1, (8,)).eval(), tmp_path_factory.mktemp("keys") / "ctl", kind="feedforward",
        example_input=torch.zeros(1, 1), rate_hz=100.0, name="ctl", postprocess={"low": [-2.0], "high": [2.0]},
        extra={"session": {"input": "plant_measurement", "command": "actuator_command"}},
        variants=(), tensorrt=False, report=lambda s: None,
    )


def _refused(bundle, device: str, key: str | None, handshake_timeout_s: float = 2.5) -> str:
    cfg = SessionConfig(device=device, key=key, handshake_timeout_s=handshake_timeout_s, duration_s=0.5, status=False,
                        backend="onnxruntime")
    with pytest.raises(SessionError) as e:
        run_session(bundle, cfg)
    msg = str(e.value)
    assert "check the port, baud rate" not in msg, msg  # not "a missing device"
    return msg


def test_host_keyed_device_unsigned(bundle):
    msg = _refused(bundle, PLANT, KEY_A)
    assert "frames arrived but were refused: unsigned frame on a link that requires signing" in msg, msg
    assert "does not sign" in msg and "give the device the key, or run without --key" in msg


def test_host_and_device_keyed_with_different_keys(bundle):
    msg = _refused(bundle, PLANT + f"&key={KEY_B}", KEY_A)  # --key wins over the URL's key
    assert "frames arrived but were refused: bad tag" in msg and "signs with another key" in msg, msg


def test_host_unkeyed_device_signs(bundle, pty_board):
    # a board that signs (sim:// would hand the host its key, so this one is on a bare pty): it says HELLO
    # and HEARTBEAT once a second until a host HELLO it can verify arrives, which never happens here
    def board(end, stop):
        link = Link(end, role="device", shared_secret=bytes.fromhex(KEY_A))
        while not stop.is_set():
            link.poll()
            link.send(Hello(kind="plant", n_channels=1, rate_hz=100.0))
            link.send(Heartbeat())
            stop.wait(0.5)

    msg = _refused(bundle, pty_board(board), None)
    assert "frames arrived but were refused: bad tag" in msg and "the device signs its frames" in msg, msg
    assert "give the host its key with --key" in msg


def test_the_cli_says_it_too(bundle, capsys):
    from closedloop.sdk.cli import main

    t = time.monotonic()
    rc = main(["run", str(bundle), "--device", PLANT, "--key", KEY_A, "--duration", "0.5", "--quiet",
               "--backend", "onnxruntime", "--handshake-timeout", "1.5"])
    err = capsys.readouterr().err
    assert rc == 2 and time.monotonic() - t < 20
    assert "within 1.5 s" in err
    assert "closedloop run: error: no Hello from" in err and "unsigned frame on a link that requires signing" in err


def test_a_hello_with_a_field_too_many_is_named_malformed_not_a_baud_rate_problem(bundle, pty_board):
    """A firmware author who adds a field to their HELLO: the frames arrive intact (their CRC checks) but do not
    parse; the timeout says so, with the parser's own reason, rather than "check the baud rate"."""

    class LongHello(Hello):
        def encode_payload(self) -> bytes:
            return super().encode_payload() + b"\x01\x02"

    def board(end, stop):
        link = Link(end, role="device")
        while not stop.is_set():
            link.poll()
            link.send(LongHello(kind="plant", n_channels=1, rate_hz=100.0))
            stop.wait(0.3)

    msg = _refused(bundle, pty_board(board), None, handshake_timeout_s=1.5)
    assert "arrived intact (their CRC-32C checks, so the baud rate is right) but malformed (the last: " in msg, msg
    assert "check the baud rate" not in msg and "a HELLO takes exactly its fields" in msg


def test_a_frame_of_another_protocol_version_is_named_with_the_header_to_check(bundle, pty_board):
    """Intact frames whose header says another protocol version: the advice is the raw frame's header (magic and
    version byte), not the message fields."""
    from closedloop.firmware_bridge.cobs import cobs_decode, cobs_encode
    from closedloop.firmware_bridge.crc import crc32c
    from closedloop.firmware_bridge.frame import encode_frame

    raw = bytearray(cobs_decode(encode_frame(Hello(kind="plant", n_channels=1, rate_hz=100.0), 0, 0)[:-1]))
    raw[2] = 2  # the version byte
    raw[-4:] = crc32c(bytes(raw[:-4])).to_bytes(4, "little")
    wire = cobs_encode(bytes(raw)) + b"\x00"

    def board(end, stop):
        while not stop.is_set():
            end.read(4096)
            end.write(wire)
            stop.wait(0.3)

    msg = _refused(bundle, pty_board(board), None, handshake_timeout_s=1.5)
    assert "but malformed (the last: magic/version 434c/2; expected 434c/1)" in msg, msg
    assert "check the raw frame's header against docs/protocol.md section 4" in msg
    assert "a HELLO takes exactly its fields" not in msg
