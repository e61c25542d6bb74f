"""The Numba backend's weight kernels: panel-layout matrix products, dense layers, GRU and LSTM.

Part of the torch-free runtime; ``closedloop.runtime.kernels.run_plan`` calls these for
the plan rows that multiply by weights (Gemm/MatMul by a constant, recurrent
layers). Activations are seen as ``(rows, features)`` matrices. Weights are stored
in *panels* (``panel_layout``): for each block of ``LANES`` output rows, the weights
each input meets lie side by side, so a matrix-vector product streams the weights
once, front to back, into a vector of accumulators. A batch-1 step is bound by how
fast the weights come from cache (a 2-layer, 256-unit GRU holds 3 MB of them), and
this layout reaches that limit where plain row-major dot products spend a third of
their time on horizontal sums; the same panels, held in fp16 or int8 and widened in
``_panel_dot``, are where smaller weight storage would go. Sums are reordered (SIMD
lanes, ``fastmath``), so results differ from torch's in the last bits (about 1e-6).
Nothing here allocates.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .kernels_act import ACT_NONE, JIT, activate, fast_sigmoid, fast_tanh

LANES = 16  # output rows per weight panel (one AVX-512 vector, two AVX2 ones)
UNROLL = 4  # independent accumulators per panel


def panel_layout(w: np.ndarray) -> np.ndarray:
    """Lay a row-major (out, in) weight matrix out in panels of ``LANES`` output rows.

    Panel ``p`` holds rows ``p*LANES ...`` transposed, so for each input index ``k``
    the ``LANES`` weights it meets are contiguous: ``matmul_panel`` then reads the
    weights once, front to back, with no horizontal sums. The last panel is padded
    with zero rows.
    """
    w = np.asarray(w, dtype=np.float32)
    n, m = w.shape
    blocks = -(-n // LANES)
    padded = np.zeros((blocks * LANES, m), dtype=np.float32)
    padded[:n] = w
    return np.ascontiguousarray(padded.reshape(blocks, LANES, m).transpose(0, 2, 1).reshape(blocks, m * LANES))


def _panel_dot_ir(panels, block, x, row, lanes, accumulate: bool, flat: bool = False):
    """Signature and LLVM IR of ``_panel_dot``.

    ``accumulate``: start from ``lanes`` instead of zero; ``flat``: ``row`` is an element
    offset into ``x`` and the dot product runs over the panel's width (``panels.shape[1]
    / LANES`` inputs) rather than over a row of ``x``.
    """
    for a in (panels, x, lanes):
        if not (isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 2 and a.layout == "C"):
            return None  # only 2-D C-contiguous float32 arrays: the IR below assumes that layout
    sig = types.void(panels, block, x, row, lanes)

    def codegen(context, builder, signature, args):
        pty, bty, xty, rty, lty = signature.args
        pv, bv, xv, rv, lv = args
        pa = cgutils.create_struct_proxy(pty)(context, builder, value=pv)
        xa = cgutils.create_struct_proxy(xty)(context, builder, value=xv)
        la = cgutils.create_struct_proxy(lty)(context, builder, value=lv)
        intp = context.get_value_type(types.intp)

        def const(v: int) -> ir.Constant:
            return ir.Constant(intp, v)

        vec = ir.VectorType(ir.FloatType(), LANES)
        vec_ptr = vec.as_pointer()
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vec, [vec, vec, vec]), f"llvm.fma.v{LANES}f32"
        )
        panel_width = cgutils.unpack_tuple(builder, pa.shape, 2)[1]
        bv = context.cast(builder, bv, bty, types.intp)
        rv = context.cast(builder, rv, rty, types.intp)
        wbase = builder.gep(pa.data, [builder.mul(bv, panel_width)])
        if flat:
            m = builder.udiv(panel_width, const(LANES))
            xbase = builder.gep(xa.data, [rv])
        else:
            m = cgutils.unpack_tuple(builder, xa.shape, 2)[1]
            xbase = builder.gep(xa.data, [builder.mul(rv, m)])
        zero = ir.Constant(vec, [0.0] * LANES)
        undef = ir.Constant(vec, ir.Undefined)
        splat = ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES)
        accs = [cgutils.alloca_once_value(builder, zero) for _ in range(UNROLL)]
        if accumulate:
            builder.store(builder.load(builder.bitcast(la.data, vec_ptr), align=4), accs[0])

        def step(k, acc):
            xk = builder.load(builder.gep(xbase, [k]))
            xs = builder.shuffle_vector(builder.insert_element(undef, xk, ir.Constant(ir.IntType(32), 0)), undef, splat)
            w = builder.load(builder.bitcast(builder.gep(wbase, [builder.mul(k, const(LANES))]), vec_ptr), align=4)
            builder.store(builder.call(fma, [w, xs, builder.load(acc)]), acc)

        quads = builder.udiv(m, const(UNROLL))
        with cgutils.for_range(builder, quads) as loop:
            k0 = builder.mul(loop.index, const(UNROLL))
            for u in range(UNROLL):
                step(builder.add(k0, const(u)), accs[u])
        done = builder.mul(quads, const(UNROLL))
        with cgutils.for_range(builder, builder.sub(m, done)) as loop:
            step(builder.add(done, loop.index), accs[0])
        total = builder.load(accs[0])
        for acc in accs[1:]:
            total = builder.fadd(total, builder.load(acc))
        builder.store(total, builder.bitcast(la.data, vec_ptr), align=4)
        return context.get_dummy_value()

    return sig, codegen


POSITIONS = 8  # output positions per panel pass of a convolution (8 independent FMA chains)


def _panel_dot_multi_ir(panels, block, x, start, step, lanes, accumulate: bool):
    """Signature and LLVM IR of ``panel_dot8_at``: ``POSITIONS`` dot products sharing each weight load."""
    for a in (panels, x, lanes):
        if not (isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 2 and a.layout == "C"):
            return None
    sig = types.void(panels, block, x, start, step, lanes)

    def codegen(context, builder, signature, args):
        pty, bty, xty, sty, tty, lty = signature.args
        pv, bv, xv, sv, tv, lv = args
        pa = cgutils.create_struct_proxy(pty)(context, builder, value=pv)
        xa = cgutils.create_struct_proxy(xty)(context, builder, value=xv)
        la = cgutils.create_struct_proxy(lty)(context, builder, value=lv)
        intp = context.get_value_type(types.intp)

        def const(v: int) -> ir.Constant:
            return ir.Constant(intp, v)

        vec = ir.VectorType(ir.FloatType(), LANES)
        vec_ptr = vec.as_pointer()
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vec, [vec, vec, vec]), f"llvm.fma.v{LANES}f32"
        )
        panel_width = cgutils.unpack_tuple(builder, pa.shape, 2)[1]
        bv = context.cast(builder, bv, bty, types.intp)
        sv = context.cast(builder, sv, sty, types.intp)
        tv = context.cast(builder, tv, tty, types.intp)
        wbase = builder.gep(pa.data, [builder.mul(bv, panel_width)])
        m = builder.udiv(panel_width, const(LANES))
        xbases = [builder.gep(xa.data, [builder.add(sv, builder.mul(tv, const(q)))]) for q in range(POSITIONS)]
        lane_ptrs = [builder.bitcast(builder.gep(la.data, [const(q * LANES)]), vec_ptr) for q in range(POSITIONS)]
        zero = ir.Constant(vec, [0.0] * LANES)
        undef = ir.Constant(vec, ir.Undefined)
        splat = ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES)
        accs = [cgutils.alloca_once_value(builder, zero) for _ in range(POSITIONS)]
        if accumulate:
            for acc, ptr in zip(accs, lane_ptrs, strict=True):
                builder.store(builder.load(ptr, align=4), acc)
        with cgutils.for_range(builder, m) as loop:
            k = loop.index
            w = builder.load(builder.bitcast(builder.gep(wbase, [builder.mul(k, const(LANES))]), vec_ptr), align=4)
            for xb, acc in zip(xbases, accs, strict=True):
                xk = builder.load(builder.gep(xb, [k]))
                xs = builder.shuffle_vector(builder.insert_element(undef, xk, ir.Constant(ir.IntType(32), 0)), undef,
                                            splat)
                builder.store(builder.call(fma, [w, xs, builder.load(acc)]), acc)
        for acc, ptr in zip(accs, lane_ptrs, strict=True):
            builder.store(builder.load(acc), ptr, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def panel_dot8_at(typingctx, panels, block, x, start, step, lanes):
    """``lanes[0, q*LANES : (q+1)*LANES] = panels[block] . x.flat[start + q*step :][:K]`` for ``q < POSITIONS``.

    The convolution kernel's inner product: ``POSITIONS`` output positions (``step``
    elements apart in the input) share every weight load and run as independent FMA
    chains. ``lanes`` must hold ``POSITIONS * LANES`` values; unchecked like ``panel_dot_at``.
    """
    return _panel_dot_multi_ir(panels, block, x, start, step, lanes, accumulate=False)


@intrinsic
def panel_dot8_at_add(typingctx, panels, block, x, start, step, lanes):
    """``panel_dot8_at`` that adds to ``lanes``."""
    return _panel_dot_multi_ir(panels, block, x, start, step, lanes, accumulate=True)


@intrinsic
def _panel_dot(typingctx, panels, block, x, row, lanes):
    """``lanes[0, :LANES] = panels[block] . x[row]`` with explicit SIMD vectors.

    Written in LLVM IR because Numba's own loops cannot keep a vector of
    accumulators in registers: LLVM either vectorises along ``k`` (one horizontal
    sum per output row, 1.3x slower here) or gives up. ``UNROLL`` accumulators hide
    the FMA latency. ``<LANES x float>`` is legal IR everywhere; LLVM splits it into
    native vectors (AVX-512, AVX2, NEON).
    """
    return _panel_dot_ir(panels, block, x, row, lanes, accumulate=False)


@intrinsic
def panel_dot_at(typingctx, panels, block, x, start, lanes):
    """``lanes[0, :LANES] = panels[block] . x.flat[start : start + K]``, ``K = panels.shape[1] / LANES``.

    Unchecked: the caller makes sure ``start + K`` stays inside ``x``.
    """
    return _panel_dot_ir(panels, block, x, start, lanes, accumulate=False, flat=True)


@intrinsic
def panel_dot_at_add(typingctx, panels, block, x, start, lanes):
    """``panel_dot_at`` that adds to ``lanes``."""
    return _panel_dot_ir(panels, block, x, start, lanes, accumulate=True, flat=True)


@njit(**JIT)
def matmul_rows(x, x0, panels, b, y, y0, rows, lanes, accumulate):
    """``y[y0 + i, j] (+)= dot(w[j], x[x0 + i])`` for ``i < rows``, plus ``b[0, j]`` unless ``accumulate``.

    ``panels = panel_layout(w)``; ``lanes`` is (1, LANES) scratch. Row offsets rather
    than slices keep every array C-contiguous for ``_panel_dot``.
    """
    n = y.shape[1]
    if (panels.shape[1] != x.shape[1] * LANES or n > panels.shape[0] * LANES or x0 < 0 or y0 < 0
            or x0 + rows > x.shape[0] or y0 + rows > y.shape[0]):
        raise ValueError("matmul_rows: panels, x and y do not fit together")  # the IR reads unchecked
    for block in range(panels.shape[0]):
        o = block * LANES
        count = min(LANES, n - o)
        for i in range(rows):
            _panel_dot(panels, block, x, x0 + i, lanes)  # type: ignore[call-arg]  # numba types @intrinsic with typingctx
            if accumulate:
                for j in range(count):
                    y[y0 + i, o + j] += lanes[0, j]
            else:
                for j in range(count):
                    y[y0 + i, o + j] = lanes[0, j] + b[0, o + j]


@njit(**JIT)
def matmul_panel(x, panels, b, y, lanes):
    """``y[i, j] = b[0, j] + dot(w[j], x[i])`` with ``panels = panel_layout(w)``; ``lanes`` is (1, LANES) scratch."""
    if x.shape[0] != y.shape[0]:
        raise ValueError("matmul_panel: x and y have different row counts")
    matmul_rows(x, 0, panels, b, y, 0, y.shape[0], lanes, False)


@njit(**JIT)
def dense(x, panels, b, y, act, lanes):
    """``y = act(x @ w.T + b)`` with ``panels = panel_layout(w)``, ``w`` of shape (out, in)."""
    matmul_panel(x, panels, b, y, lanes)
    if act != ACT_NONE:
        activate(y, y, act)


@njit(**JIT)
def gru_seq(x, h0, w, r, bw, br, y, gx, gh, lanes, reverse):
    """ONNX GRU (gate order z, r, n; ``linear_before_reset=1``) over every time step of ``x``.

    ``x`` is (steps * batch, inputs) time-major, ``h0`` (batch, hidden), ``y`` (steps *
    batch, hidden) receives the state after each step (``reverse``: steps run last
    to first, as ONNX's reverse direction). ``w``/``r`` are ``panel_layout`` of the
    (3H, I) input and (3H, H) recurrent weights of all three gates, so one pass over
    each computes every gate; ``gx``/``gh`` (batch, 3H) are scratch. ``y`` must not
    share memory with ``x``.
    """
    batch, hidden = h0.shape
    steps = y.shape[0] // batch
    for s in range(steps):
        t = steps - 1 - s if reverse else s
        prev = h0 if s == 0 else y
        prow = 0 if s == 0 else ((t + 1) * batch if reverse else (t - 1) * batch)
        matmul_rows(x, t * batch, w, bw, gx, 0, batch, lanes, False)
        matmul_rows(prev, prow, r, br, gh, 0, batch, lanes, False)
        for i in range(batch):
            for j in range(hidden):
                z = fast_sigmoid(gx[i, j] + gh[i, j])
                rg = fast_sigmoid(gx[i, hidden + j] + gh[i, hidden + j])
                n = fast_tanh(gx[i, 2 * hidden + j] + rg * gh[i, 2 * hidden + j])
                y[t * batch + i, j] = n + z * (prev[prow + i, j] - n)  # (1 - z) * n + z * h


@njit(**JIT)
def lstm_seq(x, h0, c0, w, r, b, y, c, gx, lanes, reverse):
    """ONNX LSTM (gate order i, o, f, c; no peepholes) over every time step of ``x``.

    As ``gru_seq``: ``x`` (steps * batch, inputs), ``h0``/``c0`` (batch, hidden), ``y``
    (steps * batch, hidden) the hidden state after each step; ``c`` (batch, hidden)
    receives the final cell state (it may share memory with ``c0``). ``b`` holds the
    input and recurrent biases summed; ``gx`` (batch, 4H) is scratch.
    """
    batch, hidden = h0.shape
    steps = y.shape[0] // batch
    for s in range(steps):
        t = steps - 1 - s if reverse else s
        prev = h0 if s == 0 else y
        prow = 0 if s == 0 else ((t + 1) * batch if reverse else (t - 1) * batch)
        cprev = c0 if s == 0 else c
        matmul_rows(x, t * batch, w, b, gx, 0, batch, lanes, False)
        matmul_rows(prev, prow, r, b, gx, 0, batch, lanes, True)
        for i in range(batch):
            for j in range(hidden):
                ig = fast_sigmoid(gx[i, j])
                og = fast_sigmoid(gx[i, hidden + j])
                fg = fast_sigmoid(gx[i, 2 * hidden + j])
                cell = fg * cprev[i, j] + ig * fast_tanh(gx[i, 3 * hidden + j])
                c[i, j] = cell
                y[t * batch + i, j] = og * fast_tanh(cell)


@njit(**JIT)
def affine(x, scale, shift, y):
    """``y = x * scale + shift`` with per-column ``scale``/``shift`` of shape (1, columns)."""
    rows, n = x.shape
    for i in range(rows):
        for j in range(n):
            y[i, j] = x[i, j] * scale[0, j] + shift[0, j]


@njit(**JIT)
def copy_into(x, y):
    rows, n = x.shape
    for i in range(rows):
        for j in range(n):
            y[i, j] = x[i, j]
