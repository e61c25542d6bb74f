"""The plan runner of the torch-free runtime: one compiled call runs a whole model step.

The Numba backend (``closedloop.runtime.backends._numba_plan``) turns an ONNX graph into a
*plan*: a small int64 program (one row per step: an opcode, rows of an array table,
and integer arguments) and one float32 arena holding every array the plan touches
(weights, scratch, and the backend's input and output buffers), described by the
table as (offset, rows, cols). ``run_plan`` walks the program and calls the kernels
of ``closedloop.runtime.kernels_dense`` (weight products, GRU, LSTM),
``closedloop.runtime.kernels_act`` (activations), ``closedloop.runtime.kernels_nd``
(data movement, broadcasting, reductions, normalisation, attention products) and
``closedloop.runtime.kernels_conv`` (convolution, pooling), so a model step is one
call from Python into compiled code, and every model shares the same compiled
signature (compiled once, then loaded from Numba's disk cache). Nothing here
allocates: results go into arrays passed in.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .kernels_act import (  # noqa: F401  (re-exported: the planner and tests use them from here)
    ACT_ABS,
    ACT_ACOS,
    ACT_ASIN,
    ACT_ATAN,
    ACT_CEIL,
    ACT_CLIP,
    ACT_COS,
    ACT_ELU,
    ACT_ERF,
    ACT_EXP,
    ACT_FLOOR,
    ACT_GELU,
    ACT_GELU_TANH,
    ACT_HARD_SIGMOID,
    ACT_HARD_SWISH,
    ACT_LEAKY_RELU,
    ACT_LOG,
    ACT_LOG_SOFTMAX,
    ACT_NONE,
    ACT_POW,
    ACT_RECIPROCAL,
    ACT_RELU,
    ACT_ROUND,
    ACT_SIGMOID,
    ACT_SIGN,
    ACT_SIN,
    ACT_SOFTMAX,
    ACT_SOFTPLUS,
    ACT_SOFTSIGN,
    ACT_SQRT,
    ACT_SQUARE,
    ACT_TAN,
    ACT_TANH,
    JIT,
    activate,
    apply_act,
    fast_erf,
    fast_exp,
    fast_sigmoid,
    fast_tanh,
)
from .kernels_conv import POOL_AVG, POOL_MAX, conv_direct, conv_panel, pool2d  # noqa: F401
from .kernels_dense import (  # noqa: F401
    LANES,
    POSITIONS,
    W_F16,
    W_F32,
    W_I8,
    affine,
    copy_into,
    dense,
    gru_seq,
    lstm_seq,
    matmul_panel,
    panel_layout,
    panel_storage,
    panel_width,
    rnn_seq,
)
from .kernels_nd import (  # noqa: F401
    BIN_ADD,
    BIN_DIV,
    BIN_EQUAL,
    BIN_FMOD,
    BIN_GREATER,
    BIN_GREATER_EQUAL,
    BIN_LESS,
    BIN_LESS_EQUAL,
    BIN_MAX,
    BIN_MIN,
    BIN_MOD,
    BIN_MUL,
    BIN_NOT_EQUAL,
    BIN_POW,
    BIN_SUB,
    RED_L1,
    RED_L2,
    RED_MAX,
    RED_MEAN,
    RED_MIN,
    RED_SUM,
    RED_SUM_SQUARE,
    arg_extreme,
    batched_matmul,
    binary,
    layer_norm,
    reduce,
    strided_copy,
    topk,
    where,
)

# Opcodes of a plan row ``[op, a1, a2, ...]``: array arguments are rows of the array
# table, then integers; ``g...`` is a geometry the kernel reads from the row itself.
OP_DENSE = 0  # x, w, b, y, act, st                   y = act(x @ w.T + b), w in panels stored as st (W_*)
OP_GRU = 1  # x, h0, w, r, bw, br, y, gx, gh, reverse, st  GRU over every step, linear_before_reset=1
OP_AFFINE = 2  # x, scale, shift, y                   y = x * scale + shift (per column)
OP_ACT = 3  # x, y, act, prm                          y = act(x; alpha=prm[0,0], beta=prm[0,1])
OP_COPY = 4  # x, y                                   y = x
OP_LSTM = 5  # x, h0, c0, w, r, b, y, c, gx, reverse, st  LSTM over every step
OP_STRIDED = 6  # x, y, g[14]                         strided copy (transpose, slice, gather, concat)
OP_BINARY = 7  # a, b, y, g[10]                       y = a op b, broadcasting
OP_REDUCE = 8  # x, y, g[4]                           reduce the middle of (outer, n, inner)
OP_LAYER_NORM = 9  # x, scale, shift, y, eps          per-row layer normalisation
OP_BATCHED_MATMUL = 10  # a, b, bias, y, packed, alpha, g[7]  y[i] = alpha a[i] @ b[i] (or b[i].T) + bias
OP_CONV = 11  # x, panels, b, y, padded, st, g[19]    convolution (groups 1), then an activation
OP_POOL = 12  # x, y, g[17]                           max or average pooling
OP_CONV_GROUPED = 13  # x, w, b, y, g[19]             convolution (any groups), then an activation
OP_RNN = 14  # x, h0, w, r, b, y, relu, reverse, st     Elman RNN (tanh or relu) over every step
OP_WHERE = 15  # c, a, b, y, g[12]                    y = a where c != 0 else b, broadcasting
OP_TOPK = 16  # x, y, g[5]                            the k largest (or smallest) along an axis, in order
OP_ARG_EXTREME = 17  # x, y, g[5]                     the index of the largest (or smallest) along an axis
PROGRAM_WIDTH = 26

LANES_SLOT = 0  # table row of the (1, POSITIONS * LANES) scratch every plan carries


@njit(inline="always", **JIT)
def _view(arena, table, k):
    """Array ``k`` of a plan: ``table[k] = (offset, rows, cols)`` into the float32 ``arena``."""
    start = table[k, 0]
    return arena[start : start + table[k, 1] * table[k, 2]].reshape((table[k, 1], table[k, 2]))


@njit(**JIT)
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
                  _view(arena, table, p[4]), p[5], lanes, p[6])
        elif op == OP_AFFINE:
            affine(_view(arena, table, p[1]), _view(arena, table, p[2]), _view(arena, table, p[3]),
                   _view(arena, table, p[4]))
        elif op == OP_ACT:
            prm = _view(arena, table, p[4])
            apply_act(_view(arena, table, p[1]), _view(arena, table, p[2]), p[3], prm[0, 0], prm[0, 1])
        elif op == OP_BINARY:
            binary(_view(arena, table, p[1]), _view(arena, table, p[2]), _view(arena, table, p[3]), p[4:])
        elif op == OP_STRIDED:
            strided_copy(_view(arena, table, p[1]), _view(arena, table, p[2]), p[3:])
        elif op == OP_BATCHED_MATMUL:
            alpha = _view(arena, table, p[6])
            batched_matmul(_view(arena, table, p[1]), _view(arena, table, p[2]), _view(arena, table, p[3]),
                           _view(arena, table, p[4]), _view(arena, table, p[5]), alpha[0, 0], lanes, p[7:])
        elif op == OP_LAYER_NORM:
            eps = _view(arena, table, p[5])
            layer_norm(_view(arena, table, p[1]), _view(arena, table, p[2]), _view(arena, table, p[3]),
                       _view(arena, table, p[4]), eps[0, 0])
        elif op == OP_REDUCE:
            reduce(_view(arena, table, p[1]), _view(arena, table, p[2]), p[3:])
        elif op == OP_CONV:
            conv_panel(_view(arena, table, p[1]), _view(arena, table, p[2]), _view(arena, table, p[3]),
                       _view(arena, table, p[4]), _view(arena, table, p[5]), lanes, p[6], p[7:])
        elif op == OP_CONV_GROUPED:
            conv_direct(_view(arena, table, p[1]), _view(arena, table, p[2]), _view(arena, table, p[3]),
                        _view(arena, table, p[4]), p[5:])
        elif op == OP_POOL:
            pool2d(_view(arena, table, p[1]), _view(arena, table, p[2]), p[3:])
        elif op == OP_GRU:
            gru_seq(
                _view(arena, table, p[1]), _view(arena, table, p[2]), _view(arena, table, p[3]),
                _view(arena, table, p[4]), _view(arena, table, p[5]), _view(arena, table, p[6]),
                _view(arena, table, p[7]), _view(arena, table, p[8]), _view(arena, table, p[9]), lanes, p[10],
                p[11],
            )
        elif op == OP_LSTM:
            lstm_seq(
                _view(arena, table, p[1]), _view(arena, table, p[2]), _view(arena, table, p[3]),
                _view(arena, table, p[4]), _view(arena, table, p[5]), _view(arena, table, p[6]),
                _view(arena, table, p[7]), _view(arena, table, p[8]), _view(arena, table, p[9]), lanes, p[10],
                p[11],
            )
        elif op == OP_RNN:
            rnn_seq(
                _view(arena, table, p[1]), _view(arena, table, p[2]), _view(arena, table, p[3]),
                _view(arena, table, p[4]), _view(arena, table, p[5]), _view(arena, table, p[6]), p[7], lanes, p[8],
                p[9],
            )
        elif op == OP_ARG_EXTREME:
            arg_extreme(_view(arena, table, p[1]), _view(arena, table, p[2]), p[3:])
        elif op == OP_TOPK:
            topk(_view(arena, table, p[1]), _view(arena, table, p[2]), p[3:])
        elif op == OP_WHERE:
            where(_view(arena, table, p[1]), _view(arena, table, p[2]), _view(arena, table, p[3]),
                  _view(arena, table, p[4]), p[5:])
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


# every kernel module's digest, so that an edit to any of them refreshes Numba's cache of all
# (tools/kernel_digest.py says why)
KERNEL_SOURCES = "a3cfee55bd35693b"
