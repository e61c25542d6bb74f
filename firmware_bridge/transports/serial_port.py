"""Serial ports and pyserial URL handlers (``loop://``, ``socket://``, ``rfc2217://``) as transports.

:class:`SerialTransport` wraps any pyserial port object.  A bare device path or
``serial:///dev/ttyACM0?baud=921600&low_latency=1&exclusive=1`` opens a local port
(exclusively, and in the kernel's low-latency mode where the driver supports it);
``loop://``, ``socket://HOST:PORT`` and ``rfc2217://HOST:PORT`` go through
``serial.serial_for_url``.  USB-serial bridges from FTDI buffer input for a
"latency timer" (16 ms by default) before sending it to the host, which alone breaks
a 20 ms loop: opening such a port warns when its timer is above 1 ms (set it with
``echo 1 | sudo tee /sys/bus/usb-serial/devices/ttyUSB0/latency_timer`` or a udev rule).
"""

from __future__ import annotations

import errno
import os
import re
import select
import warnings
from typing import Any

import serial

from ..errors import DeviceNotConnectedError, TransportError
from .base import Transport, register_transport, split_device_url
from .pty_pair import write_until

__all__ = ["SerialTransport", "open_serial", "open_pyserial_url", "ftdi_latency_timer_ms", "LatencyWarning"]

DEFAULT_BAUD = 921600
_MISSING = (errno.ENOENT, errno.ENXIO, errno.ENODEV, errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ETIMEDOUT)


class LatencyWarning(UserWarning):
    """A port's configuration adds latency a closed loop will notice."""


class SerialTransport(Transport):
    """A transport over an open pyserial port object (any ``serial.SerialBase``)."""

    def __init__(self, port: serial.SerialBase, url: str) -> None:
        super().__init__(url)
        self.port = port
        port.timeout = 0  # reads never block; waiting is done with select() or a one-byte read
        self._fd = _port_fd(port)

    def fileno(self) -> int | None:
        return self._fd

    def _read(self, max_bytes: int, timeout: float | None) -> bytes:
        port = self.port
        try:
            data = port.read(max_bytes)
            if data or timeout == 0:
                return data
            if self._fd is not None:
                ready, _, _ = select.select([self._fd], [], [], timeout)
                return port.read(max_bytes) if ready else b""
            port.timeout = timeout  # no descriptor (loop://): block in a one-byte read
            try:
                first = port.read(1)
            finally:
                port.timeout = 0
            return first + port.read(max_bytes - 1) if first and max_bytes > 1 else first
        except (serial.SerialException, OSError) as exc:
            raise self._lost(exc) from exc

    def _write(self, data: bytes) -> int:
        try:
            written = self.port.write(data)
        except serial.SerialTimeoutException:  # a write bounded by bound_writes that the device did not take
            return 0
        except (serial.SerialException, OSError) as exc:
            raise self._lost(exc) from exc
        return len(data) if written is None else written

    def bound_writes(self, seconds: float) -> None:
        super().bound_writes(seconds)
        if self._fd is not None and not isinstance(self.port, serial.Serial):
            # a URL handler over a socket (socket://, rfc2217://): pyserial's own write timeout bounds it. (loop://,
            # in memory, never waits for a reader; its write timeout would instead time the bytes at its baud rate)
            self.port.write_timeout = seconds

    def _write_some(self, data: bytes, deadline: float) -> int:
        if isinstance(self.port, serial.Serial) and self._fd is not None:  # a local port: its fd is non-blocking
            return write_until(self._fd, data, deadline, self._lost)
        return self._write(data)  # pyserial's write timeout bounds it (bound_writes)

    def _close(self) -> None:
        self.port.close()


def _port_fd(port: serial.SerialBase) -> int | None:
    for obj in (port, getattr(port, "_socket", None)):
        try:
            fd = obj.fileno() if obj is not None else None
        except (AttributeError, OSError, ValueError):
            continue
        if isinstance(fd, int) and fd >= 0:
            return fd
    return None


def _open_error(url: str, exc: Exception) -> Exception:
    code = getattr(exc, "errno", None)
    text = str(exc)
    if code in _MISSING or any(s in text for s in ("No such file", "Connection refused", "could not open port")):
        return DeviceNotConnectedError(f"no device at {url} ({exc}); check that it is plugged in and the "
                                       "path is right (ls /dev/ttyACM* /dev/ttyUSB*), or that the server listens")
    if code == errno.EACCES or "Permission denied" in text:
        return TransportError(f"permission denied opening {url}; add your user to the 'dialout' group "
                              "(sudo usermod -aG dialout $USER) and log in again")
    return TransportError(f"could not open {url}: {exc}")


def ftdi_latency_timer_ms(path: str, sysfs_root: str = "/sys/bus/usb-serial/devices") -> int | None:
    """The FTDI latency timer of a ``/dev/ttyUSBn`` port in ms, or ``None`` if it has none."""
    name = os.path.basename(os.path.realpath(path))
    if not re.fullmatch(r"ttyUSB\d+", name):
        return None
    try:
        with open(os.path.join(sysfs_root, name, "latency_timer")) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def _flag(params: dict[str, str], name: str, default: bool) -> bool:
    value = params.pop(name, None)
    if value is None:
        return default
    if value.lower() in ("1", "true", "yes", "on", ""):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"URL option {name}={value!r}; expected 0 or 1")


def open_serial(url: str, **options: Any) -> SerialTransport:
    """Open a local serial port: a path or ``serial://PATH?baud=N&low_latency=1&exclusive=1``."""
    _, path, params = split_device_url(url)
    params.update({k: str(v) for k, v in options.items()})
    try:
        baud = int(params.pop("baud", DEFAULT_BAUD))
    except ValueError:
        raise ValueError(f"baud in {url!r} must be an integer such as 921600") from None
    low_latency = _flag(params, "low_latency", True)
    exclusive = _flag(params, "exclusive", True)
    if params:
        raise ValueError(f"unknown option(s) {sorted(params)} in {url!r}; serial ports take baud, "
                         "low_latency and exclusive")
    if not path:
        raise ValueError(f"{url!r} names no port; write serial:///dev/ttyACM0 or just /dev/ttyACM0")
    try:
        port = serial.Serial(path, baudrate=baud, timeout=0, exclusive=exclusive)
    except (serial.SerialException, OSError) as exc:
        raise _open_error(url, exc) from exc
    if low_latency:
        try:
            port.set_low_latency_mode(True)
        except (AttributeError, NotImplementedError, ValueError, OSError):
            pass  # ptys and many drivers have no ASYNC_LOW_LATENCY; nothing to do
    timer = ftdi_latency_timer_ms(path)
    if timer is not None and timer > 1:
        name = os.path.basename(os.path.realpath(path))
        warnings.warn(f"{path}: FTDI latency timer is {timer} ms, which delays every read by up to "
                      f"{timer} ms; set it to 1 ms: echo 1 | sudo tee "
                      f"/sys/bus/usb-serial/devices/{name}/latency_timer", LatencyWarning, stacklevel=3)
    return SerialTransport(port, url)


def open_pyserial_url(url: str, **options: Any) -> SerialTransport:
    """Open one of pyserial's URL handlers (``loop://``, ``socket://HOST:PORT``, ``rfc2217://``)."""
    try:
        port = serial.serial_for_url(url, timeout=0, **options)
    except (serial.SerialException, OSError) as exc:
        raise _open_error(url, exc) from exc
    return SerialTransport(port, url)


register_transport("serial", open_serial)
for _scheme in ("loop", "socket", "rfc2217"):
    register_transport(_scheme, open_pyserial_url)
