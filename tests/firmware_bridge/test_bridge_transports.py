"""Transports with real bytes: pty pairs, pyserial on a pty, loop://, socket://, spy+, the registry."""

from __future__ import annotations

import io
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from closedloop.firmware_bridge import (
    DeviceNotConnectedError,
    FrameParser,
    Heartbeat,
    NeuralFrame,
    Transport,
    UnknownTransportError,
    encode_frame,
    open_pty_pair,
    open_transport,
    register_transport,
    registered_schemes,
)
from closedloop.firmware_bridge.transports import SerialTransport, split_device_url


def _read_until(transport: Transport, size: int, timeout: float = 2.0) -> bytes:
    data, deadline = b"", time.monotonic() + timeout
    while len(data) < size and time.monotonic() < deadline:
        data += transport.read(65536, 0.05)
    return data


@pytest.fixture
def pty_pair() -> Iterator[tuple[Transport, Transport]]:
    host, device = open_pty_pair()
    yield host, device
    host.close()
    device.close()


def test_pty_pair_moves_frames_both_ways(pty_pair: tuple[Transport, Transport]) -> None:
    host, device = pty_pair
    wire = encode_frame(NeuralFrame(3, list(range(192))), 3, 60_000)
    host.write(wire)
    got = _read_until(device, len(wire))
    assert got == wire  # raw mode: every byte, including 0x00 and 0x0a, arrives unchanged
    device.write(b"\x00\x0d\x0a\x03\x1a")
    assert _read_until(host, 5) == b"\x00\x0d\x0a\x03\x1a"


def test_read_timeout_returns_empty_and_zero_never_blocks(pty_pair: tuple[Transport, Transport]) -> None:
    host, _ = pty_pair
    t0 = time.perf_counter()
    assert host.read(100, 0.0) == b""
    assert host.read(100, 0.05) == b""
    assert 0.04 < time.perf_counter() - t0 < 1.0


def test_closed_transport_raises_device_not_connected(pty_pair: tuple[Transport, Transport]) -> None:
    host, _ = pty_pair
    host.close()
    assert not host.is_open
    with pytest.raises(DeviceNotConnectedError, match="closed") as info:
        host.write(b"x")
    assert isinstance(info.value, ConnectionError)
    host.close()  # twice is harmless


def test_unplugged_peer_surfaces_as_device_not_connected() -> None:
    host, device = open_pty_pair()
    path = device.path
    device.close()
    with pytest.raises(DeviceNotConnectedError):
        for _ in range(3):
            host.read(10, 0.05)
            host.write(b"ping")
    # The host end stays open: the pty lives on, and a peer that reopens it is heard again.
    assert host.is_open
    with open_transport(f"serial://{path}?baud=115200") as again:
        again.write(b"back")
        got = b""
        for _ in range(20):
            try:
                got += host.read(10, 0.05)
            except DeviceNotConnectedError:
                continue
            if got:
                break
        assert got == b"back"
    host.close()


def test_pyserial_opens_the_pty_device_end_by_path(pty_pair: tuple[Transport, Transport]) -> None:
    host, device = pty_pair
    with open_transport(f"serial://{device.path}?baud=115200") as port:
        assert isinstance(port, SerialTransport)
        host.write(b"hello")
        assert _read_until(port, 5) == b"hello"
        port.write(b"world")
        assert _read_until(host, 5) == b"world"


def test_pty_url_gives_a_host_end_with_a_peer_path() -> None:
    with open_transport("pty://") as host, open_transport(host.peer_path) as dev:  # bare path = serial
        dev.write(encode_frame(Heartbeat(), 1, 2))
        frames = FrameParser().feed(_read_until(host, 10))
        assert [f.seq for f in frames] == [1]


def test_loop_url_echoes(tmp_path) -> None:
    with open_transport("loop://") as loop:
        wire = encode_frame(Heartbeat(), 9, 9)
        loop.write(wire)
        assert _read_until(loop, len(wire)) == wire
        assert loop.read(10, 0.02) == b""


