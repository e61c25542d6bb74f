"""Numba backend: runs single-step GRU decoders and MLP policies on Numba kernels.

The fastest way to run the small graphs closedloop deploys at batch 1 on one core.
The constructor reads the ONNX file (without the ``onnx`` package), follows the data
path through a known set of op patterns and turns it into a *plan* for
``runtime.kernels.run_plan``: an int64 program and a list of preallocated float32
arrays (weights re-laid out for speed, scratch, and views of ``inputs``/``outputs``).
Shape plumbing (Unsqueeze, Squeeze, Transpose, Reshape, Gather or Slice of unit
axes) costs nothing: every activation is stored as a (batch, features) matrix, and
plumbing only renames it. GRU layers read their initial state from the state input's
layer slices and write their final state straight into the state output. A graph
outside the known patterns is refused with the op that is not supported (never run
approximately); ``supports`` says so before anything is built.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from ..errors import GraphUnsupportedError
from ..manifest import GraphSpec
from ..onnx_reader import OnnxFormatError, OnnxModel, read_onnx
from .base import Availability, Backend, BackendOptions
from .registry import register_backend

_ADVICE = "; use --backend onnxruntime"


def _kernels():
    from .. import kernels

    return kernels


BATCH = "B"  # the batch axis in a logical shape
Shape = tuple  # of int | BATCH


class _Buffer:
    """A (rows, features) float32 matrix that one op writes; memory is bound at the end."""

    __slots__ = ("rows", "cols", "array")

    def __init__(self, rows: int, cols: int, array: np.ndarray | None = None):
        self.rows, self.cols, self.array = rows, cols, array


@dataclasses.dataclass
class _Act:
    """An activation: the ONNX value's logical shape, stored row-major as ``buf``."""

    buf: _Buffer
    shape: Shape


@dataclasses.dataclass
class _Layers:
    """A recurrent state input (layers, batch, hidden), read one layer at a time."""

    array: np.ndarray
    shape: Shape


@dataclasses.dataclass
class _Stack:
    """Per-layer states concatenated on axis 0: only ever a state output."""

    parts: list[_Act]


@dataclasses.dataclass
class _Dims:
    """A shape computed in the graph (Shape -> Gather -> Concat) that may hold BATCH."""

    dims: tuple
    scalar: bool = False


@dataclasses.dataclass
class _Op:
    code: int
    args: list  # _Buffer | np.ndarray (a parameter) | int


@dataclasses.dataclass
class Plan:
    program: np.ndarray  # (steps, PROGRAM_WIDTH) int64
    arrays: list[np.ndarray]
    params: list[np.ndarray]  # weight arrays in build order: what set_initializers refreshes


def _unsupported(node, why: str) -> GraphUnsupportedError:
    return GraphUnsupportedError(f"{node.op_type} node {node.name or node.outputs[0]!r}: {why}")


def _features(shape: Shape) -> int:
    return int(np.prod([d for d in shape if d != BATCH], dtype=np.int64))


def _storable(shape: Shape) -> bool:
    """Row-major storage is (batch, features) iff BATCH, if present, is the first non-unit axis."""
    big = [d for d in shape if d != 1]
    return BATCH not in big[1:]


