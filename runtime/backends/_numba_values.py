"""What an ONNX value means to the Numba backend's planner, the op-handler registry, and shape helpers.

``_numba_plan`` walks a graph and the op modules (``_numba_ops``, ``_numba_shape_ops``,
``_numba_seq_ops``, ``_numba_conv_ops``) handle one node at a time through
``HANDLERS``. A plan is built for one concrete batch size, so every shape is
concrete and every value is either a constant (a numpy array: initializers, and
whatever the graph computes from them and from shapes, folded while planning) or
an activation (``Act``): a row-major, contiguous N-d float32 tensor stored in a
``Buffer``. A buffer is a run of float32 values: a root, whose memory is bound
when the plan is assembled, or a window of another buffer, so reshapes, unit
transposes and slices or gathers that select one contiguous run cost nothing, and
a result can be placed straight into the part of a Concat or graph output it
becomes. Kernel calls are collected as ``Op`` rows over ``Mat`` views of buffers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from ..errors import GraphUnsupportedError

HANDLERS: dict[str, Callable] = {}  # ONNX op type -> handler(planner, node)
FOLDS: dict[str, Callable] = {}  # ONNX op type -> numpy function of constant inputs (node, *values)
# ONNX op type -> stored_as(node, *values): how the folded float32 result was stored in the file
# (a ``StoredWeight``), or None; a weight handler keeps such a weight in that storage.
STORAGE: dict[str, Callable] = {}


@dataclasses.dataclass(frozen=True)
class StoredWeight:
    """A constant weight the graph widens to float32 at run time: float16 values (``Cast``), or int8
    codes times ``scale`` (``DequantizeLinear``; a scalar or one scale per index of ``axis``)."""

    kind: str  # "float16" or "int8"
    scale: np.ndarray | None = None
    axis: int = 0


def handles(*ops: str):
    """Register a handler for the ONNX op types ``ops``."""

    def register(fn):
        for op in ops:
            HANDLERS[op] = fn
        return fn

    return register


class Buffer:
    """A run of ``size`` float32 values: a root or a window (``parent``, ``offset``) of another buffer.

    A root's memory is ``array`` (1-D) when it already exists (an input, an output, a
    constant) or is allocated when the plan is assembled. A root without memory may
    still be ``place``d inside another buffer, which is how a layer writes its state
    straight into its slice of a state output.
    """

    __slots__ = ("size", "array", "parent", "offset")

    def __init__(self, size: int, array: np.ndarray | None = None):
        self.size, self.array = int(size), array
        self.parent: Buffer | None = None
        self.offset = 0

    @classmethod
    def of(cls, array: np.ndarray) -> Buffer:
        """A buffer over memory that already exists (C-contiguous float32)."""
        return cls(array.size, array.reshape(-1))

    def window(self, offset: int, size: int) -> Buffer:
        if offset == 0 and size == self.size:
            return self
        w = Buffer(size)
        w.parent, w.offset = self, int(offset)
        return w

    @property
    def placeable(self) -> bool:
        return self.parent is None and self.array is None

    def place(self, target: Buffer, offset: int) -> None:
        assert self.placeable and target is not self
        self.parent, self.offset = target, int(offset)

    def root(self) -> tuple[Buffer, int]:
        buf, offset = self, 0
        while buf.parent is not None:
            offset += buf.offset
            buf = buf.parent
        return buf, offset


@dataclasses.dataclass(eq=False)
class Mat:
    """An op argument: ``rows * cols`` values of ``buf`` seen as a (rows, cols) matrix."""

    buf: Buffer
    rows: int
    cols: int


@dataclasses.dataclass(eq=False)
class Act:
    """An activation: a contiguous row-major tensor of ``shape`` in ``buf``."""

    buf: Buffer
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def mat(self, cols: int | None = None) -> Mat:
        """The activation as a matrix of ``cols`` columns (default: its last axis)."""
        cols = (self.shape[-1] if self.shape else 1) if cols is None else cols
        return Mat(self.buf, self.size // cols, cols)

    def flat(self) -> Mat:
        return Mat(self.buf, 1, self.size)


@dataclasses.dataclass(eq=False)
class Op:
    """One kernel step: an opcode of ``closedloop.runtime.kernels``, its arguments and what it writes."""

    code: int
    args: list  # Mat | np.ndarray (a parameter) | int
    outs: list[Buffer]


def unsupported(node, why: str) -> GraphUnsupportedError:
    """The error for a node the backend cannot run: its op and ONNX name first, then why."""
    return GraphUnsupportedError(f"{node.op_type} node {node.name or node.outputs[0]!r}: {why}")


def contiguous_strides(shape: tuple[int, ...]) -> list[int]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return strides[::-1]


def merge_axes(sizes: list[int], *strides: list[int]) -> tuple[list[int], list[list[int]]]:
    """Drop unit axes and merge neighbours that every stride list walks as one; returns (sizes, strides)."""
    keep = [i for i, n in enumerate(sizes) if n != 1]
    out_n: list[int] = []
    out_s: list[list[int]] = [[] for _ in strides]
    for i in keep:
        if out_n and all(s[i] * sizes[i] == o[-1] for s, o in zip(strides, out_s, strict=True)):
            out_n[-1] *= sizes[i]
            for s, o in zip(strides, out_s, strict=True):
                o[-1] = s[i]
        else:
            out_n.append(sizes[i])
            for s, o in zip(strides, out_s, strict=True):
                o.append(s[i])
    return out_n, out_s


def broadcast_shape(node, *shapes: tuple[int, ...]) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in np.broadcast_shapes(*shapes))
    except ValueError:
        raise unsupported(node, f"shapes {' and '.join(map(str, shapes))} do not broadcast") from None


def broadcast_strides(shape: tuple[int, ...], out: tuple[int, ...]) -> list[int]:
    """Element strides of a contiguous ``shape`` read broadcast to ``out`` (0 along broadcast axes)."""
    aligned = (1,) * (len(out) - len(shape)) + tuple(shape)
    strides = contiguous_strides(aligned)
    return [0 if a == 1 and o != 1 else s for a, o, s in zip(aligned, out, strides, strict=True)]


def axis_of(node, axis: int, rank: int) -> int:
    a = axis + rank if axis < 0 else axis
    if not 0 <= a < rank:
        raise unsupported(node, f"axis {axis} is out of range for rank {rank}")
    return a
