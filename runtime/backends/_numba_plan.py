"""Turns an ONNX graph into a plan for ``closedloop.runtime.kernels.run_plan``.

``build_plan`` checks the graph's inputs and outputs against the manifest, gives each
input its meaning (an ``Act`` over the backend's input array; see
``_numba_values``), walks the nodes in order (folding nodes whose inputs are all
constants, handing the rest to the op handlers registered in ``HANDLERS``), places
results straight into the backend's output arrays where it can, drops kernel steps
whose results nothing reads, and assembles the int64 program and the list of arrays
it runs on. A graph outside what the handlers know raises ``GraphUnsupportedError``
naming the node (its ONNX name) and the op.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, overload

import numpy as np

from ..errors import GraphUnsupportedError
from ..manifest import GraphSpec
from ..onnx_reader import Node, OnnxModel
from . import _numba_conv_ops, _numba_ops, _numba_seq_ops, _numba_shape_ops  # noqa: F401  (register handlers)
from ._numba_values import (
    FOLDS,
    HANDLERS,
    STORAGE,
    Act,
    Buffer,
    Mat,
    Op,
    StoredWeight,
    axis_of,
    contiguous_strides,
    merge_axes,
    unsupported,
)

COPY_AXES = 4  # axes the strided copy kernel walks


def load_kernels():
    """``closedloop.runtime.kernels``, imported on first use.

    This module (and so the backend registry) must import without numba, so that
    ``NumbaBackend.availability`` can say that numba is missing.
    """
    from .. import kernels

    return kernels


def compile_plan_runner() -> float:
    """Compile ``kernels.run_plan`` (every kernel a plan may call) or load it from Numba's disk cache; the seconds.

    An empty program with the argument types the backend passes: one signature serves every model,
    so afterwards no model's first step compiles (about a minute on a 2-core machine the first time,
    under a second from the cache).
    """
    import time

    kernels = load_kernels()
    t0 = time.perf_counter()
    kernels.run_plan(np.zeros((0, kernels.PROGRAM_WIDTH), np.int64), np.zeros((1, 3), np.int64),
                     np.zeros(1, np.float32))
    return time.perf_counter() - t0


@dataclasses.dataclass
class Plan:
    program: np.ndarray  # (steps, PROGRAM_WIDTH) int64
    arrays: list[np.ndarray]
    params: list[np.ndarray]  # weight arrays in build order: what set_initializers refreshes


class Planner:
    """Walks the nodes in order, giving every ONNX value a meaning (see ``_numba_values``)."""

    def __init__(self, model: OnnxModel, spec: GraphSpec, batch: int, inputs: dict, outputs: dict):
        self.k = load_kernels()
        self.model, self.spec, self.batch = model, spec, batch
        self.inputs, self.outputs = inputs, outputs
        self.values: dict[str, object] = {}
        self.ops: list[Op] = []
        self.params: list[np.ndarray] = []
        self.producer: dict[int, Op] = {}  # id(Buffer) -> the op that writes it
        self.names_of: dict[int, list[str]] = {}  # id(Buffer) -> ONNX values that are the whole buffer
        self.uses: dict[str, int] = {}
        self.node_of: dict[str, Node] = {}
        # id(Buffer) -> (source, base, shape, strides) of the strided copy that filled it, so a consumer that
        # wants the data in another order can read the source directly (the copy is then dropped as unread)
        self.copied: dict[int, tuple] = {}
        self.stored: dict[str, StoredWeight] = {}  # folded weights the file holds in float16 or int8
        for node in model.nodes:
            for name in node.inputs:
                self.uses[name] = self.uses.get(name, 0) + 1
            for name in node.outputs:
                self.node_of[name] = node
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
        raise unsupported(node, f"input {name!r} is produced by nothing this backend ran")

    def define(self, node, value, k: int = 0) -> None:
        """Give output ``k`` of ``node`` its meaning."""
        if k >= len(node.outputs) or not node.outputs[k]:
            return
        name = node.outputs[k]
        self.values[name] = value
        if isinstance(value, Act):
            self.names_of.setdefault(id(value.buf), []).append(name)

    def act(self, node, i: int = 0, *, materialize: bool = False) -> Act:
        """Input ``i`` as an activation; with ``materialize`` a constant becomes one too."""
        v = self.value(node, i)
        if isinstance(v, np.ndarray) and materialize:
            return self.materialize(v)
        if not isinstance(v, Act):
            raise unsupported(node, f"input {i} must be computed from the model's inputs, got {type(v).__name__}")
        return v

    @overload
    def const(self, node, i: int, required: Literal[True] = ...) -> np.ndarray: ...
    @overload
    def const(self, node, i: int, required: bool) -> np.ndarray | None: ...

    def const(self, node, i: int, required: bool = True) -> np.ndarray | None:
        v = self.value(node, i)
        if v is None and not required:
            return None
        if not isinstance(v, np.ndarray):
            raise unsupported(node, f"input {i} must be a constant (an initializer), not computed from the inputs")
        return v

    def ints(self, node, i: int, attr: str) -> list[int] | None:
        """An int list given as input ``i`` (newer opsets) or attribute ``attr`` (older)."""
        if self.value(node, i) is not None:
            return [int(a) for a in np.asarray(self.const(node, i)).ravel()]
        a = node.attributes.get(attr)
        return None if a is None else [int(x) for x in np.ravel(a)]

    def new_act(self, shape) -> Act:
        shape = tuple(int(d) for d in shape)
        if math.prod(shape) == 0:
            raise GraphUnsupportedError(f"an empty tensor of shape {shape} (zero-sized tensors are not supported)")
        return Act(Buffer(math.prod(shape)), shape)

    def param(self, arr: np.ndarray) -> np.ndarray:
        arr = np.array(arr, dtype=np.float32, order="C")  # a private, writable copy
        if arr.ndim != 2:
            arr = arr.reshape(1, -1)
        self.params.append(arr)
        return arr

    def storage(self, node, i: int, row_axis: int) -> tuple[int, np.ndarray | None]:
        """How to keep constant weight input ``i``: ``(W_F32, None)``, ``(W_F16, None)`` or ``(W_I8, scales)``
        with one scale per index of ``row_axis`` (the axis of the weight's output rows).

        A weight stays in the storage the file gives it (a ``Cast`` from float16, a ``DequantizeLinear``
        from int8), so the kernels compute with exactly the values ONNX Runtime does. int8 scales along
        another axis than the output rows cannot be applied per row: such a weight runs in float32.
        """
        stored = self.stored.get(node.inputs[i]) if i < len(node.inputs) else None
        if stored is None:
            return self.k.W_F32, None
        if stored.kind == "float16":
            return self.k.W_F16, None
        w = self.const(node, i)
        rows = w.shape[axis_of(node, row_axis, w.ndim)]
        assert stored.scale is not None
        if stored.scale.size == 1:
            return self.k.W_I8, np.full(rows, stored.scale[0], np.float32)
        if stored.axis == axis_of(node, row_axis, w.ndim):
            return self.k.W_I8, stored.scale
        return self.k.W_F32, None

    def panels(self, panels: np.ndarray, storage: int, scales: np.ndarray | None = None) -> np.ndarray:
        """``panel_layout`` panels (one or more stacked sets over the same output rows) as a weight
        parameter in ``storage``; ``scales``: the int8 output rows' scales."""
        per_set = None
        if scales is not None:
            lanes = self.k.LANES
            padded = np.ones(-(-scales.size // lanes) * lanes, np.float32)
            padded[: scales.size] = scales
            per_set = padded.reshape(-1, lanes)
            per_set = np.tile(per_set, (panels.shape[0] // per_set.shape[0], 1))
        return self.param(self.k.panel_storage(panels, storage, per_set))

    def materialize(self, c: np.ndarray) -> Act:
        """A constant as an activation the kernels read (refreshed by ``set_initializers`` like weights)."""
        return Act(Buffer.of(self.param(c)), tuple(int(d) for d in np.shape(c)))

    def emit(self, code: int, *args, out: Buffer | list[Buffer]) -> Op:
        outs = out if isinstance(out, list) else [out]
        op = Op(code, list(args), outs)
        self.ops.append(op)
        for b in outs:
            self.producer[id(b)] = op
        return op

    def fusable(self, name: str, v: Act, code: int, readers: int = 1) -> Op | None:
        """The op that wrote all of ``v`` (ONNX value ``name``) if it is ``code`` and only ``readers`` nodes read it.

        Uses are counted over every ONNX value that is the same whole buffer (a
        Reshape's output and its input), less the reshapes themselves.
        """
        op = self.producer.get(id(v.buf))
        if op is None or op.code != code:
            return None
        names = self.names_of.get(id(v.buf), [name])
        if sum(self.uses.get(n, 0) for n in names) - (len(names) - 1) != readers:
            return None
        return op

    def made_by(self, name: str, op_type: str):
        """The node of type ``op_type`` that computes ``name`` if only one node reads ``name``, else None."""
        node = self.node_of.get(name)
        if node is None or node.op_type != op_type or self.uses.get(name, 0) != 1:
            return None
        return node

    def scalar(self, name: str) -> float | None:
        """The value of ``name`` if it is a one-element constant."""
        v = self.values.get(name, self.model.initializers.get(name))
        return float(np.ravel(v)[0]) if isinstance(v, np.ndarray) and v.size == 1 else None

    # -- data movement ------------------------------------------------------------
    def rearrange(self, node, src: Act, base: int, shape, strides) -> Act:
        """The tensor ``src[base + sum(i_k strides_k)]`` of ``shape``: a window if contiguous, else a copy."""
        shape = tuple(int(d) for d in shape)
        sizes, (merged,) = merge_axes(list(shape), list(strides))
        if not sizes or (len(sizes) == 1 and merged[0] == 1):
            return Act(src.buf.window(base, math.prod(shape)), shape)
        out = self.new_act(shape)
        self.copy(node, src, base, shape, strides, out.buf, 0, contiguous_strides(shape))
        self.copied[id(out.buf)] = (src, base, shape, list(strides))
        return out

    def copy(self, node, src: Act, base: int, shape, strides, dst: Buffer, dst_base: int, dst_strides) -> None:
        """One strided copy step from ``src`` into ``dst``, checked to stay inside both."""
        sizes, (xs, ys) = merge_axes(list(shape), list(strides), list(dst_strides))
        if len(sizes) > COPY_AXES:
            raise unsupported(node, f"moves data of shape {tuple(shape)} in a pattern of {len(sizes)} axes "
                                    f"(at most {COPY_AXES} are supported)")
        for b, s, size, what in ((base, xs, src.buf.size, "source"), (dst_base, ys, dst.size, "destination")):
            lo = b + sum((n - 1) * st for n, st in zip(sizes, s, strict=True) if st < 0)
            hi = b + sum((n - 1) * st for n, st in zip(sizes, s, strict=True) if st > 0)
            if lo < 0 or hi >= size:
                raise unsupported(node, f"internal error: a copy would read or write outside its {what}")
        pad = COPY_AXES - len(sizes)
        sizes, xs, ys = [1] * pad + sizes, [0] * pad + xs, [0] * pad + ys
        self.emit(self.k.OP_STRIDED, src.flat(), Mat(dst, 1, dst.size), base, dst_base, *sizes, *xs, *ys, out=dst)

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
            arr = self.inputs[t.name]
            self.values[t.name] = act = Act(Buffer.of(arr), tuple(arr.shape))
            self.names_of[id(act.buf)] = [t.name]
        self.refuse_unknown_ops()
        for node in self.model.nodes:
            vals = [self.value(node, i) for i in range(len(node.inputs))]
            if node.op_type in FOLDS and all(v is None or isinstance(v, np.ndarray) for v in vals):
                result = FOLDS[node.op_type](node, *vals)
                for k, r in enumerate(result if isinstance(result, tuple) else (result,)):
                    self.define(node, np.asarray(r), k)
                stored = STORAGE[node.op_type](node, *vals) if node.op_type in STORAGE else None
                if stored is not None:
                    self.stored[node.outputs[0]] = stored
            elif node.op_type in HANDLERS:
                HANDLERS[node.op_type](self, node)
            else:
                raise unsupported(node, f"{node.op_type} runs here only on constants, and this node's inputs are "
                                        "computed from the model's inputs")
        roots = [self.bind_output(t.name, self.outputs[t.name]) for t in self.spec.outputs]
        self.drop_unread(roots)
        return self.assemble()

    def refuse_unknown_ops(self) -> None:
        first: dict[str, str] = {}
        for n in self.model.nodes:
            known = n.domain in ("", "ai.onnx") and (n.op_type in HANDLERS or n.op_type in FOLDS)
            if not known:
                op = n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}"
                first.setdefault(op, n.name or n.outputs[0])
        if first:
            listed = "; ".join(f"ONNX op {op} (node {name!r})" for op, name in first.items())
            raise GraphUnsupportedError(f"the numba backend has no kernel for {listed}")

    def bind_output(self, name: str, out: np.ndarray) -> Buffer:
        """Make value ``name`` land in the backend's output array ``out``; returns the output's buffer."""
        v = self.values.get(name)
        if not isinstance(v, Act):
            raise GraphUnsupportedError(f"output {name!r} is not computed from the inputs (a constant or missing)")
        if v.size != out.size or [d for d in v.shape if d != 1] != [d for d in out.shape if d != 1]:
            raise GraphUnsupportedError(f"output {name!r}: graph computes shape {v.shape}, manifest says {out.shape}")
        target = Buffer.of(out)
        if v.buf.placeable:
            v.buf.place(target, 0)
        else:
            self.emit(self.k.OP_COPY, v.flat(), Mat(target, 1, target.size), out=target)
        return target

    def drop_unread(self, outputs: list[Buffer]) -> None:
        """Drop kernel steps whose results reach no output (e.g. left behind by a fused pattern)."""
        live = {id(b.root()[0]) for b in outputs}
        kept = []
        for op in reversed(self.ops):
            if any(id(b.root()[0]) in live for b in op.outs):
                kept.append(op)
                live.update(id(a.buf.root()[0]) for a in op.args if isinstance(a, Mat))
        self.ops = kept[::-1]

    def assemble(self) -> Plan:
        arrays: list[np.ndarray] = []
        index: dict[object, int] = {}

        def slot(a: np.ndarray, key: object) -> int:
            if key not in index:
                index[key] = len(arrays)
                arrays.append(a)
            return index[key]

        slot(np.zeros((1, self.k.POSITIONS * self.k.LANES), dtype=np.float32), "lanes")  # row LANES_SLOT: scratch

        program = np.zeros((len(self.ops), self.k.PROGRAM_WIDTH), dtype=np.int64)
        for row, op in enumerate(self.ops):
            if 1 + len(op.args) > self.k.PROGRAM_WIDTH:
                raise AssertionError(f"opcode {op.code} has {len(op.args)} arguments")
            program[row, 0] = op.code
            for j, a in enumerate(op.args, start=1):
                if isinstance(a, Mat):
                    root, offset = a.buf.root()
                    if root.array is None:
                        root.array = np.zeros(root.size, dtype=np.float32)
                    key = (id(root.array), offset, a.rows, a.cols)
                    if key not in index:
                        view = root.array[offset : offset + a.rows * a.cols].reshape(a.rows, a.cols)
                        slot(view, key)
                    program[row, j] = index[key]
                elif isinstance(a, np.ndarray):
                    program[row, j] = slot(a, id(a))
                else:
                    program[row, j] = int(a)
        return Plan(program, arrays, self.params)


def build_plan(model: OnnxModel, spec: GraphSpec, batch: int, inputs: dict | None = None,
               outputs: dict | None = None) -> Plan:
    """Turn a graph into a plan; raises ``GraphUnsupportedError`` naming the first node it cannot run."""
    widened = {n.inputs[0] for n in model.nodes if n.op_type == "Cast" and n.attributes.get("to") == 1}
    readers: dict[str, set[str]] = {}
    for n in model.nodes:
        for name in n.inputs:
            readers.setdefault(name, set()).add(n.outputs[0] if n.outputs else "")
    low = sorted({str(a.dtype) for name, a in model.initializers.items() if a.dtype.kind == "f" and a.itemsize < 4
                  and (name not in widened or len(readers.get(name, ())) > 1)})
    if low:
        # an fp16 variant casts its float32 inputs down first; say why it cannot run rather than fail on the cast.
        # Weights stored in float16 and widened by a Cast to float32 (an fp16w variant) run.
        raise GraphUnsupportedError(f"the graph computes in {', '.join(low)} (an fp16 variant); the numba backend "
                                    "runs float32 graphs and float16 weights widened to float32 (an fp16w variant)")
    if inputs is None or outputs is None:
        inputs = {t.name: np.zeros(t.concrete_shape(batch), np.float32) for t in spec.inputs}
        outputs = {t.name: np.zeros(t.concrete_shape(batch), np.float32) for t in spec.outputs}
    return Planner(model, spec, batch, inputs, outputs).build()
