"""Turns an ONNX graph into a plan for ``closedloop.runtime.kernels.run_plan``.

``build_plan`` checks the graph's inputs and outputs against the manifest, gives each
input a meaning (``_numba_values``), walks the nodes in order through the op handlers
of ``_numba_ops``, binds the results to the backend's output buffers and assembles the
int64 program and the list of arrays it runs on. A graph outside the known patterns
raises ``GraphUnsupportedError`` naming the op that is not supported.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, overload

import numpy as np

from ..errors import GraphUnsupportedError
from ..manifest import GraphSpec
from ..onnx_reader import OnnxModel
from ._numba_ops import HANDLERS
from ._numba_values import (
    BATCH,
    Act,
    Buffer,
    Layers,
    Op,
    Shape,
    Stack,
    features,
    logical_shape,
    storable,
    unsupported,
)


def load_kernels():
    """``closedloop.runtime.kernels``, imported on first use.

    This module (and so the backend registry) must import without numba, so that
    ``NumbaBackend.availability`` can say that numba is missing.
    """
    from .. import kernels

    return kernels


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
        self.producer: dict[int, Op] = {}
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
        raise unsupported(node, f"input {name!r} is produced by nothing this backend ran")

    def define(self, node, value) -> None:
        """Give the (first) output of ``node`` its meaning."""
        self.values[node.outputs[0]] = value

    def act(self, node, i: int = 0) -> Act:
        v = self.value(node, i)
        if not isinstance(v, Act):
            raise unsupported(node, f"input {i} must be a batch-first activation, got {type(v).__name__}")
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
            raise unsupported(node, f"input {i} must be a constant (an initializer)")
        return v

    def ints(self, node, i: int, attr: str) -> list[int] | None:
        """An int list given as input ``i`` (newer opsets) or attribute ``attr`` (older)."""
        v = self.value(node, i)
        if v is not None:
            return [int(a) for a in np.asarray(self.const(node, i)).ravel()]
        a = node.attributes.get(attr)
        return None if a is None else [int(x) for x in a]

    def new_act(self, shape: Shape) -> Act:
        return Act(Buffer(self.batch if BATCH in shape else 1, features(shape)), shape)

    def param(self, arr: np.ndarray) -> np.ndarray:
        arr = np.array(arr, dtype=np.float32, order="C")  # a private, writable copy
        if arr.ndim != 2:
            arr = arr.reshape(1, -1)
        self.params.append(arr)
        return arr

    def emit(self, code: int, *args, out: Buffer | None = None) -> Op:
        op = Op(code, list(args))
        self.ops.append(op)
        if out is not None:
            self.producer[id(out)] = op
        return op

    def fusable(self, name: str, v: Act, code: int) -> Op | None:
        """The op that produced ``v`` (ONNX value ``name``) if it is ``code`` and nothing else reads it."""
        op = self.producer.get(id(v.buf))
        if op is None or op.code != code or self.uses.get(name, 0) != 1:
            return None
        return op

    def feature_vector(self, node, c: np.ndarray, shape: Shape) -> np.ndarray:
        """A constant broadcast over an activation, as one value per feature."""
        if c.ndim > len(shape):
            raise unsupported(node, f"constant of shape {c.shape} would broadcast {shape} to a larger rank")
        aligned = (1,) * (len(shape) - c.ndim) + c.shape
        for cd, d in zip(aligned, shape, strict=True):
            if cd != 1 and (d == BATCH or cd != d):
                raise unsupported(node, f"constant of shape {c.shape} does not broadcast per feature over {shape}")
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
            shape = logical_shape(t)
            arr = self.inputs[t.name]
            if storable(shape):
                act = self.new_act(shape)
                act.buf.array = arr.reshape(act.buf.rows, act.buf.cols)
                self.values[t.name] = act
            elif len(shape) == 3 and shape[1] in (BATCH, 1):
                self.values[t.name] = Layers(arr, shape)
            else:
                raise GraphUnsupportedError(f"input {t.name!r} of shape {t.shape} is neither batch-first nor (layers, batch, hidden)")
        unknown = sorted({n.op_type for n in self.model.nodes if n.op_type not in HANDLERS or n.domain not in ("", "ai.onnx")})
        if unknown:
            raise GraphUnsupportedError(f"op(s) {', '.join(unknown)} not supported by the numba backend")
        for node in self.model.nodes:
            HANDLERS[node.op_type](self, node)
        copies = [op for t in self.spec.outputs for op in self.bind_output(t.name, self.outputs[t.name])]
        self.ops.extend(copies)
        return self.assemble()

    def bind(self, buf: Buffer, view: np.ndarray) -> list[Op]:
        if buf.array is None:
            buf.array = view
            return []
        return [Op(self.k.OP_COPY, [buf, Buffer.of(view)])]

    def bind_output(self, name: str, out: np.ndarray) -> list[Op]:
        v = self.values.get(name)
        spec_shape = next(logical_shape(t) for t in self.spec.outputs if t.name == name)
        if isinstance(v, Stack):
            sizes_ok = all(storable(p.shape) and p.buf.rows * p.buf.cols == out[0].size for p in v.parts)
            if len(v.parts) != out.shape[0] or not sizes_ok:
                raise GraphUnsupportedError(f"output {name!r}: {len(v.parts)} stacked layers for shape {out.shape}")
            return [op for k, p in enumerate(v.parts) for op in self.bind(p.buf, out[k].reshape(p.buf.rows, p.buf.cols))]
        if isinstance(v, Act):
            if [d for d in v.shape if d != 1] != [d for d in spec_shape if d != 1]:
                raise GraphUnsupportedError(f"output {name!r}: graph computes shape {v.shape}, manifest says {spec_shape}")
            return self.bind(v.buf, out.reshape(v.buf.rows, v.buf.cols))
        if isinstance(v, Layers):
            rows = (-1, v.array.shape[-1])
            return [Op(self.k.OP_COPY, [Buffer.of(v.array.reshape(rows)), Buffer.of(out.reshape(rows))])]
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
                if isinstance(a, Buffer):
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
    low = sorted({str(a.dtype) for a in model.initializers.values() if a.dtype.kind == "f" and a.itemsize < 4})
    if low:
        # an fp16 variant casts its float32 inputs down first; say why it cannot run rather than fail on the cast
        raise GraphUnsupportedError(f"the graph computes in {', '.join(low)} (an fp16 variant); the numba backend "
                                    "runs float32 graphs only")
    if inputs is None or outputs is None:
        inputs = {t.name: np.zeros(t.concrete_shape(batch), np.float32) for t in spec.inputs}
        outputs = {t.name: np.zeros(t.concrete_shape(batch), np.float32) for t in spec.outputs}
    return Planner(model, spec, batch, inputs, outputs).build()
