"""The Numba backend's kernels over N-d activations: data movement, broadcasting, reductions,
normalisation and activation-by-activation products.

Part of the torch-free runtime; ``closedloop.runtime.kernels.run_plan`` calls these.
An N-d activation is stored row-major and contiguous; the planner
(``closedloop.runtime.backends._numba_plan``) hands each kernel a flat view of it
(shape ``(1, size)``) and a geometry ``g``: a slice of the plan row with sizes and
element strides, already merged to as few axes as possible and checked to stay
inside every array. So one strided copy serves Transpose, Slice with steps, Gather,
Concat, Split and Expand, and one broadcasting loop serves every element-wise op of
two activations. Inner loops run over slices indexed from 0: Numba checks a
computed index for wrap-around (negative indices), and that check alone kept LLVM
from vectorising them (14x slower loops). Nothing here allocates.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .kernels_act import JIT
from .kernels_dense import LANES, matmul_rows

# Element-wise ops of two activations (OP_BINARY).
BIN_ADD = 0
BIN_SUB = 1
BIN_MUL = 2
BIN_DIV = 3
BIN_POW = 4
BIN_MAX = 5
BIN_MIN = 6
# comparisons: 1.0 where true, 0.0 where false (a boolean tensor is kept as float32 zeros and ones; NaN compares
# false, and not-equal true, as in IEEE arithmetic and ONNX)
BIN_GREATER = 7
BIN_LESS = 8
BIN_EQUAL = 9
BIN_GREATER_EQUAL = 10
BIN_LESS_EQUAL = 11
BIN_NOT_EQUAL = 12
BIN_FMOD = 13  # C's fmod: the sign of the dividend (ONNX Mod, fmod=1; torch.fmod)
BIN_MOD = 14  # the sign of the divisor (ONNX Mod, fmod=0; Python's %)

# Reductions (OP_REDUCE).
RED_MEAN = 0
RED_SUM = 1
RED_MAX = 2
RED_MIN = 3
RED_SUM_SQUARE = 4
RED_L1 = 5
RED_L2 = 6



@njit(**JIT)
def strided_copy(x, y, g):
    """``y[yb + sum(i_k ys_k)] = x[xb + sum(i_k xs_k)]`` over 4 axes; ``g = [xb, yb, n0..n3, xs0..xs3, ys0..ys3]``."""
    xf, yf = x[0], y[0]
    xb, yb = g[0], g[1]
    n0, n1, n2, n3 = g[2], g[3], g[4], g[5]
    xs0, xs1, xs2, xs3 = g[6], g[7], g[8], g[9]
    ys0, ys1, ys2, ys3 = g[10], g[11], g[12], g[13]
    for a in range(n0):
        for b in range(n1):
            for c in range(n2):
                xo = xb + a * xs0 + b * xs1 + c * xs2
                yo = yb + a * ys0 + b * ys1 + c * ys2
                if xs3 == 1 and ys3 == 1:
                    xr, yr = xf[xo : xo + n3], yf[yo : yo + n3]
                    for d in range(n3):
                        yr[d] = xr[d]
                elif ys3 == 1 and xs3 > 0:
                    xr, yr = xf[xo : xo + (n3 - 1) * xs3 + 1 : xs3], yf[yo : yo + n3]
                    for d in range(n3):
                        yr[d] = xr[d]
                else:
                    for d in range(n3):
                        yf[yo + d * ys3] = xf[xo + d * xs3]


@njit(inline="always", **JIT)
def _bin(op, u, v):
    if op == BIN_SUB:
        return u - v
    if op == BIN_DIV:
        return u / v
    if op == BIN_POW:
        return u**v
    if op == BIN_MAX:
        return u if (u > v or u != u) else v  # NaN wins, as in torch
    if op == BIN_MIN:
        return u if (u < v or u != u) else v
    if op == BIN_MUL:
        return u * v
    if op == BIN_FMOD:
        return np.fmod(u, v)
    if op == BIN_MOD:
        r = np.fmod(u, v)
        return r + v if r != 0 and (r < 0) != (v < 0) else r
    if op >= BIN_GREATER:
        if op == BIN_GREATER:
            t = u > v
        elif op == BIN_LESS:
            t = u < v
        elif op == BIN_EQUAL:
            t = u == v
        elif op == BIN_GREATER_EQUAL:
            t = u >= v
        elif op == BIN_LESS_EQUAL:
            t = u <= v
        else:
            t = u != v
        return np.float32(1.0) if t else np.float32(0.0)
    return u + v


@njit(**JIT)
def binary(a, b, y, g):
    """``y = a op b`` with broadcasting over 3 axes; ``g = [op, n0, n1, n2, as0, as1, as2, bs0, bs1, bs2]``.

    ``y`` is contiguous; a zero stride broadcasts that operand along the axis. Add and
    Mul of rows (residual sums, gates) have loops of their own that LLVM vectorises;
    the other ops share one loop with the op switch inside.
    """
    af, bf, yf = a[0], b[0], y[0]
    op = g[0]
    n0, n1, n2 = g[1], g[2], g[3]
    as0, as1, sa = g[4], g[5], g[6]
    bs0, bs1, sb = g[7], g[8], g[9]
    same = sa == 1 and sb == 1
    for i in range(n0):
        for j in range(n1):
            ao, bo = i * as0 + j * as1, i * bs0 + j * bs1
            ar, br = af[ao : ao + (n2 - 1) * sa + 1], bf[bo : bo + (n2 - 1) * sb + 1]
            yr = yf[(i * n1 + j) * n2 : (i * n1 + j + 1) * n2]
            if same and op == BIN_ADD:
                for k in range(n2):
                    yr[k] = ar[k] + br[k]
            elif same and op == BIN_MUL:
                for k in range(n2):
                    yr[k] = ar[k] * br[k]
            elif same:
                for k in range(n2):
                    yr[k] = _bin(op, ar[k], br[k])
            else:
                for k in range(n2):
                    yr[k] = _bin(op, ar[k * sa], br[k * sb])


@njit(**JIT)
def where(c, a, b, y, g):
    """``y = a if c != 0 else b`` with broadcasting over 3 axes; ``g = [n0, n1, n2, cs0..cs2, as0..as2, bs0..bs2]``.

    A select, not arithmetic: the value not taken never reaches ``y`` (an ``-inf`` fill or a NaN on the other
    side stays where it is). ``y`` is contiguous; a zero stride broadcasts that operand along the axis.
    """
    cf, af, bf, yf = c[0], a[0], b[0], y[0]
    n0, n1, n2 = g[0], g[1], g[2]
    cs0, cs1, sc = g[3], g[4], g[5]
    as0, as1, sa = g[6], g[7], g[8]
    bs0, bs1, sb = g[9], g[10], g[11]
    for i in range(n0):
        for j in range(n1):
            co, ao, bo = i * cs0 + j * cs1, i * as0 + j * as1, i * bs0 + j * bs1
            cr = cf[co : co + (n2 - 1) * sc + 1]
            ar, br = af[ao : ao + (n2 - 1) * sa + 1], bf[bo : bo + (n2 - 1) * sb + 1]
            yr = yf[(i * n1 + j) * n2 : (i * n1 + j + 1) * n2]
            for k in range(n2):
                yr[k] = ar[k * sa] if cr[k * sc] != 0 else br[k * sb]


@njit(inline="always", **JIT)
def _beats(largest, v, w):
    return v > w if largest else v < w


@njit(**JIT)
def topk(x, y, g):
    """``y[o, j, i]``: the ``j``-th largest (or smallest) of ``x[o, :, i]``, ``j < k``, in order;
    ``g = [outer, n, inner, k, largest]``.

    An insertion into the ``k`` places kept so far (``k`` is small where a model takes a top-k); equal values keep
    their order along the axis.
    """
    xf, yf = x[0], y[0]
    outer, n, inner, k, largest = g[0], g[1], g[2], g[3], g[4]
    for o in range(outer):
        for i in range(inner):
            xb, yb = o * n * inner + i, o * k * inner + i
            held = 0
            for t in range(n):
                v = xf[xb + t * inner]
                if held == k and not _beats(largest, v, yf[yb + (k - 1) * inner]):
                    continue
                j = held if held < k else k - 1
                while j > 0 and _beats(largest, v, yf[yb + (j - 1) * inner]):
                    yf[yb + j * inner] = yf[yb + (j - 1) * inner]
                    j -= 1
                yf[yb + j * inner] = v
                if held < k:
                    held += 1


@njit(**JIT)
def arg_extreme(x, y, g):
    """``y[o, i]``: the index (as a float) of the largest (or smallest) of ``x[o, :, i]``; the first one where values
    tie, or the last; ``g = [outer, n, inner, largest, last]``. A NaN is never taken over a number."""
    xf, yf = x[0], y[0]
    outer, n, inner, largest, last = g[0], g[1], g[2], g[3], g[4]
    for o in range(outer):
        for i in range(inner):
            xb = o * n * inner + i
            best, at = xf[xb], 0
            for t in range(1, n):
                v = xf[xb + t * inner]
                if _beats(largest, v, best) or (last and v == best) or (best != best and v == v):
                    best, at = v, t
            yf[o * inner + i] = np.float32(at)


@njit(inline="always", **JIT)
def _red_in(op, v):
    if op == RED_SUM_SQUARE or op == RED_L2:
        return v * v
    if op == RED_L1:
        return np.abs(v)
    return v


@njit(inline="always", **JIT)
def _red_add(op, acc, v):
    if op == RED_MAX:
        return v if (v > acc or v != v) else acc
    if op == RED_MIN:
        return v if (v < acc or v != v) else acc
    return acc + v


@njit(**JIT)
def reduce(x, y, g):
    """``y[o, i] = reduce_k x[o, k, i]``; ``g = [op, outer, n, inner]``."""
    xf, yf = x[0], y[0]
    op, outer, n, inner = g[0], g[1], g[2], g[3]
    for o in range(outer):
        yr = yf[o * inner : (o + 1) * inner]
        xo = xf[o * n * inner : (o + 1) * n * inner]
        if inner == 1:
            acc = _red_in(op, xo[0])
            for k in range(1, n):
                acc = _red_add(op, acc, _red_in(op, xo[k]))
            yr[0] = acc
        else:
            for i in range(inner):
                yr[i] = _red_in(op, xo[i])
            for k in range(1, n):
                xr = xo[k * inner : (k + 1) * inner]
                for i in range(inner):
                    yr[i] = _red_add(op, yr[i], _red_in(op, xr[i]))
    if op == RED_MEAN or op == RED_L2:
        inv = np.float32(1.0) / np.float32(n)
        for o in range(outer * inner):
            yf[o] = yf[o] * inv if op == RED_MEAN else np.sqrt(yf[o])


@njit(**JIT)
def layer_norm(x, scale, shift, y, eps):
    """``y = (x - mean) / sqrt(var + eps) * scale + shift`` over each row (two passes, as ONNX Runtime)."""
    rows, n = x.shape
    inv_n = np.float32(1.0) / np.float32(n)
    e = np.float32(eps)
    for i in range(rows):
        mean = np.float32(0.0)
        for j in range(n):
            mean += x[i, j]
        mean *= inv_n
        var = np.float32(0.0)
        for j in range(n):
            d = x[i, j] - mean
            var += d * d
        inv = np.float32(1.0) / np.sqrt(var * inv_n + e)
        for j in range(n):
            y[i, j] = (x[i, j] - mean) * inv * scale[0, j] + shift[0, j]


@njit(**JIT)
def batched_matmul(a, b, bias, y, packed, alpha, lanes, g):
    """``y[i] = alpha a[i] @ b[i] + bias`` for ``i < count``; ``g = [count, m, k, n, a_step, b_step, trans_b]``.

    ``a`` is ((count or 1) * m, k) and ``y`` (count * m, n): ``a[i]`` starts at row
    ``i * m`` (row 0 when ``a_step`` is 0, broadcast). ``b[i]`` is the (k, n) matrix at
    element ``i * b_step`` of the flat ``b`` (a step of 0 broadcasts), read as (n, k)
    transposed when ``trans_b``. Each ``b[i]`` is first laid out in weight panels in
    ``packed`` ((n / LANES, k * LANES) scratch), then multiplied like a dense layer:
    the attention products of a small transformer have 8 or 32 columns, too short
    for LLVM to vectorise a plain loop over them (5-7x slower).
    """
    bf = b[0]
    count, m, k, n, a_step, b_step, trans_b = g[0], g[1], g[2], g[3], g[4], g[5], g[6]
    blocks = packed.shape[0]
    if packed.shape[1] != k * LANES or blocks * LANES < n or a.shape[1] != k or y.shape[0] != count * m:
        raise ValueError("batched_matmul: operands and scratch do not fit the geometry")
    for i in range(count):
        if i == 0 or b_step != 0:
            bo = i * b_step
            for blk in range(blocks):
                row = packed[blk]
                for lane in range(LANES):
                    c = blk * LANES + lane
                    if c < n:
                        if trans_b:
                            for q in range(k):
                                row[q * LANES + lane] = alpha * bf[bo + c * k + q]
                        else:
                            for q in range(k):
                                row[q * LANES + lane] = alpha * bf[bo + q * n + c]
                    else:
                        for q in range(k):
                            row[q * LANES + lane] = 0.0
        matmul_rows(a, i * m if a_step else 0, packed, bias, y, i * m, m, lanes, False)


# every kernel module's digest, so that an edit to any of them refreshes Numba's cache of all
# (tools/kernel_digest.py says why)
KERNEL_SOURCES = "a3cfee55bd35693b"
