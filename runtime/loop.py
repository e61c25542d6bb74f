"""The fixed-rate real-time loop.

One step per period against absolute deadlines ``t0 + k * period``: sleep until
about ``spin_us`` before the deadline, then spin on ``time.perf_counter_ns`` (plain
sleep overshoots by tens to hundreds of microseconds; spinning a whole period
wastes a core and, under SCHED_FIFO, gets the task throttled). Every step's latency
(its own duration) and lateness (start minus deadline) is recorded. A step that
ends after the next deadline is an overrun, handled by policy:

- ``skip``: drop the periods that were missed and resume at the next future deadline;
- ``hold``: like skip, but call ``on_hold(k)`` once per missed period (a session
  re-sends its last command, so the device holds the last output);
- ``stop``: end the loop (``stopped_by="overrun"``).

Ctrl-C and SIGTERM end the loop cleanly with a summary. Spare time after a step can be given
to ``on_idle(k, budget_ns)`` (status lines, weight scrubbing) with a stated budget, and
``on_step_end(k, latency_ns, lateness_ns)`` hands each step's timing to per-step hooks.

With ``wake_on_input`` and a ``wait_input(timeout_s) -> bool`` callable, the loop waits for the
device instead of sleeping: a step starts as soon as ``wait_input`` reports input, or at its
deadline when none came (the watchdog's tick), and the deadlines restart one period after
each step that input woke. A sample is then answered in a step's time rather than after up to
one period of waiting for the next tick; the device's clock sets the rate. Such a step's
lateness is the time from the wake-up to the step's start; it has no prewarm.

Two measures against tail latency, both on by default and both measured in
``bench/``: Python's cyclic garbage collector is frozen and disabled for the loop's
duration (a collection can pause for milliseconds; it runs once before the loop, or
before a session's handshake, and again after), and ``prewarm()``, if given, is called
when the sleep ends, just before the final spin: a step that runs once every 20 ms otherwise finds its weights
and code evicted from the caches and runs several times slower than back to back.
"""

from __future__ import annotations

import enum
import gc
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .stats import LoopSummary, RingRecorder


class OverrunPolicy(str, enum.Enum):
    SKIP = "skip"
    HOLD = "hold"
    STOP = "stop"


def overrun_policy(value: object) -> OverrunPolicy:
    """``value`` as an :class:`OverrunPolicy` (the enum or its name); anything else is refused naming the choices."""
    try:
        return OverrunPolicy(value)
    except ValueError:
        raise ValueError(f"overrun {value!r}: expected one of {', '.join(p.value for p in OverrunPolicy)} (skip: drop "
                         "the late periods; hold: re-send the last command for each; stop: end the run)") from None


@dataclass
class LoopConfig:
    """Settings of the real-time loop."""

    rate_hz: float
    duration_s: float | None = None
    max_steps: int | None = None
    overrun: OverrunPolicy = OverrunPolicy.SKIP
    spin_us: int = 300
    idle_margin_us: int = 200  # keep this much of the period free after an idle task
    capacity: int = 1 << 20
    freeze_gc: bool = True  # no cyclic garbage collection while the loop runs
    # with freeze_gc, collect once before freezing. A full collection in a big process takes up to a second:
    # a session collects before its handshake instead (the device streams from then on) and turns this off
    collect_gc: bool = True
    prewarm_lead_us: int = 300  # with a prewarm hook, wake this much earlier to run it before the spin
    # step when input arrives (run's wait_input), the deadline only the latest start; the grid restarts at each
    wake_on_input: bool = False

    def __post_init__(self) -> None:
        if not self.rate_hz > 0:
            raise ValueError(f"rate_hz must be > 0, got {self.rate_hz}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0 (None: until stopped), got {self.duration_s}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 (None: no limit), got {self.max_steps}")
        self.overrun = overrun_policy(self.overrun)
        if self.spin_us < 0:
            raise ValueError(f"spin_us must be >= 0, got {self.spin_us}")

    @property
    def period_ns(self) -> int:
        return round(1e9 / self.rate_hz)


StepFn = Callable[[int], object]


