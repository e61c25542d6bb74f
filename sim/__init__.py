"""Simulators for closedloop: device emulators that speak the wire protocol, plants, neural sources.

The emulators make a simulator indistinguishable from a board above the transport:
each runs in its own process on a serial port (a real one, or one end of a pty) and
speaks :mod:`closedloop.firmware_bridge` frames.  ``sim://NAME?param=...`` opens one behind a pty
(registered with :func:`closedloop.firmware_bridge.register_transport` when this package is
imported; :func:`register` does it again harmlessly), and ``python -m closedloop.sim NAME --port
PATH`` (:func:`cli_main`) serves one on a given port.  Devices, plants, neural sources
and panda tasks each live in a small registry, so new ones plug in by name.  The
session semantics a host must follow are in ``docs/devices.md``.
"""

from .cli import KEY_ENV, cli_main
from .devices import (
    DEVICES,
    Device,
    DeviceRunner,
    StatusCode,
    UnknownDeviceError,
    device_class,
    device_params,
    register_device,
)
from .faults import FaultConfig
from .params import Param, ParamError
from .transport import SimTransport, open_sim, register

register()

__all__ = ["cli_main", "KEY_ENV", "DEVICES", "Device", "DeviceRunner", "StatusCode", "UnknownDeviceError",
           "device_class", "device_params", "register_device", "FaultConfig", "Param", "ParamError",
           "SimTransport", "open_sim", "register"]
