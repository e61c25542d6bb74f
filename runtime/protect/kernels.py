"""The weight scrubber's Numba kernels: the keyed block permutation and the block scan.

Plain Python functions here, compiled with ``njit(cache=True)`` on first use by
``kernels()``: importing the runtime must not import numba (which pulls in scipy) until
a protected bundle is scrubbed. Used by ``closedloop.runtime.protect.layout`` (the permutation
behind keyed block membership) and ``closedloop.runtime.protect.scrubber`` (the scans); see that module.
"""

from __future__ import annotations

import numpy as np


def _window_permutation(n: int, window: int, seed: np.uint64) -> np.ndarray:
    """Fisher-Yates inside each window of ``window`` elements, driven by splitmix64 (version-stable)."""
    perm = np.arange(n)
    state = np.uint64(seed)
    for start in range(0, n, window):
        size = min(window, n - start)
        for i in range(size - 1, 0, -1):
            state += np.uint64(0x9E3779B97F4A7C15)
            z = state
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            z = z ^ (z >> np.uint64(31))
            j = int(z % np.uint64(i + 1))
            a = perm[start + i]
            perm[start + i] = perm[start + j]
            perm[start + j] = a
    return perm


def _scan(words, table, pos, seg, tol0, tol1, ref0, ref1, b0, b1, out):
    """Indices of blocks in [b0, b1) whose syndromes exceed their tensor's tolerances.

    ``words`` are the weights themselves (float32, int8) when ``table`` is empty, or float16
    weights read as uint16 words and decoded through ``table`` (65536 entries). The branch is
    the same every element, so it costs nothing measurable (timed against one kernel per dtype).
    ``ref0``/``ref1`` are each block's clean sums: zero for a constrained block, stored for a
    guarded one (docs/robustness.md).
    """
    n = 0
    k = pos.shape[1]
    decode = table.size > 0
    for t in range(seg.size - 1):
        a, c = tol0[t], tol1[t]
        for b in range(max(seg[t], b0), min(seg[t + 1], b1)):
            s0 = 0.0
            s1 = 0.0
            for j in range(k):
                p = pos[b, j]
                if p >= 0:
                    v = float(table[int(words[p])]) if decode else float(words[p])
                    s0 += v
                    s1 += j * v
            if not (abs(s0 - ref0[b]) <= a and abs(s1 - ref1[b]) <= c):  # NaN fails too
                if n < out.size:
                    out[n] = b
                n += 1
    return n


_KERNELS: dict = {}


def kernels() -> dict:
    """The Numba-compiled kernels, compiled (or loaded from cache) on first use: importing the runtime
    must not import numba (which pulls in scipy) until a kernel is needed."""
    if not _KERNELS:
        from numba import njit

        _KERNELS["permutation"] = njit(cache=True)(_window_permutation)
        _KERNELS["scan"] = njit(cache=True, nogil=True)(_scan)
    return _KERNELS

