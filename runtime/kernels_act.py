"""Element-wise math of the Numba kernels: the shared JIT flags, vectorisable tanh, sigmoid, erf
and exp, and the activations the plan applies (alone, or fused into a dense or convolution step).

Part of the torch-free runtime (``closedloop.runtime.kernels`` runs the plans). libm's
``tanhf``/``expf``/``erff`` are scalar calls that LLVM cannot vectorise (no SVML here),
so each has a polynomial or rational approximation written so that LLVM can; their
errors (at most 4.2e-7 absolute, 8.2e-8 relative for exp) are far below what a
float32 model's outputs carry. NaN stays NaN through every one of them, so the
runtime's guards see a bad input. Nothing here allocates.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

# fastmath without nnan/ninf: reassociation is what lets LLVM vectorise sums, while
# NaN and inf must keep their meaning so a NaN input shows up as NaN outputs (which
# the runtime's guards catch) rather than as plausible numbers. error_model="numpy":
# no ZeroDivisionError check on float division, whose branch would stop LLVM from
# vectorising every loop that divides.
FASTMATH = {"reassoc", "contract", "arcp", "nsz", "afn"}
JIT: dict[str, Any] = {"cache": True, "fastmath": FASTMATH, "nogil": True, "error_model": "numpy"}

# Activation codes (fused into DENSE and CONV, or applied alone by ACT with two
# float parameters alpha, beta). Row-wise ones (softmax) act on each row as a whole.
ACT_NONE = 0
ACT_RELU = 1
ACT_TANH = 2
ACT_SIGMOID = 3
ACT_SOFTMAX = 4
ACT_LOG_SOFTMAX = 5
ACT_ERF = 6
ACT_GELU = 7  # exact: x Phi(x)
ACT_GELU_TANH = 8
ACT_SQRT = 9
ACT_EXP = 10
ACT_LOG = 11
ACT_ABS = 12
ACT_RECIPROCAL = 13
ACT_LEAKY_RELU = 14  # alpha: negative slope
ACT_ELU = 15  # alpha
ACT_CLIP = 16  # alpha: min, beta: max
ACT_POW = 17  # alpha: exponent
ACT_SQUARE = 18
ACT_SOFTPLUS = 19
ACT_HARD_SIGMOID = 20  # alpha * x + beta, clipped to [0, 1]
ACT_HARD_SWISH = 21
ACT_SIGN = 22
ACT_SIN = 23
ACT_COS = 24
ACT_TAN = 25
ACT_ASIN = 26
ACT_ACOS = 27
ACT_ATAN = 28
ACT_FLOOR = 29
ACT_CEIL = 30
ACT_ROUND = 31  # half to even, as ONNX Round
ACT_SOFTSIGN = 32

@intrinsic
def _float_from_bits(typingctx, bits):
    """The float32 whose IEEE bits are the low 32 bits of the integer ``bits`` (a bitcast LLVM vectorises)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        low = builder.trunc(args[0], ir.IntType(32)) if getattr(bits, "bitwidth", 32) > 32 else args[0]
        return builder.bitcast(low, ir.FloatType())

    return types.float32(bits), codegen


@njit(inline="always", **JIT)
def fast_tanh(x):
    """tanh as an odd rational function ``x P(x^2) / Q(x^2)`` clamped at +-9: max error 3.3e-7.

    libm's ``tanhf``/``expf`` are scalar calls that LLVM cannot vectorise (no SVML
    here): they made the GRU gate loop 9x slower than this. Beyond +-9, where
    ``1 - tanh`` is below 3e-8, the result saturates at +-(1 - 6e-8); it never
    exceeds 1 in magnitude.
    """
    # Near-minimax fit on [0, 9] by tools/fit_tanh.py (Loeb's method with Lawson's
    # weights): 1.9e-8 in float64; max abs error of this float32 evaluation against
    # float64 tanh over [-10, 10] and +-inf: 3.3e-7 without FMA, 3.1e-7 compiled here
    # (float32 rounding dominates).
    c = np.float32(9.0)
    x = c if x > c else x  # comparisons, not min/max: a NaN must stay NaN
    x = -c if x < -c else x
    x2 = x * x
    p = np.float32(1.3184214e-08)
    p = p * x2 + np.float32(2.0471824e-05)
    p = p * x2 + np.float32(0.0034865814)
    p = p * x2 + np.float32(0.13373198)
    p = p * x2 + np.float32(0.9999999)
    q = np.float32(7.7026596e-07)
    q = q * x2 + np.float32(0.00032713846)
    q = q * x2 + np.float32(0.025841977)
    q = q * x2 + np.float32(0.46706495)
    q = q * x2 + np.float32(1.0)
    y = x * p / q
    one = np.float32(1.0)
    y = one if y > one else y  # rounding can overshoot by 2e-7: keep |tanh| <= 1, sigmoid in [0, 1]
    return -one if y < -one else y