class RealTimeLoop:
    """Run ``step(k)`` once per period until a duration, a step count, Ctrl-C or ``stop()``."""

    def __init__(self, config: LoopConfig):
        self.config = config
        self.latency = RingRecorder(config.capacity)
        self.lateness = RingRecorder(config.capacity)
        self._stop = threading.Event()
        self.missed = 0
        self.skipped = 0
        self.overruns = 0
        self.last_summary: LoopSummary | None = None  # the latest run's, also when a step raised

    def stop(self, reason: str = "stop") -> None:
        """Ask the loop to end after the current step (thread-safe); ``reason`` becomes ``stopped_by``.

        A safety rule names itself (``device_changed``, ``watchdog_limit``, ``weights_unrepairable``), so a
        caller (the CLI's exit code) can tell a safety stop from a requested one.
        """
        self._stop.reason = reason  # type: ignore[attr-defined]
        self._stop.set()

    def run(
        self,
        step: StepFn,
        on_hold: Callable[[int], object] | None = None,
        on_idle: Callable[[int, int], object] | None = None,
        prewarm: Callable[[], object] | None = None,
        on_step_end: Callable[[int, int, int], object] | None = None,
        wait_input: Callable[[float], bool] | None = None,
    ) -> LoopSummary:
        cfg = self.config
        period = cfg.period_ns
        spin = cfg.spin_us * 1000
        wake_early = spin + (cfg.prewarm_lead_us * 1000 if prewarm is not None else 0)
        idle_margin = cfg.idle_margin_us * 1000
        clock = time.perf_counter_ns
        sleep = time.sleep
        max_steps = cfg.max_steps if cfg.max_steps is not None else 1 << 62
        end_ns = None
        lat_add = self.latency.add
        late_add = self.lateness.add
        stopped_by = "steps"
        steps = 0
        k = 0
        t_setup = clock()
        restore = _install_stop_signals(self._stop)
        gc_was_enabled = gc.isenabled()
        if cfg.freeze_gc:
            if cfg.collect_gc:
                gc.collect()
            gc.freeze()  # existing objects leave the collector's generations: nothing to scan
            gc.disable()
        t0 = clock() + period  # first deadline one period out: time to settle
        t_first = t0  # t0 moves when input restarts the grid; the loop's span counts from here
        woken_by_input = wait_input if cfg.wake_on_input else None
        if cfg.duration_s is not None:
            end_ns = t0 + int(cfg.duration_s * 1e9)
        try:
            while steps < max_steps:
                deadline = t0 + k * period
                if end_ns is not None and deadline >= end_ns:
                    stopped_by = "duration"
                    break
                if self._stop.is_set():
                    stopped_by = ("interrupt" if getattr(self._stop, "by_sigint", False)
                                  else getattr(self._stop, "reason", "stop"))
                    break
                now = clock()
                if woken_by_input is not None:
                    # wait for the device up to the deadline; input starts the step now and restarts the grid
                    if deadline > now and woken_by_input((deadline - now) / 1e9):
                        deadline = clock()
                        t0 = deadline - k * period
                    while clock() < deadline:  # a wait that returned a little early, without input
                        pass
                else:
                    wait = deadline - now - wake_early
                    if wait > 0:
                        sleep(wait / 1e9)
                    if prewarm is not None and clock() < deadline:
                        prewarm()
                    while clock() < deadline:
                        pass
                start = clock()
                step(k)
                end = clock()
                steps += 1
                late_add(start - deadline)
                lat_add(end - start)
                if on_step_end is not None:  # per-step hooks (runtime.observe): the step's own timing
                    on_step_end(k, end - start, start - deadline)
                next_deadline = deadline + period
                if end > next_deadline:
                    self.overruns += 1
                    self.missed += 1
                    if cfg.overrun is OverrunPolicy.STOP:
                        stopped_by = "overrun"
                        break
                    # Resume at the first deadline still ahead; periods in between are skipped.
                    n_skip = (end - next_deadline) // period + 1
                    if cfg.overrun is OverrunPolicy.HOLD and on_hold is not None:
                        for j in range(n_skip):
                            on_hold(k + 1 + j)
                    self.skipped += n_skip
                    self.missed += n_skip
                    k += 1 + n_skip
                else:
                    k += 1
                    if on_idle is not None:
                        budget = next_deadline - clock() - idle_margin - wake_early
                        if budget > 0:
                            on_idle(k, budget)
        except KeyboardInterrupt:
            stopped_by = "interrupt"
        except BaseException:
            stopped_by = "error"  # a step raised: the caller still gets the loop's figures (last_summary)
            raise
        finally:
            t_end = clock()
            restore()
            if cfg.freeze_gc:
                gc.unfreeze()
                if gc_was_enabled:
                    gc.enable()
            self.last_summary = self._summary(steps, stopped_by, wall_s=(t_end - t_first) / 1e9,
                                              setup_s=(t_first - t_setup) / 1e9)
        return self.last_summary

    def _summary(self, steps: int, stopped_by: str, wall_s: float, setup_s: float) -> LoopSummary:
        cfg = self.config
        lat = self.latency.samples()
        late = self.lateness.samples()
        periods = steps + self.skipped
        # stepping on input, the device sets the pace: the loop's own span is its duration, not its periods
        duration = wall_s if cfg.wake_on_input else periods / cfg.rate_hz

        def pct(a: np.ndarray, q: float) -> float:
            return float(np.percentile(a, q)) / 1e3 if a.size else float("nan")

        return LoopSummary(
            rate_hz=cfg.rate_hz,
            steps=steps,
            duration_s=duration,
            achieved_rate_hz=steps / duration if duration else 0.0,
            latency_p50_us=pct(lat, 50),
            latency_p99_us=pct(lat, 99),
            latency_max_us=self.latency.max / 1e3,
            lateness_p50_us=pct(late, 50),
            lateness_p99_us=pct(late, 99),
            lateness_max_us=self.lateness.max / 1e3,
            jitter_us=float(np.std(late)) / 1e3 if late.size else float("nan"),
            missed_deadlines=self.missed,
            skipped_periods=self.skipped,
            overruns=self.overruns,
            stopped_by=stopped_by,
            wall_s=wall_s,
            setup_s=setup_s,
        )


def _install_stop_signals(stop: threading.Event) -> Callable[[], None]:
    """Turn Ctrl-C (SIGINT) and SIGTERM (``kill PID``, ``systemctl stop``) into a clean stop after the current
    step (main thread only): ``stopped_by`` ``interrupt`` and ``terminated``."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum, frame):  # noqa: ARG001
        if signum == signal.SIGINT:
            stop.by_sigint = True  # type: ignore[attr-defined]
        else:
            stop.reason = "terminated"  # type: ignore[attr-defined]
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore
