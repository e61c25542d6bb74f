"""The ``sim://NAME?param=...`` transport: a device emulator in its own process, behind a pty.

:func:`open_sim` checks the parameters, opens a pty pair, starts ``python -m closedloop.sim NAME
--port /dev/pts/N ...`` on the pty's device end (so the emulator does real serial I/O
through pyserial), waits until the emulator has opened its port, lets go of its own
copy of that end, and returns a :class:`SimTransport` on the host end.  Closing the
transport stops the emulator (SIGTERM, then SIGKILL) and reaps it; if the host dies
instead, the emulator sees its pty vanish and exits by itself.

A pty's host end reads EIO while no process holds the device end open.  When an
emulator closes its port (an injected disconnect), :class:`SimTransport` raises
:class:`~closedloop.firmware_bridge.DeviceNotConnectedError` from ``read`` but stays open, and
reading again works once the emulator reopens its end; only when the emulator process
has exited does the transport close itself.  The read loop is
:class:`~closedloop.firmware_bridge.FdTransport`'s; this class only decides, in ``_peer_lost``,
what a failed read or write means.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import tty
import weakref
from typing import IO, Any

import closedloop
from closedloop.firmware_bridge import (
    DeviceNotConnectedError,
    FdTransport,
    TransportError,
    redact_device_url,
    register_transport,
)
from closedloop.firmware_bridge.transports import split_device_url

from .cli import KEY_ENV
from .devices import device_params
from .params import parse_key

__all__ = ["SimTransport", "open_sim", "register"]

_EXIT_GRACE_S = 0.05
# The folder that holds the ``closedloop`` package (a source checkout or site-packages), so the
# emulator's interpreter imports the same closedloop as its host.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(closedloop.__file__)))


def _stop_process(process: subprocess.Popen, fd: int | None, stderr: IO[bytes] | None) -> None:
    """Terminate and reap the emulator, then release the pty and log file (idempotent)."""
    if process.poll() is None:
        try:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=3.0)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=3.0)
        except ProcessLookupError:
            pass
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
    if stderr is not None:
        stderr.close()


def _tail(stderr: IO[bytes] | None, limit: int = 2000) -> str:
    if stderr is None or stderr.closed:
        return ""
    try:
        stderr.seek(0)
        return stderr.read().decode(errors="replace")[-limit:].strip()
    except (OSError, ValueError):
        return ""


class SimTransport(FdTransport):
    """Host end of a pty whose device end is served by an emulator process.

    Attributes
    ----------
    process : subprocess.Popen
        The emulator process.
    device_name : str
        Registry name (``"plant"``).
    device_path : str
        The pty's device end (``/dev/pts/N``) the emulator has open.
    params : dict
        The emulator's typed parameters (defaults filled in; the key removed).
    shared_secret : bytes or None
        The signing secret from ``key=``: give it to ``Link(..., shared_secret=...)``.
    """

    def __init__(self, fd: int, url: str, process: subprocess.Popen, device_name: str, device_path: str,
                 params: dict[str, Any], shared_secret: bytes | None, stderr: IO[bytes]) -> None:
        super().__init__(fd, url)
        self.process = process
        self.device_name = device_name
        self.device_path = device_path
        self.params = {k: v for k, v in params.items() if k != "key"}
        self.shared_secret = shared_secret
        self._stderr = stderr
        self._finalizer = weakref.finalize(self, _stop_process, process, fd, stderr)
        self._port_closed = False  # the emulator closed its end of the pty and has not reopened it

    @property
    def device_running(self) -> bool:
        """Whether the emulator process is still alive."""
        return self.process.poll() is None

    def emulator_pid(self) -> int | None:
        return self.process.pid if self.process.poll() is None else None

    def emulator_log(self) -> str:
        """The tail of the emulator's stderr (errors, and everything with ``verbose``)."""
        return _tail(self._stderr)

    def _read(self, max_bytes: int, timeout: float | None) -> bytes:
        data = super()._read(max_bytes, timeout)
        self._port_closed = False  # the read did not fail: the emulator's end of the pty is open
        return data

    def _peer_lost(self, exc: BaseException) -> DeviceNotConnectedError:
        """A failed read or write: the emulator exited (close, say so), or only closed its port (stay open).

        A dying emulator's pty closes a moment before the process can be reaped, so the first failure waits
        up to ``_EXIT_GRACE_S`` for it; while the port stays closed, each further read (every loop step) only
        looks, so a session polling a closed port is never held up."""
        if not self._port_closed:
            try:
                self.process.wait(timeout=_EXIT_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        self._port_closed = True
        if self.process.poll() is not None:
            code, log = self.process.returncode, _tail(self._stderr)
            self.close()
            return DeviceNotConnectedError(f"{self.url}: the emulator exited with code {code}"
                                           + (f": {log}" if log else "") + "; open the URL again to restart it")
        return DeviceNotConnectedError(f"{self.url}: the device closed its end of the pty ({exc}); the transport "
                                       "stays open: keep reading, frames resume when the device reopens its port")

    def _write(self, data: bytes) -> int:
        try:
            return super()._write(data)
        except DeviceNotConnectedError as exc:  # FdTransport closed itself; report why
            raise self._peer_lost(exc) from exc

    def _write_some(self, data: bytes, deadline: float) -> int:
        try:
            return super()._write_some(data, deadline)
        except DeviceNotConnectedError as exc:  # as _write: say whether the emulator exited
            raise self._peer_lost(exc) from exc

    def _close(self) -> None:
        self._finalizer()


def _wait_ready(ready_fd: int, process: subprocess.Popen, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    got = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([ready_fd], [], [], min(0.1, max(0.0, deadline - time.monotonic())))
        if ready:
            chunk = os.read(ready_fd, 64)
            if not chunk:
                return got.startswith(b"ready")
            got += chunk
            if got.startswith(b"ready"):
                return True
        elif process.poll() is not None:
            return False
    return False


def open_sim(url: str, *, startup_timeout_s: float = 30.0, **options: Any) -> SimTransport:
    """Start the emulator named in ``url`` behind a pty; return the host end.

    Parameters
    ----------
    url : str
        ``sim://NAME?param=value&...`` (see ``docs/devices.md`` for every parameter).
    startup_timeout_s : float
        How long to wait for the emulator to open its port.
    **options
        More device parameters (as if given in the query).

    Raises
    ------
    sim.params.ParamError
        An unknown device, or an unknown or malformed parameter (before anything starts).
    DeviceNotConnectedError
        The emulator did not come up; the message carries its stderr.
    """
    _, name, raw = split_device_url(url)
    name = name.strip("/")
    raw.update({k: str(v) for k, v in options.items()})
    from .params import ParamError

    try:
        _, params = device_params(name, raw)
    except KeyError as exc:
        raise ParamError(str(exc)) from None
    secret = parse_key(params["key"], f"sim://{name}")
    master, slave = os.openpty()
    tty.setraw(slave)
    path = os.ttyname(slave)
    ready_r, ready_w = os.pipe()
    cmd = [sys.executable, "-m", "closedloop.sim", name, "--port", path, "--ready-fd", str(ready_w)]
    for key, value in raw.items():
        if key != "key":
            cmd += [f"--{key}", value]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH", "")) if p)
    env.pop(KEY_ENV, None)
    if secret is not None:
        env[KEY_ENV] = secret.hex()
    stderr = tempfile.TemporaryFile(prefix=f"sim-{name}-")
    try:
        process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
                                   pass_fds=(ready_w,), env=env, start_new_session=True)
    except OSError as exc:
        for fd in (master, slave, ready_r, ready_w):
            os.close(fd)
        stderr.close()
        raise TransportError(f"cannot start the {name} emulator ({exc})") from exc
    os.close(ready_w)
    try:
        ok = _wait_ready(ready_r, process, startup_timeout_s)
    finally:
        os.close(ready_r)
        # The emulator holds the device end now; ours must go, or a disconnect would never show.
        os.close(slave)
    if not ok:
        log = _tail(stderr)
        _stop_process(process, master, stderr)
        raise DeviceNotConnectedError(f"{redact_device_url(url)}: the {name} emulator did not open {path} within "
                                      f"{startup_timeout_s:g} s (exit code {process.returncode})"
                                      + (f": {log}" if log else ""))
    return SimTransport(master, url, process, name, path, params, secret, stderr)


def register() -> None:
    """Register ``sim://`` with :func:`closedloop.firmware_bridge.register_transport` (done by ``import closedloop.sim``; idempotent)."""
    register_transport("sim", open_sim)
