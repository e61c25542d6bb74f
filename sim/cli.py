"""``python -m closedloop.sim NAME --port PATH [--PARAM VALUE ...]``: run one device emulator on a serial port.

This is the emulator's process entry point, used directly (``closedloop device NAME
--port ...``, or on one end of a ``socat`` pty pair) and by the ``sim://`` transport,
which starts it behind a pty.  Options after ``--port`` are the device's parameters,
the same names as in a ``sim://`` URL query (``--rate 50`` is ``rate=50``).  The
signing key may come from ``--key HEX`` or, to keep it out of the process list, from
the ``CLOSEDLOOP_DEVICE_KEY`` environment variable.  Started by hand, it says on stderr when it
is serving.  Exit codes: 0 stopped by SIGTERM, 130 stopped by SIGINT (Ctrl-C), 1 the port went
away while it served, 2 bad arguments or a port that cannot be opened.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Sequence

from closedloop.firmware_bridge import DeviceNotConnectedError, TransportError

from .devices import DEVICES, DeviceRunner, PortGoneError, device_class, device_params
from .devices.runner import stderr_log
from .faults import FaultConfig
from .params import COMMON_PARAMS, FAULT_PARAMS, ParamError, format_params_help, import_plugins, parse_key

__all__ = ["cli_main", "KEY_ENV"]

#: Environment variable the emulator reads its hex signing key from when ``--key`` is not given.
KEY_ENV = "CLOSEDLOOP_DEVICE_KEY"

USAGE = """usage: closedloop device NAME --port PATH [--verbose] [--PARAM VALUE ...]   (or python -m closedloop.sim NAME ...)
       closedloop device NAME --help   (parameters of one device)
       closedloop device --list        (devices)"""


def _split_args(args: Sequence[str]) -> tuple[dict[str, str], dict[str, str]]:
    """``(control options, device params)`` from ``--name value`` / ``--name=value`` pairs."""
    control: dict[str, str] = {}
    params: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) < 3:
            raise ParamError(f"unexpected argument {arg!r}; options look like --rate 50\n{USAGE}")
        name, eq, value = arg[2:].partition("=")
        name = name.replace("-", "_")
        if name in ("verbose", "help"):
            control[name] = "1"
            i += 1
            continue
        if not eq:
            if i + 1 >= len(args):
                raise ParamError(f"option --{name} needs a value (e.g. --{name} 1)")
            value = args[i + 1]
            i += 1
        i += 1
        (control if name in ("port", "ready_fd") else params)[name] = value
    return control, params


def _help(name: str, raw: dict[str, str]) -> str:
    import_plugins(raw.get("plugins"), f"sim://{name}")
    cls = device_class(name)
    extra = cls.extra_params(raw)
    plug = f"\n\nparameters of the selected plug-in:\n{format_params_help(extra)}" if extra else ""
    return (f"{USAGE}\n\n{name}: {(cls.__doc__ or '').strip()}\n\ndevice parameters:\n"
            f"{format_params_help(cls.PARAMS)}{plug}\n\ncommon parameters:\n{format_params_help(COMMON_PARAMS)}"
            f"\n\nfault injection:\n{format_params_help(FAULT_PARAMS)}\n\n(a plug-in's parameters depend on "
            "the model/source chosen: add e.g. --model dc-motor before --help)")


def cli_main(argv: Sequence[str] | None = None) -> int:
    """Run the emulator named by ``argv[0]`` until SIGTERM/SIGINT; return the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    if args[0] == "--list":
        for name, cls in sorted(DEVICES.items()):
            print(f"{name:<12} {(cls.__doc__ or '').strip().splitlines()[0]}")
        return 0
    name = args[0]
    try:
        control, raw = _split_args(args[1:])
        if "help" in control:
            print(_help(name, raw))
            return 0
        if "key" not in raw and os.environ.get(KEY_ENV):
            raw["key"] = os.environ[KEY_ENV]
        cls, params = device_params(name, raw)
        key = parse_key(params["key"], f"sim://{name}")
        if "port" not in control:
            raise ParamError(f"--port is required: the serial port the {name} emulator serves on\n{USAGE}")
    except (ParamError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log = stderr_log if "verbose" in control else None
    device = cls(params, log)
    runner = DeviceRunner(device, control["port"], faults=FaultConfig.from_params(params), seed=params["seed"],
                          shared_secret=key, log=log,
                          host_pid=os.getppid() if "ready_fd" in control else None)
    stopped_by: list[int] = []

    def handler(signum: int, frame: object) -> None:
        stopped_by.append(signum)
        runner.stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    try:
        # A pty number is reused as soon as it is free; an emulator of an earlier session that is still exiting
        # may hold its lock on the same path for a moment (seen under heavy load): retry that case briefly.
        deadline = time.monotonic() + 5.0
        while True:
            try:
                runner.open()
                break
            except (TransportError, DeviceNotConnectedError, OSError) as exc:
                if "exclusively lock" in str(exc) and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                print(f"error: cannot open {control['port']} for the {name} emulator: {exc}", file=sys.stderr)
                return 2  # bad input: a port that is not there or not free
        if "ready_fd" in control:  # the sim:// transport waits for this before it lets go of the pty
            fd = int(control["ready_fd"])
            os.write(fd, b"ready\n")
            os.close(fd)
        else:  # started by hand: say that it serves, where, and how it stops
            print(f"{name} emulator serving on {control['port']} (Ctrl-C stops)", file=sys.stderr, flush=True)
        runner.run()
        return 130 if signal.SIGINT in stopped_by else 0
    except PortGoneError as exc:
        print(f"{name} emulator: {exc}", file=sys.stderr)
        return 1  # the port went away while it served
    finally:
        runner.close()