class _Planner:
    """Walks the nodes in order, giving every ONNX value a meaning (see the classes above)."""

    def __init__(self, model: OnnxModel, spec: GraphSpec, batch: int, inputs: dict, outputs: dict):
        self.k = _kernels()
        self.model, self.spec, self.batch = model, spec, batch
        self.inputs, self.outputs = inputs, outputs
        self.values: dict[str, object] = {}
        self.ops: list[_Op] = []
        self.params: list[np.ndarray] = []
        self.producer: dict[int, _Op] = {}
        self.uses: dict[str, int] = {}
        for node in model.nodes:
            for name in node.inputs:
                self.uses[name] = self.uses.get(name, 0) + 1
        for out in model.outputs:
            self.uses[out.name] = self.uses.get(out.name, 0) + 1

    # -- values -------------------------------------------------------------------
    def value(self, node, i: int):
        if i >= len(node.inputs) or not node.inputs[i]:
            return None
        name = node.inputs[i]
        if name in self.values:
            return self.values[name]
        if name in self.model.initializers:
            return self.model.initializers[name]
        raise _unsupported(node, f"input {name!r} is produced by nothing this backend ran")

    def act(self, node, i: int = 0) -> _Act:
        v = self.value(node, i)
        if not isinstance(v, _Act):
            raise _unsupported(node, f"input {i} must be a batch-first activation, got {type(v).__name__}")
        return v

    def const(self, node, i: int, required: bool = True) -> np.ndarray | None:
        v = self.value(node, i)
        if v is None and not required:
            return None
        if not isinstance(v, np.ndarray):
            raise _unsupported(node, f"input {i} must be a constant (an initializer)")
        return v

    def ints(self, node, i: int, attr: str) -> list[int] | None:
        """An int list given as input ``i`` (newer opsets) or attribute ``attr`` (older)."""
        v = self.value(node, i)
        if v is not None:
            return [int(a) for a in np.asarray(self.const(node, i)).ravel()]
        a = node.attributes.get(attr)
        return None if a is None else [int(x) for x in a]

    def new_act(self, shape: Shape) -> _Act:
        return _Act(_Buffer(self.batch if BATCH in shape else 1, _features(shape)), shape)

    def param(self, arr: np.ndarray) -> np.ndarray:
        arr = np.array(arr, dtype=np.float32, order="C")  # a private, writable copy
        if arr.ndim != 2:
            arr = arr.reshape(1, -1)
        self.params.append(arr)
        return arr

    def emit(self, code: int, *args, out: _Buffer | None = None) -> _Op:
        op = _Op(code, list(args))
        self.ops.append(op)
        if out is not None:
            self.producer[id(out)] = op
        return op

    def fusable(self, name: str, v: _Act, code: int) -> _Op | None:
        """The op that produced ``v`` (ONNX value ``name``) if it is ``code`` and nothing else reads it."""
        op = self.producer.get(id(v.buf))
        if op is None or op.code != code or self.uses.get(name, 0) != 1:
            return None
        return op

    def feature_vector(self, node, c: np.ndarray, shape: Shape) -> np.ndarray:
        """A constant broadcast over an activation, as one value per feature."""
        if c.ndim > len(shape):
            raise _unsupported(node, f"constant of shape {c.shape} would broadcast {shape} to a larger rank")
        aligned = (1,) * (len(shape) - c.ndim) + c.shape
        for cd, d in zip(aligned, shape, strict=True):
            if cd != 1 and (d == BATCH or cd != d):
                raise _unsupported(node, f"constant of shape {c.shape} does not broadcast per feature over {shape}")
        unit = tuple(1 if d == BATCH else d for d in shape)
        return np.broadcast_to(c.reshape(aligned).astype(np.float32), unit).reshape(-1)

    # -- building -----------------------------------------------------------------
    def build(self) -> Plan:
        graph_inputs = {v.name for v in self.model.graph_inputs()}
        spec_inputs = {t.name for t in self.spec.inputs}
        if graph_inputs != spec_inputs:
            raise GraphUnsupportedError(
                f"graph inputs {sorted(graph_inputs)} differ from the manifest's {sorted(spec_inputs)}"
            )
        for t in self.spec.inputs + self.spec.outputs:
            if t.dtype != "float32":
                raise GraphUnsupportedError(f"tensor {t.name!r} is {t.dtype}; only float32 is supported")
        for t in self.spec.inputs:
            shape = tuple(BATCH if isinstance(d, str) else int(d) for d in t.shape)
            arr = self.inputs[t.name]
            if _storable(shape):
                act = self.new_act(shape)
                act.buf.array = arr.reshape(act.buf.rows, act.buf.cols)
                self.values[t.name] = act
            elif len(shape) == 3 and shape[1] in (BATCH, 1):
                self.values[t.name] = _Layers(arr, shape)
            else:
                raise GraphUnsupportedError(f"input {t.name!r} of shape {t.shape} is neither batch-first nor (layers, batch, hidden)")
        for node in self.model.nodes:
            handler = _HANDLERS.get(node.op_type)
            if node.domain not in ("", "ai.onnx") or handler is None:
                raise _unsupported(node, "this op is not supported by the numba backend")
            handler(self, node)
        copies = [op for t in self.spec.outputs for op in self.bind_output(t.name, self.outputs[t.name])]
        self.ops.extend(copies)
        return self.assemble()

    def bind(self, buf: _Buffer, view: np.ndarray) -> list[_Op]:
        if buf.array is None:
            buf.array = view
            return []
        return [_Op(self.k.OP_COPY, [buf, _Buffer(buf.rows, buf.cols, view)])]

    def bind_output(self, name: str, out: np.ndarray) -> list[_Op]:
        v = self.values.get(name)
        spec_shape = next(tuple(BATCH if isinstance(d, str) else d for d in t.shape) for t in self.spec.outputs if t.name == name)
        if isinstance(v, _Stack):
            if len(v.parts) != out.shape[0] or not all(_storable(p.shape) for p in v.parts):
                raise GraphUnsupportedError(f"output {name!r}: {len(v.parts)} stacked layers for shape {out.shape}")
            return [op for k, p in enumerate(v.parts) for op in self.bind(p.buf, out[k].reshape(p.buf.rows, p.buf.cols))]
        if isinstance(v, _Act):
            if [d for d in v.shape if d != 1] != [d for d in spec_shape if d != 1]:
                raise GraphUnsupportedError(f"output {name!r}: graph computes shape {v.shape}, manifest says {spec_shape}")
            return self.bind(v.buf, out.reshape(v.buf.rows, v.buf.cols))
        if isinstance(v, _Layers):
            return [_Op(self.k.OP_COPY, [_Buffer(0, 0, v.array.reshape(-1, v.array.shape[-1])),
                                         _Buffer(0, 0, out.reshape(-1, out.shape[-1]))])]
        raise GraphUnsupportedError(f"output {name!r} is not computed from the inputs (a constant or missing)")

    def assemble(self) -> Plan:
        arrays: list[np.ndarray] = []
        index: dict[int, int] = {}

        def slot(a: np.ndarray) -> int:
            if id(a) not in index:
                index[id(a)] = len(arrays)
                arrays.append(a)
            return index[id(a)]

        slot(np.zeros((1, self.k.LANES), dtype=np.float32))  # row LANES_SLOT: matmul scratch

        program = np.zeros((len(self.ops), self.k.PROGRAM_WIDTH), dtype=np.int64)
        for row, op in enumerate(self.ops):
            program[row, 0] = op.code
            for j, a in enumerate(op.args, start=1):
                if isinstance(a, _Buffer):
                    if a.array is None:
                        a.array = np.zeros((a.rows, a.cols), dtype=np.float32)
                    program[row, j] = slot(a.array)
                elif isinstance(a, np.ndarray):
                    program[row, j] = slot(a)
                else:
                    program[row, j] = int(a)
        return Plan(program, arrays, self.params)


