"""ONNX Runtime's CPU backend, and the base class of its GPU backends (``ort_gpu_backend``).

Inputs and outputs are bound once with io_binding to the backend's preallocated
numpy arrays, so a step is one ``run_with_iobinding`` call with no allocation and no
copy. One intra-op thread by default: on a loaded 2-core machine the default two
threads caused millisecond outliers.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np

from ..manifest import GraphSpec
from .base import Availability, Backend, BackendOptions
from .registry import register_backend


def _ort():
    import onnxruntime

    return onnxruntime


class _OrtBackend(Backend):
    provider: ClassVar[str] = "CPUExecutionProvider"

    missing_hint: ClassVar[str] = ""  # what to install when the provider is not in the build

    @classmethod
    def availability(cls) -> Availability:
        try:
            ort = _ort()
        except ImportError as exc:
            return Availability(False, f"onnxruntime not importable ({exc})")
        providers = ort.get_available_providers()
        if cls.provider not in providers:
            return Availability(False, f"{cls.provider} is not in this onnxruntime build (onnxruntime "
                                       f"{ort.__version__} has {', '.join(providers)})" + cls.missing_hint)
        return Availability(True, f"onnxruntime {ort.__version__}")

    def _providers(self) -> list:
        return [self.provider]

    def __init__(self, path: Path, spec: GraphSpec, options: BackendOptions | None = None):
        super().__init__(path, spec, options)
        self._overrides: dict[str, np.ndarray] = {}
        self._build()

    def _build(self) -> None:
        ort = _ort()
        so = ort.SessionOptions()
        so.intra_op_num_threads = self.options.threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # ORT 1.32 at ENABLE_ALL silently ignores add_initializer overrides of float16 weights (measured:
        # the file's values are used); EXTENDED honours them, so a session with overrides uses that.
        level = "ORT_ENABLE_EXTENDED" if self._overrides else "ORT_ENABLE_ALL"
        so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
        # An int8w variant's DequantizeLinear -> MatMul becomes MatMulNBits, which by default (level 4) also
        # quantizes the activations to int8: 4e-3 off the graph's float32 arithmetic on a small transformer.
        # Level 1 computes in float32, as the graph says (and as the Numba backend does).
        so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
        self._keep = []  # OrtValues must outlive the session that uses them
        for name, arr in self._overrides.items():
            v = ort.OrtValue.ortvalue_from_numpy(arr)
            self._keep.append(v)
            so.add_initializer(name, v)
        self._sess = self._make_session(ort, so)
        io = self._sess.io_binding()
        device = "cpu"
        for name, arr in self.inputs.items():
            v = ort.OrtValue.ortvalue_from_numpy(arr, device)
            self._keep.append(v)
            io.bind_ortvalue_input(name, v)
        for name, arr in self.outputs.items():
            v = ort.OrtValue.ortvalue_from_numpy(arr, device)
            self._keep.append(v)
            io.bind_ortvalue_output(name, v)
        self._io = io
        self._run = self._sess.run_with_iobinding
        self._run(self._io)  # first run outside the loop: ORT allocates its arena here
        self._after_first_run()

    def _make_session(self, ort, so):
        return ort.InferenceSession(str(self.path), sess_options=so, providers=self._providers())

    def _after_first_run(self) -> None:
        """Hook for a subclass: checks on the built session (the GPU backends' node placement)."""

    def run(self) -> None:
        self._run(self._io)

    def set_initializers(self, initializers: dict[str, np.ndarray]) -> None:
        """Rebuild the session with these initializers replacing the file's (ORT add_initializer)."""
        # Merged with earlier overrides: a partial update must not revert the others to the file's values.
        self._overrides = {**self._overrides, **{k: np.ascontiguousarray(v) for k, v in initializers.items()}}
        self._build()

    def close(self) -> None:
        self._sess = None


@register_backend
class OrtCpuBackend(_OrtBackend):
    name = "onnxruntime"
    provider = "CPUExecutionProvider"
    preference = 20
