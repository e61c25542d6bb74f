"""Reduced-precision variants of an exported graph: FP16, dynamically quantized INT8, and float32
graphs whose weights are stored in float16 or int8 (FP16W, INT8W).

Each variant is made from the FP32 graph, keeps its float32 inputs and outputs (so
the manifest's tensor specs hold for every variant), and is measured against the
FP32 graph with ONNX Runtime on the same random and sequence inputs as the FP32
parity check (``closedloop.export.parity``). A variant whose error exceeds its stated, looser
tolerance is still written, but flagged ``"within_tolerance": false`` so the runtime
and the user can decline it.

* ``fp16``: ``onnxruntime.transformers.float16.convert_float_to_float16`` with
  ``keep_io_types=True`` (weights and activations in float16, I/O float32).
* ``int8``: ``onnxruntime.quantization.quantize_dynamic`` with QInt8 weights in 7 bits
  (``reduce_range``: right on x86 CPUs without VNNI too; activations quantized on the
  fly). Only some ops have integer kernels: MatMul and Gemm become ``MatMulInteger``;
  GRU stays float32. The record lists which ops were quantized and which
  weight-bearing ops kept float.
* ``fp16w``, ``int8w``: the product weights stored in float16, or in int8 with a float32
  scale per output row, widened to float32 inside the graph; every activation stays
  float32 (``closedloop.export.weight_storage``). ONNX Runtime runs them as plain ONNX and
  the Numba backend keeps the weights in that storage, so a model whose float32 weights
  do not fit the cache can run from it. The record says ``auto_choice``: a runtime
  choosing automatically may take the variant when it is within tolerance.

Adding a variant is one builder function and one ``VARIANTS`` entry.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from closedloop.runtime.manifest import GraphSpec
from closedloop.runtime.onnx_reader import op_counts, parse_onnx

from .errors import ExportError
from .parity import ParityInputs, Runner, Tolerance, compare, ort_runner
from .weight_storage import store_weights

# Ops that carry weights, so a quantizer may or may not convert them.
WEIGHT_OPS = {"Gemm", "MatMul", "Conv", "ConvTranspose", "GRU", "LSTM", "RNN", "Attention", "Gather"}


@dataclass
class VariantBuild:
    onnx_bytes: bytes
    info: dict[str, Any]


# Ops the fp16 variant keeps in float32, beyond the converter's own list. LayerNormalization: its variance
# sums lose digits in float16, and a transformer encoder converted with it in float16 segfaults ONNX Runtime
# 1.32's session creation at ORT_ENABLE_ALL (the crash goes with MatmulTransposeFusion or NchwcTransformer
# disabled, or with the normalisation in float32, which is what the Cast nodes around it give).
FP16_KEEP_FLOAT32 = ("LayerNormalization",)
# Where the graph still crashes that session creation, a Transpose feeding a float16 MatMul is the pattern
# (MatmulTransposeFusion; seen on every nn.GRU / nn.LSTM streamed through SequenceStep, whose batch_first
# Transposes sit around the recurrence): the fp16 variant is rebuilt with Transpose kept in float32 too.
FP16_RETRY_KEEP_FLOAT32 = ("Transpose",)


def _fp16(fp32: bytes, keep: tuple[str, ...] = FP16_KEEP_FLOAT32) -> VariantBuild:
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    block = sorted(set(DEFAULT_OP_BLOCK_LIST) | set(keep))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = convert_float_to_float16(onnx.load_from_string(fp32), keep_io_types=True, op_block_list=block)
    info: dict[str, Any] = {
        "converter": "onnxruntime.transformers.float16.convert_float_to_float16(keep_io_types=True, "
                     f"op_block_list=DEFAULT_OP_BLOCK_LIST + {list(keep)})",
        "io_dtype": "float32",
        "float32_ops": list(keep),
    }
    if caught:  # e.g. weights outside float16's range, clamped
        info["converter_warnings"] = sorted({str(w.message)[:200] for w in caught})
    return VariantBuild(model.SerializeToString(), info)


def _int8(fp32: bytes) -> VariantBuild:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory(prefix="closedloop-int8-") as d:
        src, dst = Path(d) / "fp32.onnx", Path(d) / "int8.onnx"
        src.write_bytes(fp32)
        # quantize_dynamic logs a root-logger warning suggesting pre-processing; that step
        # runs ORT's optimiser, whose fused com.microsoft ops would tie the graph to ORT.
        previous = logging.root.manager.disable
        logging.disable(logging.WARNING)
        try:
            # reduce_range: 7-bit weights. On x86 CPUs without VNNI (AVX2 only, as on many AMD EPYCs) ONNX
            # Runtime's u8 x s8 kernel sums pairs of products in saturating int16 (VPMADDUBSW), and full-range
            # 8-bit weights overflow it: the tests' GRU decoder's variant was 0.19 off fp32 on such a CPU, 0.0026
            # with 7-bit weights. A variant runs on whatever CPU it is deployed to, so it is built for all of them.
            quantize_dynamic(src, dst, weight_type=QuantType.QInt8, reduce_range=True)
        finally:
            logging.disable(previous)
        data = dst.read_bytes()
    before, after = op_counts(parse_onnx(fp32)), op_counts(parse_onnx(data))
    info = {
        "quantizer": "onnxruntime.quantization.quantize_dynamic(weight_type=QInt8, reduce_range=True)",
        "quantized_ops": sorted(op for op, n in before.items() if op in WEIGHT_OPS and after.get(op, 0) < n),
        "float_ops_kept": sorted(op for op in after if op in WEIGHT_OPS),
        "added_ops": sorted(op for op, n in after.items() if n > before.get(op, 0)),
    }
    return VariantBuild(data, info)


def _fp16w(fp32: bytes) -> VariantBuild:
    return VariantBuild(*store_weights(fp32, "float16"))


def _int8w(fp32: bytes) -> VariantBuild:
    return VariantBuild(*store_weights(fp32, "int8"))


VARIANTS: dict[str, Callable[[bytes], VariantBuild]] = {"fp16": _fp16, "int8": _int8, "fp16w": _fp16w,
                                                        "int8w": _int8w}

#: Stated tolerances against the FP32 graph (same rule as FP32 parity: abs OR rel).
VARIANT_TOLERANCES: dict[str, Tolerance] = {
    "fp16": Tolerance(abs=1e-2, rel=1e-2),  # float16 has ~3 significant digits
    "int8": Tolerance(abs=5e-2, rel=5e-2),  # 8-bit weights and activations
    "fp16w": Tolerance(abs=1e-2, rel=1e-2),  # float16 weights, float32 arithmetic: as fp16 or better
    "int8w": Tolerance(abs=5e-2, rel=5e-2),  # 8-bit weights (one scale per row), float32 activations
}


def _session_crash(data: bytes) -> str | None:
    """How ONNX Runtime's session creation dies on ``data`` in a child process (None when it loads).

    A converter can write a graph on which ONNX Runtime crashes the process rather than raising; the
    parity check would take the exporting process with it, so the variant is loaded first where a
    crash costs only the child (about 0.4 s).
    """
    code = ("import sys, onnxruntime as o; o.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider'])")
    with tempfile.TemporaryDirectory(prefix="closedloop-variant-") as d:
        path = Path(d) / "variant.onnx"
        path.write_bytes(data)
        result = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300)
    if result.returncode == 0:
        return None
    if result.returncode < 0:
        return f"is killed by {signal.Signals(-result.returncode).name}"
    return f"fails ({result.stderr.strip().splitlines()[-1][:300] if result.stderr.strip() else 'no message'})"


def check_variant_names(names: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ExportError(f"unknown variant(s) {unknown}; known variants: {sorted(VARIANTS)} (or pass variants=())")
    if len(set(names)) != len(names):
        raise ExportError(f"variants {list(names)} lists a name twice")
    return tuple(names)


def build_variant(
    name: str,
    fp32: bytes,
    spec: GraphSpec,
    fp32_run: Runner,
    inputs: ParityInputs,
    tolerance: Tolerance | None = None,
) -> tuple[bytes, dict[str, Any]]:
    """Make variant ``name`` of the FP32 graph and measure it; return (bytes, manifest record without 'file')."""
    check_variant_names([name])
    built = VARIANTS[name](fp32)
    crash = _session_crash(built.onnx_bytes)
    if crash and name == "fp16":  # the known crashing pattern, broken up by Casts around the Transposes
        built = _fp16(fp32, FP16_KEEP_FLOAT32 + FP16_RETRY_KEEP_FLOAT32)
        crash = _session_crash(built.onnx_bytes)
    if crash:
        import onnxruntime

        raise ExportError(f"variant {name}: ONNX Runtime {onnxruntime.__version__} {crash} creating a session for it "
                          "at its default optimisation level, so no runtime could load it; export without it "
                          f"(variants=[...] without {name!r}) or report the graph")
    tol = tolerance or VARIANT_TOLERANCES[name]
    parity = compare(fp32_run, ort_runner(built.onnx_bytes), spec, inputs, tol)
    parity["reference"] = "fp32 ONNX graph (ONNX Runtime)"
    record = {
        **built.info,
        "parity_vs_fp32": parity,
        "within_tolerance": parity["within_tolerance"],
        "tolerance": tol.to_dict(),
    }
    return built.onnx_bytes, record
