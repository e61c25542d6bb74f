"""Fixtures for the emulator tests: a host that opens ``sim://`` URLs over real ptys and talks the protocol."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import pytest

from closedloop.firmware_bridge import (
    DeviceNotConnectedError,
    Frame,
    Hello,
    Link,
    Message,
    Status,
    open_transport,
)
from closedloop.sim import SimTransport, StatusCode


class Host:
    """The host end of one emulator: a Link over a SimTransport, plus test conveniences."""

    def __init__(self, url: str) -> None:
        self.transport: SimTransport = open_transport(url)  # type: ignore[assignment]
        self.link = Link(self.transport, shared_secret=self.transport.shared_secret)
        self.statuses: list[Status] = []

    @property
    def stats(self):
        return self.link.stats.received

    def send(self, message: Message) -> None:
        self.link.send(message)

    def recv(self, timeout: float) -> Frame | None:
        frame = self.link.recv(timeout)
        if frame is not None and isinstance(frame.message, Status):
            self.statuses.append(frame.message)
        return frame

    def handshake(self, timeout: float = 5.0, name: str = "pytest") -> Hello:
        """Send a host HELLO (again every 0.5 s, frames may be dropped) until the device's HELLO comes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.send(Hello(kind="host", name=name))
            end = time.monotonic() + 0.5
            while time.monotonic() < end:
                frame = self.recv(max(0.0, end - time.monotonic()))
                if frame is not None and isinstance(frame.message, Hello):
                    return frame.message
        raise AssertionError(f"no HELLO from {self.transport.url} within {timeout} s")

    def collect(self, seconds: float, kind: type[Message] | None = None) -> list[tuple[float, Frame]]:
        """``(host arrival time, frame)`` for ``seconds``; keeps Status messages in ``self.statuses``."""
        out = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            frame = self.recv(max(0.0, end - time.monotonic()))
            if frame is not None and (kind is None or isinstance(frame.message, kind)):
                out.append((time.monotonic(), frame))
        return out

    def wait_for(self, predicate: Callable[[Frame], bool], timeout: float) -> Frame:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            frame = self.recv(max(0.0, end - time.monotonic()))
            if frame is not None and predicate(frame):
                return frame
        raise AssertionError(f"no matching frame within {timeout} s")

    def wait_status(self, code: StatusCode, timeout: float = 3.0) -> Status:
        for status in self.statuses:
            if status.code == code:
                return status
        frame = self.wait_for(lambda f: isinstance(f.message, Status) and f.message.code == code, timeout)
        return frame.message  # type: ignore[return-value]

    def report(self, timeout: float = 3.0) -> dict:
        """The device's REPORT (asked again every 0.5 s: a fault may drop the answer)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.send(Status(int(StatusCode.REQUEST_REPORT)))
            end = time.monotonic() + 0.5
            while time.monotonic() < end:
                frame = self.recv(max(0.0, end - time.monotonic()))
                if frame is not None and isinstance(frame.message, Status) and frame.message.code == StatusCode.REPORT:
                    return json.loads(frame.message.text)
        raise AssertionError(f"no REPORT from {self.transport.url} within {timeout} s")

    def read_until_error(self, timeout: float) -> DeviceNotConnectedError | None:
        """Read until the transport raises (a disconnect); ``None`` if it did not within ``timeout``."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                self.recv(0.05)
            except DeviceNotConnectedError as exc:
                return exc
        return None

    def first_frame_after_reconnect(self, kind: type[Message], timeout: float) -> tuple[Frame, int]:
        """After a read error: keep reading through the disconnect, as a session would, until a
        ``kind`` frame arrives from the reopened device; return it and how many reads failed.

        Frames parsed just before the first error are still in the Link's inbox and come out
        first; they are skipped (only frames after a further failed read count).
        """
        errors = 0
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                frame = self.recv(0.05)
            except DeviceNotConnectedError:
                errors += 1
                time.sleep(0.05)
                continue
            if errors and frame is not None and isinstance(frame.message, kind):
                return frame, errors
        raise AssertionError(f"no {kind.__name__} within {timeout} s after the disconnect ({errors} failed reads)")

    def close(self) -> None:
        self.link.close()


@pytest.fixture
def host() -> Iterator[Callable[[str], Host]]:
    """``host(url)`` opens an emulator; every one opened is closed (and its process reaped) at teardown."""
    opened: list[Host] = []

    def open_host(url: str) -> Host:
        h = Host(url)
        opened.append(h)
        return h

    yield open_host
    for h in opened:
        h.close()
        assert h.transport.process.poll() is not None, "emulator process still running after close()"
