"""Numba kernels of the torch-free runtime, and the compiled plan runner that chains them.

The Numba backend (``closedloop.runtime.backends._numba_plan``) turns an ONNX graph into a
*plan*: a small int64 program (one row per step: an opcode and rows of an array
table) and one float32 arena holding every array the plan touches (weights, scratch,
and the backend's input and output buffers), described by the table as (offset,
rows, cols).
``run_plan`` walks the program and calls the kernels below, so a model step is one
call from Python into compiled code, and every model shares the same compiled
signature (compiled once, then loaded from Numba's disk cache). Nothing here
allocates: results go into arrays passed in.

Every activation is stored as a ``(rows, features)`` matrix, rows being the batch.
Weights are stored in *panels* (``panel_layout``): for each block of ``LANES``
output rows, the weights each input meets lie side by side, so a matrix-vector
product streams the weights once, front to back, into a vector of accumulators.
A batch-1 step is bound by how fast the weights come from cache (a 2-layer,
256-unit GRU holds 3 MB of them), and this layout reaches that limit where plain
row-major dot products spend a third of their time on horizontal sums. Sums are
reordered (SIMD lanes, ``fastmath``) and tanh/sigmoid are rational approximations
(``fast_tanh``), so results differ from torch's in the last bits (about 1e-6).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

# fastmath without nnan/ninf: reassociation is what lets LLVM vectorise sums, while
# NaN and inf must keep their meaning so a NaN input shows up as NaN outputs (which
# the runtime's guards catch) rather than as plausible numbers. error_model="numpy":
# no ZeroDivisionError check on float division, whose branch would stop LLVM from
# vectorising every loop that divides.
_FASTMATH = {"reassoc", "contract", "arcp", "nsz", "afn"}
_JIT: dict[str, Any] = {"cache": True, "fastmath": _FASTMATH, "nogil": True, "error_model": "numpy"}

# Activation codes (fused into DENSE, or applied alone by ACT). Row-wise ones act on
# each row (batch element) as a whole.
ACT_NONE = 0
ACT_RELU = 1
ACT_TANH = 2
ACT_SIGMOID = 3
ACT_SOFTMAX = 4
ACT_LOG_SOFTMAX = 5

# Opcodes of a plan row ``[op, a1, a2, ...]``; the a's are rows of the array table unless noted.
OP_DENSE = 0  # x, w, b, y, act(code)              y = act(x @ w.T + b), w in panel layout
OP_GRU = 1  # x, h, w, r, bw, br, h_out, gx, gh    one GRU step, linear_before_reset=1
OP_AFFINE = 2  # x, scale, shift, y                 y = x * scale + shift (per feature)
OP_ACT = 3  # x, y, act(code)                      y = act(x)
OP_COPY = 4  # x, y                                y = x
PROGRAM_WIDTH = 10

LANES_SLOT = 0  # table row of the (1, LANES) scratch every plan carries
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


@intrinsic
def _panel_dot(typingctx, panels, block, x, row, lanes):
    """``lanes[0, :LANES] = panels[block] . x[row]`` with explicit SIMD vectors.

    Written in LLVM IR because Numba's own loops cannot keep a vector of
    accumulators in registers: LLVM either vectorises along ``k`` (one horizontal
    sum per output row, 1.3x slower here) or gives up. ``UNROLL`` accumulators hide
    the FMA latency. ``<LANES x float>`` is legal IR everywhere; LLVM splits it into
    native vectors (AVX-512, AVX2, NEON).
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
        m = cgutils.unpack_tuple(builder, xa.shape, 2)[1]
        bv = context.cast(builder, bv, bty, types.intp)
        rv = context.cast(builder, rv, rty, types.intp)
        wbase = builder.gep(pa.data, [builder.mul(bv, panel_width)])
        xbase = builder.gep(xa.data, [builder.mul(rv, m)])
        zero = ir.Constant(vec, [0.0] * LANES)
        undef = ir.Constant(vec, ir.Undefined)
        splat = ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES)
        accs = [cgutils.alloca_once_value(builder, zero) for _ in range(UNROLL)]

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


