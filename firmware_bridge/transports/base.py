"""Transport interface and the registry that maps device-URL schemes to transports.

A transport moves bytes to and from one device and knows nothing about frames.  It is
chosen by URL, one grammar everywhere as in pyserial: a port path or
``serial:///dev/ttyACM0?baud=921600``, ``loop://``, ``socket://HOST:PORT``,
``pty://`` and, registered later by other packages, ``sim://NAME?...`` and
``replay://RECORDING``.  A ``spy+`` prefix on any URL hexdumps the traffic both ways.
Adding a transport is one class plus ``register_transport(scheme, factory)``; this
module never imports the packages that extend it.
"""

from __future__ import annotations

import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from types import TracebackType
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from ..errors import DeviceNotConnectedError, TransportError, UnknownTransportError, WriteBlockedError

__all__ = [
    "Transport", "TransportFactory", "register_transport", "open_transport", "registered_schemes",
    "split_device_url",
]


class Transport(ABC):
    """Bytes to and from one device.

    Subclasses implement :meth:`_read`, :meth:`_write` and :meth:`_close`; this base
    class guards the lifecycle, so using a closed transport raises
    :class:`DeviceNotConnectedError` instead of failing somewhere deeper.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self._open = True
        #: None: ``write`` blocks until every byte is written (a device's own end, a tool). A number of seconds
        #: (``bound_writes``): it never waits longer for the device to take the bytes (a host's real-time loop).
        self.write_deadline_s: float | None = None
        self._pending = b""  # with bounded writes: the tail of a frame the device took only in part

    @property
    def is_open(self) -> bool:
        return self._open

    def read(self, max_bytes: int = 65536, timeout: float | None = 0.0) -> bytes:
        """Return the bytes available now, waiting up to ``timeout`` seconds for the first one.

        ``timeout=0`` never blocks; ``None`` waits until at least one byte arrives.
        Returns ``b""`` when nothing arrived in time.
        """
        self._check_open("read from")
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive; got {max_bytes}")
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 seconds or None; got {timeout}")
        return self._read(max_bytes, timeout)

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Send all of ``data``; return the number of bytes written.

        With :meth:`bound_writes` it waits at most ``write_deadline_s`` for the device to take the bytes: a frame
        the device took in part has its tail written first by the next call (a frame is never cut short on the
        wire by a later one), and a frame of which nothing could be written raises :class:`WriteBlockedError`.
        """
        self._check_open("write to")
        if self.write_deadline_s is None:
            return self._write(bytes(data))
        deadline = time.monotonic() + self.write_deadline_s
        if self._pending:  # the tail of the last frame goes first
            self._pending = self._pending[self._write_some(self._pending, deadline):]
        data = bytes(data)
        n = 0 if self._pending else self._write_some(data, deadline)
        if n == 0 and data:
            raise WriteBlockedError(f"{self.url}: the device is not reading (its input buffer is full); a frame of "
                                    f"{len(data)} bytes was not sent")
        self._pending = data[n:]
        return len(data)

    def bound_writes(self, seconds: float) -> None:
        """From now on ``write`` never waits longer than ``seconds`` for the device (see ``write``). A real-time
        host calls this: a device that stops reading must not stall its loop, its watchdog or its stop."""
        if not seconds > 0:
            raise ValueError(f"seconds must be > 0; got {seconds}")
        self.write_deadline_s = float(seconds)

    def _write_some(self, data: bytes, deadline: float) -> int:
        """Write as much of ``data`` as the device takes before ``deadline`` (``time.monotonic()``); return how
        many bytes. This default writes it all, as ``_write`` does: transports that can be held up by a device
        that does not read (a tty, a socket) override it."""
        return self._write(data)

    def close(self) -> None:
        """Release the device; further reads and writes raise. Closing twice is harmless."""
        if self._open:
            self._open = False
            self._close()

    def fileno(self) -> int | None:
        """A file descriptor that select() can wait on, or ``None``."""
        return None

    def emulator_pid(self) -> int | None:
        """The process id of a device emulator this transport started on this machine (``sim://``), so that a
        real-time session can schedule it as a device's own clock would run; ``None`` for a real device."""
        return None

    def _check_open(self, action: str) -> None:
        if not self._open:
            raise DeviceNotConnectedError(f"cannot {action} {self.url}: the transport is closed; "
                                          "open it again with open_transport()")

    def _lost(self, exc: BaseException) -> DeviceNotConnectedError:
        """Close after an I/O failure and return the error to raise."""
        try:
            self.close()
        except OSError:
            pass
        return DeviceNotConnectedError(f"{self.url} stopped responding ({exc}); "
                                       "check the cable/power, then reopen the transport")

    @abstractmethod
    def _read(self, max_bytes: int, timeout: float | None) -> bytes: ...

    @abstractmethod
    def _write(self, data: bytes) -> int: ...

    @abstractmethod
    def _close(self) -> None: ...

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, {'open' if self._open else 'closed'})"


