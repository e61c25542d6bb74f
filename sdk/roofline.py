"""Measure a step's floor on this machine: single-core peak FLOP/s and read bandwidth.

The floor of a model step is the larger of its FLOPs at the measured single-core
peak and its weight bytes at the measured read bandwidth for a working set of that
size. Peak is measured with a single-threaded float32 GEMM in a subprocess (so the
BLAS thread count can be pinned to one before numpy loads); bandwidth with a Numba
reduction over an array the size of the weights (fastmath, so it vectorises).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

_PEAK_PROBE = r"""
import json, time, numpy as np
n = 512
a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
b = np.random.default_rng(1).standard_normal((n, n)).astype(np.float32)
c = np.empty((n, n), np.float32)
for _ in range(3):
    np.matmul(a, b, out=c)
best = 1e9
for _ in range(15):
    t = time.perf_counter(); np.matmul(a, b, out=c); best = min(best, time.perf_counter() - t)
print(json.dumps({"gflops": 2 * n**3 / best / 1e9}))
"""


def single_core_peak_gflops() -> float:
    """Single-threaded float32 GEMM rate (GFLOP/s), the practical single-core peak."""
    env = dict(os.environ)
    for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS"):
        env[k] = "1"
    out = subprocess.run([sys.executable, "-c", _PEAK_PROBE], env=env, capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["gflops"])


def read_bandwidth_gbs(n_bytes: int, repeats: int = 50) -> float:
    """Read bandwidth (GB/s) for a working set of ``n_bytes`` already in cache when it fits."""
    from numba import njit

    @njit(fastmath=True, cache=False)
    def _sum(a):
        s = np.float32(0.0)
        for i in range(a.size):
            s += a[i]
        return s

    a = np.ones(max(n_bytes // 4, 1024), dtype=np.float32)
    _sum(a)
    best = 1e9
    for _ in range(repeats):
        t = time.perf_counter()
        _sum(a)
        best = min(best, time.perf_counter() - t)
    return a.nbytes / best / 1e9


def cold_read_bandwidth_gbs(n_bytes: int, repeats: int = 30, evict_bytes: int = 96 << 20) -> float:
    """Read bandwidth (GB/s) for ``n_bytes`` that are *not* in cache: each read follows a
    pass over ``evict_bytes`` of other data (larger than the last-level cache), the
    situation of a step that runs once every 20 ms after other work. Median of repeats."""
    from numba import njit

    @njit(fastmath=True, cache=False)
    def _sum(a):
        s = np.float32(0.0)
        for i in range(a.size):
            s += a[i]
        return s

    @njit(cache=False)
    def _scribble(b, v):
        for i in range(0, b.size, 16):
            b[i] = v

    a = np.ones(max(n_bytes // 4, 1024), dtype=np.float32)
    b = np.zeros(evict_bytes // 4, dtype=np.float32)
    _sum(a)
    _scribble(b, 1.0)
    times = []
    for r in range(repeats):
        _scribble(b, float(r))
        t = time.perf_counter()
        _sum(a)
        times.append(time.perf_counter() - t)
    return a.nbytes / float(np.median(times)) / 1e9


def gru_flops(n_in: int, n_hidden: int, n_layers: int, n_out: int) -> int:
    """Multiply-adds counted as 2 FLOPs; gate nonlinearities ignored (small)."""
    flops = 0
    width = n_in
    for _ in range(n_layers):
        flops += 2 * 3 * n_hidden * (width + n_hidden)
        width = n_hidden
    return flops + 2 * n_hidden * n_out


def mlp_flops(sizes: list[int]) -> int:
    return sum(2 * a * b for a, b in zip(sizes[:-1], sizes[1:], strict=False))
