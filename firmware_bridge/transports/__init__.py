"""Transports: byte pipes to devices, opened by URL through a registry keyed by scheme.

Importing this package registers the built-in schemes: ``serial`` (and bare device
paths), pyserial's ``loop``, ``socket`` and ``rfc2217``, and ``pty``; ``lsl`` (an LSL
stream, with pylsl installed) is found through its entry point. Other packages add
theirs (``sim``, ``replay``) with :func:`register_transport`.
"""

from .base import (
    Transport,
    TransportFactory,
    open_transport,
    redact_device_url,
    register_transport,
    registered_schemes,
    split_device_url,
)
from .lsl import LslStreamNotFoundError, LslTransport, open_lsl
from .pty_pair import FdTransport, open_pty, open_pty_pair
from .serial_port import (
    LatencyWarning,
    SerialTransport,
    ftdi_latency_timer_ms,
    open_pyserial_url,
    open_serial,
)
from .spy import SpyTransport, hexdump

__all__ = [
    "Transport", "TransportFactory", "open_transport", "redact_device_url", "register_transport", "registered_schemes",
    "split_device_url", "FdTransport", "open_pty", "open_pty_pair", "LatencyWarning", "SerialTransport",
    "ftdi_latency_timer_ms", "open_pyserial_url", "open_serial", "SpyTransport", "hexdump",
    "LslTransport", "LslStreamNotFoundError", "open_lsl",
]
