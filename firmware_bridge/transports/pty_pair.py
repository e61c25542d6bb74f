"""Pseudo-terminal pairs: a real tty link between two ends on one machine, no hardware.

:func:`open_pty_pair` returns both ends of a pty as transports (raw mode: no echo, no
line editing), so a test or a device emulator can talk over the same kernel tty layer
a USB serial port uses.  The ``pty://`` URL opens a pair and returns the host end;
its ``peer_path`` (``/dev/pts/N``) is what another process, such as an emulator, opens
as its serial port.  POSIX only.
"""

from __future__ import annotations

import errno
import os
import select
import time
from typing import Any

from ..errors import DeviceNotConnectedError, TransportError
from .base import Transport, register_transport, split_device_url

__all__ = ["FdTransport", "open_pty_pair", "open_pty"]


class FdTransport(Transport):
    """A transport over one read/write file descriptor (a pty end, a pipe, a tty)."""

    def __init__(self, fd: int, url: str, keep_open: tuple[int, ...] = (), path: str | None = None,
                 peer_path: str | None = None) -> None:
        super().__init__(url)
        self.fd = fd
        #: The tty path of this end (``/dev/pts/N``) when it has one.
        self.path = path
        #: For ``pty://``: the path another process opens to reach this end.
        self.peer_path = peer_path
        self._keep_open = keep_open

    def fileno(self) -> int | None:
        return self.fd

    def _read(self, max_bytes: int, timeout: float | None) -> bytes:
        try:
            ready, _, _ = select.select([self.fd], [], [], timeout)
            if not ready:
                return b""
            data = os.read(self.fd, max_bytes)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EINTR):
                return b""
            raise self._peer_lost(exc) from exc
        if not data:
            raise self._peer_lost(EOFError("end of file"))
        return data

    def _peer_lost(self, exc: BaseException) -> DeviceNotConnectedError:
        """The error to raise when a read fails (``exc``: the ``OSError``, or ``EOFError`` at end of file).

        Subclasses that know more about the other end (``sim://``: is the emulator still
        running?) override this rather than copy the read loop.
        """
        if isinstance(exc, OSError) and exc.errno == errno.EIO:
            # The other end of the pty is closed for now. The pty itself lives on
            # while we keep this end, so the peer can reopen it: stay open.
            return DeviceNotConnectedError(
                f"{self.url}: the other end of the pty is closed ({exc}); it may reopen, keep reading"
            )
        return self._lost(exc)

    def _write(self, data: bytes) -> int:
        view = memoryview(data)
        try:
            while view:
                written = os.write(self.fd, view)
                view = view[written:]
        except OSError as exc:
            raise self._lost(exc) from exc
        return len(data)

    def bound_writes(self, seconds: float) -> None:
        super().bound_writes(seconds)
        os.set_blocking(self.fd, False)  # writes then take what the kernel accepts now; reads select() first

    def _write_some(self, data: bytes, deadline: float) -> int:
        return write_until(self.fd, data, deadline, self._lost)

    def _close(self) -> None:
        for fd in (self.fd, *self._keep_open):
            try:
                os.close(fd)
            except OSError:
                pass


def write_until(fd: int, data: bytes, deadline: float, lost) -> int:
    """Write ``data`` to the non-blocking ``fd`` as the kernel takes it until ``deadline`` (``time.monotonic()``);
    return the bytes written (0 when the device's buffer stayed full). ``lost(exc)``: the error for a failed write."""
    view, written = memoryview(data), 0
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:
            n = 0
        except InterruptedError:
            continue
        except OSError as exc:
            raise lost(exc) from exc
        written += n
        view = view[n:]
        left = deadline - time.monotonic()
        if not view or left <= 0:
            break
        select.select([], [fd], [], left)
    return written


def _raw_pty() -> tuple[int, int, str]:
    import tty

    try:
        master, slave = os.openpty()
    except (OSError, AttributeError) as exc:
        raise TransportError(f"cannot open a pty pair on this system ({exc}); ptys need a POSIX OS") from exc
    tty.setraw(slave)
    return master, slave, os.ttyname(slave)


def open_pty_pair() -> tuple[FdTransport, FdTransport]:
    """Open a pty pair; return ``(host_end, device_end)`` as transports.

    Bytes written to one end are read from the other.  ``device_end.path`` is the
    ``/dev/pts/N`` name.  Close both ends when done (each is a context manager).
    """
    master, slave, name = _raw_pty()
    return (FdTransport(master, f"pty://{name}#host", path=None),
            FdTransport(slave, f"pty://{name}#device", path=name))


def open_pty(url: str = "pty://", **options: Any) -> FdTransport:
    """``pty://``: open a pair, return the host end; another process opens ``peer_path``."""
    _, target, params = split_device_url(url)
    if target or params or options:
        raise ValueError(f"{url!r}: pty:// takes no path or options; it creates a fresh pair")
    master, slave, name = _raw_pty()
    # Keep the device end open so the host end does not see EIO before the peer opens it.
    return FdTransport(master, f"pty://{name}", keep_open=(slave,), peer_path=name)


register_transport("pty", open_pty)
