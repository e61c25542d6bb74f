"""The Numba backend's weight kernels: panel-layout matrix products, dense layers, GRU and LSTM.

Part of the torch-free runtime; ``closedloop.runtime.kernels.run_plan`` calls these for
the plan rows that multiply by weights (Gemm/MatMul by a constant, recurrent
layers). Activations are seen as ``(rows, features)`` matrices. Weights are stored
in *panels* (``panel_layout``): for each block of ``LANES`` output rows, the weights
each input meets lie side by side, so a matrix-vector product streams the weights
once, front to back, into a vector of accumulators. A batch-1 step is bound by how
fast the weights come from cache (a 2-layer, 256-unit GRU holds 3 MB of them), and
this layout reaches that limit where plain row-major dot products spend a third of
their time on horizontal sums. The same panels can be held in float16 or in int8 with
a float32 scale per output row (``panel_storage``): the kernels widen each weight
vector as it is loaded and accumulate in float32, so a step reads a half or a quarter
of the bytes, which is what lets a model whose fp32 weights spill out of L2 run from
it. Sums are reordered (SIMD lanes, ``fastmath``), so results differ from torch's in
the last bits (about 1e-6). Nothing here allocates.
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


# How a weight panel is stored (``panel_storage``); the kernels accumulate in float32 for every storage.
W_F32 = 0  # float32 panels
W_F16 = 1  # IEEE float16 panels, widened on load (F16C's vcvtph2ps on x86)
W_I8 = 2  # int8 panels, one float32 scale per output row ahead of each panel's codes


@njit(**JIT)
def panel_width(inputs, storage):
    """Float32 slots one panel (``LANES`` output rows by ``inputs``) takes in ``storage``."""
    if storage == W_F16:
        return inputs * LANES // 2
    if storage == W_I8:
        return LANES + inputs * LANES // 4
    return inputs * LANES


def panel_storage(panels: np.ndarray, storage: int, scales: np.ndarray | None = None) -> np.ndarray:
    """Float32 ``panel_layout`` panels in ``storage``, as the float32 array the plan's arena holds.

    The arena is one float32 array, so a compressed panel is its bytes seen as float32: float16
    codes two to a slot, or ``LANES`` float32 scales (one per output row of the panel) then int8
    codes four to a slot. ``scales`` (``(panels, LANES)``) are the int8 rows' scales, so that a
    weight stored as int8 codes times a scale (``DequantizeLinear`` in a bundle) gets back exactly
    its codes; without them each row is quantized symmetrically, ``s = max |w| / 127``.
    """
    panels = np.ascontiguousarray(panels, dtype=np.float32)
    blocks, width = panels.shape
    if storage == W_F32:
        return panels
    if storage == W_F16:
        return np.ascontiguousarray(panels.astype(np.float16)).view(np.float32)
    if storage != W_I8:
        raise ValueError(f"weight storage {storage} is not one of W_F32, W_F16, W_I8")
    if width % 4:
        raise ValueError(f"int8 panels need a multiple of 4 weights per panel, got {width}")
    per_row = panels.reshape(blocks, width // LANES, LANES)  # [panel, input, lane]
    if scales is None:
        scales = np.abs(per_row).max(axis=1) / np.float32(127)
    scales = np.array(np.broadcast_to(scales, (blocks, LANES)), dtype=np.float32)
    scales[scales == 0] = 1  # an all-zero (or padding) row: any scale gives codes 0
    codes = np.clip(np.rint(per_row / scales[:, None, :]), -128, 127).astype(np.int8).reshape(blocks, width)
    out = np.empty((blocks, LANES + width // 4), dtype=np.float32)
    out[:, :LANES] = scales
    out[:, LANES:] = codes.view(np.float32)
    return out


def _float_arrays(*arrays) -> bool:
    return all(isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 2 and a.layout == "C"
               for a in arrays)


class _Weights:
    """LLVM IR that reads weight vectors from panel ``block`` in one storage (see ``panel_storage``)."""

    def __init__(self, context, builder, pa, block, storage: int):
        self.b, self.storage = builder, storage
        intp = context.get_value_type(types.intp)
        self.intp = intp
        self.vec = ir.VectorType(ir.FloatType(), LANES)
        self.width = cgutils.unpack_tuple(builder, pa.shape, 2)[1]
        base = builder.gep(pa.data, [builder.mul(block, self.width)])
        self.scales = None
        if storage == W_F16:
            self.data = builder.bitcast(base, ir.HalfType().as_pointer())
            self.raw = ir.VectorType(ir.HalfType(), LANES)
        elif storage == W_I8:
            self.scales = builder.bitcast(base, self.vec.as_pointer())
            self.data = builder.bitcast(builder.gep(base, [ir.Constant(intp, LANES)]), ir.IntType(8).as_pointer())
            self.raw = ir.VectorType(ir.IntType(8), LANES)
        else:
            self.data, self.raw = base, self.vec

    def inputs(self):
        """How many inputs a panel spans, from its width in float32 slots."""
        b, c = self.b, (lambda v: ir.Constant(self.intp, v))
        if self.storage == W_F16:
            return b.udiv(b.mul(self.width, c(2)), c(LANES))
        if self.storage == W_I8:
            return b.udiv(b.mul(b.sub(self.width, c(LANES)), c(4)), c(LANES))
        return b.udiv(self.width, c(LANES))

    def load(self, k):
        """The ``LANES`` weights input ``k`` meets, as float32 (before any int8 scale)."""
        b = self.b
        ptr = b.bitcast(b.gep(self.data, [b.mul(k, ir.Constant(self.intp, LANES))]), self.raw.as_pointer())
        raw = b.load(ptr, align=1 if self.storage == W_I8 else (2 if self.storage == W_F16 else 4))
        if self.storage == W_F16:
            return b.fpext(raw, self.vec)
        if self.storage == W_I8:
            return b.sitofp(raw, self.vec)
        return raw

    def start(self, acc, lanes_ptr) -> None:
        """Start accumulator ``acc`` from the values at ``lanes_ptr`` (to add to them).

        float32 and float16 sums start there; an int8 sum must be scaled before it is added, so it
        starts from zero and ``finish`` adds the values then (read late: a value held across the
        loop would take a vector register the convolution's eight chains need).
        """
        if self.scales is None:
            self.b.store(self.b.load(lanes_ptr, align=4), acc)

    def finish(self, total, lanes_ptr, accumulate: bool):
        """The dot product from the sum: times the per-row scales for int8 (plus the old values when adding)."""
        if self.scales is None:
            return total
        total = self.b.fmul(total, self.b.load(self.scales, align=4))
        return self.b.fadd(total, self.b.load(lanes_ptr, align=4)) if accumulate else total


def _panel_dot_ir(panels, block, x, row, lanes, accumulate: bool, flat: bool = False, storage: int = W_F32):
    """Signature and LLVM IR of ``_panel_dot``.

    ``accumulate``: add to ``lanes`` instead of overwriting it; ``flat``: ``row`` is an element
    offset into ``x`` and the dot product runs over the panel's width (its inputs) rather
    than over a row of ``x``; ``storage``: how the panels hold the weights.
    """
    if not _float_arrays(panels, x, lanes):
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
        bv = context.cast(builder, bv, bty, types.intp)
        rv = context.cast(builder, rv, rty, types.intp)
        weights = _Weights(context, builder, pa, bv, storage)
        if flat:
            m = weights.inputs()
            xbase = builder.gep(xa.data, [rv])
        else:
            m = cgutils.unpack_tuple(builder, xa.shape, 2)[1]
            xbase = builder.gep(xa.data, [builder.mul(rv, m)])
        zero = ir.Constant(vec, [0.0] * LANES)
        undef = ir.Constant(vec, ir.Undefined)
        splat = ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES)
        accs = [cgutils.alloca_once_value(builder, zero) for _ in range(UNROLL)]
        lanes_ptr = builder.bitcast(la.data, vec_ptr)
        if accumulate:
            weights.start(accs[0], lanes_ptr)

        def step(k, acc):
            xk = builder.load(builder.gep(xbase, [k]))
            xs = builder.shuffle_vector(builder.insert_element(undef, xk, ir.Constant(ir.IntType(32), 0)), undef, splat)
            builder.store(builder.call(fma, [weights.load(k), xs, builder.load(acc)]), acc)

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
        builder.store(weights.finish(total, lanes_ptr, accumulate), lanes_ptr, align=4)
        return context.get_dummy_value()

    return sig, codegen


POSITIONS = 8  # output positions per panel pass of a convolution (8 independent FMA chains)


def _panel_dot_multi_ir(panels, block, x, start, step, lanes, accumulate: bool, storage: int = W_F32):
    """Signature and LLVM IR of ``panel_dot8_at``: ``POSITIONS`` dot products sharing each weight load."""
    if not _float_arrays(panels, x, lanes):
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
        bv = context.cast(builder, bv, bty, types.intp)
        sv = context.cast(builder, sv, sty, types.intp)
        tv = context.cast(builder, tv, tty, types.intp)
        weights = _Weights(context, builder, pa, bv, storage)
        m = weights.inputs()
        xbases = [builder.gep(xa.data, [builder.add(sv, builder.mul(tv, const(q)))]) for q in range(POSITIONS)]
        lane_ptrs = [builder.bitcast(builder.gep(la.data, [const(q * LANES)]), vec_ptr) for q in range(POSITIONS)]
        zero = ir.Constant(vec, [0.0] * LANES)
        undef = ir.Constant(vec, ir.Undefined)
        splat = ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES)
        accs = [cgutils.alloca_once_value(builder, zero) for _ in range(POSITIONS)]
        if accumulate:
            for acc, ptr in zip(accs, lane_ptrs, strict=True):
                weights.start(acc, ptr)
        with cgutils.for_range(builder, m) as loop:
            k = loop.index
            w = weights.load(k)
            for xb, acc in zip(xbases, accs, strict=True):
                xk = builder.load(builder.gep(xb, [k]))
                xs = builder.shuffle_vector(builder.insert_element(undef, xk, ir.Constant(ir.IntType(32), 0)), undef,
                                            splat)
                builder.store(builder.call(fma, [w, xs, builder.load(acc)]), acc)
        for acc, ptr in zip(accs, lane_ptrs, strict=True):
            builder.store(weights.finish(builder.load(acc), ptr, accumulate), ptr, align=4)
        return context.get_dummy_value()

    return sig, codegen


def _dot(storage: int, accumulate: bool, flat: bool):
    def typer(typingctx, panels, block, x, row, lanes):
        return _panel_dot_ir(panels, block, x, row, lanes, accumulate, flat, storage)

    typer.__name__ = typer.__qualname__ = f"panel_dot_s{storage}_a{int(accumulate)}_f{int(flat)}"
    return intrinsic(typer)


def _dot8(storage: int, accumulate: bool):
    def typer(typingctx, panels, block, x, start, step, lanes):
        return _panel_dot_multi_ir(panels, block, x, start, step, lanes, accumulate, storage)

    typer.__name__ = typer.__qualname__ = f"panel_dot8_s{storage}_a{int(accumulate)}"
    return intrinsic(typer)


# One intrinsic per storage: the storage picks the IR, so the kernels branch on it once per panel.
# ``_dot_row[s]``: ``lanes[0, :LANES] = panels[block] . x[row]`` with explicit SIMD vectors, written in
# LLVM IR because Numba's own loops cannot keep a vector of accumulators in registers (LLVM either
# vectorises along ``k``, one horizontal sum per output row, 1.3x slower here, or gives up); ``UNROLL``
# accumulators hide the FMA latency, and ``<LANES x float>`` is legal IR everywhere (LLVM splits it into
# AVX-512, AVX2 or NEON vectors). ``_dot_at[s]``/``_dot_at_add[s]``: the same over ``x.flat[start:][:K]``
# (K the panel's inputs), overwriting or adding to ``lanes``. ``_dot8_at[s]``/``_dot8_at_add[s]``:
# ``POSITIONS`` such products ``step`` elements apart sharing every weight load (the convolution's inner
# product; ``lanes`` holds ``POSITIONS * LANES`` values). All unchecked: callers keep reads inside ``x``.
_dot_row = [_dot(s, False, False) for s in (W_F32, W_F16, W_I8)]
_dot_at = [_dot(s, False, True) for s in (W_F32, W_F16, W_I8)]
_dot_at_add = [_dot(s, True, True) for s in (W_F32, W_F16, W_I8)]
_dot8_at = [_dot8(s, False) for s in (W_F32, W_F16, W_I8)]
_dot8_at_add = [_dot8(s, True) for s in (W_F32, W_F16, W_I8)]
_dot_row_f32, _dot_row_f16, _dot_row_i8 = _dot_row
_dot_at_f32, _dot_at_f16, _dot_at_i8 = _dot_at
_dot_at_add_f32, _dot_at_add_f16, _dot_at_add_i8 = _dot_at_add
_dot8_at_f32, _dot8_at_f16, _dot8_at_i8 = _dot8_at
_dot8_at_add_f32, _dot8_at_add_f16, _dot8_at_add_i8 = _dot8_at_add


@njit(inline="always", **JIT)
def panel_dot(panels, block, x, row, lanes, storage):
    """``lanes[0, :LANES] = panels[block] . x[row]`` for panels in ``storage``."""
    if storage == W_F16:
        _dot_row_f16(panels, block, x, row, lanes)
    elif storage == W_I8:
        _dot_row_i8(panels, block, x, row, lanes)
    else:
        _dot_row_f32(panels, block, x, row, lanes)


@njit(inline="always", **JIT)
def panel_dot_at(panels, block, x, start, lanes, storage, add):
    """``lanes[0, :LANES] (+)= panels[block] . x.flat[start : start + K]``; unchecked."""
    if add:
        if storage == W_F16:
            _dot_at_add_f16(panels, block, x, start, lanes)
        elif storage == W_I8:
            _dot_at_add_i8(panels, block, x, start, lanes)
        else:
            _dot_at_add_f32(panels, block, x, start, lanes)
    elif storage == W_F16:
        _dot_at_f16(panels, block, x, start, lanes)
    elif storage == W_I8:
        _dot_at_i8(panels, block, x, start, lanes)
    else:
        _dot_at_f32(panels, block, x, start, lanes)


@njit(inline="always", **JIT)
def panel_dot8_at(panels, block, x, start, step, lanes, storage, add):
    """``lanes[0, q*LANES : (q+1)*LANES] (+)= panels[block] . x.flat[start + q*step :][:K]``, ``q < POSITIONS``."""
    if add:
        if storage == W_F16:
            _dot8_at_add_f16(panels, block, x, start, step, lanes)
        elif storage == W_I8:
            _dot8_at_add_i8(panels, block, x, start, step, lanes)
        else:
            _dot8_at_add_f32(panels, block, x, start, step, lanes)
    elif storage == W_F16:
        _dot8_at_f16(panels, block, x, start, step, lanes)
    elif storage == W_I8:
        _dot8_at_i8(panels, block, x, start, step, lanes)
    else:
        _dot8_at_f32(panels, block, x, start, step, lanes)


@njit(**JIT)
def matmul_rows(x, x0, panels, b, y, y0, rows, lanes, accumulate, storage=W_F32):
    """``y[y0 + i, j] (+)= dot(w[j], x[x0 + i])`` for ``i < rows``, plus ``b[0, j]`` unless ``accumulate``.

    ``panels = panel_storage(panel_layout(w), storage)``; ``lanes`` is (1, LANES) scratch. Row
    offsets rather than slices keep every array C-contiguous for the IR of ``panel_dot``.
    """
    n = y.shape[1]
    if (panels.shape[1] != panel_width(x.shape[1], storage) or n > panels.shape[0] * LANES or x0 < 0 or y0 < 0
            or x0 + rows > x.shape[0] or y0 + rows > y.shape[0]):
        raise ValueError("matmul_rows: panels, x and y do not fit together")  # the IR reads unchecked
    for block in range(panels.shape[0]):
        o = block * LANES
        count = min(LANES, n - o)
        for i in range(rows):
            panel_dot(panels, block, x, x0 + i, lanes, storage)
            if accumulate:
                for j in range(count):
                    y[y0 + i, o + j] += lanes[0, j]
            else:
                for j in range(count):
                    y[y0 + i, o + j] = lanes[0, j] + b[0, o + j]


@njit(**JIT)
def matmul_panel(x, panels, b, y, lanes, storage=W_F32):
    """``y[i, j] = b[0, j] + dot(w[j], x[i])``, ``panels`` as for ``matmul_rows``; ``lanes`` is (1, LANES) scratch."""
    if x.shape[0] != y.shape[0]:
        raise ValueError("matmul_panel: x and y have different row counts")
    matmul_rows(x, 0, panels, b, y, 0, y.shape[0], lanes, False, storage)


@njit(**JIT)
def dense(x, panels, b, y, act, lanes, storage=W_F32):
    """``y = act(x @ w.T + b)`` with ``panels = panel_storage(panel_layout(w), storage)``, ``w`` of shape (out, in)."""
    matmul_panel(x, panels, b, y, lanes, storage)
    if act != ACT_NONE:
        activate(y, y, act)


@njit(**JIT)
def seq_step(s, steps, batch, reverse):
    """Step ``s`` of a recurrence over ``steps`` time steps of ``batch`` rows: the time index it computes
    (``reverse``: last to first) and the first row in ``y`` of the state it starts from (0 at ``s == 0``,
    where the state is ``h0``)."""
    t = steps - 1 - s if reverse else s
    prow = 0 if s == 0 else ((t + 1) * batch if reverse else (t - 1) * batch)
    return t, prow


@njit(**JIT)
def gru_seq(x, h0, w, r, bw, br, y, gx, gh, lanes, reverse, storage=W_F32):
    """ONNX GRU (gate order z, r, n; ``linear_before_reset=1``) over every time step of ``x``.

    ``x`` is (steps * batch, inputs) time-major, ``h0`` (batch, hidden), ``y`` (steps *
    batch, hidden) receives the state after each step (``reverse``: steps run last
    to first, as ONNX's reverse direction). ``w``/``r`` are ``panel_layout`` of the
    (3H, I) input and (3H, H) recurrent weights of all three gates (in ``storage``), so one
    pass over each computes every gate; ``gx``/``gh`` (batch, 3H) are scratch. ``y`` must not
    share memory with ``x``.
    """
    batch, hidden = h0.shape
    steps = y.shape[0] // batch
    for s in range(steps):
        t, prow = seq_step(s, steps, batch, reverse)
        prev = h0 if s == 0 else y
        matmul_rows(x, t * batch, w, bw, gx, 0, batch, lanes, False, storage)
        matmul_rows(prev, prow, r, br, gh, 0, batch, lanes, False, storage)
        for i in range(batch):
            for j in range(hidden):
                z = fast_sigmoid(gx[i, j] + gh[i, j])
                rg = fast_sigmoid(gx[i, hidden + j] + gh[i, hidden + j])
                n = fast_tanh(gx[i, 2 * hidden + j] + rg * gh[i, 2 * hidden + j])
                y[t * batch + i, j] = n + z * (prev[prow + i, j] - n)  # (1 - z) * n + z * h


@njit(**JIT)
def lstm_seq(x, h0, c0, w, r, b, y, c, gx, lanes, reverse, storage=W_F32):
    """ONNX LSTM (gate order i, o, f, c; no peepholes) over every time step of ``x``.

    As ``gru_seq``: ``x`` (steps * batch, inputs), ``h0``/``c0`` (batch, hidden), ``y``
    (steps * batch, hidden) the hidden state after each step; ``c`` (batch, hidden)
    receives the final cell state (it may share memory with ``c0``). ``b`` holds the
    input and recurrent biases summed; ``gx`` (batch, 4H) is scratch.
    """
    batch, hidden = h0.shape
    steps = y.shape[0] // batch
    for s in range(steps):
        t, prow = seq_step(s, steps, batch, reverse)
        prev = h0 if s == 0 else y
        cprev = c0 if s == 0 else c
        matmul_rows(x, t * batch, w, b, gx, 0, batch, lanes, False, storage)
        matmul_rows(prev, prow, r, b, gx, 0, batch, lanes, True, storage)
        for i in range(batch):
            for j in range(hidden):
                ig = fast_sigmoid(gx[i, j])
                og = fast_sigmoid(gx[i, hidden + j])
                fg = fast_sigmoid(gx[i, 2 * hidden + j])
                cell = fg * cprev[i, j] + ig * fast_tanh(gx[i, 3 * hidden + j])
                c[i, j] = cell
                y[t * batch + i, j] = og * fast_tanh(cell)


@njit(**JIT)
def rnn_seq(x, h0, w, r, b, y, relu, lanes, reverse, storage=W_F32):
    """ONNX RNN (Elman: ``h = f(x W^T + h R^T + Wb + Rb)``, ``f`` tanh, or relu with ``relu``) over every step.

    As ``gru_seq``: ``x`` (steps * batch, inputs), ``h0`` (batch, hidden), ``y`` (steps * batch, hidden) the state
    after each step; ``b`` holds the input and recurrent biases summed. The products go straight into ``y``.
    """
    batch, hidden = h0.shape
    steps = y.shape[0] // batch
    for s in range(steps):
        t, prow = seq_step(s, steps, batch, reverse)
        prev = h0 if s == 0 else y
        matmul_rows(x, t * batch, w, b, y, t * batch, batch, lanes, False, storage)
        matmul_rows(prev, prow, r, b, y, t * batch, batch, lanes, True, storage)
        for i in range(batch):
            for j in range(hidden):
                v = y[t * batch + i, j]
                y[t * batch + i, j] = (v if v > 0.0 else 0.0) if relu else fast_tanh(v)


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


# every kernel module's digest, so that an edit to any of them refreshes Numba's cache of all
# (tools/kernel_digest.py says why)
KERNEL_SOURCES = "a3cfee55bd35693b"