def test_socket_url_against_a_local_server() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(4096):
                conn.sendall(data)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    try:
        with open_transport(f"socket://127.0.0.1:{port}") as sock:
            wires = b"".join(encode_frame(NeuralFrame(i, [i] * 64), i, i) for i in range(20))
            sock.write(wires)
            frames = FrameParser().feed(_read_until(sock, len(wires)))
            assert [f.seq for f in frames] == list(range(20))
    finally:
        server.close()
        thread.join(2)


def test_socket_url_with_nobody_listening_is_device_not_connected() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(DeviceNotConnectedError, match="no device"):
        open_transport(f"socket://127.0.0.1:{port}")


def test_missing_serial_device_is_device_not_connected() -> None:
    with pytest.raises(DeviceNotConnectedError, match="plugged in"):
        open_transport("/dev/ttyACM_definitely_missing")


def test_spy_prefix_hexdumps_both_directions() -> None:
    log = io.StringIO()
    with open_transport("spy+loop://", spy_stream=log) as spy:
        spy.write(b"CL\x01\x10")
        assert _read_until(spy, 4) == b"CL\x01\x10"
        assert spy.url == "spy+loop://"
    text = log.getvalue()
    assert "TX 4 bytes" in text and "RX " in text
    assert "0000  43 4c 01 10" in text and "CL.." in text


def test_unknown_scheme_lists_the_known_ones() -> None:
    with pytest.raises(UnknownTransportError, match="known schemes: .*loop") as info:
        open_transport("warp://nowhere")
    assert isinstance(info.value, ValueError)


def test_other_packages_extend_the_registry_by_scheme() -> None:
    class Null(Transport):
        def _read(self, max_bytes: int, timeout: float | None) -> bytes:
            return b""

        def _write(self, data: bytes) -> int:
            return len(data)

        def _close(self) -> None:
            pass

    def factory(url: str, **options: object) -> Transport:
        t = Null(url)
        t.params = split_device_url(url)[2]  # type: ignore[attr-defined]
        return t

    register_transport("nulltest", factory)
    assert "nulltest" in registered_schemes()
    with open_transport("nulltest://thing?rate=50") as t:
        assert t.params == {"rate": "50"} and t.write(b"abc") == 3
    with pytest.raises(ValueError, match="already registered"):
        register_transport("nulltest", lambda url: Null(url))
    register_transport("nulltest", factory)  # same factory again is fine


def test_url_grammar() -> None:
    assert split_device_url("serial:///dev/ttyACM0?baud=921600") == ("serial", "/dev/ttyACM0", {"baud": "921600"})
    assert split_device_url("COM3") == ("serial", "COM3", {})
    assert split_device_url("sim://plant?noise=0.1&seed=3") == ("sim", "plant", {"noise": "0.1", "seed": "3"})
    assert split_device_url("replay://runs/a.rec") == ("replay", "runs/a.rec", {})
    with pytest.raises(ValueError, match="unknown option"):
        open_transport("serial:///dev/null?parity=E")


def test_spy_can_log_to_a_logger(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    logger = logging.getLogger("closedloop.test.spy")
    with caplog.at_level(logging.DEBUG, logger=logger.name), open_transport("spy+loop://", spy_stream=logger) as spy:
        spy.write(b"\x00\x01")
        _read_until(spy, 2)
    assert any("TX 2 bytes" in r.getMessage() for r in caplog.records)
    assert any("RX " in r.getMessage() for r in caplog.records)


def test_ftdi_latency_timer_is_read_from_sysfs(tmp_path) -> None:
    from closedloop.firmware_bridge.transports import ftdi_latency_timer_ms

    (tmp_path / "ttyUSB3").mkdir()
    (tmp_path / "ttyUSB3" / "latency_timer").write_text("16\n")
    assert ftdi_latency_timer_ms("/dev/ttyUSB3", sysfs_root=str(tmp_path)) == 16
    assert ftdi_latency_timer_ms("/dev/ttyUSB9", sysfs_root=str(tmp_path)) is None
    assert ftdi_latency_timer_ms("/dev/ttyACM0", sysfs_root=str(tmp_path)) is None
