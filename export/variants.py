"""Reduced-precision variants of an exported graph: FP16 and dynamically quantized INT8.

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

Adding a variant is one builder function and one ``VARIANTS`` entry.
"""

from __future__ import annotations

import logging
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from closedloop.runtime.manifest import GraphSpec
from closedloop.runtime.onnx_reader import parse_onnx

from .errors import ExportError
from .onnx_export import op_counts
from .parity import ParityInputs, Runner, Tolerance, compare, ort_runner

# Ops that carry weights, so a quantizer may or may not convert them.
WEIGHT_OPS = {"Gemm", "MatMul", "Conv", "ConvTranspose", "GRU", "LSTM", "RNN", "Attention", "Gather"}


@dataclass
class VariantBuild:
    onnx_bytes: bytes
    info: dict[str, Any]


def _fp16(fp32: bytes) -> VariantBuild:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = convert_float_to_float16(onnx.load_from_string(fp32), keep_io_types=True)
    info: dict[str, Any] = {
        "converter": "onnxruntime.transformers.float16.convert_float_to_float16(keep_io_types=True)",
        "io_dtype": "float32",
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


VARIANTS: dict[str, Callable[[bytes], VariantBuild]] = {"fp16": _fp16, "int8": _int8}

#: Stated tolerances against the FP32 graph (same rule as FP32 parity: abs OR rel).
VARIANT_TOLERANCES: dict[str, Tolerance] = {
    "fp16": Tolerance(abs=1e-2, rel=1e-2),  # float16 has ~3 significant digits
    "int8": Tolerance(abs=5e-2, rel=5e-2),  # 8-bit weights and activations
}


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