def build_plan(model: OnnxModel, spec: GraphSpec, batch: int, inputs: dict | None = None,
               outputs: dict | None = None) -> Plan:
    """Turn a graph into a plan; raises ``GraphUnsupportedError`` naming the first op it cannot run."""
    if inputs is None or outputs is None:
        inputs = {t.name: np.zeros(t.concrete_shape(batch), np.float32) for t in spec.inputs}
        outputs = {t.name: np.zeros(t.concrete_shape(batch), np.float32) for t in spec.outputs}
    return _Planner(model, spec, batch, inputs, outputs).build()


# -- op handlers (one registry, no if/elif chain) -------------------------------------
_HANDLERS: dict = {}


def _handles(*ops: str):
    def register(fn):
        for op in ops:
            _HANDLERS[op] = fn
        return fn

    return register


def _axis(node, axis: int, rank: int) -> int:
    a = axis + rank if axis < 0 else axis
    if not 0 <= a < rank:
        raise _unsupported(node, f"axis {axis} is out of range for rank {rank}")
    return a


def _fold(p: _Planner, node, fn) -> bool:
    """Constant-fold a node whose inputs are all constants; True if it did."""
    vals = [p.value(node, i) for i in range(len(node.inputs))]
    if not all(v is None or isinstance(v, np.ndarray) for v in vals):
        return False
    p.values[node.outputs[0]] = np.asarray(fn(*vals))
    return True


