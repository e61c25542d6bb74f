"""``make demo``: the main job, end to end on this machine.

Builds a GRU decoder (192 channels -> 2 x 256 GRU -> 32 log-probs) and an MLP policy
(40 -> 256 -> 256 -> 8), exports both to verified bundles (ONNX with parity checked),
runs each step on torch eager, ONNX Runtime and the Numba backend, back to back and
inside the real-time loop at 50 Hz, runs the loop at 1 kHz and 50 Hz, and prints the
latency table. The full measurement is ``closedloop bench`` (minutes).
"""

from __future__ import annotations

import sys

from .benchmark import SpineBenchConfig, run_spine_benchmark


def main() -> int:
    print("closedloop demo: export a GRU decoder and an MLP policy, run them in the real-time loop\n")
    cfg = SpineBenchConfig.quick()
    run_spine_benchmark(cfg)
    print(
        f"\nbundles kept in {cfg.bundle_dir}/: try  .venv/bin/closedloop inspect {cfg.bundle_dir}/gru"
        f"   or  .venv/bin/closedloop run {cfg.bundle_dir}/mlp --duration 3"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
