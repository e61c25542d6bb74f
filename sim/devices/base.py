"""The :class:`Device` interface every emulator implements, its status codes, and the device registry.

A device describes itself (:meth:`Device.hello`), produces its stream one tick at a
time at its own rate (:meth:`Device.tick`), and reacts to host messages
(:meth:`Device.on_message`).  It knows nothing about ports, framing, the handshake or
faults: :class:`~closedloop.sim.devices.runner.DeviceRunner` does all of that, so adding a device
is one class plus :func:`register_device`.  Events a device wants the host to see go
through :meth:`Device.notify` as STATUS messages (rate-limited per code).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from enum import IntEnum
from typing import Any, ClassVar, TypeVar

from closedloop.firmware_bridge import DeviceState, Hello, Message, Severity, Status

from ..params import COMMON_PARAMS, FAULT_PARAMS, Param, ParamError, import_plugins, parse_params
from ..registry import registrar

__all__ = ["Device", "StatusCode", "DEVICES", "register_device", "device_class", "device_params",
           "UnknownDeviceError"]

D = TypeVar("D", bound=type["Device"])


class StatusCode(IntEnum):
    """STATUS codes the emulators use (documented in ``docs/devices.md``).

    The host sends ``Status(REQUEST_REPORT)`` to ask for a ``REPORT`` (JSON text).
    """

    REQUEST_REPORT = 1       # host -> device: send a REPORT
    REPORT = 2               # device -> host: JSON with counters, params, device-specific state
    STREAMING = 10           # streaming started (text lists the active faults)
    HOST_RECONNECTED = 11    # a new host HELLO while streaming: streaming continues
    FAULT_SILENCE = 20       # a silence ended (text: how long)
    FAULT_DISCONNECT = 21    # the port is about to close for a while
    RECONNECTED = 22         # the port was reopened after a disconnect
    OVERRUN = 23             # the emulator fell behind real time and skipped ticks
    COMMAND_CLIPPED = 30     # a command was clipped to the limits (text: what and how)
    BAD_COMMAND = 31         # a command was refused (wrong size, NaN, wrong type)
    HOLD = 32                # no command for hold_s: the safe action is applied
    TASK_SUCCESS = 40        # the task's success condition became true


class UnknownDeviceError(KeyError):
    """No device emulator is registered under the requested name."""

    def __str__(self) -> str:
        return str(self.args[0])


class Device(ABC):
    """One emulated device.

    Parameters
    ----------
    params : dict
        Typed values of :func:`device_params` for this class (see :func:`parse_params`).
    log : callable, optional
        Receives human-readable lines (``--verbose``).
    """

    #: Hello kind ("headstage", "plant", "panda").
    KIND: ClassVar[str]
    #: Device-specific parameters (``rate`` among them).
    PARAMS: ClassVar[tuple[Param, ...]] = ()
    #: Registry name, set by :func:`register_device`.
    NAME: ClassVar[str] = ""
    #: Whether its data frames carry floats (a plant's measurements) rather than integers (spike counts): only
    #: float data can take the ``nonfinite`` fault.
    FLOAT_DATA: ClassVar[bool] = True

    def __init__(self, params: Mapping[str, Any], log: Callable[[str], None] | None = None) -> None:
        self.params = dict(params)
        self.log = log
        self.outbox: list[Message] = []
        self.safe_action_applied = False
        self._last_notice_s: dict[int, float] = {}
        self._suppressed: dict[int, int] = {}

    @classmethod
    def extra_params(cls, raw: Mapping[str, str]) -> tuple[Param, ...]:
        """Parameters that depend on others (a plant's model, a headstage's source)."""
        return ()

    @property
    def rate_hz(self) -> float:
        return float(self.params["rate"])

    @abstractmethod
    def hello(self) -> Hello:
        """This device's HELLO (kind, channels, rate, command limits, name)."""

    def start(self, t_s: float) -> None:
        """Streaming starts at device time ``t_s`` (the first host HELLO)."""
        return None

    @abstractmethod
    def tick(self, index: int, t_s: float) -> Sequence[Message]:
        """Advance to device time ``t_s`` (tick ``index`` since streaming started); return the frames to send."""

    def on_message(self, message: Message, t_s: float) -> None:
        """A message from the host that is not HELLO, HEARTBEAT or a report request."""
        self.notify(StatusCode.BAD_COMMAND, Severity.WARNING,
                    f"{self.KIND} does not accept {getattr(message, 'NAME', type(message).__name__)}; "
                    "see docs/devices.md for what each device accepts", t_s)

    def report(self) -> dict[str, Any]:
        """Device-specific state for a REPORT."""
        return {}

    def state(self) -> DeviceState:
        """HEARTBEAT state while streaming."""
        return DeviceState.SAFE_STOP if self.safe_action_applied else DeviceState.RUNNING

    def close(self) -> None:
        """Release resources (a physics client, files)."""
        return None

    def notify(self, code: StatusCode, severity: Severity, text: str, t_s: float,
               min_interval_s: float = 1.0) -> None:
        """Queue a STATUS, at most one per ``code`` per ``min_interval_s`` (the rest are counted)."""
        last = self._last_notice_s.get(code)
        if last is not None and t_s - last < min_interval_s:
            self._suppressed[code] = self._suppressed.get(code, 0) + 1
            return
        more = self._suppressed.pop(code, 0)
        if more:
            text += f" (+{more} more since the last report)"
        self._last_notice_s[code] = t_s
        self.outbox.append(Status(int(code), severity, text[:4000]))


#: Device classes by name.
DEVICES: dict[str, type[Device]] = {}


def register_device(name: str, *, replace: bool = False) -> Callable[[D], D]:
    """Class decorator: make ``sim://NAME`` and ``python -m closedloop.sim NAME`` start this device."""
    return registrar(DEVICES, "device name", name, replace)


def device_class(name: str) -> type[Device]:
    """The device class registered as ``name``."""
    try:
        return DEVICES[name]
    except KeyError:
        raise UnknownDeviceError(f"no device emulator named {name!r}; known: {', '.join(sorted(DEVICES))} "
                                 "(add one with sim.register_device)") from None


def device_params(name: str, raw: Mapping[str, str]) -> tuple[type[Device], dict[str, Any]]:
    """The device class for ``name`` and the typed values of ``raw`` (URL query or CLI options)."""
    where = f"sim://{name}"
    plugins = raw.get("plugins")
    import_plugins(plugins, where)  # before the lookups: a plug-in may register the device itself
    cls = device_class(name)
    specs = COMMON_PARAMS + FAULT_PARAMS + cls.PARAMS
    known = {p.name for p in specs}
    # Check the device's own parameters first: an unknown model/source is named with its choices.
    parse_params(where, specs, {k: v for k, v in raw.items() if k.replace("-", "_") in known})
    extra = cls.extra_params(raw)
    names = [p.name for p in specs + extra]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise ParamError(f"{where}: parameter name(s) {clash} are declared twice (device and plug-in); "
                         "rename the plug-in's parameter")
    values = parse_params(where, specs + extra, raw)
    if values.get("nonfinite") and not cls.FLOAT_DATA:
        raise ParamError(f"{where}: nonfinite={values['nonfinite']:g}: this device's data are integers (a "
                         f"{cls.KIND}'s counts), which cannot be NaN or infinite; glitch= and corrupt= fault them")
    return cls, values
