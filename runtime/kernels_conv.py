"""The Numba backend's convolution and pooling kernels, over (batch, channels, height, width).

Part of the torch-free runtime; ``closedloop.runtime.kernels.run_plan`` calls these. A
1-D op runs as 2-D with height 1. A convolution (``conv_panel``) first copies each
batch element into a zero-padded channels-last scratch, where the inputs one output
position meets along a kernel row (all channels, all columns when the dilation is
1) are one contiguous run; the weights of that kernel row are stored in panels
(``kernels_dense.panel_layout``), so each run is one panel product giving 16 output
channels at once, for ``POSITIONS`` output positions per pass of the weights (on
Zen 4 that reaches the AVX-512 FMA limit). A direct loop over short output rows
spent most of its time starting and finishing vector loops (10x slower on a 1-D
CNN). Grouped convolutions (depthwise ones) use the direct loop (``conv_direct``).
Inner loops index with unsigned integers: Numba checks a signed computed index for
wrap-around, and the check keeps LLVM from vectorising. Nothing here allocates.
"""

from __future__ import annotations

import numpy as np
from numba import literally, njit

from .kernels_act import JIT, apply_act
from .kernels_dense import LANES, POSITIONS, W_F16, W_F32, W_I8, panel_dot8_at, panel_dot_at, panel_width

POOL_MAX = 0
POOL_AVG = 1

# Geometry of OP_CONV: g = [batch, cin, h, w, cout, ho, wo, kh, kw, sh, sw, dh, dw, ph, pw, ph_end, pw_end,
# groups, act]; pads at the start and end of each spatial axis.


@njit(inline="always", **JIT)
def _u(i):
    return np.uint64(i)


@njit(**JIT)
def conv_panel(x, panels, bias, y, padded, lanes, storage, g):
    """Convolution with ``groups == 1``, then an activation (see ``_conv_panel``).

    One compiled loop nest per weight storage: with the storage a run-time value, the loop nest
    held every storage's product (twelve copies of the eight-chain loop) and ran 1.45x slower on
    a TCN here, fp32 included.
    """
    if storage == W_F16:
        _conv_panel(x, panels, bias, y, padded, lanes, W_F16, g)
    elif storage == W_I8:
        _conv_panel(x, panels, bias, y, padded, lanes, W_I8, g)
    else:
        _conv_panel(x, panels, bias, y, padded, lanes, W_F32, g)


@njit(**JIT)
def _conv_panel(x, panels, bias, y, padded, lanes, storage, g):
    """Convolution with ``groups == 1``, then an activation; ``storage`` is a compile-time constant.

    ``panels`` stacks, per kernel segment, ``panel_layout`` of its (out, K) weights: a
    segment is a kernel row (K = kw * cin) when the column dilation is 1, else one
    kernel tap (K = cin); segment ``s`` of output block ``b`` is panel ``s * blocks +
    b``, stored as ``storage`` (``kernels_dense.panel_storage``). ``padded`` is ((h + ph + ph_end) * (w + pw + pw_end) * cin) scratch whose
    padding stays zero; ``bias`` is (1, out); ``lanes`` holds ``POSITIONS * LANES`` values.
    """
    literally(storage)
    xf, yf, pf = x[0], y[0], padded[0]
    nb, cin, h, wd, cout, ho, wo = g[0], g[1], g[2], g[3], g[4], g[5], g[6]
    kh, kw, sh, sw, dh, dw, ph, pw, ph_end, pw_end, act = (
        g[7], g[8], g[9], g[10], g[11], g[12], g[13], g[14], g[15], g[16], g[18])
    wp = wd + pw + pw_end
    fused = dw == 1
    per_row = 1 if fused else kw
    k = (kw if fused else 1) * cin
    blocks = (cout + LANES - 1) // LANES
    plane = ho * wo
    if (panels.shape[1] != panel_width(k, storage) or panels.shape[0] != kh * per_row * blocks
            or pf.shape[0] < (h + ph + ph_end) * wp * cin or xf.shape[0] < nb * cin * h * wd):
        raise ValueError("conv_panel: weights, input and scratch do not fit the geometry")
    for bi in range(nb):
        for c in range(cin):  # channels-last copy into the padded scratch
            src = (bi * cin + c) * h * wd
            for ih in range(h):
                dst = ((ih + ph) * wp + pw) * cin + c
                for iw in range(wd):
                    pf[_u(dst + iw * cin)] = xf[_u(src + ih * wd + iw)]
        for block in range(blocks):
            o = block * LANES
            count = min(LANES, cout - o)
            for oh in range(ho):
                ow = 0
                while ow < wo:  # POSITIONS output columns per panel pass, then one at a time
                    many = ow + POSITIONS <= wo
                    for i in range(kh):
                        for jj in range(per_row):
                            start = ((oh * sh + i * dh) * wp + ow * sw + jj * dw) * cin
                            seg = (i * per_row + jj) * blocks + block
                            first = i == 0 and jj == 0
                            if many:
                                panel_dot8_at(panels, seg, padded, start, sw * cin, lanes, storage, not first)
                            else:
                                panel_dot_at(panels, seg, padded, start, lanes, storage, not first)
                    t = bi * cout * plane + oh * wo + ow
                    span = POSITIONS if many else 1
                    for q in range(count):
                        bq = bias[0, o + q]
                        row = t + (o + q) * plane
                        for r in range(span):
                            yf[_u(row + r)] = lanes[0, r * LANES + q] + bq
                    ow += span
    if act != 0:
        out = y.reshape((nb * cout, plane))
        apply_act(out, out, act, 0.0, 0.0)


