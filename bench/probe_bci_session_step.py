"""Where a live typing session's step time goes: the pty poll, the bin (model + CTC), the command, the recording.

    python bench/probe_bci_session_step.py BUNDLE [--seconds 6] [--record PATH]

Runs ``BUNDLE`` (a calibrated handwriting decoder, e.g. ``out/demo/bci_decoder`` after
``make demo``) against the headstage emulator playing the demo's session, wraps the session's
step parts with timers and prints p50 / p99 / max per part in microseconds, then the loop's
own step latency. A probe, not a benchmark: it prints and writes nothing. docs/bci_deployment.md,
"Latency", quotes it.
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np

from closedloop import sim  # noqa: F401  (registers sim://)
from closedloop.runtime import SessionConfig
from closedloop.runtime.session import Session

URL = ("sim://headstage?source=handwriting&preset=tiny&session=3&channels=192&trials=160&seed=0&gap_s=0.5"
       "&loop=0&first_trial=96")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--record", help="also record (the recording's cost is then part of the step)")
    ap.add_argument("--device", default=URL)
    a = ap.parse_args()
    spent: dict[str, list[int]] = collections.defaultdict(list)

    def timed(obj, name: str, key: str) -> None:
        inner = getattr(obj, name)

        def wrapper(*args, **kwargs):
            t = time.perf_counter_ns()
            out = inner(*args, **kwargs)
            spent[key].append(time.perf_counter_ns() - t)
            return out

        setattr(obj, name, wrapper)

    cfg = SessionConfig(device=a.device, duration_s=a.seconds, status=False, record=a.record, backend="numba")
    with Session(a.bundle, cfg) as s:
        s.start()
        for obj, name, key in ((s, "step", "step"), (s, "_poll", "poll"), (s, "_act", "act"),
                               (s.family, "guarded_step", "bin (model + CTC)"), (s, "_send", "send")):
            timed(obj, name, key)
        if s.writer is not None:
            for name in ("append_output", "append_json"):
                timed(s.writer, name, name)
        summary = s.run()
    print("| part | calls | p50 us | p99 us | max us |\n| --- | --- | --- | --- | --- |")
    for key, ns in spent.items():
        us = np.asarray(ns) / 1e3
        print(f"| {key} | {us.size} | {np.percentile(us, 50):.1f} | {np.percentile(us, 99):.1f} | {us.max():.1f} |")
    print(f"loop step latency p50 {summary.loop.latency_p50_us:.1f} us, p99 {summary.loop.latency_p99_us:.1f} us")


if __name__ == "__main__":
    main()
