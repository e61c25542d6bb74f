"""A model step's floor on this machine: its FLOPs at single-core peak, its weights at read bandwidth.

The floor of one step is the larger of two times: the step's multiply-adds (2 FLOPs
each) at the measured single-core peak, and its weight bytes at the measured read
bandwidth for a working set of that size (from cache when it fits, and from memory
after other work has evicted it: the "cold" floor of a step that runs once a period).
``closedloop bench BUNDLE`` (``closedloop.runtime.timing``) sets each measured step
beside it; the spine benchmark (``closedloop.sdk.benchmark``) does the same for its models.

Everything here runs on the deployed footprint (numpy, numba, onnxruntime; no torch).
Peak is a single-threaded float32 GEMM in a subprocess (so the BLAS thread count is
pinned to one before numpy loads); bandwidth a Numba reduction over an array the size
of the weights (fastmath, so it vectorises; a numpy sum where numba is missing).
A graph's FLOPs come from the shapes ONNX Runtime reports for every node of one
profiled batch-1 run, so windows, convolutions and sequence axes count at their real size.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .manifest import GraphSpec
from .onnx_reader import Node, OnnxModel, read_onnx

_PEAK_PROBE = r"""
import json, time, numpy as np
n = 512
a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
b = np.random.default_rng(1).standard_normal((n, n)).astype(np.float32)
c = np.empty((n, n), np.float32)
for _ in range(3):
    np.matmul(a, b, out=c)
best = 1e9
for _ in range(15):
    t = time.perf_counter(); np.matmul(a, b, out=c); best = min(best, time.perf_counter() - t)
print(json.dumps({"gflops": 2 * n**3 / best / 1e9}))
"""


def single_core_peak_gflops() -> float:
    """Single-threaded float32 GEMM rate (GFLOP/s), the practical single-core peak."""
    env = dict(os.environ)
    for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS"):
        env[k] = "1"
    out = subprocess.run([sys.executable, "-c", _PEAK_PROBE], env=env, capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["gflops"])


@functools.cache
def _kernels() -> tuple[Callable[[np.ndarray], object], Callable[[np.ndarray, float], None]]:
    """(sum, scribble), compiled once per process; plain numpy where numba is missing."""
    try:
        from numba import njit
    except ImportError:
        def scribble_np(b: np.ndarray, v: float) -> None:
            b[::16] = v

        return np.sum, scribble_np

    @njit(fastmath=True, cache=False)
    def _sum(a):
        s = np.float32(0.0)
        for i in range(a.size):
            s += a[i]
        return s

    @njit(cache=False)
    def _scribble(b, v):
        for i in range(0, b.size, 16):
            b[i] = v

    return _sum, _scribble


def read_bandwidth_gbs(n_bytes: int, repeats: int = 50) -> float:
    """Read bandwidth (GB/s) for a working set of ``n_bytes`` already in cache when it fits."""
    total, _ = _kernels()
    a = np.ones(max(n_bytes // 4, 1024), dtype=np.float32)
    total(a)
    best = 1e9
    for _ in range(repeats):
        t = time.perf_counter()
        total(a)
        best = min(best, time.perf_counter() - t)
    return a.nbytes / best / 1e9


def cold_read_bandwidth_gbs(n_bytes: int, repeats: int = 30, evict_bytes: int = 96 << 20) -> float:
    """Read bandwidth (GB/s) for ``n_bytes`` that are *not* in cache: each read follows a
    pass over ``evict_bytes`` of other data (larger than the last-level cache), the
    situation of a step that runs once every 20 ms after other work. Median of repeats."""
    total, scribble = _kernels()
    a = np.ones(max(n_bytes // 4, 1024), dtype=np.float32)
    b = np.zeros(evict_bytes // 4, dtype=np.float32)
    total(a)
    scribble(b, 1.0)
    times = []
    for r in range(repeats):
        scribble(b, float(r))
        t = time.perf_counter()
        total(a)
        times.append(time.perf_counter() - t)
    return a.nbytes / float(np.median(times)) / 1e9


def gru_flops(n_in: int, n_hidden: int, n_layers: int, n_out: int) -> int:
    """Multiply-adds counted as 2 FLOPs; gate nonlinearities ignored (small)."""
    flops = 0
    width = n_in
    for _ in range(n_layers):
        flops += 2 * 3 * n_hidden * (width + n_hidden)
        width = n_hidden
    return flops + 2 * n_hidden * n_out


def mlp_flops(sizes: list[int]) -> int:
    return sum(2 * a * b for a, b in zip(sizes[:-1], sizes[1:], strict=False))


@dataclass
class GraphCost:
    """What one batch-1 step of a graph must do: multiply-add FLOPs and weight bytes to read."""

    flops: int
    weight_bytes: int
    exact: bool  # False: some activation shapes were unknown and counted as one row (a lower bound)
    flops_by_op: dict[str, int] = field(default_factory=dict)

    def floor_us(self, peak_gflops: float, read_gbs: float) -> tuple[float, str]:
        """The step's floor (us) and what bounds it, ``"flops"`` or ``"bandwidth"``."""
        t_flops = self.flops / (peak_gflops * 1e3)
        t_bytes = self.weight_bytes / (read_gbs * 1e3)
        return max(t_flops, t_bytes), "flops" if t_flops > t_bytes else "bandwidth"


_GATES = {"GRU": 3, "LSTM": 4, "RNN": 1}