@njit(inline="always", **JIT)
def fast_sigmoid(x):
    """The logistic function as ``(1 + tanh(x / 2)) / 2``: max error 1.9e-7, vectorisable."""
    half = np.float32(0.5)
    return half * fast_tanh(half * x) + half


@njit(inline="always", **JIT)
def fast_erf(x):
    """erf as an odd rational function clamped at +-4 (Eigen's float erf): max abs error 4.2e-7."""
    c = np.float32(4.0)
    x = c if x > c else x  # NaN stays NaN
    x = -c if x < -c else x
    x2 = x * x
    p = np.float32(-2.72614225801306e-10)
    p = p * x2 + np.float32(2.77068142495902e-08)
    p = p * x2 + np.float32(-2.10102402082508e-06)
    p = p * x2 + np.float32(-5.69250639462346e-05)
    p = p * x2 + np.float32(-7.34990630326855e-04)
    p = p * x2 + np.float32(-2.95459980854025e-03)
    p = p * x2 + np.float32(-1.60960333262415e-02)
    q = np.float32(-1.45660718464996e-05)
    q = q * x2 + np.float32(-2.13374055278905e-04)
    q = q * x2 + np.float32(-1.68282697438203e-03)
    q = q * x2 + np.float32(-7.37332916720468e-03)
    q = q * x2 + np.float32(-1.42647390514189e-02)
    y = x * p / q
    one = np.float32(1.0)
    y = one if y > one else y
    return -one if y < -one else y


@njit(inline="always", **JIT)
def fast_exp(x):
    """exp with Cephes' range reduction and polynomial, scaled by 2^n through the exponent bits.

    Max relative error 8.2e-8 on [-87, 88]; below -87.3 it returns 1.2e-38 (not 0),
    above 88.7 inf. Vectorisable, unlike libm's ``expf``; NaN stays NaN.
    """
    hi, lo = np.float32(88.72283), np.float32(-87.33654)
    x = hi if x > hi else x
    x = lo if x < lo else x
    n = np.floor(x * np.float32(1.44269504) + np.float32(0.5))
    n = n if n == n else np.float32(0.0)  # NaN: keep the int conversion defined; r carries the NaN
    r = x - n * np.float32(0.693359375) - n * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    y = p * r * r + r + np.float32(1.0)
    return y * _float_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))  # type: ignore[call-arg]


# One element function per activation, each ``f(v, alpha, beta)``, inlined into its own loop in ``apply_act``.
@njit(inline="always", **JIT)
def _relu(v, a, b):
    return np.float32(0.0) if v <= np.float32(0.0) else v  # NaN passes through, as in torch


@njit(inline="always", **JIT)
def _tanh(v, a, b):
    return fast_tanh(v)


@njit(inline="always", **JIT)
def _sigmoid(v, a, b):
    return fast_sigmoid(v)


@njit(inline="always", **JIT)
def _erf(v, a, b):
    return fast_erf(v)


@njit(inline="always", **JIT)
def _gelu(v, a, b):
    return np.float32(0.5) * v * (np.float32(1.0) + fast_erf(v * np.float32(0.70710678)))


@njit(inline="always", **JIT)
def _gelu_tanh(v, a, b):
    u = np.float32(0.7978845608) * (v + np.float32(0.044715) * v * v * v)
    return np.float32(0.5) * v * (np.float32(1.0) + fast_tanh(u))


@njit(inline="always", **JIT)
def _sqrt(v, a, b):
    return np.sqrt(v)


@njit(inline="always", **JIT)
def _exp(v, a, b):
    return fast_exp(v)


@njit(inline="always", **JIT)
def _log(v, a, b):
    return np.log(v)


@njit(inline="always", **JIT)
def _abs(v, a, b):
    return np.abs(v)


@njit(inline="always", **JIT)
def _reciprocal(v, a, b):
    return np.float32(1.0) / v


@njit(inline="always", **JIT)
def _leaky_relu(v, a, b):
    return v if v >= np.float32(0.0) else a * v


@njit(inline="always", **JIT)
def _elu(v, a, b):
    return v if v > np.float32(0.0) else a * (fast_exp(v) - np.float32(1.0))


@njit(inline="always", **JIT)
def _clip(v, a, b):
    v = a if v < a else v  # comparisons keep NaN
    return b if v > b else v


@njit(inline="always", **JIT)
def _pow(v, a, b):
    return v**a