@njit(**_JIT)
def matmul_panel(x, panels, b, y, lanes):
    """``y[i, j] = b[0, j] + dot(w[j], x[i])`` with ``panels = panel_layout(w)``; ``lanes`` is (1, LANES) scratch."""
    rows, n = y.shape
    if panels.shape[1] != x.shape[1] * LANES or n > panels.shape[0] * LANES or x.shape[0] != rows:
        raise ValueError("matmul_panel: panels, x and y do not fit together")  # the IR reads unchecked
    for block in range(panels.shape[0]):
        o = block * LANES
        count = min(LANES, n - o)
        for i in range(rows):
            _panel_dot(panels, block, x, i, lanes)  # type: ignore[call-arg]  # called without typingctx; numba types @intrinsic with it
            for j in range(count):
                y[i, o + j] = lanes[0, j] + b[0, o + j]


@njit(inline="always", **_JIT)
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


@njit(inline="always", **_JIT)
def fast_sigmoid(x):
    """The logistic function as ``(1 + tanh(x / 2)) / 2``: max error 1.9e-7, vectorisable."""
    half = np.float32(0.5)
    return half * fast_tanh(half * x) + half


@njit(**_JIT)
def activate(x, y, act):
    """``y = act(x)``; ``x`` and ``y`` may be the same array."""
    rows, n = x.shape
    one = np.float32(1.0)
    if act == ACT_RELU:
        for i in range(rows):
            for j in range(n):
                v = x[i, j]
                y[i, j] = np.float32(0.0) if v <= 0 else v  # NaN passes through, as in torch
    elif act == ACT_TANH:
        for i in range(rows):
            for j in range(n):
                y[i, j] = fast_tanh(x[i, j])
    elif act == ACT_SIGMOID:
        for i in range(rows):
            for j in range(n):
                y[i, j] = fast_sigmoid(x[i, j])
    elif act == ACT_SOFTMAX or act == ACT_LOG_SOFTMAX:
        for i in range(rows):
            top = x[i, 0]
            for j in range(1, n):
                top = max(top, x[i, j])
            total = np.float32(0.0)
            for j in range(n):
                total += np.exp(x[i, j] - top)
            if act == ACT_SOFTMAX:
                inv = one / total
                for j in range(n):
                    y[i, j] = np.exp(x[i, j] - top) * inv
            else:
                shift = top + np.log(total)
                for j in range(n):
                    y[i, j] = x[i, j] - shift
    else:
        for i in range(rows):
            for j in range(n):
                y[i, j] = x[i, j]


@njit(**_JIT)
def dense(x, panels, b, y, act, lanes):
    """``y = act(x @ w.T + b)`` with ``panels = panel_layout(w)``, ``w`` of shape (out, in)."""
    matmul_panel(x, panels, b, y, lanes)
    if act != ACT_NONE:
        activate(y, y, act)


@njit(**_JIT)
def gru_step(x, h, w, r, bw, br, h_out, gx, gh, lanes):
    """One GRU step for every row, ONNX gate order (z, r, n), ``linear_before_reset=1``.

    ``w``/``r`` are ``panel_layout`` of the (3H, I) input and (3H, H) recurrent
    weights of all three gates, so one pass over each computes every gate;
    ``gx``/``gh`` (rows, 3H) are scratch. ``h_out`` must not share memory with ``x``
    (it may with ``h``).
    """
    matmul_panel(x, w, bw, gx, lanes)
    matmul_panel(h, r, br, gh, lanes)
    rows, hidden = h.shape
    for i in range(rows):
        for j in range(hidden):
            z = fast_sigmoid(gx[i, j] + gh[i, j])
            rg = fast_sigmoid(gx[i, hidden + j] + gh[i, hidden + j])
            n = fast_tanh(gx[i, 2 * hidden + j] + rg * gh[i, 2 * hidden + j])
            h_out[i, j] = n + z * (h[i, j] - n)  # (1 - z) * n + z * h


@njit(**_JIT)
def affine(x, scale, shift, y):
    """``y = x * scale + shift`` with per-feature ``scale``/``shift`` of shape (1, features)."""
    rows, n = x.shape
    for i in range(rows):
        for j in range(n):
            y[i, j] = x[i, j] * scale[0, j] + shift[0, j]


