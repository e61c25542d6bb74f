"""What an ONNX value means to the Numba backend's planner, and the helpers on it.

``_numba_plan`` walks a graph and ``_numba_ops`` handles one node at a time; both give
every ONNX value one of the meanings below: a constant (a numpy array), an activation
stored as a (batch, features) float32 matrix (``Act``), a recurrent state read one
layer at a time (``Layers``), per-layer states stacked into a state output
(``Stack``), or a shape computed in the graph (``Dims``). Kernel calls are collected
as ``Op`` rows over ``Buffer`` matrices, whose memory is bound when the plan is assembled.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import GraphUnsupportedError
from ..manifest import TensorSpec

BATCH = "B"  # the batch axis in a logical shape
Shape = tuple  # of int | BATCH


class Buffer:
    """A (rows, features) float32 matrix that one op writes; memory is bound at the end."""

    __slots__ = ("rows", "cols", "array")

    def __init__(self, rows: int, cols: int, array: np.ndarray | None = None):
        self.rows, self.cols, self.array = rows, cols, array

    @classmethod
    def of(cls, array: np.ndarray) -> Buffer:
        """A buffer over memory that already exists: a state layer, a fixed fill, an output view."""
        return cls(array.shape[0], array.shape[1], array)


@dataclasses.dataclass
class Act:
    """An activation: the ONNX value's logical shape, stored row-major as ``buf``."""

    buf: Buffer
    shape: Shape


@dataclasses.dataclass
class Layers:
    """A recurrent state input (layers, batch, hidden), read one layer at a time."""

    array: np.ndarray
    shape: Shape


@dataclasses.dataclass
class Stack:
    """Per-layer states concatenated on axis 0: only ever a state output."""

    parts: list[Act]


@dataclasses.dataclass
class Dims:
    """A shape computed in the graph (Shape -> Gather -> Concat) that may hold BATCH."""

    dims: tuple
    scalar: bool = False


@dataclasses.dataclass
class Op:
    """One kernel step: an opcode of ``closedloop.runtime.kernels`` and its arguments."""

    code: int
    args: list  # Buffer | np.ndarray (a parameter) | int


def unsupported(node, why: str) -> GraphUnsupportedError:
    return GraphUnsupportedError(f"{node.op_type} node {node.name or node.outputs[0]!r}: {why}")


def features(shape: Shape) -> int:
    return int(np.prod([d for d in shape if d != BATCH], dtype=np.int64))


def storable(shape: Shape) -> bool:
    """Row-major storage is (batch, features) iff BATCH, if present, is the first non-unit axis."""
    big = [d for d in shape if d != 1]
    return BATCH not in big[1:]


def logical_shape(t: TensorSpec) -> Shape:
    """A manifest tensor's shape with its named (dynamic) axis as BATCH."""
    return tuple(BATCH if isinstance(d, str) else int(d) for d in t.shape)


def shape_of(v) -> tuple:
    """The logical shape of an activation or a state, or the shape of a constant."""
    return v.shape if isinstance(v, Act | Layers) else np.shape(v)
