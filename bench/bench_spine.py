"""Spine benchmark: GRU decoder and MLP policy steps on torch eager, ONNX Runtime and
Numba (back to back and at a 20 ms cadence) beside each step's measured floor, and the
real-time loop's lateness at 1 kHz and 50 Hz over 20 s each.

    python bench/bench_spine.py            # full run (about 3 minutes), writes bench/results/spine/
    python bench/bench_spine.py --quick    # a few seconds per part, nothing written

Writes ``spine.json``, ``spine.md`` (the printed table and targets) and ``spine_latency.png``.
Run it on an otherwise idle machine: it measures tail latency. What every column means:
``closedloop.sdk.benchmark``.
"""

import argparse
import sys
from pathlib import Path

from closedloop.sdk.benchmark import SpineBenchConfig, format_table, run_spine_benchmark

RESULTS = "bench/results/spine"


def markdown(results: dict) -> str:
    """The benchmark's printed table as Markdown, with the machine it ran on."""
    m = results.get("machine", {})
    keys = ("cpu", "host_kind", "python", "torch", "single_core_peak_gflops")
    machine = ", ".join(f"{k} {m[k]:.0f}" if isinstance(m[k], float) else f"{k} {m[k]}" for k in keys if k in m)
    return ("# Spine: per-step latency and loop lateness\n\nWritten by `python bench/bench_spine.py`"
            + (f" on: {machine}" if machine else "") + ".\n\n```\n" + format_table(results) + "\n```\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few seconds per part, nothing written")
    ap.add_argument("--out", default=RESULTS, help=f"results folder (default {RESULTS})")
    a = ap.parse_args(argv)
    cfg = SpineBenchConfig.quick() if a.quick else SpineBenchConfig(out_dir=a.out)
    results = run_spine_benchmark(cfg)
    if cfg.out_dir:
        (Path(cfg.out_dir) / f"{cfg.name}.md").write_text(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
