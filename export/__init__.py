"""Export: turn a trained torch module into a bundle the torch-free runtime loads.

``export_bundle`` traces the module to ONNX (a single-step graph with explicit
state for recurrent models), proves parity with torch on random and recorded
inputs, adds FP16/INT8 variants with their measured error, reports TensorRT
compatibility (and builds an engine where TensorRT and a GPU exist), and writes the
bundle atomically with a SHA-256 per file. The format is in ``docs/bundle.md``.
"""

from __future__ import annotations

from .api import ExportOptions, export_bundle
from .errors import ExportError, GraphCheckError, ParityError, UnsupportedOpError
from .onnx_export import ExportedGraph, export_onnx
from .parity import FP32_TOLERANCE, Tolerance
from .sequence_step import SequenceStep
from .tensorrt import build_tensorrt_engines, tensorrt_compatibility
from .variants import VARIANT_TOLERANCES, VARIANTS
from .writer import write_bundle

__all__ = [
    "FP32_TOLERANCE",
    "VARIANTS",
    "VARIANT_TOLERANCES",
    "ExportError",
    "ExportOptions",
    "ExportedGraph",
    "GraphCheckError",
    "ParityError",
    "SequenceStep",
    "Tolerance",
    "build_tensorrt_engines",
    "export_bundle",
    "export_onnx",
    "tensorrt_compatibility",
    "UnsupportedOpError",
    "write_bundle",
]
