"""Progress of a training run that a person can follow, on a terminal or in a log.

:class:`Progress` hands out one :class:`StageProgress` per training stage. On a terminal
(``stream.isatty()``) each stage is a tqdm bar with the recent loss, the last and best
validation CER and the time left (the smaller of the bar's estimate to the step ceiling
and what is left of the time budget). Anywhere else (a pipe, a CI log) it writes plain
lines: one per validation evaluation, and one at least every ``interval_s`` seconds
(10) between them, from a clock thread when a single step takes longer. ``quiet`` writes nothing. Lines go to ``stream`` (stderr), so
``--json`` output on stdout stays one document.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import IO, Any

from tqdm.auto import tqdm

__all__ = ["Progress", "StageProgress", "format_seconds"]


def format_seconds(s: float) -> str:
    """``75.2`` -> ``"1m15s"``; under a minute ``"42s"``; ``"?"`` for an unknown (inf/nan) time."""
    if s != s or s == float("inf"):
        return "?"
    s = max(0, int(round(s)))
    if s < 60:
        return f"{s}s"
    m, s = divmod(s, 60)
    return f"{m}m{s:02d}s" if m < 60 else f"{m // 60}h{m % 60:02d}m"


def _terminal_size(stream: IO[str]) -> tuple[int, int]:
    """``(columns, rows)`` of the terminal behind ``stream``; 0 where it reports none or is not one."""
    import os

    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return 0, 0
    return size.columns, size.lines


class StageProgress:
    """One stage's bar or log lines; :class:`Progress` makes them."""

    def __init__(self, parent: Progress, name: str, total: int, deadline: float | None):
        self.parent, self.name, self.total, self.deadline = parent, name, total, deadline
        self.t0 = self.last_line = time.perf_counter()
        self.done, self.loss = 0, float("nan")
        self.last_val: dict | None = None
        self.best_val: dict | None = None
        self.bar = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        if parent.enabled and parent.tty:
            size = _terminal_size(parent.stream)
            # a terminal that reports no size (a pseudo-terminal under `script`, some CI runners) would get no bar
            # from tqdm (it hides bars below the screen's 0 rows): give it a fixed 100 x 20
            self.bar = (tqdm(total=total, desc=name, file=parent.stream, leave=True, dynamic_ncols=True) if all(size)
                        else tqdm(total=total, desc=name, file=parent.stream, leave=True, ncols=size[0] or 100,
                                  nrows=size[1] or 20))
        elif parent.enabled:  # a step can outlast the interval (the first one compiles kernels): a clock keeps time
            threading.Thread(target=self._heartbeat, name=f"progress: {name}", daemon=True).start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(min(1.0, self.parent.interval_s or 1.0)):
            with self._lock:
                if time.perf_counter() - self.last_line >= self.parent.interval_s and not self._stop.is_set():
                    self._line()

    def time_left(self) -> float:
        """Seconds to the step ceiling at the current rate, or to the deadline if that is sooner."""
        elapsed = time.perf_counter() - self.t0
        left = elapsed / self.done * (self.total - self.done) if self.done else float("inf")
        if self.deadline is not None:
            left = min(left, max(0.0, self.deadline - time.perf_counter()))
        return left

    def _fields(self) -> dict[str, str]:
        out = {"loss": f"{self.loss:.3f}"}
        if self.last_val is not None:
            out["val CER"] = f"{self.last_val['CER']:.1%}"
            if "loss" in self.last_val:
                out["val loss"] = f"{self.last_val['loss']:.3f}"
        if self.best_val is not None:
            out["best"] = f"{self.best_val['CER']:.1%}@{self.best_val['step']}"
        out["left"] = format_seconds(self.time_left())
        return out

    def _line(self) -> None:
        fields = ", ".join(f"{k} {v}" for k, v in self._fields().items())
        self.parent.write(f"{self.name}: step {self.done}/{self.total}, {fields}, "
                          f"{format_seconds(time.perf_counter() - self.t0)} elapsed")
        self.last_line = time.perf_counter()

    def step(self, done: int, loss: float) -> None:
        """Step ``done`` (1-based) finished with recent mean loss ``loss``."""
        if not self.parent.enabled:
            return
        delta, self.done, self.loss = done - self.done, done, loss
        if self.bar is not None:
            self.bar.update(max(delta, 0))
            if done % 5 == 0 or done == self.total:
                self.bar.set_postfix(self._fields(), refresh=False)
        else:
            with self._lock:
                if time.perf_counter() - self.last_line >= self.parent.interval_s:
                    self._line()

    def validated(self, step: int, row: dict, best: dict | None) -> None:
        """A validation evaluation at ``step`` (``row``: CER, WER, chars); ``best``: the best row so far."""
        self.last_val, self.best_val = row, best
        if self.parent.enabled and self.bar is None:
            with self._lock:
                self.done = max(self.done, step)
                self._line()

    def restart(self, attempt: int, seed: int, why: str = "still on the CTC plateau") -> None:
        """The run was abandoned on the CTC plateau (``why``: what showed it); attempt ``attempt`` starts from seed
        ``seed``."""
        self.parent.note(f"{self.name}: {why}; restart {attempt} from seed {seed}")
        self.done, self.t0 = 0, time.perf_counter()
        self.last_val = self.best_val = None
        if self.bar is not None:
            self.bar.reset()

    def close(self, summary: str = "") -> None:
        self._stop.set()
        if self.bar is not None:
            self.bar.close()
        if summary:
            self.parent.note(f"{self.name}: {summary}")


class Progress:
    """Where training progress goes: bars on a terminal, lines elsewhere, nothing when ``quiet``.

    ``tty`` defaults to ``stream.isatty()``.
    """

    def __init__(self, quiet: bool = False, stream: IO[str] | None = None, interval_s: float = 10.0,
                 tty: bool | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = not quiet
        self.interval_s = interval_s
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)()) if tty is None else tty

    def stage(self, name: str, total: int, deadline: float | None = None) -> StageProgress:
        return StageProgress(self, name, total, deadline)

    def write(self, line: str) -> None:
        if self.enabled:
            if self.tty:
                tqdm.write(line, file=self.stream)
            else:
                print(line, file=self.stream, flush=True)

    def note(self, line: str) -> None:
        """A line that is not a progress update (a stage's start or end, a restart)."""
        self.write(line)


def silent() -> Any:
    """A :class:`Progress` that writes nothing."""
    return Progress(quiet=True)