@_handles("Constant")
def _constant(p: _Planner, node) -> None:
    a = node.attributes
    for key in ("value_float", "value_floats", "value_int", "value_ints"):
        if key in a:
            p.values[node.outputs[0]] = np.asarray(a[key], np.float32 if "float" in key else np.int64)
            return
    if node.outputs[0] not in p.model.initializers:
        raise _unsupported(node, f"constant attributes {sorted(a)} are not supported")
    p.values[node.outputs[0]] = p.model.initializers[node.outputs[0]]


@_handles("Identity", "Dropout", "Cast")
def _identity(p: _Planner, node) -> None:
    if node.op_type == "Cast":
        to = node.attributes.get("to")
        v = p.value(node, 0)
        if isinstance(v, np.ndarray):
            from ..onnx_reader import ONNX_DTYPES

            p.values[node.outputs[0]] = v.astype(ONNX_DTYPES[to])
            return
        if isinstance(v, _Act) and to != 1:
            raise _unsupported(node, f"casting an activation to ONNX type {to} (only float32 runs here)")
    if node.op_type == "Dropout" and len(node.outputs) > 1 and p.uses.get(node.outputs[1]):
        raise _unsupported(node, "the dropout mask output is used")
    p.values[node.outputs[0]] = p.value(node, 0)


@_handles("Shape")
def _shape(p: _Planner, node) -> None:
    v = p.value(node, 0)
    if not isinstance(v, _Act | _Layers):
        raise _unsupported(node, "shape of a value that is not an activation")
    start, end = node.attributes.get("start", 0), node.attributes.get("end")
    p.values[node.outputs[0]] = _Dims(tuple(v.shape[start:end]))


@_handles("Unsqueeze")
def _unsqueeze(p: _Planner, node) -> None:
    axes = p.ints(node, 1, "axes") or []
    v = p.value(node, 0)
    if isinstance(v, _Dims) and v.scalar and axes == [0]:
        p.values[node.outputs[0]] = _Dims(v.dims)
        return
    shape = list(v.shape if isinstance(v, _Act) else np.shape(v))
    rank = len(shape) + len(axes)
    for a in sorted(_axis(node, a, rank) for a in axes):
        shape.insert(a, 1)
    if isinstance(v, np.ndarray):
        p.values[node.outputs[0]] = v.reshape(shape)
    else:
        p.values[node.outputs[0]] = _Act(p.act(node).buf, tuple(shape))


@_handles("Squeeze")
def _squeeze(p: _Planner, node) -> None:
    v = p.value(node, 0)
    shape = v.shape if isinstance(v, _Act) else np.shape(v)
    axes = p.ints(node, 1, "axes")
    drop = {_axis(node, a, len(shape)) for a in axes} if axes is not None else {i for i, d in enumerate(shape) if d == 1}
    if any(shape[a] != 1 for a in drop):
        raise _unsupported(node, f"squeezing axes {sorted(drop)} of shape {shape} that are not of size 1")
    new = tuple(d for i, d in enumerate(shape) if i not in drop)
    p.values[node.outputs[0]] = v.reshape(new) if isinstance(v, np.ndarray) else _Act(p.act(node).buf, new)


