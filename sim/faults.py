"""Fault injection between a device emulator's :class:`~closedloop.firmware_bridge.Link` and its serial port.

:class:`FaultyTransport` wraps the device's real transport.  A :class:`Link` writes
exactly one frame per ``write`` call, so each write is one frame to drop, corrupt,
duplicate or delay, with seeded random draws so a test sees the same faults every
run.  It can also be muted (silence: frames are generated and numbered but not
written) and detached (disconnect: the port is closed; the runner reopens it).  The
scheduled device reset (``reset_at``) is played by the runner, which restarts its link.
Sequence numbers are assigned before this layer, so a dropped or muted frame shows up
at the host as a sequence gap, exactly as a frame lost on a real wire would.

:func:`misbehave` plays the faults of a misbehaving device rather than a wire: well-framed data frames whose
contents are wrong (a value too few or too many, a NaN or an infinity), which only the host's checks of the
contents can catch.
"""

from __future__ import annotations

import copy
import heapq
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from closedloop.firmware_bridge import JointState, Message, NeuralFrame, PlantMeasurement, Transport

__all__ = ["FaultConfig", "FaultCounters", "FaultyTransport", "corrupt_one_bit", "misbehave"]


@dataclass(frozen=True)
class FaultConfig:
    """Which faults to inject (see :data:`closedloop.sim.params.FAULT_PARAMS` for meanings and units)."""

    drop: float = 0.0
    corrupt: float = 0.0
    duplicate: float = 0.0
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    glitch: float = 0.0
    nonfinite: float = 0.0
    silence_at: float | None = None
    silence_s: float = 1.0
    disconnect_at: float | None = None
    disconnect_s: float = 1.0
    reset_at: float | None = None
    reset_s: float = 0.5

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> FaultConfig:
        return cls(**{name: params[name] for name in cls.__dataclass_fields__})

    def active(self) -> dict[str, float]:
        """The faults that are switched on, by name (for a Status line)."""
        on: dict[str, float] = {}
        for name in ("drop", "corrupt", "duplicate", "delay_ms", "jitter_ms", "glitch", "nonfinite"):
            if getattr(self, name):
                on[name] = getattr(self, name)
        if self.silence_at is not None:
            on.update(silence_at=self.silence_at, silence_s=self.silence_s)
        if self.disconnect_at is not None:
            on.update(disconnect_at=self.disconnect_at, disconnect_s=self.disconnect_s)
        if self.reset_at is not None:
            on.update(reset_at=self.reset_at, reset_s=self.reset_s)
        return on


@dataclass
class FaultCounters:
    """What the injector did, for the device's status report."""

    frames: int = 0
    dropped: int = 0
    corrupted: int = 0
    duplicated: int = 0
    delayed: int = 0
    muted: int = 0
    while_disconnected: int = 0
    glitched: int = 0  # data frames sent with a value too few or too many
    nonfinite: int = 0  # data frames sent with a NaN or an infinity

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


#: the data field of each streamed message that the message-level faults (``glitch``, ``nonfinite``) touch
_DATA_FIELDS = {NeuralFrame: "counts", PlantMeasurement: "y", JointState: "q"}


def misbehave(message: Message, config: FaultConfig, rng: np.random.Generator, counters: FaultCounters) -> Message:
    """``message`` as a misbehaving device would send it: well framed (the CRC passes), wrong inside.

    With probability ``glitch`` a data frame's values lose their last one or gain a copy of it (so the frame no
    longer has the HELLO's ``n_channels``); with probability ``nonfinite`` one of its values becomes NaN, +inf or
    -inf (float data only). Other messages pass as they are. The draws come from their own generator, so these
    faults never shift the wire faults' draws."""
    name = _DATA_FIELDS.get(type(message))
    if name is None or not (config.glitch or config.nonfinite):
        return message
    u_glitch, u_nonfinite, u_which, u_kind = rng.random(4)
    values = getattr(message, name)
    if u_glitch < config.glitch:
        counters.glitched += 1
        values = values[:-1] if values.size > 1 and u_kind < 0.5 else np.append(values, values[-1:])
    if u_nonfinite < config.nonfinite and values.dtype.kind == "f" and values.size:
        counters.nonfinite += 1
        values = values.copy()
        values[int(u_which * values.size)] = (np.nan, np.inf, -np.inf)[int(u_kind * 3)]
    if values is getattr(message, name):
        return message
    out = copy.copy(message)
    setattr(out, name, values)
    return out


