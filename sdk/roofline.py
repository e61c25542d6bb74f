"""A step's floor on this machine: kept here for the SDK's benchmarks; the code is ``closedloop.runtime.roofline``.

The measurements (single-core peak FLOP/s, read bandwidth from cache and from memory)
and the FLOP counts need no torch, so they live in the runtime, where ``closedloop bench
BUNDLE`` uses them on a board; these names stay importable from ``closedloop.sdk.roofline``.
"""

from __future__ import annotations

from closedloop.runtime.roofline import (
    GraphCost,
    cold_read_bandwidth_gbs,
    graph_cost,
    gru_flops,
    mlp_flops,
    read_bandwidth_gbs,
    single_core_peak_gflops,
)

__all__ = [
    "GraphCost",
    "cold_read_bandwidth_gbs",
    "graph_cost",
    "gru_flops",
    "mlp_flops",
    "read_bandwidth_gbs",
    "single_core_peak_gflops",
]
