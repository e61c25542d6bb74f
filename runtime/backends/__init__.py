"""Backends that run a graph: ONNX Runtime (CPU; CUDA and TensorRT EPs as ort-cuda, ort-trt), native TensorRT, Numba."""

from . import (
    onnxruntime_backend,  # noqa: F401  (registers)
    ort_gpu_backend,  # noqa: F401  (ort-cuda, ort-trt)
    tensorrt_backend,  # noqa: F401
)
from .base import Availability, Backend, BackendOptions
from .registry import (
    BackendChoice,
    backend_names,
    backend_report,
    choose_backend,
    create_backend,
    get_backend_class,
    register_backend,
    time_backend,
)

try:  # the Numba backend is added by its own module
    from . import numba_backend  # noqa: F401
except ImportError as _exc:  # numba missing: the registry simply lacks it, and says so
    NUMBA_IMPORT_ERROR: str | None = str(_exc)
else:
    NUMBA_IMPORT_ERROR = None

__all__ = [
    "Availability",
    "Backend",
    "BackendChoice",
    "BackendOptions",
    "backend_names",
    "backend_report",
    "choose_backend",
    "create_backend",
    "get_backend_class",
    "register_backend",
    "time_backend",
]