def corrupt_one_bit(data: bytes, rng: np.random.Generator) -> bytes:
    """``data`` with one bit flipped in a non-delimiter byte, never creating a 0x00.

    Keeping the delimiters intact means the host's parser sees the same frame
    boundaries and rejects exactly this frame (by CRC, or as malformed COBS when a
    code byte was hit) instead of merging it with its neighbour.
    """
    buf = bytearray(data)
    candidates = np.flatnonzero(np.frombuffer(bytes(buf), dtype=np.uint8))
    if candidates.size == 0:
        return bytes(buf)
    i = int(candidates[rng.integers(candidates.size)])
    bits = [b for b in range(8) if buf[i] ^ (1 << b)]
    buf[i] ^= 1 << bits[int(rng.integers(len(bits)))]
    return bytes(buf)


@dataclass(order=True)
class _Pending:
    release_s: float
    order: int
    data: bytes = field(compare=False)


class FaultyTransport(Transport):
    """A transport that injects faults into what it writes; reads pass through.

    Parameters
    ----------
    inner : Transport or None
        The real port (``None`` while disconnected).
    config : FaultConfig
        Probabilities and delays.
    rng : numpy.random.Generator
        Seeded source of every fault decision.
    clock_s : callable
        The device clock in seconds (delayed frames are released against it).
    """

    def __init__(self, inner: Transport | None, config: FaultConfig, rng: np.random.Generator,
                 clock_s: Any) -> None:
        super().__init__(inner.url if inner is not None else "faulty://")
        self.inner = inner
        self.config = config
        self.rng = rng
        self.clock_s = clock_s
        self.muted = False
        self.counters = FaultCounters()
        self._queue: list[_Pending] = []
        self._order = 0
        self._last_release_s = 0.0

    @property
    def connected(self) -> bool:
        return self.inner is not None and self.inner.is_open

    def fileno(self) -> int | None:
        return self.inner.fileno() if self.connected else None  # type: ignore[union-attr]

    def attach(self, inner: Transport) -> None:
        """Use ``inner`` as the port again (after a disconnect); starts with a delimiter."""
        self.inner = inner
        inner.write(b"\x00")  # ends any partial frame the host holds from before

    def detach(self) -> None:
        """Close the port (a disconnect); frames written meanwhile go nowhere."""
        inner, self.inner = self.inner, None
        self._queue.clear()
        if inner is not None:
            inner.close()

    def next_release_s(self) -> float | None:
        """When the next delayed frame is due, or ``None``."""
        return self._queue[0].release_s if self._queue else None

    def flush_due(self) -> None:
        """Write the delayed frames whose time has come."""
        now = self.clock_s()
        while self._queue and self._queue[0].release_s <= now:
            data = heapq.heappop(self._queue).data
            if self.connected and not self.muted:
                self.inner.write(data)  # type: ignore[union-attr]

    def _write(self, data: bytes) -> int:
        c, cfg, rng = self.counters, self.config, self.rng
        c.frames += 1
        # Always draw the same numbers per frame so one fault never shifts another's draws.
        u_drop, u_corrupt, u_dup = rng.random(3)
        jitter = rng.uniform(-cfg.jitter_ms, cfg.jitter_ms) if cfg.jitter_ms else 0.0
        if not self.connected:
            c.while_disconnected += 1
            return len(data)
        if self.muted:
            c.muted += 1
            return len(data)
        if u_drop < cfg.drop:
            c.dropped += 1
            return len(data)
        wire = data
        if u_corrupt < cfg.corrupt:
            c.corrupted += 1
            wire = corrupt_one_bit(wire, rng)
        if u_dup < cfg.duplicate:
            c.duplicated += 1
            wire = wire + data  # the copy is the clean frame, as a retransmission would be
        delay_s = max(0.0, cfg.delay_ms + jitter) / 1000.0
        if delay_s <= 0.0:
            self.inner.write(wire)  # type: ignore[union-attr]
            return len(data)
        c.delayed += 1
        # A serial line never reorders: a frame leaves no earlier than the one before it.
        release = max(self.clock_s() + delay_s, self._last_release_s)
        self._last_release_s = release
        self._order += 1
        heapq.heappush(self._queue, _Pending(release, self._order, wire))
        return len(data)

    def _read(self, max_bytes: int, timeout: float | None) -> bytes:
        if not self.connected:
            return b""
        return self.inner.read(max_bytes, timeout)  # type: ignore[union-attr]

    def _close(self) -> None:
        self.detach()