@_handles("Transpose")
def _transpose(p: _Planner, node) -> None:
    v = p.value(node, 0)
    if isinstance(v, np.ndarray):
        p.values[node.outputs[0]] = np.transpose(v, node.attributes.get("perm"))
        return
    v = p.act(node)
    perm = node.attributes.get("perm") or list(range(len(v.shape)))[::-1]
    moved = [a for a in perm if v.shape[a] != 1]
    if moved != sorted(moved):
        raise _unsupported(node, f"perm {perm} reorders data of shape {v.shape} (only unit axes may move)")
    p.values[node.outputs[0]] = _Act(v.buf, tuple(v.shape[a] for a in perm))


@_handles("Reshape", "Flatten")
def _reshape(p: _Planner, node) -> None:
    v = p.value(node, 0)
    if node.op_type == "Flatten":
        a = node.attributes.get("axis", 1)
        if isinstance(v, np.ndarray):
            p.values[node.outputs[0]] = v.reshape(int(np.prod(v.shape[:a])), -1)
            return
        v = p.act(node)
        head, tail = v.shape[:a], v.shape[a:]
        if BATCH in tail or any(d not in (1, BATCH) for d in head):
            raise _unsupported(node, f"flattening {v.shape} at axis {a} mixes batch and features")
        p.values[node.outputs[0]] = _Act(v.buf, (BATCH if BATCH in head else 1, _features(tail)))
        return
    target_v = p.value(node, 1)
    target = list(target_v.dims) if isinstance(target_v, _Dims) else [int(d) for d in p.const(node, 1).ravel()]
    if isinstance(v, np.ndarray) and isinstance(target_v, np.ndarray):
        p.values[node.outputs[0]] = v.reshape([v.shape[i] if d == 0 else d for i, d in enumerate(target)])
        return
    v = p.act(node)
    if node.attributes.get("allowzero", 0) == 0:
        target = [v.shape[i] if d == 0 else d for i, d in enumerate(target)]
    known = _features(tuple(d for d in target if d != -1))
    feats = _features(v.shape)
    if -1 in target:
        if BATCH in v.shape and BATCH not in target and known == feats:
            fill = BATCH
        elif feats % known == 0 and (BATCH in target or BATCH not in v.shape):
            fill = feats // known
        else:
            raise _unsupported(node, f"cannot resolve -1 reshaping {v.shape} to {target}")
        target = [fill if d == -1 else d for d in target]
    new = tuple(target)
    if _features(new) != feats or (BATCH in new) != (BATCH in v.shape) or not _storable(new):
        raise _unsupported(node, f"reshape {v.shape} -> {new} moves the batch axis or changes the size")
    p.values[node.outputs[0]] = _Act(v.buf, new)


@_handles("Gather")
def _gather(p: _Planner, node) -> None:
    v = p.value(node, 0)
    idx = p.const(node, 1)
    axis = node.attributes.get("axis", 0)
    if isinstance(v, np.ndarray):
        p.values[node.outputs[0]] = np.take(v, idx, axis=axis)
    elif isinstance(v, _Dims):
        picked = [v.dims[int(i)] for i in idx.ravel()]
        p.values[node.outputs[0]] = _Dims(tuple(picked), scalar=idx.ndim == 0)
    elif isinstance(v, _Layers) and _axis(node, axis, 3) == 0 and idx.ndim == 0:
        layer = v.array[int(idx)]
        p.values[node.outputs[0]] = _Act(_Buffer(layer.shape[0], layer.shape[1], layer), v.shape[1:])
    elif isinstance(v, _Act):
        a = _axis(node, axis, len(v.shape))
        if v.shape[a] != 1 or idx.size != 1 or int(idx.ravel()[0]) not in (0, -1):
            raise _unsupported(node, f"gathering {idx.ravel().tolist()} on axis {a} of {v.shape} (only unit axes)")
        shape = v.shape[:a] + (() if idx.ndim == 0 else (1,)) + v.shape[a + 1 :]
        p.values[node.outputs[0]] = _Act(v.buf, shape)
    else:
        raise _unsupported(node, "gather on this kind of value")


