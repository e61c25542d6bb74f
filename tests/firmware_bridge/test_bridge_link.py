"""Link: numbering, timestamps, signing by role, poll/recv over a real pty pair."""

from __future__ import annotations

import threading
import time

import pytest

from closedloop.firmware_bridge import (
    ActuatorCommand,
    DeviceNotConnectedError,
    Heartbeat,
    Link,
    NeuralFrame,
    WriteBlockedError,
    open_link,
    open_pty_pair,
)

SECRET = b"s" * 32


def test_send_numbers_frames_and_returns_what_was_sent() -> None:
    host, device = open_pty_pair()
    with Link(host, clock_us=lambda: 123, first_seq=2**32 - 1) as a, Link(device) as b:
        sent = [a.send(Heartbeat()), a.send(ActuatorCommand([1.0, 2.0]))]
        assert [f.seq for f in sent] == [2**32 - 1, 0] and sent[0].timestamp_us == 123
        got = [b.recv(1.0), b.recv(1.0)]
        assert [(f.seq, f.message, f.timestamp_us) for f in got] == [(f.seq, f.message, 123) for f in sent]
        assert b.stats.received.lost == 0 and a.stats.frames_sent == 2


def test_a_bounded_write_to_a_device_that_does_not_read_never_waits_past_its_bound_and_keeps_frames_whole() -> None:
    """A host's real-time loop bounds its writes (the session does): with a device that stopped reading, each write
    returns within the bound, a frame nothing of which fit is refused (WriteBlockedError), one that fit in part is
    finished first by the next write; what the device then reads is whole frames, in order, none cut short."""
    host, device = open_pty_pair()
    host.bound_writes(0.002)
    a, b = Link(host), Link(device)
    sent, refused, slowest = [], 0, 0.0
    for k in range(800):  # far more than the pty's buffer holds
        t = time.monotonic()
        try:
            sent.append(a.send(ActuatorCommand([float(k), -1.0])).message.u[0])
        except WriteBlockedError:
            refused += 1
        slowest = max(slowest, time.monotonic() - t)
    assert refused > 0 and slowest < 0.2, (refused, slowest)
    got = []
    while (f := b.recv(0.5)) is not None:
        got.append(f.message.u[0])
    # every frame the device gets is one that was sent, whole (no CRC error), in order; the last of them may still
    # be waiting in the host's pending tail
    assert got == sent[:len(got)] and len(got) >= len(sent) - 1
    assert b.stats.received.crc_errors == 0 and b.stats.received.malformed == 0
    a.close()
    b.close()


def test_poll_never_blocks_and_recv_times_out() -> None:
    host, device = open_pty_pair()
    with Link(host) as a, Link(device):
        t0 = time.perf_counter()
        assert a.poll() == []
        assert a.recv(0.05) is None
        assert time.perf_counter() - t0 < 0.5


def test_signed_link_between_host_and_device_roles() -> None:
    host, device = open_pty_pair()
    with Link(host, shared_secret=SECRET, role="host") as a, \
         Link(device, shared_secret=SECRET, role="device") as b:
        a.send(ActuatorCommand([0.5]))
        frame = b.recv(1.0)
        assert frame is not None and frame.signed and frame.message == ActuatorCommand([0.5])
        b.send(NeuralFrame(1, [1, 2]))
        assert a.recv(1.0).message == NeuralFrame(1, [1, 2])


def test_same_role_on_both_ends_cannot_talk() -> None:
    host, device = open_pty_pair()
    with Link(host, shared_secret=SECRET, role="host") as a, \
         Link(device, shared_secret=SECRET, role="host") as b:
        a.send(Heartbeat())
        assert b.recv(0.2) is None and b.stats.received.bad_tag == 1


def test_unsigned_sender_to_signed_receiver_is_refused() -> None:
    host, device = open_pty_pair()
    with Link(host) as a, Link(device, shared_secret=SECRET, role="device") as b:
        a.send(Heartbeat())
        assert b.recv(0.2) is None and b.stats.received.unsigned == 1


def test_echo_thread_round_trips_many_frames() -> None:
    host, device = open_pty_pair()
    dev = Link(device, role="device")
    stop = threading.Event()

    def echo() -> None:
        while not stop.is_set():
            frame = dev.recv(0.05)
            if frame is not None:
                dev.send(frame.message, timestamp_us=frame.timestamp_us)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    a = Link(host)
    try:
        for i in range(200):
            a.send(NeuralFrame(i, [i % 7] * 192))
            back = a.recv(1.0)
            assert back is not None and back.message.bin_index == i
        assert a.stats.received.accepted == 200 and a.stats.received.rejected == 0
    finally:
        stop.set()
        thread.join(2)
        a.close()
        dev.close()


def test_open_link_by_url_and_closed_link_raises() -> None:
    link = open_link("loop://")
    link.send(Heartbeat())
    assert link.recv(1.0).message == Heartbeat()
    link.close()
    assert not link.is_open
    with pytest.raises(DeviceNotConnectedError):
        link.send(Heartbeat())
    with pytest.raises(ValueError, match="shared_secret"):
        open_link("loop://", require_signed=True)
