"""Export: turn a trained torch module (or an ONNX file made elsewhere: ``import_onnx``) into a bundle the
torch-free runtime loads.

``export_bundle`` traces the module to ONNX (a single-step graph with explicit
state for recurrent models), proves parity with torch on random and recorded
inputs, adds FP16/INT8 variants with their measured error, reports TensorRT
compatibility (and builds an engine where TensorRT and a GPU exist), and writes the
bundle atomically with a SHA-256 per file. The format is in ``docs/bundle.md``.

Names load on first use: ``import_onnx`` needs onnx and ONNX Runtime, not torch.
"""

from __future__ import annotations

from closedloop.common.lazy import lazy_exports

from .errors import ExportError, GraphCheckError, ParityError, UnsupportedOpError

_EXPORTS: dict[str, str] = {
    "FP32_TOLERANCE": ".parity",
    "VARIANTS": ".variants",
    "VARIANT_TOLERANCES": ".variants",
    "ExportOptions": ".assemble",
    "ExportedGraph": ".onnx_export",
    "PowerSpectrum": ".spectral",
    "SequenceStep": ".sequence_step",
    "Tolerance": ".parity",
    "Window": "closedloop.runtime.manifest",  # export_bundle(..., windows={"x": Window(...)})
    "build_tensorrt_engines": ".tensorrt",
    "export_bundle": ".api",
    "export_onnx": ".onnx_export",
    "import_onnx": ".onnx_import",
    "tensorrt_compatibility": ".tensorrt",
    "write_bundle": ".writer",
}

__all__ = ["FP32_TOLERANCE", "VARIANTS", "VARIANT_TOLERANCES", "ExportError", "ExportOptions", "ExportedGraph",
           "GraphCheckError", "ParityError", "PowerSpectrum", "SequenceStep", "Tolerance", "UnsupportedOpError", "Window",
           "build_tensorrt_engines",
           "export_bundle", "export_onnx", "import_onnx", "tensorrt_compatibility", "write_bundle"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
