"""A link: one transport plus a frame encoder and parser, with sequence numbers and signing.

:class:`Link` is what the runtime and the device emulators hold: ``send(message)``
numbers, timestamps, optionally signs and writes a frame; ``poll()`` returns the
frames that have arrived without blocking; ``recv(timeout)`` waits for the next one.
Signing is per link: give both ends the same shared secret and opposite roles, and
each direction gets its own derived key (see :mod:`closedloop.firmware_bridge.signing`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

from .c_parser import make_parser
from .frame import SEQ_MODULUS, Frame, encode_frame
from .messages import Message
from .parser import ParserStats
from .signing import FrameSigner, FrameVerifier, derive_link_keys
from .transports import Transport, open_transport

__all__ = ["Link", "LinkStats", "open_link"]


@dataclass
class LinkStats:
    """Traffic counters of a :class:`Link`; ``received`` holds the parser's counters."""

    frames_sent: int = 0
    bytes_sent: int = 0
    received: ParserStats = field(default_factory=ParserStats)


def _now_us() -> int:
    return time.monotonic_ns() // 1000


class Link:
    """Frames over a transport.

    Parameters
    ----------
    transport : Transport
        An open transport (see :func:`~closedloop.firmware_bridge.transports.open_transport`).
    shared_secret : bytes, optional
        Sign outgoing frames and verify incoming ones with keys derived from this secret.
    role : {"host", "device"}
        Which end this is; picks the send and receive keys.
    require_signed : bool, optional
        Refuse unsigned incoming frames.  Defaults to ``True`` when a secret is given.
    clock_us : callable, optional
        Timestamp source in microseconds for outgoing frames (default: monotonic clock).
    first_seq : int
        Sequence number of the first frame sent.
    parser : {"auto", "c", "python"}, optional
        Which frame parser reads incoming bytes (see :func:`~closedloop.firmware_bridge.c_parser.make_parser`);
        default ``$CLOSEDLOOP_PARSER``, else ``"auto"``: the C-backed one when it is available.
        Both give the same frames and counters.

    Notes
    -----
    A link is not thread-safe: give each thread its own, or guard it with a lock.
    """

    def __init__(self, transport: Transport, *, shared_secret: bytes | None = None,
                 role: Literal["host", "device"] = "host", require_signed: bool | None = None,
                 clock_us: Callable[[], int] | None = None, first_seq: int = 0,
                 parser: str | None = None) -> None:
        if role not in ("host", "device"):
            raise ValueError(f"role must be 'host' or 'device'; got {role!r}")
        self.transport = transport
        self.role = role
        self.signer: FrameSigner | None = None
        verifier = None
        if shared_secret is not None:
            to_device, to_host = derive_link_keys(shared_secret)
            send_key, recv_key = (to_device, to_host) if role == "host" else (to_host, to_device)
            self.signer = FrameSigner(send_key)
            verifier = FrameVerifier(recv_key, required=require_signed)
        elif require_signed:
            raise ValueError("require_signed=True needs a shared_secret to verify with")
        self.parser = make_parser(verifier, backend=parser)
        self.stats = LinkStats(received=self.parser.stats)
        self.next_seq = first_seq % SEQ_MODULUS
        self._clock_us = clock_us or _now_us
        self._inbox: deque[Frame] = deque()
        self._started = False

    @property
    def is_open(self) -> bool:
        return self.transport.is_open

    def send(self, message: Message, timestamp_us: int | None = None) -> Frame:
        """Encode and write ``message``; return the frame as sent (seq, timestamp, counter)."""
        ts = self._clock_us() if timestamp_us is None else timestamp_us
        counter = self.signer.next_counter if self.signer is not None else None
        wire = encode_frame(message, self.next_seq, ts, self.signer)
        if not self._started:
            wire = b"\x00" + wire  # ends whatever partial bytes the receiver holds
            self._started = True
        self.transport.write(wire)
        frame = Frame(message.type_id, self.next_seq, ts, message, 1 if counter is not None else 0, counter)
        self.next_seq = (self.next_seq + 1) % SEQ_MODULUS
        self.stats.frames_sent += 1
        self.stats.bytes_sent += len(wire)
        return frame

    def poll(self) -> list[Frame]:
        """Every frame received so far, without blocking (may be empty).

        If the transport fails while frames are already parsed, those frames are
        returned first; the failure is raised by the next call.
        """
        try:
            self._pump(0.0)
        except (ConnectionError, OSError):
            if not self._inbox:
                raise
        frames = list(self._inbox)
        self._inbox.clear()
        return frames

    def recv(self, timeout: float | None = None) -> Frame | None:
        """The next frame, waiting up to ``timeout`` seconds (``None``: forever); ``None`` on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._inbox:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._pump(left)
            if self._inbox or (deadline is not None and time.monotonic() >= deadline):
                break
        return self._inbox.popleft() if self._inbox else None

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a whole frame; True once one is parsed and waiting for :meth:`poll`.

        Raises what the transport raises (a device that is gone), like :meth:`poll`.
        """
        if self._inbox:
            return True
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if not self._pump(left) and not self._inbox:
                # a transport that returned at once with nothing (a stream it is still looking for): do not spin
                time.sleep(min(left, 0.0005))
            if self._inbox:
                return True

    def _pump(self, timeout: float | None) -> int:
        """Read what the transport has (waiting up to ``timeout`` for the first bytes) into the inbox; bytes read."""
        data = self.transport.read(65536, timeout)
        n = 0
        while data:
            n += len(data)
            self._inbox.extend(self.parser.feed(data))
            data = self.transport.read(65536, 0.0)
        return n

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> Link:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Link({self.transport.url!r}, role={self.role!r}, signed={self.signer is not None})"


def open_link(url: str, *, shared_secret: bytes | None = None, role: Literal["host", "device"] = "host",
              require_signed: bool | None = None, parser: str | None = None, **transport_options: Any) -> Link:
    """Open the transport at ``url`` and wrap it in a :class:`Link` (``parser`` as for :class:`Link`)."""
    transport = open_transport(url, **transport_options)
    try:
        return Link(transport, shared_secret=shared_secret, role=role, require_signed=require_signed, parser=parser)
    except Exception:
        transport.close()
        raise
