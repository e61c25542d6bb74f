"""Zoo benchmark: the full-size zoo models (LSTM and GRU decoders, TCN, CNN and transformer over a
window, goal-conditioned and MLP policies) at batch 1 on one thread: p50/p99 per step on torch
eager, ONNX Runtime and Numba, the ratios numba/ORT and numba/torch, the variants, a streaming
check, and the issue's targets judged from the numbers.

    python bench/bench_zoo.py            # full run (a few minutes), writes bench/results/zoo/zoo.{json,md,png}
    python bench/bench_zoo.py --quick    # under a minute, fp32 only, writes zoo_quick.* (git ignores it)

Run it on an otherwise idle machine: it measures tail latency. Harness: ``closedloop.sdk.zoo.benchmark``.
"""

import argparse
import sys

from closedloop.sdk.zoo.benchmark import ZooBenchConfig, run_zoo_benchmark

RESULTS = "bench/results/zoo"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps, fp32 only; writes zoo_quick.*")
    ap.add_argument("--out", default=RESULTS, help=f"results folder (default {RESULTS})")
    ap.add_argument("--models", nargs="+", help="only these zoo models (default: all)")
    ap.add_argument("--bundles", help="keep the exported bundles in this folder (default: a temporary one)")
    a = ap.parse_args(argv)
    cfg = ZooBenchConfig.quick(a.out) if a.quick else ZooBenchConfig(out_dir=a.out)
    cfg.models = tuple(a.models) if a.models else None
    cfg.bundle_dir = a.bundles
    run_zoo_benchmark(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