@_handles("Slice")
def _slice(p: _Planner, node) -> None:
    v = p.value(node, 0)
    starts, ends = p.ints(node, 1, "starts"), p.ints(node, 2, "ends")
    shape = v.shape if isinstance(v, _Act | _Layers) else np.shape(v)
    axes = p.ints(node, 3, "axes") or list(range(len(starts)))
    steps = p.ints(node, 4, "steps") or [1] * len(starts)
    if isinstance(v, np.ndarray):
        sl = [slice(None)] * v.ndim
        for a, s, e, st in zip(axes, starts, ends, steps, strict=True):
            sl[a] = slice(s, e, st)
        p.values[node.outputs[0]] = v[tuple(sl)]
        return
    new = list(shape)
    pick = None
    for a, s, e, st in zip(axes, starts, ends, steps, strict=True):
        a = _axis(node, a, len(shape))
        if shape[a] == BATCH:
            raise _unsupported(node, "slicing the batch axis")
        lo, hi, _ = slice(s, e, st).indices(shape[a])
        if st != 1 or hi - lo < 1:
            raise _unsupported(node, f"slice {s}:{e}:{st} of axis {a}")
        if (lo, hi) != (0, shape[a]):
            if not (isinstance(v, _Layers) and a == 0 and hi - lo == 1):
                raise _unsupported(node, f"slice {s}:{e} of axis {a} of {shape} (only one layer of a state)")
            pick = lo
            new[a] = 1
    if isinstance(v, _Layers) and pick is not None:
        layer = v.array[pick]
        p.values[node.outputs[0]] = _Act(_Buffer(layer.shape[0], layer.shape[1], layer), tuple(new))
    else:
        p.values[node.outputs[0]] = v


@_handles("Concat")
def _concat(p: _Planner, node) -> None:
    vals = [p.value(node, i) for i in range(len(node.inputs))]
    axis = node.attributes.get("axis", 0)
    if all(isinstance(v, np.ndarray) for v in vals):
        p.values[node.outputs[0]] = np.concatenate(vals, axis=axis)
    elif all(isinstance(v, _Dims | np.ndarray) for v in vals) and axis == 0:
        dims = [d for v in vals for d in (v.dims if isinstance(v, _Dims) else [int(x) for x in v.ravel()])]
        p.values[node.outputs[0]] = _Dims(tuple(dims))
    elif all(isinstance(v, _Act) and len(v.shape) == 3 and v.shape[0] == 1 for v in vals) and axis == 0:
        p.values[node.outputs[0]] = _Stack(vals)
    else:
        raise _unsupported(node, "only per-layer states (1, batch, hidden) stacked on axis 0 are supported")


def _dense(p: _Planner, node, x: _Act, w: np.ndarray, bias: np.ndarray | None, shape: Shape) -> None:
    n = w.shape[0]
    b = np.zeros(n, np.float32) if bias is None else p.feature_vector(node, bias, (BATCH, n))
    y = p.new_act(shape)
    p.emit(p.k.OP_DENSE, x.buf, p.param(p.k.panel_layout(w)), p.param(b), y.buf, p.k.ACT_NONE, out=y.buf)
    p.values[node.outputs[0]] = y


@_handles("Gemm")
def _gemm(p: _Planner, node) -> None:
    a = node.attributes
    if a.get("alpha", 1.0) != 1.0 or a.get("beta", 1.0) != 1.0 or a.get("transA", 0) != 0:
        raise _unsupported(node, f"alpha/beta/transA = {a.get('alpha', 1.0)}/{a.get('beta', 1.0)}/{a.get('transA', 0)} (need 1/1/0)")
    x, w = p.act(node), p.const(node, 1)
    w = w if a.get("transB", 0) else w.T
    if len(x.shape) != 2 or x.shape[1] != w.shape[1] or x.shape[0] not in (1, BATCH):
        raise _unsupported(node, f"input {x.shape} does not match weight {w.shape}")
    _dense(p, node, x, w, p.const(node, 2, required=False), (x.shape[0], w.shape[0]))