@njit(**JIT)
def conv_direct(x, w, bias, y, g):
    """Convolution with any ``groups``, then an activation; ``w`` is (out, in/groups * kh * kw).

    Each weight meets a run of output columns at once (contiguous when the stride is 1).
    """
    xf, yf = x[0], y[0]
    nb, cin, h, wd, cout, ho, wo = g[0], g[1], g[2], g[3], g[4], g[5], g[6]
    kh, kw, sh, sw, dh, dw, ph, pw, groups, act = g[7], g[8], g[9], g[10], g[11], g[12], g[13], g[14], g[17], g[18]
    cg, og = cin // groups, cout // groups
    plane = ho * wo
    for bi in range(nb):
        for co in range(cout):
            yo = (bi * cout + co) * plane
            bv = bias[0, co]
            for t in range(plane):
                yf[_u(yo + t)] = bv
            for cl in range(cg):
                xo = (bi * cin + (co // og) * cg + cl) * h * wd
                for i in range(kh):
                    for j in range(kw):
                        wv = w[co, (cl * kh + i) * kw + j]
                        off = j * dw - pw  # input column of output column 0
                        lo = max(0, -(off // sw))  # first output column whose input is inside
                        hi = min(wo, (wd - 1 - off) // sw + 1)
                        for oh in range(ho):
                            ih = oh * sh - ph + i * dh
                            if ih < 0 or ih >= h or hi <= lo:
                                continue
                            xr = xo + ih * wd + off
                            yr = yo + oh * wo
                            for q in range(lo, hi):
                                yf[_u(yr + q)] += wv * xf[_u(xr + q * sw)]
    if act != 0:
        out = y.reshape((nb * cout, plane))
        apply_act(out, out, act, 0.0, 0.0)


@njit(inline="always", **JIT)
def _inside(start, k, size):
    """How many of ``start ... start + k - 1`` lie in ``[0, size)``."""
    return max(0, min(start + k, size) - max(start, 0))


@njit(**JIT)
def pool2d(x, y, g):
    """MaxPool / AveragePool over (planes, height, width); 1-D as height 1.

    ``g = [planes, h, w, ho, wo, kh, kw, sh, sw, ph, pw, ph_end, pw_end, dh, dw, mode,
    count_include_pad]``. An average that counts padding divides by the window clipped
    to the padded input (as ONNX Runtime and torch), otherwise by the elements inside.
    Each window offset meets a run of output columns at once.
    """
    xf, yf = x[0], y[0]
    planes, h, wd, ho, wo = g[0], g[1], g[2], g[3], g[4]
    kh, kw, sh, sw, ph, pw, ph_end, pw_end = g[5], g[6], g[7], g[8], g[9], g[10], g[11], g[12]
    dh, dw, mode, cip = g[13], g[14], g[15], g[16]
    is_max = mode == POOL_MAX
    start = np.float32(-np.inf) if is_max else np.float32(0.0)
    pairs = is_max and kw == 2 and sw == 2 and pw == 0 and dw == 1 and 2 * wo <= wd
    for p in range(planes):
        xo, yo = p * h * wd, p * ho * wo
        for oh in range(ho):
            yr = yo + oh * wo
            for q in range(wo):
                yf[_u(yr + q)] = start
            for i in range(kh):
                ih = oh * sh - ph + i * dh
                if ih < 0 or ih >= h:
                    continue
                xr = xo + ih * wd
                if pairs:  # the usual MaxPool(2): a constant stride LLVM vectorises
                    for q in range(wo):
                        a, b, m = xf[_u(xr + 2 * q)], xf[_u(xr + 2 * q + 1)], yf[_u(yr + q)]
                        v = a if (a > b or a != a) else b
                        yf[_u(yr + q)] = v if (v > m or v != v) else m
                    continue
                for j in range(kw):
                    off = j * dw - pw
                    lo = max(0, -(off // sw))
                    hi = min(wo, (wd - 1 - off) // sw + 1)
                    xr = xo + ih * wd + off
                    if is_max:
                        for q in range(lo, hi):
                            v = xf[_u(xr + q * sw)]
                            m = yf[_u(yr + q)]
                            yf[_u(yr + q)] = v if (v > m or v != v) else m  # NaN wins, as in torch
                    else:
                        for q in range(lo, hi):
                            yf[_u(yr + q)] += xf[_u(xr + q * sw)]
            if not is_max:
                hs = oh * sh - ph
                rows_in = (min(hs + kh, h + ph_end) - hs) if cip else _inside(hs, kh, h)
                for q in range(wo):
                    ws = q * sw - pw
                    cols_in = (min(ws + kw, wd + pw_end) - ws) if cip else _inside(ws, kw, wd)
                    yf[_u(yr + q)] = yf[_u(yr + q)] / np.float32(max(rows_in * cols_in, 1))


# every kernel module's digest, so that an edit to any of them refreshes Numba's cache of all
# (tools/kernel_digest.py says why)
KERNEL_SOURCES = "a3cfee55bd35693b"
