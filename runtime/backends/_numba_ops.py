"""The Numba backend's op handlers: what each supported ONNX op becomes in a plan.

One handler per op type, registered in ``HANDLERS`` (no if/elif chain), called by
``_numba_plan.Planner`` for each node in order. Shape plumbing (Unsqueeze, Squeeze,
Transpose, Reshape, Gather or Slice of unit axes) only renames an activation;
constants are folded; Gemm/MatMul become dense kernel steps into which a following
bias, affine op or activation is fused; GRU becomes one kernel step per layer.
Anything outside these patterns raises ``GraphUnsupportedError`` naming the node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..onnx_reader import ONNX_DTYPES
from ._numba_values import (
    BATCH,
    Act,
    Buffer,
    Dims,
    Layers,
    Shape,
    Stack,
    features,
    shape_of,
    storable,
    unsupported,
)

if TYPE_CHECKING:
    from ._numba_plan import Planner


HANDLERS: dict = {}  # ONNX op type -> handler(planner, node)


def _handles(*ops: str):
    def register(fn):
        for op in ops:
            HANDLERS[op] = fn
        return fn

    return register


def _axis(node, axis: int, rank: int) -> int:
    a = axis + rank if axis < 0 else axis
    if not 0 <= a < rank:
        raise unsupported(node, f"axis {axis} is out of range for rank {rank}")
    return a


def _fold(p: Planner, node, fn) -> bool:
    """Constant-fold a node whose inputs are all constants; True if it did."""
    vals = [p.value(node, i) for i in range(len(node.inputs))]
    if not all(v is None or isinstance(v, np.ndarray) for v in vals):
        return False
    p.define(node, np.asarray(fn(*vals)))
    return True


@_handles("Constant")
def _constant(p: Planner, node) -> None:
    a = node.attributes
    for key in ("value_float", "value_floats", "value_int", "value_ints"):
        if key in a:
            p.define(node, np.asarray(a[key], np.float32 if "float" in key else np.int64))
            return
    if node.outputs[0] not in p.model.initializers:
        raise unsupported(node, f"constant attributes {sorted(a)} are not supported")
    p.define(node, p.model.initializers[node.outputs[0]])


@_handles("Identity", "Dropout", "Cast")
def _identity(p: Planner, node) -> None:
    if node.op_type == "Cast":
        to = node.attributes.get("to")
        v = p.value(node, 0)
        if isinstance(v, np.ndarray):
            p.define(node, v.astype(ONNX_DTYPES[to]))
            return
        if isinstance(v, Act) and to != 1:
            raise unsupported(node, f"casting an activation to ONNX type {to} (only float32 runs here)")
    if node.op_type == "Dropout" and len(node.outputs) > 1 and p.uses.get(node.outputs[1]):
        raise unsupported(node, "the dropout mask output is used")
    p.define(node, p.value(node, 0))


@_handles("Shape")
def _shape(p: Planner, node) -> None:
    v = p.value(node, 0)
    if not isinstance(v, Act | Layers):
        raise unsupported(node, "shape of a value that is not an activation")
    start, end = node.attributes.get("start", 0), node.attributes.get("end")
    p.define(node, Dims(tuple(v.shape[start:end])))


@_handles("ConstantOfShape")
def _constant_of_shape(p: Planner, node) -> None:
    v = p.value(node, 0)
    fill = np.asarray(node.attributes.get("value", np.zeros(1, np.float32))).ravel()
    if isinstance(v, np.ndarray):
        p.define(node, np.full([int(d) for d in v.ravel()], fill[0], dtype=fill.dtype))
        return
    if not isinstance(v, Dims) or fill.dtype != np.float32:
        raise unsupported(node, "only float32 fills of a constant or batch-dependent shape")
    shape = tuple(v.dims)
    rows = p.batch if BATCH in shape else 1
    if storable(shape):  # e.g. a zero initial state: a buffer nothing ever writes
        p.define(node, Act(Buffer.of(np.full((rows, features(shape)), fill[0])), shape))
    elif len(shape) == 3 and shape[1] in (BATCH, 1):
        p.define(node, Layers(np.full((shape[0], rows, shape[2]), fill[0]), shape))
    else:
        raise unsupported(node, f"a filled tensor of shape {shape}")


@_handles("Unsqueeze")
def _unsqueeze(p: Planner, node) -> None:
    axes = p.ints(node, 1, "axes") or []
    v = p.value(node, 0)
    if isinstance(v, Dims) and v.scalar and axes == [0]:
        p.define(node, Dims(v.dims))
        return
    shape = list(shape_of(v))
    rank = len(shape) + len(axes)
    for a in sorted(_axis(node, a, rank) for a in axes):
        shape.insert(a, 1)
    if isinstance(v, np.ndarray):
        p.define(node, v.reshape(shape))
    else:
        p.define(node, Act(p.act(node).buf, tuple(shape)))


@_handles("Squeeze")
def _squeeze(p: Planner, node) -> None:
    v = p.value(node, 0)
    shape = shape_of(v)
    axes = p.ints(node, 1, "axes")
    drop = {_axis(node, a, len(shape)) for a in axes} if axes is not None else {i for i, d in enumerate(shape) if d == 1}
    if any(shape[a] != 1 for a in drop):
        raise unsupported(node, f"squeezing axes {sorted(drop)} of shape {shape} that are not of size 1")
    new = tuple(d for i, d in enumerate(shape) if i not in drop)
    p.define(node, v.reshape(new) if isinstance(v, np.ndarray) else Act(p.act(node).buf, new))


@_handles("Transpose")
def _transpose(p: Planner, node) -> None:
    v = p.value(node, 0)
    if isinstance(v, np.ndarray):
        p.define(node, np.transpose(v, node.attributes.get("perm")))
        return
    v = p.act(node)
    perm = node.attributes.get("perm") or list(range(len(v.shape)))[::-1]
    moved = [a for a in perm if v.shape[a] != 1]
    if moved != sorted(moved):
        raise unsupported(node, f"perm {perm} reorders data of shape {v.shape} (only unit axes may move)")
    p.define(node, Act(v.buf, tuple(v.shape[a] for a in perm)))


@_handles("Reshape", "Flatten")
def _reshape(p: Planner, node) -> None:
    v = p.value(node, 0)
    if node.op_type == "Flatten":
        a = node.attributes.get("axis", 1)
        if isinstance(v, np.ndarray):
            p.define(node, v.reshape(int(np.prod(v.shape[:a])), -1))
            return
        v = p.act(node)
        head, tail = v.shape[:a], v.shape[a:]
        if BATCH in tail or any(d not in (1, BATCH) for d in head):
            raise unsupported(node, f"flattening {v.shape} at axis {a} mixes batch and features")
        p.define(node, Act(v.buf, (BATCH if BATCH in head else 1, features(tail))))
        return
    target_v = p.value(node, 1)
    target = list(target_v.dims) if isinstance(target_v, Dims) else [int(d) for d in p.const(node, 1).ravel()]
    if isinstance(v, np.ndarray) and isinstance(target_v, np.ndarray):
        p.define(node, v.reshape([v.shape[i] if d == 0 else d for i, d in enumerate(target)]))
        return
    v = p.act(node)
    if node.attributes.get("allowzero", 0) == 0:
        target = [v.shape[i] if d == 0 else d for i, d in enumerate(target)]
    known = features(tuple(d for d in target if d != -1))
    feats = features(v.shape)
    if -1 in target:
        fill: int | str
        if BATCH in v.shape and BATCH not in target and known == feats:
            fill = BATCH
        elif feats % known == 0 and (BATCH in target or BATCH not in v.shape):
            fill = feats // known
        else:
            raise unsupported(node, f"cannot resolve -1 reshaping {v.shape} to {target}")
        target = [fill if d == -1 else d for d in target]
    new = tuple(target)
    if features(new) != feats or (BATCH in new) != (BATCH in v.shape) or not storable(new):
        raise unsupported(node, f"reshape {v.shape} -> {new} moves the batch axis or changes the size")
    p.define(node, Act(v.buf, new))


@_handles("Gather")
def _gather(p: Planner, node) -> None:
    v = p.value(node, 0)
    idx = p.const(node, 1)
    axis = node.attributes.get("axis", 0)
    if isinstance(v, np.ndarray):
        p.define(node, np.take(v, idx, axis=axis))
    elif isinstance(v, Dims):
        picked = [v.dims[int(i)] for i in idx.ravel()]
        p.define(node, Dims(tuple(picked), scalar=idx.ndim == 0))
    elif isinstance(v, Layers) and _axis(node, axis, 3) == 0 and idx.ndim == 0:
        layer = v.array[int(idx)]
        p.define(node, Act(Buffer.of(layer), v.shape[1:]))
    elif isinstance(v, Act):
        a = _axis(node, axis, len(v.shape))
        if v.shape[a] != 1 or idx.size != 1 or int(idx.ravel()[0]) not in (0, -1):
            raise unsupported(node, f"gathering {idx.ravel().tolist()} on axis {a} of {v.shape} (only unit axes)")
        shape = v.shape[:a] + (() if idx.ndim == 0 else (1,)) + v.shape[a + 1 :]
        p.define(node, Act(v.buf, shape))
    else:
        raise unsupported(node, "gather on this kind of value")


@_handles("Slice")
def _slice(p: Planner, node) -> None:
    v = p.value(node, 0)
    starts, ends = p.ints(node, 1, "starts"), p.ints(node, 2, "ends")
    if starts is None or ends is None:
        raise unsupported(node, "a slice without starts or ends")
    shape = shape_of(v)
    axes = p.ints(node, 3, "axes") or list(range(len(starts)))
    steps = p.ints(node, 4, "steps") or [1] * len(starts)
    if isinstance(v, np.ndarray):
        sl = [slice(None)] * v.ndim
        for a, s, e, st in zip(axes, starts, ends, steps, strict=True):
            sl[a] = slice(s, e, st)
        p.define(node, v[tuple(sl)])
        return
    new = list(shape)
    pick = None
    for a, s, e, st in zip(axes, starts, ends, steps, strict=True):
        a = _axis(node, a, len(shape))
        if shape[a] == BATCH:
            raise unsupported(node, "slicing the batch axis")
        lo, hi, _ = slice(s, e, st).indices(shape[a])
        if st != 1 or hi - lo < 1:
            raise unsupported(node, f"slice {s}:{e}:{st} of axis {a}")
        if (lo, hi) != (0, shape[a]):
            if not (isinstance(v, Layers) and a == 0 and hi - lo == 1):
                raise unsupported(node, f"slice {s}:{e} of axis {a} of {shape} (only one layer of a state)")
            pick = lo
            new[a] = 1
    if isinstance(v, Layers) and pick is not None:
        layer = v.array[pick]
        p.define(node, Act(Buffer.of(layer), tuple(new)))
    else:
        p.define(node, v)


@_handles("Concat")
def _concat(p: Planner, node) -> None:
    vals = [p.value(node, i) for i in range(len(node.inputs))]
    axis = node.attributes.get("axis", 0)
    if all(isinstance(v, np.ndarray) for v in vals):
        p.define(node, np.concatenate(vals, axis=axis))
    elif all(isinstance(v, Dims | np.ndarray) for v in vals) and axis == 0:
        dims = [d for v in vals for d in (v.dims if isinstance(v, Dims) else [int(x) for x in v.ravel()])]
        p.define(node, Dims(tuple(dims)))
    elif all(isinstance(v, Act) and len(v.shape) == 3 and v.shape[0] == 1 for v in vals) and axis == 0:
        p.define(node, Stack(vals))
    else:
        raise unsupported(node, "only per-layer states (1, batch, hidden) stacked on axis 0 are supported")


def _dense(p: Planner, node, x: Act, w: np.ndarray, bias: np.ndarray | None, shape: Shape) -> None:
    n = w.shape[0]
    b = np.zeros(n, np.float32) if bias is None else p.feature_vector(node, bias, (BATCH, n))
    y = p.new_act(shape)
    p.emit(p.k.OP_DENSE, x.buf, p.param(p.k.panel_layout(w)), p.param(b), y.buf, p.k.ACT_NONE, out=y.buf)
    p.define(node, y)


@_handles("Gemm")
def _gemm(p: Planner, node) -> None:
    a = node.attributes
    if a.get("alpha", 1.0) != 1.0 or a.get("beta", 1.0) != 1.0 or a.get("transA", 0) != 0:
        raise unsupported(node, f"alpha/beta/transA = {a.get('alpha', 1.0)}/{a.get('beta', 1.0)}/{a.get('transA', 0)} (need 1/1/0)")
    x, w = p.act(node), p.const(node, 1)
    w = w if a.get("transB", 0) else w.T
    if len(x.shape) != 2 or x.shape[1] != w.shape[1] or x.shape[0] not in (1, BATCH):
        raise unsupported(node, f"input {x.shape} does not match weight {w.shape}")
    _dense(p, node, x, w, p.const(node, 2, required=False), (x.shape[0], w.shape[0]))


@_handles("MatMul")
def _matmul(p: Planner, node) -> None:
    x, w = p.act(node), p.const(node, 1)
    if w.ndim != 2 or x.shape[-1] != w.shape[0] or any(d not in (1, BATCH) for d in x.shape[:-1]):
        raise unsupported(node, f"activation {x.shape} @ constant {w.shape} (need (..., K) @ (K, N))")
    _dense(p, node, x, w.T, None, x.shape[:-1] + (w.shape[1],))


@_handles("Add", "Sub", "Mul", "Div")
def _arith(p: Planner, node) -> None:
    fns = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide}
    if _fold(p, node, fns[node.op_type]):
        return
    first, second = p.value(node, 0), p.value(node, 1)
    if isinstance(first, Act) and isinstance(second, np.ndarray):
        x, c, x_first = first, second, True
    elif isinstance(second, Act) and isinstance(first, np.ndarray) and node.op_type != "Div":
        x, c, x_first = second, first, False
    else:
        raise unsupported(node, "only an activation combined with a constant is supported")
    vec = p.feature_vector(node, c, x.shape)
    op = node.op_type
    name = node.inputs[0 if x_first else 1]
    dense = p.fusable(name, x, p.k.OP_DENSE) if x_first or op == "Add" else None
    if dense is not None and op in ("Add", "Sub") and dense.args[4] == p.k.ACT_NONE:
        dense.args[2] += vec.reshape(1, -1) if op == "Add" else -vec.reshape(1, -1)  # fold into the bias
        p.define(node, x)
        return
    scale, shift = np.ones_like(vec), np.zeros_like(vec)
    affine = p.fusable(name, x, p.k.OP_AFFINE)
    if affine is not None:  # extend the previous affine op instead of adding one
        scale, shift = affine.args[1].reshape(-1), affine.args[2].reshape(-1)
    if op == "Add":
        shift += vec
    elif op == "Sub" and x_first:
        shift -= vec
    elif op == "Sub":
        scale *= -1
        shift[:] = vec - shift
    elif op == "Mul":
        scale *= vec
        shift *= vec
    else:
        scale /= vec
        shift /= vec
    if affine is not None:
        p.define(node, x)
        return
    y = p.new_act(x.shape)
    p.emit(p.k.OP_AFFINE, x.buf, p.param(scale), p.param(shift), y.buf, out=y.buf)
    p.define(node, y)


_ACTS = {"Relu": "ACT_RELU", "Tanh": "ACT_TANH", "Sigmoid": "ACT_SIGMOID", "Softmax": "ACT_SOFTMAX",
         "LogSoftmax": "ACT_LOG_SOFTMAX"}


@_handles(*_ACTS)
def _activation(p: Planner, node) -> None:
    x = p.act(node)
    code = getattr(p.k, _ACTS[node.op_type])
    if node.op_type in ("Softmax", "LogSoftmax"):
        legacy = p.model.opset.get("ai.onnx", 17) < 13
        a = _axis(node, node.attributes.get("axis", 1 if legacy else -1), len(x.shape))
        rest = [d for d in (x.shape[:a] if legacy else x.shape[:a] + x.shape[a + 1 :]) if d != 1]
        if rest not in ([], [BATCH]) or BATCH in (x.shape[a:] if legacy else x.shape[a : a + 1]):
            raise unsupported(node, f"axis {a} of {x.shape} is not the feature axis")
    dense = p.fusable(node.inputs[0], x, p.k.OP_DENSE)
    if dense is not None and dense.args[4] == p.k.ACT_NONE:
        dense.args[4] = code
        p.define(node, x)
        return
    y = p.new_act(x.shape)
    p.emit(p.k.OP_ACT, x.buf, y.buf, code, out=y.buf)
    p.define(node, y)


@_handles("GRU")
def _gru(p: Planner, node) -> None:
    a = node.attributes
    x, w, r = p.act(node), p.const(node, 1), p.const(node, 2)
    b = p.const(node, 3, required=False)
    hidden = int(a.get("hidden_size", r.shape[-1]))
    checks = {
        "direction": (a.get("direction", "forward"), "forward"),
        "linear_before_reset": (a.get("linear_before_reset", 0), 1),
        "activations": (a.get("activations", ["Sigmoid", "Tanh"]), ["Sigmoid", "Tanh"]),
        "clip": (a.get("clip"), None),
        "layout": (a.get("layout", 0), 0),
        "activation_alpha/beta": (a.get("activation_alpha", a.get("activation_beta")), None),
    }
    for key, (got, want) in checks.items():
        if got != want:
            raise unsupported(node, f"{key}={got!r} (supported: {want!r})")
    if p.value(node, 4) is not None:
        raise unsupported(node, "sequence_lens is given (single-step graphs only)")
    if len(x.shape) != 3 or x.shape[0] != 1:
        raise unsupported(node, f"input of shape {x.shape}: a single time step (1, batch, features) is required")
    if w.shape != (1, 3 * hidden, x.shape[2]) or r.shape != (1, 3 * hidden, hidden):
        raise unsupported(node, f"weights {w.shape}/{r.shape} for hidden_size {hidden}")
    h0 = p.value(node, 5)
    if h0 is None:
        h0 = Act(Buffer.of(np.zeros((x.buf.rows, hidden), np.float32)), (1, x.shape[1], hidden))
    if not isinstance(h0, Act) or h0.shape != (1, x.shape[1], hidden):
        raise unsupported(node, f"initial_h must be one layer (1, batch, {hidden}) of the state input")
    b = np.zeros((1, 6 * hidden), np.float32) if b is None else b
    if b.shape != (1, 6 * hidden):
        raise unsupported(node, f"bias of shape {b.shape} for hidden_size {hidden} (need (1, {6 * hidden}))")
    out = p.new_act((1, x.shape[1], hidden))
    gx, gh = Buffer(out.buf.rows, 3 * hidden), Buffer(out.buf.rows, 3 * hidden)
    p.emit(p.k.OP_GRU, x.buf, h0.buf, p.param(p.k.panel_layout(w[0])), p.param(p.k.panel_layout(r[0])),
           p.param(b[0, : 3 * hidden]), p.param(b[0, 3 * hidden :]), out.buf, gx, gh, out=out.buf)
    outs = node.outputs + ["", ""]
    if outs[0]:
        p.values[outs[0]] = Act(out.buf, (1, 1) + out.shape[1:])
    if outs[1]:
        p.values[outs[1]] = out