def weight_bytes(model: OnnxModel) -> int:
    """Bytes of the graph's weights: every floating or 8-bit initializer or Constant (shape and index
    constants left out)."""
    consts = [n.attributes.get("value") for n in model.nodes if n.op_type == "Constant"]
    arrays = [*model.initializers.values(), *(c for c in consts if isinstance(c, np.ndarray))]
    return sum(int(a.nbytes) for a in arrays if a.dtype.kind == "f" or a.dtype.itemsize == 1)


def graph_cost(path: str | Path, spec: GraphSpec | None = None) -> GraphCost:
    """FLOPs and weight bytes of one batch-1 step of the ONNX graph at ``path``.

    MatMul, Gemm, Conv, ConvTranspose and the recurrent ops (GRU, LSTM, RNN) are counted
    as 2 FLOPs per multiply-add; elementwise work and nonlinearities are left out (small
    beside them). Activation shapes come from a profiled ONNX Runtime run when ``spec``
    gives the inputs and ONNX Runtime can run the graph; otherwise each product counts
    one row (``exact`` is False).
    """
    model = read_onnx(path)
    shapes: dict[str, tuple[int, ...]] = {k: tuple(a.shape) for k, a in model.initializers.items()}
    for node in model.nodes:
        value = node.attributes.get("value")
        if node.op_type == "Constant" and isinstance(value, np.ndarray):
            shapes[node.outputs[0]] = tuple(value.shape)
    if spec is not None:
        shapes |= _profiled_shapes(Path(path), spec)
    total, exact = 0, True
    by_op: dict[str, int] = {}
    for node in model.nodes:
        flops, known = _node_flops(node, shapes)
        if flops:
            by_op[node.op_type] = by_op.get(node.op_type, 0) + flops
            total += flops
        exact &= known
    return GraphCost(flops=total, weight_bytes=weight_bytes(model), exact=exact, flops_by_op=by_op)


def _node_flops(node: Node, shapes: dict[str, tuple[int, ...]]) -> tuple[int, bool]:
    """(FLOPs, whether every shape needed was known) of one node; 0 for ops not counted."""

    def shape(i: int, outputs: bool = False) -> tuple[int, ...] | None:
        names = node.outputs if outputs else node.inputs
        return shapes.get(names[i]) if i < len(names) and names[i] else None

    op = node.op_type
    if op in ("MatMul", "MatMulInteger", "Gemm"):
        a, b, y = shape(0), shape(1), shape(0, outputs=True)
        trans_a = op == "Gemm" and bool(node.attributes.get("transA", 0))
        if a is not None and y is not None:
            return 2 * int(np.prod(y)) * a[0 if trans_a else -1], True
        return (2 * int(np.prod(b)), False) if b is not None else (0, False)
    if op in ("Conv", "ConvInteger"):
        w, y = shape(1), shape(0, outputs=True)
        if w is None:
            return 0, False
        per_output = int(np.prod(w[1:]))
        return (2 * int(np.prod(y)) * per_output, True) if y is not None else (2 * int(np.prod(w)), False)
    if op == "ConvTranspose":
        x, w = shape(0), shape(1)
        if w is None:
            return 0, False
        return (2 * int(np.prod(x)) * int(np.prod(w[1:])), True) if x is not None else (2 * int(np.prod(w)), False)
    if op in _GATES:
        x, w, r = shape(0), shape(1), shape(2)
        if w is None or r is None:
            return 0, False
        dirs, gated, n_in = w
        per_step = 2 * dirs * gated * (n_in + r[-1])
        if x is None:
            return per_step, False
        seq, batch = (x[1], x[0]) if node.attributes.get("layout", 0) else (x[0], x[1])
        return per_step * seq * batch, True
    return 0, True


def _profiled_shapes(path: Path, spec: GraphSpec) -> dict[str, tuple[int, ...]]:
    """The shape of every node output in one batch-1 ONNX Runtime run (empty if it cannot run)."""
    try:
        import onnxruntime as ort
    except ImportError:
        return {}
    model = read_onnx(path)
    with tempfile.TemporaryDirectory(prefix="closedloop-cost-") as tmp:
        so = ort.SessionOptions()
        so.enable_profiling = True
        so.profile_file_prefix = str(Path(tmp) / "cost")
        # unoptimised, so every profiled node is a node of the file, under its own name
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        so.intra_op_num_threads = 1
        so.log_severity_level = 3
        try:
            session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
            feed = {t.name: np.zeros(t.concrete_shape(1), dtype=np.dtype(t.dtype)) for t in spec.inputs}
            session.run(None, feed)
            events = json.loads(Path(session.end_profiling()).read_text())
        except Exception:  # noqa: BLE001 - a graph ONNX Runtime cannot run is costed from its weights alone
            return {}
    shapes: dict[str, tuple[int, ...]] = {t.name: t.concrete_shape(1) for t in spec.inputs}
    by_event = {f"{n.name}_kernel_time": n for n in model.nodes if n.name}
    for ev in events:
        node = by_event.get(ev.get("name", "")) if ev.get("cat") == "Node" else None
        if node is None:
            continue
        outs = [o for o in node.outputs if o]
        for name, typed in zip(outs, ev.get("args", {}).get("output_type_shape", []), strict=False):
            dims = next(iter(typed.values()), None) if isinstance(typed, dict) else None
            if isinstance(dims, list):
                shapes[name] = tuple(int(d) for d in dims)
    return shapes