@_handles("MatMul")
def _matmul(p: _Planner, node) -> None:
    x, w = p.act(node), p.const(node, 1)
    if w.ndim != 2 or x.shape[-1] != w.shape[0] or any(d not in (1, BATCH) for d in x.shape[:-1]):
        raise _unsupported(node, f"activation {x.shape} @ constant {w.shape} (need (..., K) @ (K, N))")
    _dense(p, node, x, w.T, None, x.shape[:-1] + (w.shape[1],))


@_handles("Add", "Sub", "Mul", "Div")
def _arith(p: _Planner, node) -> None:
    fns = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide}
    if _fold(p, node, fns[node.op_type]):
        return
    first, second = p.value(node, 0), p.value(node, 1)
    if isinstance(first, _Act) and isinstance(second, np.ndarray):
        x, c, x_first = first, second, True
    elif isinstance(second, _Act) and isinstance(first, np.ndarray) and node.op_type != "Div":
        x, c, x_first = second, first, False
    else:
        raise _unsupported(node, "only an activation combined with a constant is supported")
    vec = p.feature_vector(node, c, x.shape)
    op = node.op_type
    name = node.inputs[0 if x_first else 1]
    dense = p.fusable(name, x, p.k.OP_DENSE) if x_first or op == "Add" else None
    if dense is not None and op in ("Add", "Sub") and dense.args[4] == p.k.ACT_NONE:
        dense.args[2] += vec.reshape(1, -1) if op == "Add" else -vec.reshape(1, -1)  # fold into the bias
        p.values[node.outputs[0]] = x
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
        p.values[node.outputs[0]] = x
        return
    y = p.new_act(x.shape)
    p.emit(p.k.OP_AFFINE, x.buf, p.param(scale), p.param(shift), y.buf, out=y.buf)
    p.values[node.outputs[0]] = y


_ACTS = {"Relu": "ACT_RELU", "Tanh": "ACT_TANH", "Sigmoid": "ACT_SIGMOID", "Softmax": "ACT_SOFTMAX",
         "LogSoftmax": "ACT_LOG_SOFTMAX"}


@_handles(*_ACTS)
def _activation(p: _Planner, node) -> None:
    x = p.act(node)
    code = getattr(p.k, _ACTS[node.op_type])
    if node.op_type in ("Softmax", "LogSoftmax"):
        legacy = p.model.opset.get("ai.onnx", 17) < 13
        a = _axis(node, node.attributes.get("axis", 1 if legacy else -1), len(x.shape))
        rest = [d for d in (x.shape[:a] if legacy else x.shape[:a] + x.shape[a + 1 :]) if d != 1]
        if rest not in ([], [BATCH]) or BATCH in (x.shape[a:] if legacy else x.shape[a : a + 1]):
            raise _unsupported(node, f"axis {a} of {x.shape} is not the feature axis")
    dense = p.fusable(node.inputs[0], x, p.k.OP_DENSE)
    if dense is not None and dense.args[4] == p.k.ACT_NONE:
        dense.args[4] = code
        p.values[node.outputs[0]] = x
        return
    y = p.new_act(x.shape)
    p.emit(p.k.OP_ACT, x.buf, y.buf, code, out=y.buf)
    p.values[node.outputs[0]] = y


@_handles("GRU")
def _gru(p: _Planner, node) -> None:
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
            raise _unsupported(node, f"{key}={got!r} (supported: {want!r})")
    if p.value(node, 4) is not None:
        raise _unsupported(node, "sequence_lens is given (single-step graphs only)")
    if len(x.shape) != 3 or x.shape[0] != 1:
        raise _unsupported(node, f"input of shape {x.shape}: a single time step (1, batch, features) is required")
    if w.shape != (1, 3 * hidden, x.shape[2]) or r.shape != (1, 3 * hidden, hidden):
        raise _unsupported(node, f"weights {w.shape}/{r.shape} for hidden_size {hidden}")
    h0 = p.value(node, 5)
    if h0 is None:
        h0 = _Act(_Buffer(x.buf.rows, hidden, np.zeros((x.buf.rows, hidden), np.float32)), (1, x.shape[1], hidden))
    if not isinstance(h0, _Act) or h0.shape != (1, x.shape[1], hidden):
        raise _unsupported(node, f"initial_h must be one layer (1, batch, {hidden}) of the state input")
    b = np.zeros((1, 6 * hidden), np.float32) if b is None else b
    out = p.new_act((1, x.shape[1], hidden))
    gx, gh = _Buffer(out.buf.rows, 3 * hidden), _Buffer(out.buf.rows, 3 * hidden)
    p.emit(p.k.OP_GRU, x.buf, h0.buf, p.param(p.k.panel_layout(w[0])), p.param(p.k.panel_layout(r[0])),
           p.param(b[0, : 3 * hidden]), p.param(b[0, 3 * hidden :]), out.buf, gx, gh, out=out.buf)
    outs = node.outputs + ["", ""]
    if outs[0]:
        p.values[outs[0]] = _Act(out.buf, (1, 1) + out.shape[1:])
    if outs[1]:
        p.values[outs[1]] = out


