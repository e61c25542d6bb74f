"""Benchmark: fine-tuning a pre-trained push policy with sparse vs success-visitation rewards, and its deployment.

    python bench/bench_rl.py            # the full comparison (about 70 min on 2 loaded cores); writes bench/results/rl/
    python bench/bench_rl.py --tiny     # a smoke run of about a minute (outputs rl_tiny.*, not committed)

Four rewards (sparse, svm, potential, gail) x 3 seeds of behaviour cloning then SAC on Panda
push, two processes of one thread at a time; then the best policy deployed through the
runtime and the panda emulator. What is measured: ``closedloop.sdk.rl.benchmark`` and docs/rl.md.
Writes ``rl.json``, ``rl.md`` and ``rl_success.png``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from closedloop.sdk.rl.benchmark import full_config, run_rl_benchmark, tiny_config

RESULTS = "bench/results/rl"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a smoke run of about a minute (outputs rl_tiny.*)")
    ap.add_argument("--out", default=RESULTS, help=f"results folder (default {RESULTS})")
    ap.add_argument("--workers", type=int, default=None, help="parallel runs (default 2)")
    a = ap.parse_args(argv)
    cfg = tiny_config() if a.tiny else full_config()
    if a.workers:
        cfg["workers"] = a.workers
    stem = "rl_tiny" if a.tiny else "rl"
    run_rl_benchmark(cfg, Path(a.out), stem, tiny=a.tiny)
    print((Path(a.out) / f"{stem}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
