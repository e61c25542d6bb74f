"""Spine benchmark: GRU decoder and MLP policy steps on torch eager, ONNX Runtime and
Numba (back to back and at a 20 ms cadence) beside each step's measured floor, and the
real-time loop's lateness at 1 kHz and 50 Hz over 20 s each.

    python bench/bench_spine.py            # full run (about 3 minutes), writes bench/results/spine.*
    python bench/bench_spine.py --quick    # a few seconds per part, nothing written

Run it on an otherwise idle machine: it measures tail latency.
"""

import argparse
import sys

from closedloop.sdk.benchmark import SpineBenchConfig, run_spine_benchmark

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    cfg = SpineBenchConfig.quick() if a.quick else SpineBenchConfig(out_dir=a.out)
    run_spine_benchmark(cfg)
    sys.exit(0)
