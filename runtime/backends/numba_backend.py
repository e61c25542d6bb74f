"""Numba backend: runs the models users bring (MLP, GRU, LSTM, 1-D/2-D CNN, attention) on Numba kernels.

The fastest way to run the small graphs closedloop deploys at batch 1 on one core.
The constructor reads the ONNX file (without the ``onnx`` package) and turns it into
a *plan* (``_numba_plan.build_plan``) for its batch size: an int64 program for
``closedloop.runtime.kernels.run_plan`` over float32 arrays (weights re-laid out for speed,
scratch, inputs and outputs) that all live in one preallocated arena, so a step is
a single call into compiled code. ``inputs``/``outputs`` hold views of that arena
once the constructor returns. Shape plumbing costs nothing where the data stays in
place, and recurrent layers read their initial state from the state input's layer
slices and write their final state straight into the state output. Which ops run
is in the op modules (``_numba_ops``, ``_numba_shape_ops``, ``_numba_seq_ops``,
``_numba_conv_ops``); a graph outside them is refused naming the node and the op
(never run approximately), and ``supports`` says so before anything is built.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from ..errors import GraphUnsupportedError
from ..manifest import GraphSpec
from ..onnx_reader import OnnxFormatError, OnnxModel, read_onnx
from ._numba_plan import Plan, build_plan, load_kernels
from .base import Availability, Backend, BackendOptions
from .registry import register_backend

__all__ = ["NumbaBackend", "Plan", "build_plan"]

_ADVICE = "; use --backend onnxruntime"


@register_backend
class NumbaBackend(Backend):
    """A whole model step (dense, recurrent, convolutional, attention layers) as one call into compiled Numba code."""

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
        kernels = load_kernels()
        self._model: OnnxModel = read_onnx(self.path)
        try:
            plan = build_plan(self._model, spec, self.options.batch, self.inputs, self.outputs)
        except GraphUnsupportedError as exc:
            raise GraphUnsupportedError(f"{self.path.name}: {exc}{_ADVICE}") from exc
        self._program = plan.program
        self._arena, self._table, views, twins = kernels.pack_arena(plan.arrays)
        # From here on the buffers live in the arena: hand out its views.
        where = {id(a): v for a, v in zip(plan.arrays, views, strict=True)}
        self._params: list[np.ndarray | None] = [where.get(id(a)) for a in plan.params]  # None: a parameter no kept step reads
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
            if old is not None:
                old[...] = new
        self._model = model

    def weight_locations(self, names: list[str]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The arena and, per named initializer, the arena index of each element (ONNX shape; -1 if not held
        as a plain copy), so a weight scrubber can check the memory the kernels compute with.

        Found by building the plan twice with coded values (``c`` and ``2c + 7``): an arena element is a
        copy of initializer element ``c`` exactly when both builds put those codes there.
        """
        known = self._model.initializers
        codes, start = {}, 1
        for name in names:
            codes[name] = (start, known[name].shape)
            start += known[name].size
        if 2 * start + 7 >= 1 << 24:
            raise ValueError(f"{start - 1} weights are too many to locate with float32 codes")

        def probe(fn):
            merged = dict(known)
            merged.update({n: fn(np.arange(s, s + int(np.prod(sh)), dtype=np.float64)).reshape(sh).astype(np.float32)
                           for n, (s, sh) in codes.items()})
            return build_plan(dataclasses.replace(self._model, initializers=merged), self.spec, self.options.batch).params

        first, second = probe(lambda c: c), probe(lambda c: 2 * c + 7)
        where = np.full(start, -1, dtype=np.int64)
        seen = np.zeros(start, dtype=np.int64)
        base = self._arena.ctypes.data
        for arena_view, a, b in zip(self._params, first, second, strict=True):
            if arena_view is None:
                continue
            a, b = a.reshape(-1).astype(np.float64), b.reshape(-1).astype(np.float64)
            hit = np.flatnonzero((a >= 1) & (a < start) & (a == np.round(a)) & (b == 2 * a + 7))
            c = a[hit].astype(np.int64)
            where[c] = (arena_view.ctypes.data - base) // 4 + hit
            np.add.at(seen, c, 1)
        where[seen != 1] = -1
        return self._arena, {n: where[s: s + int(np.prod(sh))].reshape(sh) for n, (s, sh) in codes.items()}

    def describe(self) -> str:
        return f"{self.name} ({len(self._program)} kernel steps)"