#: ``factory(url, **options) -> Transport``; ``url`` is the full device URL.
TransportFactory = Callable[..., Transport]

_REGISTRY: dict[str, TransportFactory] = {}
_LOCK = threading.Lock()


def register_transport(scheme: str, factory: TransportFactory, *, replace: bool = False) -> None:
    """Make ``open_transport("SCHEME://...")`` call ``factory(url, **options)``.

    Raises
    ------
    ValueError
        When the scheme is malformed or already registered and ``replace`` is false.
    """
    key = scheme.lower()
    if not key or not key.replace("-", "").replace(".", "").isalnum() or "+" in key:
        raise ValueError(f"transport scheme {scheme!r} must be letters/digits (like 'sim' or 'replay')")
    with _LOCK:
        if key in _REGISTRY and not replace and _REGISTRY[key] is not factory:
            raise ValueError(f"transport scheme {key!r} is already registered to {_REGISTRY[key]!r}; "
                             "pass replace=True to override it")
        _REGISTRY[key] = factory


#: Entry-point group through which installed packages provide transports: ``sim://`` and
#: ``replay://`` come from closedloop's own sim and runtime layers this way, found on first use
#: (as pyserial finds its URL handlers), so no import has to come first.
ENTRY_POINT_GROUP = "closedloop.transports"


def _load_entry_point(scheme: str) -> TransportFactory | None:
    """Register and return the factory an installed distribution provides for ``scheme``, if any."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name.lower() == scheme:
            try:
                factory = ep.load()
            except Exception as exc:  # a broken provider must say which one it is
                raise TransportError(f"the transport for {scheme!r} ({ep.value}) failed to load: {exc}") from exc
            with _LOCK:
                return _REGISTRY.setdefault(scheme, factory)
    return None


def registered_schemes() -> list[str]:
    """Schemes :func:`open_transport` understands, sorted: those registered and those installed as entry points."""
    from importlib.metadata import entry_points

    with _LOCK:
        known = set(_REGISTRY)
    return sorted(known | {ep.name.lower() for ep in entry_points(group=ENTRY_POINT_GROUP)})


def split_device_url(url: str) -> tuple[str, str, dict[str, str]]:
    """``(scheme, target, params)`` of a device URL; a bare path means scheme ``serial``.

    >>> split_device_url("serial:///dev/ttyACM0?baud=921600")
    ('serial', '/dev/ttyACM0', {'baud': '921600'})
    >>> split_device_url("/dev/ttyUSB0")
    ('serial', '/dev/ttyUSB0', {})
    >>> split_device_url("sim://handwriting?channels=192")
    ('sim', 'handwriting', {'channels': '192'})
    """
    if "://" not in url:
        return ("serial", url, {})
    parts = urlsplit(url)
    target = parts.netloc + parts.path
    return (parts.scheme.lower(), target, dict(parse_qsl(parts.query, keep_blank_values=True)))


#: Query parameters of a device URL that carry secrets (``sim://...?key=HEX``, the link's shared secret).
SECRET_PARAMS = ("key", "secret", "token", "password")
_SECRET_VALUE = re.compile(r"([?&](?:" + "|".join(SECRET_PARAMS) + r")=)[^&#]*", re.IGNORECASE)


def redact_device_url(url: str) -> str:
    """``url`` with the values of its secret parameters (``key=...``) replaced by ``***``, for anything that
    shows or stores a device URL: recordings, the monitor, LSL metadata, messages.

    >>> redact_device_url("sim://headstage?channels=8&key=000102")
    'sim://headstage?channels=8&key=***'
    """
    return _SECRET_VALUE.sub(r"\1***", url)


def open_transport(url: str, **options: Any) -> Transport:
    """Open the device at ``url`` through the transport registered for its scheme.

    A ``spy+`` prefix (``spy+loop://``, ``spy+/dev/ttyACM0``) wraps the transport in a
    :class:`~closedloop.firmware_bridge.transports.spy.SpyTransport`; ``spy_stream`` (a text stream,
    default ``sys.stderr``, or a :class:`logging.Logger`) says where the hexdump goes.

    Raises
    ------
    UnknownTransportError
        No transport is registered for the scheme.
    DeviceNotConnectedError
        The device is not there (unplugged, wrong path, nobody listening).
    """
    if url.startswith("spy+"):
        from .spy import SpyTransport

        stream = options.pop("spy_stream", None)
        return SpyTransport(open_transport(url[4:], **options), stream=stream)
    options.pop("spy_stream", None)
    scheme = split_device_url(url)[0]
    with _LOCK:
        factory = _REGISTRY.get(scheme)
    if factory is None:
        factory = _load_entry_point(scheme)
    if factory is None:
        raise UnknownTransportError(f"no transport for scheme {scheme!r} in {url!r}; known schemes: "
                                    f"{', '.join(registered_schemes())} (others register with "
                                    "register_transport)")
    transport = factory(url, **options)
    if not isinstance(transport, Transport):
        raise TransportError(f"the factory for {scheme!r} returned {type(transport).__name__}, not a Transport")
    return transport
