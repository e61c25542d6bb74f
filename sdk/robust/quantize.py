"""Int8 weights whose blocks keep the zero-sum constraints *exactly*.

Rounding ``w / s`` to integers breaks ``sum q = 0`` and ``sum j q = 0`` by a few
units. ``quantize_blocks`` corrects that per block, cheapest first: single ``+-1``
moves on the members whose rounding residual points the right way fix the sum, then
pair moves (``+1`` at ``a``, ``-1`` at ``b``, which keep the sum and change the
index-weighted sum by ``a - b``) fix the second constraint. Every move costs at most
one quantization step on one weight, and both sums come out exactly zero, so at run
time every int8 bit flip (a change of ``+-2^b``) is seen and located exactly.

``int8_weight_only`` rewrites an fp32 ONNX graph so each protected weight is stored
as int8 with one float scale per tensor and a ``DequantizeLinear`` in front of its
consumers (weight-only quantization: activations stay float).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def _fix_block(x, q, idx, m):
    s0 = 0
    s1 = 0
    for j in range(m):
        s0 += q[idx[j]]
        s1 += j * q[idx[j]]
    # 1. the sum: move |s0| members by -sign(s0), those whose residual points that way first
    step = -1 if s0 > 0 else 1
    while s0 != 0:
        best, bj = 1e30, -1
        for j in range(m):
            v = q[idx[j]] + step
            if v < -127 or v > 127:
                continue
            c = (v - x[idx[j]]) ** 2 - (q[idx[j]] - x[idx[j]]) ** 2
            if c < best:
                best, bj = c, j
        q[idx[bj]] += step
        s0 += step
        s1 += step * bj
    # 2. the index-weighted sum: pair moves (+1 at a, -1 at b) change it by a - b
    for _ in range(4 * m):
        if s1 == 0:
            break
        best, ba, bb, bd = 1e30, -1, -1, 0
        for a in range(m):
            for b in range(m):
                d = a - b
                if a == b or abs(s1 + d) >= abs(s1):
                    continue
                qa, qb = q[idx[a]] + 1, q[idx[b]] - 1
                if qa > 127 or qb < -127:
                    continue
                c = ((qa - x[idx[a]]) ** 2 - (qa - 1 - x[idx[a]]) ** 2
                     + (qb - x[idx[b]]) ** 2 - (qb + 1 - x[idx[b]]) ** 2)
                key = abs(s1 + d) * 16.0 + c  # closest to zero first, then the cheapest
                if key < best:
                    best, ba, bb, bd = key, a, b, d
        if ba < 0:
            break
        q[idx[ba]] += 1
        q[idx[bb]] -= 1
        s1 += bd
    return s0 == 0 and s1 == 0


@njit(cache=True)
def _quantize(x, pos):
    q = np.empty(x.size, dtype=np.int64)
    for i in range(x.size):
        q[i] = min(127, max(-127, int(np.round(x[i]))))
    bad = 0
    for b in range(pos.shape[0]):
        m = 0
        for j in range(pos.shape[1]):
            if pos[b, j] >= 0:
                m += 1
        if not _fix_block(x, q, pos[b], m):
            bad += 1
    return q, bad


def quantize_blocks(w: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, float]:
    """Symmetric per-tensor int8 (scale ``max|w| / 127``) with every block's two sums exactly zero.

    ``w`` must already satisfy the constraints in float (a finalized protected weight).
    Returns ``(q, scale)`` with ``q`` int8 in ``w``'s shape; ``q * scale`` approximates ``w``.
    """
    flat = np.asarray(w, dtype=np.float64).reshape(-1)
    top = float(np.max(np.abs(flat))) if flat.size else 0.0
    # A little headroom so correction moves rarely hit the +-127 clip.
    scale = top / 120.0 if top > 0 else 1.0
    q, bad = _quantize(flat / scale, np.ascontiguousarray(pos, dtype=np.int64))
    if bad:
        raise ValueError(f"{bad} block(s) could not be made exactly zero-sum in int8; use a larger block size")
    return q.astype(np.int8).reshape(np.shape(w)), scale


def int8_weight_only(fp32_onnx: bytes, weights: dict[str, tuple[np.ndarray, float]]) -> bytes:
    """Replace each named fp32 initializer by ``DequantizeLinear(name + '_q', name + '_scale')``."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load_from_string(fp32_onnx)
    g = model.graph
    keep = [t for t in g.initializer if t.name not in weights]
    del g.initializer[:]
    g.initializer.extend(keep)
    nodes = []
    for name, (q, scale) in weights.items():
        g.initializer.extend([
            numpy_helper.from_array(np.asarray(q, dtype=np.int8), name + "_q"),
            numpy_helper.from_array(np.asarray(scale, dtype=np.float32), name + "_scale"),
            numpy_helper.from_array(np.asarray(0, dtype=np.int8), name + "_zero"),
        ])
        nodes.append(helper.make_node("DequantizeLinear", [name + "_q", name + "_scale", name + "_zero"], [name],
                                      name=f"dequantize_{name}"))
    inputs = [i for i in g.input if i.name not in weights]
    del g.input[:]
    g.input.extend(inputs)
    rest = list(g.node)
    del g.node[:]
    g.node.extend(nodes + rest)
    onnx.checker.check_model(model)
    return model.SerializeToString()