@njit(inline="always", **JIT)
def _square(v, a, b):
    return v * v


@njit(inline="always", **JIT)
def _sign(v, a, b):
    return np.float32(1.0) if v > 0 else np.float32(-1.0) if v < 0 else v  # 0 and NaN pass through


@njit(inline="always", **JIT)
def _sin(v, a, b):
    return np.sin(v)


@njit(inline="always", **JIT)
def _cos(v, a, b):
    return np.cos(v)


@njit(inline="always", **JIT)
def _tan(v, a, b):
    return np.tan(v)


@njit(inline="always", **JIT)
def _asin(v, a, b):
    return np.arcsin(v)


@njit(inline="always", **JIT)
def _acos(v, a, b):
    return np.arccos(v)


@njit(inline="always", **JIT)
def _atan(v, a, b):
    return np.arctan(v)


@njit(inline="always", **JIT)
def _floor(v, a, b):
    return np.floor(v)


@njit(inline="always", **JIT)
def _ceil(v, a, b):
    return np.ceil(v)


@njit(inline="always", **JIT)
def _round(v, a, b):
    return np.rint(v)


@njit(inline="always", **JIT)
def _softsign(v, a, b):
    return v / (np.float32(1.0) + np.abs(v))


@njit(inline="always", **JIT)
def _softplus(v, a, b):
    return v if v > np.float32(20.0) else np.log1p(fast_exp(v))


@njit(inline="always", **JIT)
def _hard_sigmoid(v, a, b):
    return _clip(a * v + b, np.float32(0.0), np.float32(1.0))


@njit(inline="always", **JIT)
def _hard_swish(v, a, b):
    return v * _clip(a * v + b, np.float32(0.0), np.float32(1.0))


@njit(inline="always", **JIT)
def _bigger(a, b):
    return a if a > b else b


@njit(inline="always", **JIT)
def _row_max(r, n):
    """The largest of ``r[:n]`` with eight independent chains (one chain of selects is latency-bound, 5x slower).

    A NaN may or may not win; the softmax that uses it turns any NaN in the row into NaN outputs anyway.
    """
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = r[0]
    j = 0
    while j + 8 <= n:
        m0 = _bigger(m0, r[j])
        m1 = _bigger(m1, r[j + 1])
        m2 = _bigger(m2, r[j + 2])
        m3 = _bigger(m3, r[j + 3])
        m4 = _bigger(m4, r[j + 4])
        m5 = _bigger(m5, r[j + 5])
        m6 = _bigger(m6, r[j + 6])
        m7 = _bigger(m7, r[j + 7])
        j += 8
    while j < n:
        m0 = _bigger(m0, r[j])
        j += 1
    return _bigger(_bigger(_bigger(m0, m1), _bigger(m2, m3)), _bigger(_bigger(m4, m5), _bigger(m6, m7)))


@njit(**JIT)
def _softmax_rows(x, y):
    """Softmax of each row (its own function: a log-softmax branch in the same loop nest halved its speed)."""
    rows, n = x.shape
    for i in range(rows):
        r = x[i]
        top = _row_max(r, n)
        total = np.float32(0.0)
        out = y[i]  # taken after the max: taken before, the loops below ran 1.5x slower
        for j in range(n):
            e = fast_exp(r[j] - top)
            out[j] = e
            total += e
        inv = np.float32(1.0) / total
        for j in range(n):
            out[j] *= inv


@njit(**JIT)
def _log_softmax_rows(x, y):
    rows, n = x.shape
    for i in range(rows):
        r, out = x[i], y[i]
        top = _row_max(r, n)
        total = np.float32(0.0)
        for j in range(n):
            total += fast_exp(r[j] - top)
        shift = top + np.log(total)
        for j in range(n):
            out[j] = r[j] - shift


