"""The Numba backend's shape ops: constants, shapes, and the ops that only move data.

Registered in ``HANDLERS`` (for activations) and ``FOLDS`` (numpy, when every input is
a constant: shapes are concrete once the batch is fixed, so the Shape -> Gather ->
Concat -> Reshape chains exporters write fold away). Reshape, Flatten, Squeeze and
Unsqueeze rename an activation; Transpose, Slice (any axes and steps), Gather,
Split and Expand describe their result as a strided view of the input
(``Planner.rearrange``), which costs nothing when it is one contiguous run and one
strided copy otherwise; Concat places each part where it lands in the result when
it can, and copies it there otherwise; Pad copies the input into the middle of its result
and fills the borders (a constant block, or reversed or repeated views of the input).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ..onnx_reader import ONNX_DTYPES
from ._numba_ops import binary
from ._numba_values import (
    FOLDS,
    STORAGE,
    Act,
    StoredWeight,
    axis_of,
    broadcast_shape,
    broadcast_strides,
    contiguous_strides,
    handles,
    unsupported,
)

if TYPE_CHECKING:
    from ._numba_plan import Planner


def folds(*ops: str):
    def register(fn):
        for op in ops:
            FOLDS[op] = fn
        return fn

    return register


def _ints(v) -> list[int]:
    return [int(a) for a in np.asarray(v).ravel()]


# -- shape arithmetic shared by folds and activations ---------------------------------------
def _unsqueezed(node, shape, axes) -> tuple:
    out = list(shape)
    for a in sorted(axis_of(node, a, len(shape) + len(axes)) for a in axes):
        out.insert(a, 1)
    return tuple(out)


def _squeezed(node, shape, axes) -> tuple:
    drop = {axis_of(node, a, len(shape)) for a in axes} if axes else {i for i, d in enumerate(shape) if d == 1}
    if any(shape[a] != 1 for a in drop):
        raise unsupported(node, f"squeezing axes {sorted(drop)} of shape {tuple(shape)} that are not of size 1")
    return tuple(d for i, d in enumerate(shape) if i not in drop)


def _reshaped(node, shape, target) -> tuple:
    if not node.attributes.get("allowzero", 0):
        target = [shape[i] if d == 0 else d for i, d in enumerate(target)]
    size = math.prod(shape)
    known = math.prod(d for d in target if d != -1)
    if -1 in target:
        if known == 0 or size % known:
            raise unsupported(node, f"cannot reshape {tuple(shape)} to {tuple(target)}")
        target = [size // known if d == -1 else d for d in target]
    if math.prod(target) != size:
        raise unsupported(node, f"reshape of {tuple(shape)} to {tuple(target)} changes the size")
    return tuple(int(d) for d in target)


def _flattened(node, shape) -> tuple:
    a = node.attributes.get("axis", 1)
    a = a + len(shape) if a < 0 else a
    return (math.prod(shape[:a]), math.prod(shape[a:]))


def _sliced(node, shape, starts, ends, axes, steps):
    """(base, shape, strides) of a slice of a contiguous tensor, in elements."""
    strides = contiguous_strides(tuple(shape))
    out, walk, base = list(shape), list(strides), 0
    axes = axes if axes is not None else list(range(len(starts)))
    steps = steps if steps is not None else [1] * len(starts)
    for a, s, e, st in zip(axes, starts, ends, steps, strict=True):
        a = axis_of(node, a, len(shape))
        if st == 0:
            raise unsupported(node, "a slice step of 0")
        lo, hi, st = slice(s, e, st).indices(shape[a])
        out[a] = len(range(lo, hi, st))
        base += lo * strides[a]
        walk[a] = strides[a] * st
    return base, tuple(out), walk


# -- constants and shapes -----------------------------------------------------------------
@handles("Constant")
def _constant(p: Planner, node) -> None:
    a = node.attributes
    for key in ("value_float", "value_floats", "value_int", "value_ints"):
        if key in a:
            p.define(node, np.asarray(a[key], np.float32 if "float" in key else np.int64))
            return
    if node.outputs[0] not in p.model.initializers:
        raise unsupported(node, f"constant attributes {sorted(a)} are not supported")
    p.define(node, p.model.initializers[node.outputs[0]])


@folds("Identity", "Dropout")
def _fold_identity(node, x, *rest):
    return x


@folds("Cast")
def _fold_cast(node, x):
    return x.astype(ONNX_DTYPES[node.attributes.get("to")])


def _stored_cast(node, x) -> StoredWeight | None:
    return StoredWeight("float16") if x.dtype == np.float16 and node.attributes.get("to") == 1 else None


STORAGE["Cast"] = _stored_cast


def _per_axis(node, x: np.ndarray, v: np.ndarray) -> np.ndarray:
    """A DequantizeLinear scale or zero point shaped to broadcast against ``x`` (scalar or along ``axis``)."""
    if v.size == 1:
        return v.reshape(())
    a = axis_of(node, node.attributes.get("axis", 1), x.ndim)
    if v.ndim != 1 or v.size != x.shape[a]:
        raise unsupported(node, f"a scale or zero point of shape {v.shape} for input {x.shape} along axis {a}")
    return v.reshape([-1 if i == a else 1 for i in range(x.ndim)])


@folds("DequantizeLinear")
def _fold_dequantize(node, x, scale, zero=None):
    if node.attributes.get("block_size", 0):
        raise unsupported(node, "blocked quantization (block_size); per-tensor and per-axis scales are supported")
    q = x.astype(np.float32)
    if zero is not None:
        q = q - _per_axis(node, x, zero).astype(np.float32)
    return (q * _per_axis(node, x, scale).astype(np.float32)).astype(np.float32)


def _stored_dequantize(node, x, scale, zero=None) -> StoredWeight | None:
    # Only a DequantizeLinear without a zero point keeps its int8 codes: the plan's layout must follow the
    # graph's types, not its values, or a weight scrubber's repair of a flipped zero point would change the
    # layout under the running kernels (a zero point present runs in float32, dequantized at load).
    if x.dtype != np.int8 or zero is not None or node.attributes.get("block_size", 0):
        return None
    axis = axis_of(node, node.attributes.get("axis", 1), x.ndim) if scale.size > 1 else 0
    return StoredWeight("int8", np.asarray(scale, np.float32).reshape(-1), axis)


STORAGE["DequantizeLinear"] = _stored_dequantize


ONNX_FLOAT, ONNX_BOOL = 1, 9  # TensorProto data types


@handles("Identity", "Dropout", "Cast")
def _identity(p: Planner, node) -> None:
    # a boolean is kept as float32 ones and zeros: casting one to float32 changes nothing, and casting a float32
    # value to bool gives 1 where it is nonzero (NaN too), else 0
    to = node.attributes.get("to")
    if node.op_type == "Cast" and to == ONNX_BOOL:
        p.define(node, binary(p, node, p.act(node), p.materialize(np.zeros((), np.float32)), "NotEqual"))
        return
    if node.op_type == "Cast" and to != ONNX_FLOAT:
        raise unsupported(node, f"casting an activation to ONNX type {to} (float32 and bool run here)")
    if node.op_type == "Dropout" and len(node.outputs) > 1 and p.uses.get(node.outputs[1]):
        raise unsupported(node, "the dropout mask output is used")
    p.define(node, p.act(node))


def _shape_slice(node, shape):
    start, end = node.attributes.get("start", 0), node.attributes.get("end")
    return np.array(shape[start:end], dtype=np.int64)


@folds("Shape")
def _fold_shape(node, x):
    return _shape_slice(node, x.shape)


@folds("Size")
def _fold_size(node, x):
    return np.array(x.size, dtype=np.int64)


@handles("Shape", "Size")
def _shape(p: Planner, node) -> None:
    x = p.act(node)
    p.define(node, _shape_slice(node, x.shape) if node.op_type == "Shape" else np.array(x.size, dtype=np.int64))


@folds("ConstantOfShape")
def _fold_constant_of_shape(node, shape):
    fill = np.asarray(node.attributes.get("value", np.zeros(1, np.float32))).ravel()
    return np.full(_ints(shape), fill[0], dtype=fill.dtype)


# -- renaming: the data stays where it is -------------------------------------------------
@folds("Unsqueeze")
def _fold_unsqueeze(node, x, axes=None):
    return x.reshape(_unsqueezed(node, x.shape, _ints(axes) if axes is not None else node.attributes["axes"]))


@folds("Squeeze")
def _fold_squeeze(node, x, axes=None):
    axes = _ints(axes) if axes is not None else node.attributes.get("axes")
    return x.reshape(_squeezed(node, x.shape, axes))


@folds("Reshape")
def _fold_reshape(node, x, target):
    return x.reshape(_reshaped(node, x.shape, _ints(target)))


@folds("Flatten")
def _fold_flatten(node, x):
    return x.reshape(_flattened(node, x.shape))


@handles("Unsqueeze", "Squeeze", "Reshape", "Flatten")
def _rename(p: Planner, node) -> None:
    x = p.act(node)
    if node.op_type == "Unsqueeze":
        shape = _unsqueezed(node, x.shape, p.ints(node, 1, "axes") or [])
    elif node.op_type == "Squeeze":
        shape = _squeezed(node, x.shape, p.ints(node, 1, "axes"))
    elif node.op_type == "Reshape":
        shape = _reshaped(node, x.shape, _ints(p.const(node, 1)))
    else:
        shape = _flattened(node, x.shape)
    p.define(node, Act(x.buf, shape))


# -- moving data: a view when contiguous, a strided copy otherwise ------------------------
@folds("Transpose")
def _fold_transpose(node, x):
    return np.transpose(x, node.attributes.get("perm"))


@handles("Transpose")
def _transpose(p: Planner, node) -> None:
    x = p.act(node)
    perm = node.attributes.get("perm") or list(range(len(x.shape)))[::-1]
    strides = contiguous_strides(x.shape)
    p.define(node, p.rearrange(node, x, 0, [x.shape[a] for a in perm], [strides[a] for a in perm]))


def _slice_args(p: Planner, node):
    starts, ends = p.ints(node, 1, "starts"), p.ints(node, 2, "ends")
    if starts is None or ends is None:
        raise unsupported(node, "a slice without starts or ends")
    return starts, ends, p.ints(node, 3, "axes"), p.ints(node, 4, "steps")


@folds("Slice")
def _fold_slice(node, x, starts=None, ends=None, axes=None, steps=None):
    a = node.attributes
    starts = _ints(starts) if starts is not None else a.get("starts")
    ends = _ints(ends) if ends is not None else a.get("ends")
    if starts is None or ends is None:
        raise unsupported(node, "a slice without starts or ends")
    axes = _ints(axes) if axes is not None else a.get("axes")
    steps = _ints(steps) if steps is not None else None
    sl = [slice(None)] * x.ndim
    for ax, s, e, st in zip(axes or range(len(starts)), starts, ends, steps or [1] * len(starts), strict=True):
        sl[ax] = slice(s, e, st)
    return x[tuple(sl)]


@handles("Slice")
def _slice(p: Planner, node) -> None:
    x = p.act(node)
    base, shape, strides = _sliced(node, x.shape, *_slice_args(p, node))
    p.define(node, p.rearrange(node, x, base, shape, strides))


@folds("Gather")
def _fold_gather(node, x, idx):
    return np.take(x, idx.astype(np.int64), axis=node.attributes.get("axis", 0))


@handles("Gather")
def _gather(p: Planner, node) -> None:
    x, idx = p.act(node), p.const(node, 1).astype(np.int64)
    a = axis_of(node, node.attributes.get("axis", 0), len(x.shape))
    n = x.shape[a]
    if idx.size and (idx.min() < -n or idx.max() >= n):
        raise unsupported(node, f"indices {idx.ravel().tolist()} out of range for axis {a} of size {n}")
    flat = np.where(idx < 0, idx + n, idx).ravel()
    strides = contiguous_strides(x.shape)
    head, tail = list(x.shape[:a]), list(x.shape[a + 1 :])
    steps = np.diff(flat)
    if flat.size == 1 or (flat.size > 1 and (steps == steps[0]).all() and steps[0] != 0):
        # an arithmetic progression of indices: one strided view of the input
        step = int(steps[0]) if flat.size > 1 else 0
        idx_strides = contiguous_strides(idx.shape)
        walk = [s * step * strides[a] for s in idx_strides]
        shape = head + list(idx.shape) + tail
        walk = strides[:a] + walk + strides[a + 1 :]
        p.define(node, p.rearrange(node, x, int(flat[0]) * strides[a], shape, walk))
        return
    out = p.new_act(tuple(head + list(idx.shape) + tail))
    inner = math.prod(tail)
    for j, i in enumerate(flat):  # one copy per index
        part = head + tail
        p.copy(node, x, int(i) * strides[a], part, strides[:a] + strides[a + 1 :], out.buf, j * inner,
               [s * flat.size * inner for s in contiguous_strides(tuple(head))] + contiguous_strides(tuple(tail)))
    p.define(node, out)


@folds("Concat")
def _fold_concat(node, *xs):
    return np.concatenate(xs, axis=node.attributes.get("axis", 0))


@handles("Concat")
def _concat(p: Planner, node) -> None:
    parts = [p.act(node, i, materialize=True) for i in range(len(node.inputs))]
    rank = len(parts[0].shape)
    a = axis_of(node, node.attributes.get("axis", 0), rank)
    for q in parts:
        if len(q.shape) != rank or q.shape[:a] + q.shape[a + 1 :] != parts[0].shape[:a] + parts[0].shape[a + 1 :]:
            raise unsupported(node, f"parts of shapes {[q.shape for q in parts]} do not concatenate on axis {a}")
    shape = list(parts[0].shape)
    shape[a] = sum(q.shape[a] for q in parts)
    out = p.new_act(tuple(shape))
    out_strides = contiguous_strides(out.shape)
    contiguous = math.prod(shape[:a]) == 1  # each part is one run of the result
    offset, placed = 0, set()
    for q in parts:
        base = offset * out_strides[a]
        if contiguous and q.buf.placeable and id(q.buf) not in placed and q.buf is not out.buf:
            q.buf.place(out.buf, base)  # the producer writes straight into its part of the result
            placed.add(id(q.buf))
        else:
            p.copy(node, q, 0, q.shape, contiguous_strides(q.shape), out.buf, base, out_strides)
        offset += q.shape[a]
    p.define(node, out)


@folds("Pad")
def _fold_pad(node, x, pads=None, value=None, axes=None):
    mode = _pad_mode(node)
    widths = _pad_widths(node, x.ndim, _ints(pads) if pads is not None else node.attributes.get("pads"),
                         _ints(axes) if axes is not None else None)
    fill = _pad_value(value)
    if mode == "constant":
        return np.pad(x, widths, mode="constant", constant_values=fill)
    if mode == "reflect":
        return np.pad(x, widths, mode="reflect")
    if mode == "edge":
        return np.pad(x, widths, mode="edge")
    raise unsupported(node, f"pad mode {mode!r}")


def _pad_mode(node) -> str:
    mode = node.attributes.get("mode", "constant")
    return mode.decode() if isinstance(mode, bytes) else str(mode)


def _pad_value(value) -> float:
    """The constant a Pad fills with: its optional third input, 0 when absent or empty."""
    return float(np.asarray(value).ravel()[0]) if value is not None and np.asarray(value).size else 0.0


def _pad_widths(node, rank: int, pads, axes) -> list[tuple[int, int]]:
    """ONNX ``pads`` (all begins, then all ends, over ``axes`` or every axis) as (begin, end) per axis."""
    if pads is None:
        raise unsupported(node, "a pad without pads")
    axes = [axis_of(node, a, rank) for a in axes] if axes is not None else list(range(rank))
    if len(pads) != 2 * len(axes):
        raise unsupported(node, f"{len(pads)} pads for {len(axes)} axes")
    widths = [(0, 0)] * rank
    for k, a in enumerate(axes):
        widths[a] = (int(pads[k]), int(pads[k + len(axes)]))
    if any(b < 0 or e < 0 for b, e in widths):
        raise unsupported(node, f"negative pads {pads} (a crop)")
    return widths


@handles("Pad")
def _pad(p: Planner, node) -> None:
    """Constant, reflect and edge padding as strided copies: the input into the middle of the result, then each
    padded border (constant: from a constant block; reflect and edge: views of the input walking backwards or
    standing still along the padded axis; those two modes pad one axis)."""
    x = p.act(node)
    mode = _pad_mode(node)
    widths = _pad_widths(node, len(x.shape), p.ints(node, 1, "pads"), p.ints(node, 3, "axes"))
    padded = [a for a, (b, e) in enumerate(widths) if b or e]
    if not padded:
        p.define(node, x)
        return
    shape = tuple(n + b + e for n, (b, e) in zip(x.shape, widths, strict=True))
    out = p.new_act(shape)
    dst = contiguous_strides(shape)
    src = contiguous_strides(x.shape)
    if mode == "constant":
        value = p.const(node, 2, required=False)
        fill = _pad_value(value)
        block = p.materialize(np.full(shape, fill, np.float32))
        p.copy(node, block, 0, shape, dst, out.buf, 0, dst)
    elif mode not in ("reflect", "edge"):
        raise unsupported(node, f"pad mode {mode!r} (constant, reflect and edge are supported)")
    elif len(padded) > 1:
        raise unsupported(node, f"{mode} padding of {len(padded)} axes (one axis is supported)")
    middle = sum(b * st for (b, _), st in zip(widths, dst, strict=True))
    p.copy(node, x, 0, x.shape, src, out.buf, middle, dst)
    if mode != "constant":
        a = padded[0]
        (b, e), n = widths[a], x.shape[a]
        if mode == "reflect" and max(b, e) > n - 1:
            raise unsupported(node, f"reflect padding of {max(b, e)} on an axis of {n} (at most {n - 1})")
        for count, first_out, first_in, step in ((b, 0, b if mode == "reflect" else 0, -1 if mode == "reflect" else 0),
                                                 (e, b + n, n - 2 if mode == "reflect" else n - 1,
                                                  -1 if mode == "reflect" else 0)):
            if not count:
                continue
            part = list(x.shape)
            part[a] = count
            walk = list(src)
            walk[a] = src[a] * step
            p.copy(node, x, first_in * src[a], part, walk, out.buf, first_out * dst[a], dst)
    p.define(node, out)


@folds("Split")
def _fold_split(node, x, split=None):
    a = node.attributes.get("axis", 0)
    sizes = _split_sizes(node, x.shape[a], _ints(split) if split is not None else node.attributes.get("split"))
    return tuple(np.split(x, np.cumsum(sizes)[:-1], axis=a))


def _split_sizes(node, n: int, given) -> list[int]:
    if given:
        sizes = [int(s) for s in given]
    else:
        k = len(node.outputs)
        chunk = -(-n // k)
        sizes = [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])
    if sum(sizes) != n or len(sizes) != len(node.outputs):
        raise unsupported(node, f"split sizes {sizes} for an axis of size {n} into {len(node.outputs)} outputs")
    return sizes


@handles("Split")
def _split(p: Planner, node) -> None:
    x = p.act(node)
    a = axis_of(node, node.attributes.get("axis", 0), len(x.shape))
    sizes = _split_sizes(node, x.shape[a], p.ints(node, 1, "split"))
    strides = contiguous_strides(x.shape)
    offset = 0
    for k, n in enumerate(sizes):
        shape = list(x.shape)
        shape[a] = n
        if node.outputs[k]:
            p.define(node, p.rearrange(node, x, offset * strides[a], shape, strides), k)
        offset += n


@folds("Expand")
def _fold_expand(node, x, shape):
    return x * np.ones(_ints(shape), dtype=x.dtype)


@handles("Expand")
def _expand(p: Planner, node) -> None:
    x = p.act(node)
    out = broadcast_shape(node, x.shape, tuple(_ints(p.const(node, 1))))
    p.define(node, p.rearrange(node, x, 0, out, broadcast_strides(x.shape, out)))


# -- constant-only ops exporters use for shapes and masks ---------------------------------
def _int_div(a, b):
    if a.dtype.kind in "iu" and b.dtype.kind in "iu":
        return (np.trunc(a / b)).astype(np.result_type(a, b))  # ONNX integer division truncates
    return np.divide(a, b)


_NUMPY: dict[str, Callable] = {
    "Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": _int_div, "Pow": np.power,
    "Equal": np.equal, "Less": np.less, "Greater": np.greater, "LessOrEqual": np.less_equal,
    "GreaterOrEqual": np.greater_equal, "And": np.logical_and, "Or": np.logical_or, "Xor": np.logical_xor,
    "Not": np.logical_not, "Neg": np.negative, "Abs": np.abs, "Sqrt": np.sqrt, "Reciprocal": np.reciprocal,
    "Exp": np.exp, "Log": np.log, "Floor": np.floor, "Ceil": np.ceil, "Where": np.where, "Sign": np.sign,
    "MatMul": np.matmul, "Range": lambda s, e, d: np.arange(s, e, d, dtype=np.result_type(s, e, d)),
    "Tile": lambda x, r: np.tile(x, _ints(r)),
}


def _fold_numpy(node, *xs):
    return _NUMPY[node.op_type](*xs)


for _op in _NUMPY:
    FOLDS[_op] = _fold_numpy


@folds("Max", "Min")
def _fold_extremum(node, *xs):
    fn = np.maximum if node.op_type == "Max" else np.minimum
    out = xs[0]
    for x in xs[1:]:
        out = fn(out, x)
    return out


@folds("Mod")
def _fold_mod(node, a, b):
    return np.fmod(a, b) if node.attributes.get("fmod", 0) else np.mod(a, b)


@folds("Trilu")
def _fold_trilu(node, x, k=None):
    k = int(np.ravel(k)[0]) if k is not None else 0
    return np.triu(x, k) if node.attributes.get("upper", 1) else np.tril(x, k)


_NUMPY_REDUCE: dict[str, Callable] = {"ReduceProd": np.prod, "ReduceSum": np.sum, "ReduceMean": np.mean,
                                      "ReduceMax": np.max, "ReduceMin": np.min}


@folds(*_NUMPY_REDUCE)
def _fold_reduce(node, x, axes=None):
    """A reduction of constants (``torch.var``'s element count: the product of a folded Shape's entries)."""
    given = _ints(axes) if axes is not None else node.attributes.get("axes")
    if not given and node.attributes.get("noop_with_empty_axes", 0):
        return x
    out = _NUMPY_REDUCE[node.op_type](x, axis=tuple(int(a) for a in given) if given else None,
                                      keepdims=bool(node.attributes.get("keepdims", 1)))
    return np.asarray(out, dtype=x.dtype)

