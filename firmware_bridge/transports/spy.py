"""A transport wrapper that hexdumps every byte read and written, for debugging a link.

Open any device URL with a ``spy+`` prefix (``spy+/dev/ttyACM0``, ``spy+socket://...``)
or wrap a transport in :class:`SpyTransport` to see the exact bytes on the wire, in
both directions, with timestamps: like pyserial's ``spy://``, for every transport.  The
dump goes to a text stream (``sys.stderr`` by default) or, given a
:class:`logging.Logger`, to that logger at DEBUG level.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

from .base import Transport

__all__ = ["SpyTransport", "hexdump"]


def hexdump(data: bytes, prefix: str = "", width: int = 16) -> str:
    """Classic hexdump lines: offset, hex bytes, printable ASCII.

    >>> print(hexdump(b"CL\\x01\\x10", "TX "))
    TX 0000  43 4c 01 10                                       CL..
    """
    lines = []
    for off in range(0, len(data), width):
        chunk = data[off : off + width]
        text = "".join(chr(b) if 32 <= b < 127 else "." for b in chunk)
        lines.append(f"{prefix}{off:04x}  {chunk.hex(' '):<{3 * width}}  {text}")
    return "\n".join(lines)


class SpyTransport(Transport):
    """Pass everything to ``inner`` and hexdump each read and write to ``stream`` (a text
    stream or a :class:`logging.Logger`)."""

    def __init__(self, inner: Transport, stream: TextIO | logging.Logger | None = None) -> None:
        super().__init__("spy+" + inner.url)
        self.inner = inner
        self.stream = stream if stream is not None else sys.stderr
        self._t0 = time.perf_counter()

    @property
    def is_open(self) -> bool:
        return self._open and self.inner.is_open

    def fileno(self) -> int | None:
        return self.inner.fileno()

    def _log(self, direction: str, data: bytes) -> None:
        stamp = time.perf_counter() - self._t0
        text = f"{stamp:10.6f} {direction} {len(data)} bytes\n{hexdump(data, f'{stamp:10.6f} {direction} ')}"
        if isinstance(self.stream, logging.Logger):
            self.stream.debug("%s %s", self.url, text)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def _read(self, max_bytes: int, timeout: float | None) -> bytes:
        data = self.inner.read(max_bytes, timeout)
        if data:
            self._log("RX", data)
        return data

    def _write(self, data: bytes) -> int:
        self._log("TX", data)
        return self.inner.write(data)

    def __getattr__(self, name: str):
        # Pass through what the wrapped transport offers (a sim:// emulator's process,
        # its shared secret, ...), so spy+URL works wherever URL does.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _close(self) -> None:
        self.inner.close()