@register_backend
class NumbaBackend(Backend):
    """Single-step GRU stacks and MLPs as one call into compiled Numba code."""

    name = "numba"
    preference = 30

    @classmethod
    def availability(cls) -> Availability:
        try:
            import numba
        except ImportError as exc:
            return Availability(False, f"numba not importable ({exc}); pip install numba")
        return Availability(True, f"numba {numba.__version__}")

    @classmethod
    def supports(cls, path: Path, spec: GraphSpec) -> Availability:
        try:
            model = read_onnx(path)
            build_plan(model, spec, batch=1)
        except GraphUnsupportedError as exc:
            return Availability(False, f"{exc}{_ADVICE}")
        except (OnnxFormatError, OSError) as exc:
            return Availability(False, f"cannot read the graph: {exc}")
        return Availability(True, "all ops supported")

    def __init__(self, path: Path, spec: GraphSpec, options: BackendOptions | None = None):
        super().__init__(path, spec, options)
        kernels = _kernels()
        self._model: OnnxModel = read_onnx(self.path)
        try:
            plan = build_plan(self._model, spec, self.options.batch, self.inputs, self.outputs)
        except GraphUnsupportedError as exc:
            raise GraphUnsupportedError(f"{self.path.name}: {exc}{_ADVICE}") from exc
        self._program = plan.program
        self._arena, self._table, views, twins = kernels.pack_arena(plan.arrays)
        # From here on the buffers live in the arena: hand out its views.
        where = {id(a): v for a, v in zip(plan.arrays, views, strict=True)}
        self._params = [where[id(a)] for a in plan.params]
        for buffers in (self.inputs, self.outputs):
            for name, arr in buffers.items():
                buffers[name] = twins.get(id(arr), arr)
        self._run_plan = kernels.run_plan
        # Compile (or load from Numba's disk cache) and touch every buffer now, so
        # the first step of the loop is as fast as the rest. Inputs are zeros here.
        for _ in range(3):
            self.run()
        for arr in self.outputs.values():
            arr[...] = 0

    def run(self) -> None:
        self._run_plan(self._program, self._table, self._arena)

    def set_initializers(self, initializers: dict[str, np.ndarray]) -> None:
        """Copy new weight values into the kernels' arrays (re-laid out as at load)."""
        known = self._model.initializers
        for name, value in initializers.items():
            if name not in known:
                raise KeyError(f"{self.path.name} has no initializer {name!r}; it has {sorted(known)[:8]}...")
            if np.shape(value) != known[name].shape:
                raise ValueError(
                    f"initializer {name!r}: shape {np.shape(value)} does not match the graph's {known[name].shape}"
                )
        merged = dict(known)
        merged.update({k: np.asarray(v, dtype=known[k].dtype) for k, v in initializers.items()})
        model = dataclasses.replace(self._model, initializers=merged)
        fresh = build_plan(model, self.spec, self.options.batch)
        for old, new in zip(self._params, fresh.params, strict=True):
            old[...] = new
        self._model = model

    def describe(self) -> str:
        return f"{self.name} ({len(self._program)} kernel steps)"
