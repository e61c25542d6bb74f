"""Bit flips in deployed weights: unprotected vs protected vs protected + scrubbed, for three model families.

    python bench/bench_bitflip.py           # about 14 minutes on 2 cores; writes bench/results/bitflip/
    python bench/bench_bitflip.py --tiny    # about a minute; writes bitflip_tiny.* (not committed)

What is measured and how: the docstring of ``closedloop.sdk.robust.bench`` and docs/robustness.md.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from closedloop.sdk.robust.bench import BitflipBenchConfig, run_bitflip_benchmark
from closedloop.sdk.robust.bench.config import RESULTS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="the minute-long version (outputs *_tiny*, not committed)")
    p.add_argument("--out-dir", default=RESULTS, help=f"results folder (default {RESULTS})")
    p.add_argument("--families", default="bci,observer,policy", help="comma-separated family evaluators to run")
    p.add_argument("--no-timing", action="store_true", help="skip the full-scrub timing")
    p.add_argument("--merge", action="store_true", help="update an existing results file instead of replacing it")
    a = p.parse_args(argv)
    cfg = BitflipBenchConfig.tiny_config(a.out_dir) if a.tiny else BitflipBenchConfig(out_dir=a.out_dir)
    cfg = replace(cfg, families=tuple(a.families.split(",")), timing=not a.no_timing, merge=a.merge)
    run_bitflip_benchmark(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
