"""Latency and lateness statistics kept in preallocated buffers.

The real-time loop records every step's latency (how long the step took) and
lateness (how long after its deadline it started) into fixed-size ring buffers, so
recording allocates nothing. Summaries (p50/p99/max, jitter, missed deadlines)
are computed after the loop, over the most recent ``capacity`` steps; counts and
maxima cover the whole run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

#: ``LoopSummary.stopped_by`` values that mean a safety rule ended the run (the CLI exits 1 for them).
SAFETY_STOPS = frozenset({"overrun", "device_changed", "watchdog_limit", "weights_unrepairable"})


class RingRecorder:
    """Fixed-capacity int64 samples (nanoseconds), newest kept; count and max over all."""

    def __init__(self, capacity: int = 1 << 20):
        self.buf = np.zeros(capacity, dtype=np.int64)
        self.capacity = capacity
        self.count = 0
        self.max = 0

    def add(self, value_ns: int) -> None:
        self.buf[self.count % self.capacity] = value_ns
        self.count += 1
        if value_ns > self.max:
            self.max = value_ns

    def samples(self) -> np.ndarray:
        n = min(self.count, self.capacity)
        return self.buf[:n].copy()

    def recent_percentile_us(self, q: float, n: int = 2048) -> float:
        """Percentile of the newest ``n`` samples only: cheap enough to call from the loop's idle time."""
        count = min(self.count, self.capacity, n)
        if not count:
            return float("nan")
        end = self.count % self.capacity
        if end >= count:
            window = self.buf[end - count : end]
        else:
            window = np.concatenate((self.buf[self.capacity - (count - end) :], self.buf[:end]))
        return float(np.percentile(window, q)) / 1e3

    def percentile_us(self, q: float) -> float:
        s = self.samples()
        return float(np.percentile(s, q)) / 1e3 if s.size else float("nan")


@dataclass
class LoopSummary:
    """What a run of the real-time loop achieved. Times in microseconds."""

    rate_hz: float
    steps: int
    duration_s: float
    achieved_rate_hz: float
    latency_p50_us: float
    latency_p99_us: float
    latency_max_us: float
    lateness_p50_us: float
    lateness_p99_us: float
    lateness_max_us: float
    jitter_us: float  # standard deviation of lateness
    missed_deadlines: int  # steps that finished after their period ended, plus skipped periods
    skipped_periods: int
    overruns: int
    # "duration", "steps", "interrupt", "stop", or a safety rule: "overrun", "device_changed", "watchdog_limit",
    # "weights_unrepairable" (SAFETY_STOPS)
    stopped_by: str
    # wall time from the first deadline to the loop's end, and the set-up before it (GC pass, settling period);
    # 0.0 where the summary was not measured by the loop
    wall_s: float = 0.0
    setup_s: float = 0.0

    @property
    def missed_fraction(self) -> float:
        total = self.steps + self.skipped_periods
        return self.missed_deadlines / total if total else 0.0

    def to_dict(self) -> dict:
        return asdict(self) | {"missed_fraction": self.missed_fraction}

    def format(self) -> str:
        return (
            f"{self.steps} steps at {self.rate_hz:g} Hz in {self.duration_s:.2f} s "
            f"(achieved {self.achieved_rate_hz:.1f} Hz, stopped by {self.stopped_by})\n"
            f"  latency  p50 {self.latency_p50_us:8.1f} us  p99 {self.latency_p99_us:8.1f} us  "
            f"max {self.latency_max_us:8.1f} us\n"
            f"  lateness p50 {self.lateness_p50_us:8.1f} us  p99 {self.lateness_p99_us:8.1f} us  "
            f"max {self.lateness_max_us:8.1f} us  jitter {self.jitter_us:.1f} us\n"
            f"  missed deadlines {self.missed_deadlines} ({100 * self.missed_fraction:.3f}%), "
            f"overruns {self.overruns}, skipped periods {self.skipped_periods}"
        )