@njit(**_JIT)
def copy_into(x, y):
    rows, n = x.shape
    for i in range(rows):
        for j in range(n):
            y[i, j] = x[i, j]


@njit(inline="always", **_JIT)
def _view(arena, table, k):
    """Array ``k`` of a plan: ``table[k] = (offset, rows, cols)`` into the float32 ``arena``."""
    start = table[k, 0]
    return arena[start : start + table[k, 1] * table[k, 2]].reshape((table[k, 1], table[k, 2]))


@njit(**_JIT)
def run_plan(program, table, arena):
    """Run every row of ``program`` (see the opcodes above) on arrays that live in ``arena``.

    One flat arena instead of a list of arrays: passing a Numba typed list costs
    0.9 us per call, a sixth of a whole MLP step.
    """
    lanes = _view(arena, table, LANES_SLOT)
    for step in range(program.shape[0]):
        p = program[step]
        op = p[0]
        if op == OP_DENSE:
            dense(_view(arena, table, p[1]), _view(arena, table, p[2]), _view(arena, table, p[3]),
                  _view(arena, table, p[4]), p[5], lanes)
        elif op == OP_GRU:
            gru_step(
                _view(arena, table, p[1]), _view(arena, table, p[2]), _view(arena, table, p[3]),
                _view(arena, table, p[4]), _view(arena, table, p[5]), _view(arena, table, p[6]),
                _view(arena, table, p[7]), _view(arena, table, p[8]), _view(arena, table, p[9]), lanes,
            )
        elif op == OP_AFFINE:
            affine(_view(arena, table, p[1]), _view(arena, table, p[2]), _view(arena, table, p[3]),
                   _view(arena, table, p[4]))
        elif op == OP_ACT:
            activate(_view(arena, table, p[1]), _view(arena, table, p[2]), p[3])
        elif op == OP_COPY:
            copy_into(_view(arena, table, p[1]), _view(arena, table, p[2]))


def pack_arena(arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, list[np.ndarray], dict[int, np.ndarray]]:
    """Copy a plan's arrays into one 64-byte-aligned float32 arena.

    Arrays that are views of the same base (a state input and its per-layer views)
    stay views of one region. Returns the arena, the (offset, rows, cols) table in
    the order of ``arrays``, the arena view of each array, and for each base (by
    ``id``) its arena-backed twin: the caller must use views and twins from then on.
    """

    def base_of(a: np.ndarray) -> np.ndarray:
        while isinstance(a.base, np.ndarray):
            a = a.base
        return a

    regions: dict[int, tuple[np.ndarray, int]] = {}
    size = 0
    for a in arrays:
        if a.dtype != np.float32 or a.ndim != 2 or not a.flags.c_contiguous:
            raise TypeError(f"plan arrays must be 2-D C-contiguous float32, got {a.dtype} {a.shape}")
        b = base_of(a)
        if id(b) not in regions:
            if b.dtype != np.float32 or not b.flags.c_contiguous:
                raise TypeError(f"plan array base must be C-contiguous float32, got {b.dtype} {b.shape}")
            regions[id(b)] = (b, size)
            size += -(-b.size // LANES) * LANES  # keep every region 64-byte aligned
    raw = np.zeros(size + LANES, dtype=np.float32)
    shift = (-raw.ctypes.data // 4) % LANES
    arena = raw[shift : shift + size]
    twins: dict[int, np.ndarray] = {}
    for key, (b, start) in regions.items():
        twin = arena[start : start + b.size].reshape(b.shape)
        twin[...] = b
        twins[key] = twin
    table = np.zeros((len(arrays), 3), dtype=np.int64)
    views = []
    for k, a in enumerate(arrays):
        b, start = regions[id(base_of(a))]
        offset = start + (a.ctypes.data - b.ctypes.data) // 4
        table[k] = (offset, a.shape[0], a.shape[1])
        views.append(arena[offset : offset + a.size].reshape(a.shape))
    return arena, table, views, twins
