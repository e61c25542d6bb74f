"""Weight-storage variants: the FP32 graph with its weight matrices stored in float16 or int8.

A batch-1 step of a recurrent or dense model reads every weight once, so its speed is how fast the
weights come from cache; a GRU 192 -> 2 x 256 holds 3 MB of float32 weights, more than a 1-2 MB L2.
These variants store the weights that multiply activations (Gemm, MatMul by a constant, Conv, GRU,
LSTM, RNN) in half or a quarter of the bytes and keep everything else, activations included, in
float32:

* ``fp16w``: each weight as a float16 initializer widened by ``Cast(to=FLOAT)``;
* ``int8w``: each weight as int8 codes with one float32 scale per output row (symmetric, zero
  point 0: ``scale = max |row| / 127``) and ``DequantizeLinear(axis=<output-row axis>)``.

Both are plain ONNX that any runtime runs (ONNX Runtime folds the widening into float32 weights at
load). The Numba backend recognises the pattern and keeps the weights in that storage, widening
them in registers and accumulating in float32 (``closedloop.runtime.kernels_dense``), so it computes
with exactly the values ONNX Runtime does and reads a half or a quarter of the bytes.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# op type -> ((input index, axis of the output rows in that weight), ...)
WEIGHT_INPUTS: dict[str, tuple[tuple[int, int], ...]] = {
    "Conv": ((1, 0),),
    "GRU": ((1, 1), (2, 1)),
    "LSTM": ((1, 1), (2, 1)),
    "RNN": ((1, 1), (2, 1)),
}

STORAGES = ("float16", "int8")
FP16_MAX = float(np.finfo(np.float16).max)


def _weight_inputs(node: onnx.NodeProto, init: dict[str, np.ndarray]) -> tuple[tuple[int, int], ...]:
    """The (input, output-row axis) pairs of ``node`` that are weights a product reads."""
    if node.op_type == "Gemm":
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        alpha = next((a.f for a in node.attribute if a.name == "alpha"), 1.0)
        return ((1, 0 if trans_b else 1),) if alpha == 1.0 else ()
    if node.op_type == "MatMul":
        w = init.get(node.input[1]) if len(node.input) > 1 else None
        return ((1, 1),) if w is not None and w.ndim == 2 else ()
    return WEIGHT_INPUTS.get(node.op_type, ())


def store_weights(fp32: bytes, storage: str) -> tuple[bytes, dict[str, Any]]:
    """The graph with its product weights stored as ``storage`` ("float16" or "int8"); (bytes, record).

    A weight that any other node reads as well (not as the weight of a product) stays float32, so
    every op but the products sees the values it saw.
    """
    if storage not in STORAGES:
        raise ValueError(f"weight storage {storage!r} is not one of {STORAGES}")
    model = onnx.load_from_string(fp32)
    graph = model.graph
    init = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for i, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, i))
    chosen: dict[str, int] = {}  # initializer -> output-row axis
    ops: Counter[str] = Counter()
    for node in graph.node:
        for i, axis in _weight_inputs(node, init):
            name = node.input[i]
            w = init.get(name)
            if w is None or w.dtype != np.float32 or w.ndim < 2:
                continue
            uses = readers[name]
            # every reader must read it as a product weight along the same rows
            if all(any(j == k and ax == axis for j, ax in _weight_inputs(n, init)) for n, k in uses):
                chosen[name] = axis
                ops[node.op_type] += 1
    nodes, replaced, clamped = [], set(), 0
    before = after = 0
    for name, axis in chosen.items():
        w = init[name]
        before += w.nbytes
        if storage == "float16":
            clamped += int(np.count_nonzero(np.abs(w) > FP16_MAX))
            stored = np.clip(w, -FP16_MAX, FP16_MAX).astype(np.float16)
            extra = [numpy_helper.from_array(stored, f"{name}.fp16")]
            after += stored.nbytes
            nodes.append(helper.make_node("Cast", [f"{name}.fp16"], [name], to=TensorProto.FLOAT,
                                          name=f"{name}.widen"))
        else:
            others = tuple(a for a in range(w.ndim) if a != axis)
            scale = (np.abs(w).max(axis=others) / np.float32(127)).astype(np.float32)
            scale[scale == 0] = 1  # an all-zero row: codes 0 whatever the scale
            shape = [-1 if a == axis else 1 for a in range(w.ndim)]
            codes = np.clip(np.rint(w / scale.reshape(shape)), -127, 127).astype(np.int8)
            after += codes.nbytes + scale.nbytes
            # symmetric codes: no zero point (ONNX's default is 0), so a runtime's choice of how to keep the
            # weight depends on types alone, never on a value a bit flip could change
            extra = [numpy_helper.from_array(codes, f"{name}.int8"), numpy_helper.from_array(scale, f"{name}.scale")]
            nodes.append(helper.make_node("DequantizeLinear", [f"{name}.int8", f"{name}.scale"],
                                          [name], axis=axis, name=f"{name}.dequantize"))
        graph.initializer.extend(extra)
        replaced.add(name)
    kept = [t for t in graph.initializer if t.name not in replaced]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    body = list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes + body)  # the widening nodes read only initializers: they go first
    record: dict[str, Any] = {
        "weight_storage": "float16" if storage == "float16" else "int8, one float32 scale per output row",
        "compute_dtype": "float32",
        "io_dtype": "float32",
        "stored_weights": dict(sorted(ops.items())),
        "weight_bytes_stored": {"fp32": before, "variant": after},
        "auto_choice": True,
    }
    if clamped:
        record["converter_warnings"] = [f"{clamped} weight(s) outside float16's range clamped to +-{FP16_MAX:g}"]
    onnx.checker.check_model(model)
    return model.SerializeToString(), record