@njit(**JIT)
def apply_act(x, y, act, alpha, beta):
    """``y = act(x)`` with the activation's parameters; ``x`` and ``y`` may be the same array.

    One loop per activation, written out: a switch inside one shared loop keeps LLVM
    from vectorising it, and passing the element function as an argument would
    stop Numba from caching the compiled plan runner.
    """
    rows, n = x.shape
    a, b = np.float32(alpha), np.float32(beta)
    if act == ACT_RELU:
        for i in range(rows):
            for j in range(n):
                y[i, j] = _relu(x[i, j], a, b)
    elif act == ACT_TANH:
        for i in range(rows):
            for j in range(n):
                y[i, j] = _tanh(x[i, j], a, b)
    elif act == ACT_SIGMOID:
        for i in range(rows):
            for j in range(n):
                y[i, j] = _sigmoid(x[i, j], a, b)
    elif act == ACT_SOFTMAX:
        _softmax_rows(x, y)
    elif act == ACT_LOG_SOFTMAX:
        _log_softmax_rows(x, y)
    elif act == ACT_ERF:
        for i in range(rows):
            for j in range(n):
                y[i, j] = _erf(x[i, j], a, b)
    elif act == ACT_GELU:
        for i in range(rows):
            for j in range(n):
                y[i, j] = _gelu(x[i, j], a, b)
    elif act == ACT_GELU_TANH:
        for i in range(rows):
            for j in range(n):
                y[i, j] = _gelu_tanh(x[i, j], a, b)
    elif act == ACT_SQRT:
        for i in range(rows):
            for j in range(n):
                y[i, j] = _sqrt(x[i, j], a, b)
    elif act == ACT_EXP:
        for i in range(rows):
            for j in range(n):
                y[i, j] = _exp(x[i, j], a, b)
    elif act == ACT_LOG:
        for i in range(rows):
            for j in range(n):
                y[i, j] = _log(x[i, j], a, b)
    elif act == ACT_ABS:
        for i in range(rows):
            for j in range(n):
                y[i, j] = _abs(x[i, j], a, b)
    elif act == ACT_RECIPROCAL:
        for i in range(rows):
            for j in range(n):
                y[i, j] = _reciprocal(x[i, j], a, b)
    elif act == ACT_LEAKY_RELU:
        for i in range(rows):
            for j in range(n):
                y[i, j] = _leaky_relu(x[i, j], a, b)
    elif act == ACT_ELU:
        for i in range(rows):
            for j in range(n):
                y[i, j] = _elu(x[i, j], a, b)
    elif act == ACT_CLIP:
        for i in range(rows):
            for j in range(n):
                y[i, j] = _clip(x[i, j], a, b)
    elif act == ACT_POW:
        for i in range(rows):
            for j in range(n):
                y[i, j] = _pow(x[i, j], a, b)
    elif act == ACT_SQUARE:
        for i in range(rows):
            for j in range(n):
                y[i, j] = _square(x[i, j], a, b)
    elif act == ACT_SOFTPLUS:
        for i in range(rows):
            for j in range(n):
                y[i, j] = _softplus(x[i, j], a, b)
    elif act == ACT_HARD_SIGMOID:
        for i in range(rows):
            for j in range(n):
                y[i, j] = _hard_sigmoid(x[i, j], a, b)
    elif act == ACT_HARD_SWISH:
        for i in range(rows):
            for j in range(n):
                y[i, j] = _hard_swish(x[i, j], a, b)
    elif act == ACT_SIGN:
        for i in range(rows):
            for j in range(n):
                y[i, j] = _sign(x[i, j], a, b)
    elif act == ACT_SIN:
        for i in range(rows):
            for j in range(n):
                y[i, j] = _sin(x[i, j], a, b)
    elif act == ACT_COS:
        for i in range(rows):
            for j in range(n):
                y[i, j] = _cos(x[i, j], a, b)
    elif act == ACT_TAN:
        for i in range(rows):
            for j in range(n):
                y[i, j] = _tan(x[i, j], a, b)
    elif act == ACT_ASIN:
        for i in range(rows):
            for j in range(n):
                y[i, j] = _asin(x[i, j], a, b)
    elif act == ACT_ACOS:
        for i in range(rows):
            for j in range(n):
                y[i, j] = _acos(x[i, j], a, b)
    elif act == ACT_ATAN:
        for i in range(rows):
            for j in range(n):
                y[i, j] = _atan(x[i, j], a, b)
    elif act == ACT_FLOOR:
        for i in range(rows):
            for j in range(n):
                y[i, j] = _floor(x[i, j], a, b)
    elif act == ACT_CEIL:
        for i in range(rows):
            for j in range(n):
                y[i, j] = _ceil(x[i, j], a, b)
    elif act == ACT_ROUND:
        for i in range(rows):
            for j in range(n):
                y[i, j] = _round(x[i, j], a, b)
    elif act == ACT_SOFTSIGN:
        for i in range(rows):
            for j in range(n):
                y[i, j] = _softsign(x[i, j], a, b)
    else:
        for i in range(rows):
            for j in range(n):
                y[i, j] = x[i, j]


@njit(**JIT)
def activate(x, y, act):
    """``y = act(x)`` for an activation without parameters; ``x`` and ``y`` may be the same array."""
    apply_act(x, y, act, 0.0, 0.0)


# every kernel module's digest, so that an edit to any of them refreshes Numba's cache of all
# (tools/kernel_digest.py says why)
KERNEL_SOURCES = "a3cfee55bd35693b"
