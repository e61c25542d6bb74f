"""The Numba backend's compute op handlers: arithmetic, activations, products, normalisation, reductions.

One handler per op type, registered in ``HANDLERS`` (no if/elif chain), called by
``_numba_plan.Planner`` for each node whose inputs are not all constants.
An activation combined with a constant becomes an affine step (``x * scale +
shift`` per column), folded into the bias of the dense step before it or merged
with the affine step before it; two activations combine in one broadcasting step.
Gemm/MatMul by a constant weight become dense steps (any leading axes), into which
a following bias and activation are fused; MatMul of two activations (attention)
is a batched product. Anything outside these patterns raises
``GraphUnsupportedError`` naming the node.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from ._numba_values import (
    Act,
    Buffer,
    Mat,
    axis_of,
    broadcast_shape,
    broadcast_strides,
    contiguous_strides,
    handles,
    merge_axes,
    unsupported,
)

if TYPE_CHECKING:
    from ._numba_plan import Planner

_BINARY = {"Add": "BIN_ADD", "Sub": "BIN_SUB", "Mul": "BIN_MUL", "Div": "BIN_DIV", "Pow": "BIN_POW",
           "Max": "BIN_MAX", "Min": "BIN_MIN",
           # comparisons give float32 ones and zeros; on those, logical and / or / xor are a product, a maximum
           # and an inequality
           "Greater": "BIN_GREATER", "Less": "BIN_LESS", "Equal": "BIN_EQUAL", "GreaterOrEqual": "BIN_GREATER_EQUAL",
           "LessOrEqual": "BIN_LESS_EQUAL", "And": "BIN_MUL", "Or": "BIN_MAX", "Xor": "BIN_NOT_EQUAL",
           "NotEqual": "BIN_NOT_EQUAL", "Fmod": "BIN_FMOD", "Mod": "BIN_MOD"}


def binary(p: Planner, node, a: Act, b: Act, op: str) -> Act:
    """``a op b`` with ONNX (numpy) broadcasting, as one kernel step."""
    shape = broadcast_shape(node, a.shape, b.shape)
    y = p.new_act(shape)
    sizes, (sa, sb, _) = merge_axes(list(shape), broadcast_strides(a.shape, shape), broadcast_strides(b.shape, shape),
                                    contiguous_strides(shape))
    if len(sizes) > 3:
        raise unsupported(node, f"broadcasting {a.shape} with {b.shape} walks {len(sizes)} axes (at most 3 are supported)")
    pad = 3 - len(sizes)
    sizes, sa, sb = [1] * pad + sizes, [0] * pad + sa, [0] * pad + sb
    p.emit(p.k.OP_BINARY, a.flat(), b.flat(), y.flat(), getattr(p.k, _BINARY[op]), *sizes, *sa, *sb, out=y.buf)
    return y


def affine(p: Planner, node, x: Act, scale: np.ndarray, shift: np.ndarray, name: str) -> Act:
    """``x * scale + shift`` for constants that broadcast into ``x``'s shape, as one affine step.

    The step sees ``x`` as a matrix whose columns span every axis from the first one
    the constants vary along (at least the last), so a per-feature, per-channel or
    per-position constant is one row of values. It extends the affine step or folds
    into the bias of the dense step that wrote ``x`` when only this node reads it.
    """
    rank = len(x.shape)
    lead = 0
    for c in (scale, shift):
        aligned = (1,) * (rank - c.ndim) + c.shape
        first = next((i for i, d in enumerate(aligned) if d != 1), rank)
        lead = first if c is scale else min(lead, first)
    lead = min(lead, max(rank - 1, 0))
    cols = math.prod(x.shape[lead:])
    unit = (1,) * lead + tuple(x.shape[lead:])

    def row(c: np.ndarray) -> np.ndarray:
        return np.broadcast_to(c.astype(np.float32).reshape((1,) * (rank - c.ndim) + c.shape), unit).reshape(-1).copy()

    vs, vb = row(scale), row(shift)
    dense = p.fusable(name, x, p.k.OP_DENSE)
    if dense is not None and (vs == 1).all() and dense.args[4] == p.k.ACT_NONE and dense.args[2].shape[1] == cols:
        dense.args[2] += vb.reshape(1, -1)  # fold into the bias
        return x
    previous = p.fusable(name, x, p.k.OP_AFFINE)
    if previous is not None and previous.args[1].shape[1] == cols:
        s, b = previous.args[1].reshape(-1), previous.args[2].reshape(-1)
        s *= vs
        b *= vs
        b += vb
        return x
    y = p.new_act(x.shape)
    p.emit(p.k.OP_AFFINE, x.mat(cols), p.param(vs), p.param(vb), y.mat(cols), out=y.buf)
    return y


def _other(p: Planner, node, value: float) -> str | None:
    """The input of a two-input node whose other input is the constant ``value``."""
    a, b = node.inputs[:2]
    for x, c in ((a, b), (b, a)):
        s = p.scalar(c)
        if s is not None and abs(s - value) <= 1e-6 * abs(value):
            return x
    return None


def _gelu_input(p: Planner, node) -> str | None:
    """If ``node`` ends torch's exact GELU, ``(x * (erf(x / sqrt(2)) + 1)) * 0.5``, the name of ``x``.

    Each intermediate value must be read only inside the pattern; the four steps
    emitted for it are then dropped as unread, and one GELU step (or a GELU fused
    into the dense or convolution step before it) takes their place.
    """
    if node.op_type != "Mul" or len(node.inputs) != 2:
        return None
    half = _other(p, node, 0.5)
    mul = p.made_by(half, "Mul") if half else None
    for x, added in ((mul.inputs, mul.inputs[::-1]) if mul is not None else ()):
        add = p.made_by(added, "Add")
        one = _other(p, add, 1.0) if add is not None else None
        erf = p.made_by(one, "Erf") if one else None
        if erf is None:
            continue
        div, scaled = p.made_by(erf.inputs[0], "Div"), p.made_by(erf.inputs[0], "Mul")
        if div is not None and div.inputs[0] == x and _other(p, div, 2**0.5) == x:
            return x
        if scaled is not None and _other(p, scaled, 2**-0.5) == x:
            return x
    return None


@handles("Add", "Sub", "Mul", "Div")
def _arith(p: Planner, node) -> None:
    gelu = _gelu_input(p, node)
    source = p.values.get(gelu) if gelu is not None else None
    if isinstance(source, Act):
        p.define(node, unary(p, node, source, p.k.ACT_GELU, name=gelu, readers=2))
        return
    first, second = p.value(node, 0), p.value(node, 1)
    op = node.op_type
    if isinstance(first, Act) and isinstance(second, Act):
        p.define(node, binary(p, node, first, second, op))
        return
    x_first = isinstance(first, Act)
    x, c = (first, second) if x_first else (second, first)
    if not isinstance(x, Act) or not isinstance(c, np.ndarray):
        raise unsupported(node, "inputs that are neither activations nor constants")
    c = c.astype(np.float32)
    if broadcast_shape(node, x.shape, c.shape) != x.shape or (op == "Div" and not x_first):
        a, b = (x, p.materialize(c)) if x_first else (p.materialize(c), x)
        p.define(node, binary(p, node, a, b, op))
        return
    one, zero = np.ones((), np.float32), np.zeros((), np.float32)
    scale: np.ndarray
    shift: np.ndarray
    if op == "Add":
        scale, shift = one, c
    elif op == "Mul":
        scale, shift = c, zero
    elif op == "Div":
        with np.errstate(divide="ignore"):
            scale, shift = (1 / c).astype(np.float32), zero  # x / 0 -> x * inf: inf or NaN, as the division gives
    else:
        scale, shift = (one, -c) if x_first else (-one, c)
    p.define(node, affine(p, node, x, scale, shift, node.inputs[0 if x_first else 1]))


@handles("Greater", "Less", "Equal", "GreaterOrEqual", "LessOrEqual", "And", "Or", "Xor", "Mod")
def _compare(p: Planner, node) -> None:
    """A comparison or logical op with at least one computed input (float32 ones where true, zeros where false), or
    a remainder with the dividend's sign (``Mod`` with ``fmod=1``, ``torch.fmod``) or the divisor's (``fmod=0``)."""
    op = node.op_type if node.op_type != "Mod" else ("Fmod" if node.attributes.get("fmod", 0) else "Mod")
    p.define(node, binary(p, node, p.act(node, 0, materialize=True), p.act(node, 1, materialize=True), op))


@handles("Not")
def _not(p: Planner, node) -> None:
    x = p.act(node)
    p.define(node, affine(p, node, x, -np.ones((), np.float32), np.ones((), np.float32), node.inputs[0]))


def select(p: Planner, node, c: Act, a: Act, b: Act) -> Act:
    """``a`` where ``c`` is nonzero, else ``b``, with ONNX (numpy) broadcasting of all three, as one step."""
    shape = broadcast_shape(node, c.shape, a.shape, b.shape)
    y = p.new_act(shape)
    sizes, (sc, sa, sb, _) = merge_axes(list(shape), broadcast_strides(c.shape, shape),
                                        broadcast_strides(a.shape, shape), broadcast_strides(b.shape, shape),
                                        contiguous_strides(shape))
    if len(sizes) > 3:
        raise unsupported(node, f"broadcasting {c.shape}, {a.shape} and {b.shape} walks {len(sizes)} axes "
                                "(at most 3 are supported)")
    pad = 3 - len(sizes)
    sizes, sc, sa, sb = [1] * pad + sizes, [0] * pad + sc, [0] * pad + sa, [0] * pad + sb
    p.emit(p.k.OP_WHERE, c.flat(), a.flat(), b.flat(), y.flat(), *sizes, *sc, *sa, *sb, out=y.buf)
    return y


@handles("Where")
def _where(p: Planner, node) -> None:
    """``where(cond, a, b)`` as one select step, whether the condition is computed from the inputs
    (``torch.where(x > 0, ...)``, a ``masked_fill`` by a computed mask) or constant (a causal mask): a select, not
    arithmetic with the mask, so an ``-inf`` or NaN on the side not taken never reaches the result."""
    cond = p.value(node, 0)
    if not isinstance(cond, (Act, np.ndarray)):
        raise unsupported(node, "a condition that is neither computed nor a constant")
    c = cond if isinstance(cond, Act) else p.materialize(cond.astype(bool).astype(np.float32))
    p.define(node, select(p, node, c, p.act(node, 1, materialize=True), p.act(node, 2, materialize=True)))


@handles("TopK")
def _topk(p: Planner, node) -> None:
    """The ``k`` largest (``largest=1``) or smallest values along ``axis``, in order (``torch.topk(x, k).values``);
    the indices output is an integer tensor, which runs here only when nothing reads it."""
    x = p.act(node)
    if len(node.outputs) > 1 and node.outputs[1] and p.uses.get(node.outputs[1]):
        raise unsupported(node, "its indices output is read (an integer tensor: only the values run here)")
    axis = axis_of(node, node.attributes.get("axis", -1), len(x.shape))
    k = p.ints(node, 1, "k")
    n = x.shape[axis]
    if not k or not 1 <= k[0] <= n:
        raise unsupported(node, f"k={k} for an axis of {n} values")
    shape = x.shape[:axis] + (k[0],) + x.shape[axis + 1 :]
    y = p.new_act(shape)
    p.emit(p.k.OP_TOPK, x.flat(), y.flat(), math.prod(x.shape[:axis]), n, math.prod(x.shape[axis + 1 :]), k[0],
           int(node.attributes.get("largest", 1)), out=y.buf)
    p.define(node, y)


@handles("ArgMax", "ArgMin")
def _arg_extreme(p: Planner, node) -> None:
    """The index of the largest (``ArgMax``) or smallest value along ``axis``, kept as a float32 value (exact up to
    2**24): a label a model returns with ``.float()``, or compares with a class number."""
    x = p.act(node)
    axis = axis_of(node, node.attributes.get("axis", 0), len(x.shape))
    keep = bool(node.attributes.get("keepdims", 1))
    shape = x.shape[:axis] + ((1,) if keep else ()) + x.shape[axis + 1 :]
    y = p.new_act(shape)
    p.emit(p.k.OP_ARG_EXTREME, x.flat(), y.flat(), math.prod(x.shape[:axis]), x.shape[axis],
           math.prod(x.shape[axis + 1 :]), int(node.op_type == "ArgMax"), int(node.attributes.get("select_last_index", 0)),
           out=y.buf)
    p.define(node, y)


@handles("Neg")
def _neg(p: Planner, node) -> None:
    x = p.act(node)
    p.define(node, affine(p, node, x, -np.ones((), np.float32), np.zeros((), np.float32), node.inputs[0]))


@handles("Max", "Min")
def _extremum(p: Planner, node) -> None:
    vals = [p.value(node, i) for i in range(len(node.inputs))]
    consts = [v for v in vals if isinstance(v, np.ndarray)]
    acts = [v for v in vals if isinstance(v, Act)]
    out = acts[0]
    for v in acts[1:]:
        out = binary(p, node, out, v, node.op_type)
    if consts:
        c = consts[0]
        for more in consts[1:]:
            c = np.maximum(c, more) if node.op_type == "Max" else np.minimum(c, more)
        if c.size == 1 and len(acts) == 1:  # a clip on one side
            bound = float(c.ravel()[0])
            lo, hi = (bound, np.inf) if node.op_type == "Max" else (-np.inf, bound)
            out = unary(p, node, out, p.k.ACT_CLIP, lo, hi)
        else:
            out = binary(p, node, out, p.materialize(c.astype(np.float32)), node.op_type)
    p.define(node, out)


# -- activations ----------------------------------------------------------------------------
_SIMPLE = {"Relu": "ACT_RELU", "Tanh": "ACT_TANH", "Sigmoid": "ACT_SIGMOID", "Erf": "ACT_ERF", "Sqrt": "ACT_SQRT",
           "Exp": "ACT_EXP", "Log": "ACT_LOG", "Abs": "ACT_ABS", "Reciprocal": "ACT_RECIPROCAL",
           "Softplus": "ACT_SOFTPLUS", "Sign": "ACT_SIGN", "Sin": "ACT_SIN", "Cos": "ACT_COS", "Tan": "ACT_TAN",
           "Asin": "ACT_ASIN", "Acos": "ACT_ACOS", "Atan": "ACT_ATAN", "Floor": "ACT_FLOOR", "Ceil": "ACT_CEIL",
           "Round": "ACT_ROUND", "Softsign": "ACT_SOFTSIGN"}
_WITH_PARAMS = {"LeakyRelu": ("ACT_LEAKY_RELU", 0.01, 0.0), "Elu": ("ACT_ELU", 1.0, 0.0),
                "HardSigmoid": ("ACT_HARD_SIGMOID", 0.2, 0.5), "HardSwish": ("ACT_HARD_SWISH", 1 / 6, 0.5)}
_FUSABLE = ("ACT_RELU", "ACT_TANH", "ACT_SIGMOID", "ACT_ERF", "ACT_GELU", "ACT_GELU_TANH")


def unary(p: Planner, node, x: Act, code: int, alpha: float = 0.0, beta: float = 0.0, cols: int | None = None,
          name: str | None = None, readers: int = 1) -> Act:
    """``act(x)``: fused into the dense or convolution step that wrote ``x`` when it can be, else one step.

    ``name`` is the ONNX value of ``x`` (default: the node's first input), read by ``readers`` nodes.
    """
    name = node.inputs[0] if name is None else name
    row_wise = code in (p.k.ACT_SOFTMAX, p.k.ACT_LOG_SOFTMAX)
    elementwise = code in [getattr(p.k, n) for n in _FUSABLE]
    dense = p.fusable(name, x, p.k.OP_DENSE, readers)
    if dense is not None and dense.args[4] == p.k.ACT_NONE and (elementwise or (row_wise and cols == x.shape[-1])):
        dense.args[4] = code
        return x
    conv = p.fusable(name, x, p.k.OP_CONV, readers)
    if conv is not None and conv.args[-1] == p.k.ACT_NONE and elementwise:
        conv.args[-1] = code
        return x
    y = p.new_act(x.shape)
    prm = p.param(np.array([[alpha, beta]], np.float32))
    p.emit(p.k.OP_ACT, x.mat(cols), y.mat(cols), code, prm, out=y.buf)
    return y


@handles(*_SIMPLE, *_WITH_PARAMS, "Gelu", "Clip", "Pow")
def _activation(p: Planner, node) -> None:
    op, a = node.op_type, node.attributes
    alpha, beta = 0.0, 0.0
    if op in _SIMPLE:
        code = getattr(p.k, _SIMPLE[op])
    elif op in _WITH_PARAMS:
        name, alpha, beta = _WITH_PARAMS[op]
        code = getattr(p.k, name)
        alpha, beta = a.get("alpha", alpha), a.get("beta", beta)
    elif op == "Gelu":
        code = p.k.ACT_GELU_TANH if a.get("approximate", "none") == "tanh" else p.k.ACT_GELU
    elif op == "Clip":
        lo, hi = p.const(node, 1, required=False), p.const(node, 2, required=False)
        alpha = float(lo) if lo is not None else a.get("min", -np.inf)
        beta = float(hi) if hi is not None else a.get("max", np.inf)
        code = p.k.ACT_CLIP
    else:  # Pow
        base, exponent = p.value(node, 0), p.value(node, 1)
        if not (isinstance(base, Act) and isinstance(exponent, np.ndarray) and exponent.size == 1):
            a0 = base if isinstance(base, Act) else p.materialize(np.asarray(base, np.float32))
            a1 = exponent if isinstance(exponent, Act) else p.materialize(np.asarray(exponent, np.float32))
            p.define(node, binary(p, node, a0, a1, "Pow"))
            return
        e = float(exponent.ravel()[0])
        if e == 1.0:
            p.define(node, base)
            return
        special = {2.0: p.k.ACT_SQUARE, 0.5: p.k.ACT_SQRT, -1.0: p.k.ACT_RECIPROCAL}
        code, alpha = special.get(e, p.k.ACT_POW), e
    p.define(node, unary(p, node, p.act(node), code, alpha, beta))


@handles("Selu")
def _selu(p: Planner, node) -> None:
    """``gamma * elu(x, alpha)``: the ELU step and a product by the constant."""
    a = node.attributes
    x = unary(p, node, p.act(node), p.k.ACT_ELU, float(a.get("alpha", 1.67326319217681884765625)))
    gamma = np.full((1,) * len(x.shape), a.get("gamma", 1.05070102214813232421875), np.float32)
    p.define(node, binary(p, node, x, p.materialize(gamma), "Mul"))


@handles("PRelu")
def _prelu(p: Planner, node) -> None:
    """``max(x, 0) + slope * min(x, 0)``: two clips, a product by the (broadcast) slope and a sum, as four steps
    (no fusion into the step before: both halves read ``x``)."""
    x = p.act(node)
    slope = p.const(node, 1).astype(np.float32)
    pos = unary(p, node, x, p.k.ACT_CLIP, 0.0, np.inf)
    neg = unary(p, node, x, p.k.ACT_CLIP, -np.inf, 0.0)
    p.define(node, binary(p, node, pos, binary(p, node, neg, p.materialize(slope), "Mul"), "Add"))


def along_axis(p: Planner, node, x: Act, axis: int, w: np.ndarray) -> Act:
    """``w`` (out, in) applied to axis ``axis`` of ``x`` (a product over that axis, the others carried along): the
    axis moved last, one dense step, and moved back where it was."""
    last = len(x.shape) - 1
    if axis != last:
        strides = contiguous_strides(x.shape)
        order = [d for d in range(len(x.shape)) if d != axis] + [axis]
        x = p.rearrange(node, x, 0, [x.shape[d] for d in order], [strides[d] for d in order])
    y = dense(p, x, w, None)
    if axis != last:
        strides = contiguous_strides(y.shape)
        back = list(range(last))
        back.insert(axis, last)  # the result's axis d is the product's axis back[d]
        y = p.rearrange(node, y, 0, [y.shape[b] for b in back], [strides[b] for b in back])
    return y


@handles("CumSum")
def _cumsum(p: Planner, node) -> None:
    """A running sum along one axis as a product with a triangular matrix of ones (``exclusive`` drops the diagonal,
    ``reverse`` sums from the end). The axis of a window is tens to hundreds of frames, so the n x n product costs
    little; the sums are float32, as ONNX Runtime's."""
    x = p.act(node)
    a = axis_of(node, int(np.asarray(p.const(node, 1)).ravel()[0]), len(x.shape))
    n = x.shape[a]
    w = np.tril(np.ones((n, n), np.float32), -1 if node.attributes.get("exclusive", 0) else 0)  # w[j, i]: i <= j
    if node.attributes.get("reverse", 0):
        w = np.ascontiguousarray(w[::-1, ::-1])  # i >= j
    p.define(node, along_axis(p, node, x, a, w))


def _text(value, default: str) -> str:
    return default if value is None else value.decode() if isinstance(value, bytes) else str(value)


def resize_matrix(n_in: int, n_out: int, scale: float, mode: str, transform: str, nearest: str) -> np.ndarray:
    """The (n_out, n_in) matrix of ONNX Resize along one axis: row ``j`` takes output sample ``j`` from the input
    coordinate ``transform`` maps it to (computed in float32), the nearest sample (``nearest``'s rounding) or the
    two around it (linear, the coordinate clamped to the axis, as ONNX Runtime does)."""
    r = np.zeros((n_out, n_in), np.float64)
    f32, half, s = np.float32, np.float32(0.5), np.float32(scale)
    for j in range(n_out):  # in float32, as ONNX Runtime: 3 / 0.6 is 4.9999998 there, and its floor 4
        if transform == "align_corners":
            x = 0.0 if n_out == 1 else float(f32(j) * f32(n_in - 1) / f32(n_out - 1))
        elif transform == "asymmetric":
            x = float(f32(j) / s)
        elif transform == "pytorch_half_pixel" and n_out == 1:
            x = 0.0
        else:  # half_pixel, pytorch_half_pixel
            x = float((f32(j) + half) / s - half)
        if mode == "nearest":
            low = math.floor(x)
            frac = x - low
            if nearest == "floor":
                i = low
            elif nearest == "ceil":
                i = math.ceil(x)
            else:  # round, halves to the floor (round_prefer_floor) or to the ceiling
                i = low + int(frac > 0.5 or (frac == 0.5 and nearest == "round_prefer_ceil"))
            r[j, min(max(i, 0), n_in - 1)] = 1.0
        else:
            x = min(max(x, 0.0), n_in - 1.0)
            i0 = math.floor(x)
            i1, frac = min(i0 + 1, n_in - 1), x - i0
            r[j, i0] += 1.0 - frac
            r[j, i1] += frac
    return r.astype(np.float32)


@handles("Resize")
def _resize(p: Planner, node) -> None:
    """Nearest and linear resizing of the spatial axes (any scale, up or down; sizes or scales; the half_pixel,
    pytorch_half_pixel, align_corners and asymmetric coordinate transforms) as one product per resized axis with
    that axis's interpolation matrix (:func:`resize_matrix`)."""
    x = p.act(node)
    a = node.attributes
    mode = _text(a.get("mode"), "nearest")
    transform = _text(a.get("coordinate_transformation_mode"), "half_pixel")
    nearest = _text(a.get("nearest_mode"), "round_prefer_floor")
    if p.model.opset.get("ai.onnx", 17) < 11:
        raise unsupported(node, "Resize before opset 11")
    if mode not in ("nearest", "linear"):
        raise unsupported(node, f"mode {mode!r} (nearest and linear are supported)")
    if transform not in ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric"):
        raise unsupported(node, f"coordinate_transformation_mode {transform!r}")
    if nearest not in ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil"):
        raise unsupported(node, f"nearest_mode {nearest!r}")
    if a.get("antialias", 0) or a.get("axes") is not None or _text(a.get("keep_aspect_ratio_policy"), "stretch") != "stretch":
        raise unsupported(node, "antialias, axes or keep_aspect_ratio_policy")
    scales, sizes = p.const(node, 2, required=False), p.const(node, 3, required=False)
    if sizes is not None and sizes.size:
        out = [int(v) for v in sizes.ravel()]
        factors = [float(np.float32(o) / np.float32(n)) for o, n in zip(out, x.shape, strict=True)]  # as ORT
    elif scales is not None and scales.size:
        factors = [float(v) for v in scales.ravel()]
        out = [math.floor(n * f) for n, f in zip(x.shape, factors, strict=True)]
    else:
        raise unsupported(node, "neither scales nor sizes is a constant")
    if len(out) != len(x.shape) or out[:2] != list(x.shape[:2]):
        raise unsupported(node, f"resizes {x.shape} to {out}: only the axes after batch and channels")
    y = x
    for axis in range(2, len(x.shape)):
        if out[axis] != x.shape[axis] or factors[axis] != 1.0:
            y = along_axis(p, node, y, axis, resize_matrix(x.shape[axis], out[axis], factors[axis], mode, transform,
                                                           nearest))
    p.define(node, y)


@handles("Softmax", "LogSoftmax")
def _softmax(p: Planner, node) -> None:
    x = p.act(node)
    legacy = p.model.opset.get("ai.onnx", 17) < 13
    a = axis_of(node, node.attributes.get("axis", 1 if legacy else -1), len(x.shape))
    if legacy:
        cols = math.prod(x.shape[a:])
    elif math.prod(x.shape[a + 1 :]) == 1:
        cols = x.shape[a]
    else:
        raise unsupported(node, f"softmax over axis {a} of {x.shape}, which is not the last non-unit axis")
    code = p.k.ACT_SOFTMAX if node.op_type == "Softmax" else p.k.ACT_LOG_SOFTMAX
    p.define(node, unary(p, node, x, code, cols=cols))


# -- products -------------------------------------------------------------------------------
def dense(p: Planner, x: Act, w: np.ndarray, bias: np.ndarray | None,
          storage: tuple[int, np.ndarray | None] | None = None) -> Act:
    """``x @ w.T + bias`` over the last axis of ``x`` (any leading axes), ``w`` of shape (out, in).

    ``storage``: how the weights are kept (``Planner.storage``; default float32).
    """
    n = w.shape[0]
    b = np.zeros((1, n), np.float32) if bias is None else np.broadcast_to(bias.astype(np.float32), (1, n))
    y = p.new_act(x.shape[:-1] + (n,))
    code, scales = storage or (p.k.W_F32, None)
    p.emit(p.k.OP_DENSE, x.mat(), p.panels(p.k.panel_layout(w), code, scales), p.param(b), y.mat(), p.k.ACT_NONE,
           code, out=y.buf)
    return y


def batched_matmul(p: Planner, node, a: Act, b: Act) -> Act:
    """ONNX MatMul of two activations (numpy semantics: 1-D operands, broadcast leading axes).

    A scalar scaling of either operand that only this product reads is folded into it.
    """
    a, alpha_a = _unscaled(p, node.inputs[0], a)
    b, alpha_b = _unscaled(p, node.inputs[1], b)
    alpha = alpha_a * alpha_b
    sa = (1,) + a.shape if len(a.shape) == 1 else a.shape
    sb = b.shape + (1,) if len(b.shape) == 1 else b.shape
    m, k, n = sa[-2], sa[-1], sb[-1]
    if sb[-2] != k:
        raise unsupported(node, f"MatMul of {a.shape} and {b.shape}: inner sizes differ")
    lead = broadcast_shape(node, sa[:-2], sb[:-2])
    count = math.prod(lead)
    steps = []
    for v, s in ((a, sa), (b, sb)):
        own = (1,) * (len(lead) - len(s[:-2])) + s[:-2]
        if math.prod(own) == 1:
            steps.append((v, 0))
        elif own == lead:
            steps.append((v, s[-2] * s[-1]))
        else:  # partly broadcast: spell it out
            full = lead + s[-2:]
            steps.append((p.rearrange(node, Act(v.buf, s), 0, full, broadcast_strides(s, full)), s[-2] * s[-1]))
    shape = lead + ((m,) if len(a.shape) > 1 else ()) + ((n,) if len(b.shape) > 1 else ())
    y = p.new_act(shape)
    (av, a_step), (bv, b_step) = steps
    bv, trans_b = _transposed_source(p, bv, b_step)
    packed = Buffer(-(-n // p.k.LANES) * k * p.k.LANES)
    p.emit(p.k.OP_BATCHED_MATMUL, Mat(av.buf, count * m if a_step else m, k), bv.flat(),
           p.param(np.zeros((1, n), np.float32)), Mat(y.buf, count * m, n),
           Mat(packed, -(-n // p.k.LANES), k * p.k.LANES), p.param(np.array([[alpha]], np.float32)),
           count, m, k, n, a_step, b_step, trans_b, out=[y.buf, packed])
    return y


def _unscaled(p: Planner, name: str, v: Act) -> tuple[Act, float]:
    """``v`` before the scalar scaling that made it, if only the product reads it (attention's 1/sqrt(d))."""
    affine = p.fusable(name, v, p.k.OP_AFFINE)
    if affine is None:
        return v, 1.0
    scale, shift = affine.args[1].ravel(), affine.args[2].ravel()
    if (shift != 0).any() or (scale != scale[0]).any():
        return v, 1.0
    return Act(affine.args[0].buf, v.shape), float(scale[0])


def _transposed_source(p: Planner, b: Act, b_step: int) -> tuple[Act, int]:
    """``b`` as (..., n, k) for a transposed read when it was copied out of a tensor laid out that way.

    torch exports ``q @ k.transpose(-2, -1)``: the transpose is a strided copy of ``k``, and
    reading ``k`` itself transposed makes that copy unread (then dropped).
    """
    record = p.copied.get(id(b.buf))
    if record is None or len(b.shape) < 2 or record[2] != b.shape:
        return b, 0
    src, base, shape, strides = record
    t_shape = shape[:-2] + (shape[-1], shape[-2])
    t_strides = strides[:-2] + [strides[-1], strides[-2]]
    sizes, (merged,) = merge_axes(list(t_shape), t_strides)
    if sizes and not (len(sizes) == 1 and merged[0] == 1):
        return b, 0  # not a plain view of the source: keep the copy
    return Act(src.buf.window(base, math.prod(t_shape)), t_shape), 1


@handles("Gemm")
def _gemm(p: Planner, node) -> None:
    a = node.attributes
    x = p.act(node)
    if a.get("transA", 0):
        x = p.rearrange(node, x, 0, x.shape[::-1], contiguous_strides(x.shape)[::-1])
    w = p.const(node, 1).astype(np.float32)
    w = (w if a.get("transB", 0) else w.T) * np.float32(a.get("alpha", 1.0))
    # a scaled weight is no longer the values the file stores: keep it in float32
    storage = p.storage(node, 1, 0 if a.get("transB", 0) else 1) if a.get("alpha", 1.0) == 1.0 else None
    if len(x.shape) != 2 or x.shape[1] != w.shape[1]:
        raise unsupported(node, f"input {x.shape} does not match weight {w.shape}")
    c = p.value(node, 2)
    beta = np.float32(a.get("beta", 1.0))
    per_column = isinstance(c, np.ndarray) and c.size in (1, w.shape[0]) and c.shape[-1:] in ((), (1,), (w.shape[0],))
    y = dense(p, x, w, c.reshape(-1) * beta if per_column else None, storage)
    if c is not None and not per_column:
        cv = c if isinstance(c, Act) else p.materialize(np.asarray(c, np.float32))
        if beta != 1:
            cv = affine(p, node, cv, np.asarray(beta), np.zeros((), np.float32), node.inputs[2])
        y = binary(p, node, y, cv, "Add")
    p.define(node, y)


@handles("MatMul")
def _matmul(p: Planner, node) -> None:
    a, b = p.value(node, 0), p.value(node, 1)
    if isinstance(a, Act) and isinstance(b, np.ndarray) and b.ndim == 2:
        if a.shape[-1] != b.shape[0]:
            raise unsupported(node, f"activation {a.shape} @ constant {b.shape}: inner sizes differ")
        p.define(node, dense(p, a, b.astype(np.float32).T, None, p.storage(node, 1, 1)))
        return
    p.define(node, batched_matmul(p, node, p.act(node, 0, materialize=True), p.act(node, 1, materialize=True)))


@handles("Einsum")
def _einsum(p: Planner, node) -> None:
    """A two-operand Einsum that is a batched matrix product (``bqd,bkd->bqk``, ``btc,cd->btd``,
    ``bthd,hde->bthe``, ...): letters in both operands and the output are batch axes, letters in one operand and
    the output are its rows or columns, letters in both operands only are contracted. Each operand is laid out
    as (batch..., rows, inner) and (batch..., inner, columns) by strided views (a copy where not contiguous),
    the letters of each group merged into one axis, then one batched product, and the result in the output's
    order. Ellipses, repeated letters, sums over one operand and other operand counts are refused."""
    eq = str(node.attributes.get("equation", "")).replace(" ", "")
    if "..." in eq or "->" not in eq or len(node.inputs) != 2:
        raise unsupported(node, f"equation {eq!r} (two operands, an explicit output, no ellipsis are supported)")
    lhs, out = eq.split("->")
    ins = lhs.split(",")
    a, b = p.act(node, 0, materialize=True), p.act(node, 1, materialize=True)
    if len(ins) != 2 or len(ins[0]) != len(a.shape) or len(ins[1]) != len(b.shape) or any(
            len(set(t)) != len(t) for t in (*ins, out)):
        raise unsupported(node, f"equation {eq!r} for operands of shapes {a.shape} and {b.shape}")
    ia, ib = ins
    batch = [c for c in out if c in ia and c in ib]
    rows = [c for c in out if c in ia and c not in ib]
    cols = [c for c in out if c in ib and c not in ia]
    inner = [c for c in ia if c in ib and c not in out]
    if set(ia + ib) - set(out) - set(inner) or set(out) - set(ia + ib):
        raise unsupported(node, f"equation {eq!r} sums over a letter of one operand, or names one no operand has")
    size: dict[str, int] = {}
    for term, x in ((ia, a), (ib, b)):
        for c, d in zip(term, x.shape, strict=True):
            if size.setdefault(c, d) != d:
                raise unsupported(node, f"equation {eq!r}: letter {c!r} has sizes {size[c]} and {d}")

    def laid_out(x: Act, term: str, groups: list[list[str]]) -> Act:
        """``x`` with its axes in the groups' order, each group merged into one axis (empty: an axis of 1)."""
        strides = contiguous_strides(x.shape)
        order = [c for g in groups for c in g]
        v = p.rearrange(node, x, 0, [size[c] for c in order], [strides[term.index(c)] for c in order])
        return Act(v.buf, tuple(math.prod(size[c] for c in g) for g in groups))

    left = laid_out(a, ia, [[c] for c in batch] + [rows, inner])
    right = laid_out(b, ib, [[c] for c in batch] + [inner, cols])
    y = batched_matmul(p, node, left, right)  # (batch..., rows, columns), contiguous
    mid = [*batch, *rows, *cols]
    full = tuple(size[c] for c in mid)
    strides = contiguous_strides(full)
    p.define(node, p.rearrange(node, Act(y.buf, full), 0, [size[c] for c in out],
                               [strides[mid.index(c)] for c in out]))


# -- normalisation and reductions -------------------------------------------------------------
def _layer_norm(p: Planner, x: Act, cols: int, scale: np.ndarray, shift: np.ndarray, eps: float) -> Act:
    y = p.new_act(x.shape)
    p.emit(p.k.OP_LAYER_NORM, x.mat(cols), p.param(scale.reshape(1, -1)), p.param(shift.reshape(1, -1)), y.mat(cols),
           p.param(np.array([[eps]], np.float32)), out=y.buf)
    return y


@handles("LayerNormalization")
def _layer_normalization(p: Planner, node) -> None:
    if any(p.uses.get(o) for o in node.outputs[1:] if o):
        raise unsupported(node, "its mean or inverse standard deviation output is used")
    x = p.act(node)
    a = axis_of(node, node.attributes.get("axis", -1), len(x.shape))
    tail = x.shape[a:]
    scale = np.broadcast_to(p.const(node, 1).astype(np.float32), tail)
    bias = p.const(node, 2, required=False)
    shift = np.zeros(tail, np.float32) if bias is None else np.broadcast_to(bias.astype(np.float32), tail)
    p.define(node, _layer_norm(p, x, math.prod(tail), scale, shift, node.attributes.get("epsilon", 1e-5)))


@handles("InstanceNormalization")
def _instance_norm(p: Planner, node) -> None:
    x = p.act(node)
    c, spatial = x.shape[1], math.prod(x.shape[2:])
    normed = _layer_norm(p, x, spatial, np.ones(spatial, np.float32), np.zeros(spatial, np.float32),
                         node.attributes.get("epsilon", 1e-5))
    per_channel = (c,) + (1,) * (len(x.shape) - 2)
    p.define(node, affine(p, node, normed, p.const(node, 1).reshape(per_channel), p.const(node, 2).reshape(per_channel),
                          ""))


@handles("BatchNormalization")
def _batch_norm(p: Planner, node) -> None:
    if node.attributes.get("training_mode", 0) or any(p.uses.get(o) for o in node.outputs[1:] if o):
        raise unsupported(node, "training mode (export the model in eval mode)")
    x = p.act(node)
    scale, bias, mean, var = (p.const(node, i).astype(np.float64) for i in range(1, 5))
    s = scale / np.sqrt(var + node.attributes.get("epsilon", 1e-5))
    per_channel = (x.shape[1],) + (1,) * (len(x.shape) - 2)
    p.define(node, affine(p, node, x, s.reshape(per_channel).astype(np.float32),
                          (bias - mean * s).reshape(per_channel).astype(np.float32), node.inputs[0]))


_REDUCE = {"ReduceMean": "RED_MEAN", "ReduceSum": "RED_SUM", "ReduceMax": "RED_MAX", "ReduceMin": "RED_MIN",
           "ReduceSumSquare": "RED_SUM_SQUARE", "ReduceL1": "RED_L1", "ReduceL2": "RED_L2",
           "GlobalAveragePool": "RED_MEAN", "GlobalMaxPool": "RED_MAX"}


def reduce(p: Planner, node, x: Act, axes: list[int], keepdims: bool, code: str) -> Act:
    rank = len(x.shape)
    axes = sorted({axis_of(node, a, rank) for a in axes}) if axes else list(range(rank))
    lo, hi = axes[0], axes[-1]
    if any(x.shape[i] != 1 for i in range(lo, hi + 1) if i not in axes):
        raise unsupported(node, f"reducing axes {axes} of {x.shape}, which are not next to each other")
    shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape)) if keepdims else \
        tuple(d for i, d in enumerate(x.shape) if i not in axes)
    y = p.new_act(shape)
    outer, n, inner = math.prod(x.shape[:lo]), math.prod(x.shape[lo : hi + 1]), math.prod(x.shape[hi + 1 :])
    p.emit(p.k.OP_REDUCE, x.flat(), y.flat(), getattr(p.k, code), outer, n, inner, out=y.buf)
    return y


@handles("ReduceLogSumExp")
def _reduce_log_sum_exp(p: Planner, node) -> None:
    """``m + log(sum(exp(x - m)))`` with ``m`` the maximum over the same axes (no overflow, as ONNX Runtime)."""
    x = p.act(node)
    axes = p.ints(node, 1, "axes") or []
    if not axes and node.attributes.get("noop_with_empty_axes", 0):
        p.define(node, x)
        return
    top = reduce(p, node, x, axes, True, "RED_MAX")
    total = reduce(p, node, unary(p, node, binary(p, node, x, top, "Sub"), p.k.ACT_EXP), axes, True, "RED_SUM")
    y = binary(p, node, unary(p, node, total, p.k.ACT_LOG), top, "Add")
    if not node.attributes.get("keepdims", 1):
        rank = len(x.shape)
        gone = {axis_of(node, a, rank) for a in axes} if axes else set(range(rank))
        y = Act(y.buf, tuple(d for i, d in enumerate(y.shape) if i not in gone))
    p.define(node, y)


@handles(*_REDUCE)
def _reduce(p: Planner, node) -> None:
    x = p.act(node)
    if node.op_type.startswith("Global"):
        p.define(node, reduce(p, node, x, list(range(2, len(x.shape))), True, _REDUCE[node.op_type]))
        return
    axes = p.ints(node, 1, "axes")
    if not axes and node.attributes.get("noop_with_empty_axes", 0):
        p.define(node, x)
        return
    p.define(node, reduce(p, node, x, axes or [], bool(node.attributes.get("keepdims", 1)), _REDUCE[node.op_type]))
