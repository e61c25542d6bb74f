"""Per-step timing in a recording: STEPS records written off the hot path from the step ring.

A session that records also keeps every step's timing (start time, latency, lateness,
the input frame it acted on, flags), so a recording can be plotted and scrubbed
through later, not only summarised. The loop writes the ring; this observer, on its
own thread, turns each batch into one STEPS record (type 7, docs/recording.md):
``u32 count`` then ``count`` rows of six little-endian int64 (``step``, ``t_ns``,
``latency_ns``, ``lateness_ns``, ``input_seq``, ``flags``), and a ``steps_lost`` EVENT
if the ring ever overran it.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from ..recording import RecordType
from .hub import SessionObserver
from .ring import StepBatch

STEPS_RECORD_TYPE = int(RecordType.STEPS)
STEP_FIELDS = ("step", "t_ns", "latency_ns", "lateness_ns", "input_seq", "flags")
_COUNT = struct.Struct("<I")


def encode_steps(batch: StepBatch) -> bytes:
    rows = np.stack([getattr(batch, f) for f in STEP_FIELDS], axis=1).astype("<i8", copy=False)
    return _COUNT.pack(rows.shape[0]) + rows.tobytes()


def decode_steps(payloads: list[bytes]) -> dict[str, np.ndarray]:
    """STEPS payloads (in file order) -> one array per field, concatenated."""
    chunks = []
    for p in payloads:
        (n,) = _COUNT.unpack_from(p, 0)
        if len(p) != 4 + 48 * n:
            raise ValueError(f"STEPS record of {len(p)} bytes does not hold the {n} rows it declares (4 + 48 x {n})")
        chunks.append(np.frombuffer(p, dtype="<i8", offset=4).reshape(n, 6))
    rows = np.concatenate(chunks) if chunks else np.zeros((0, 6), dtype="<i8")
    return {f: rows[:, j].copy() for j, f in enumerate(STEP_FIELDS)}


class StepRecorder(SessionObserver):
    """Writes STEPS records into a ``RecordingWriter`` (thread-safe appends)."""

    def __init__(self, writer: Any):
        self.writer = writer
        self.lost = 0

    def on_steps(self, batch: StepBatch) -> None:
        if batch.lost:
            self.lost += batch.lost
            self.writer.append_json(RecordType.EVENT, {"event": "steps_lost", "step": int(batch.step[0]) if len(batch) else -1,
                                        "count": int(batch.lost)})
        if len(batch):
            self.writer.append(STEPS_RECORD_TYPE, encode_steps(batch))
