"""Certified neural observer benchmark: every plant, the certificate, the classical baselines
(Monte Carlo), two-stage vs direct training time, and the runtime's step and load-time check.

    python bench/bench_observer.py           # 36 minutes on 2 shared cores; writes bench/results/observer/observer.*
    python bench/bench_observer.py --smoke   # seconds, tiny settings; writes observer_smoke.* (not committed)

It prints the estimated run time before it starts. What every number means: the module
docstring of sdk/observer/benchmark.py and docs/observer.md.
"""

import argparse
import json
import sys
from pathlib import Path

from closedloop.sdk.observer.benchmark import ObserverBenchConfig, run_observer_benchmark

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny settings (seconds)")
    ap.add_argument("--out", default="bench/results/observer", help="results folder (default bench/results/observer)")
    ap.add_argument("--config", help="an ObserverBenchConfig JSON file (overrides the defaults)")
    a = ap.parse_args()
    if a.config:
        cfg = ObserverBenchConfig.from_dict(json.loads(Path(a.config).read_text()))
    else:
        cfg = ObserverBenchConfig.smoke() if a.smoke else ObserverBenchConfig()
    cfg.out_dir = a.out
    run_observer_benchmark(cfg)
    sys.exit(0)
