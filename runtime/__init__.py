"""closedloop runtime: load a verified bundle and run it at a fixed rate. No torch here.

This package is what goes on a board. It depends on numpy, numba, onnxruntime and
(through ``firmware_bridge``) pyserial; TensorRT is found at run time when present.
"""

from .backends import Availability, Backend, BackendOptions, backend_names, backend_report, create_backend
from .bundle import Bundle, check_bundle, load_bundle
from .errors import BackendUnavailableError, BundleError, DeadlineStop, GraphUnsupportedError
from .families import FamilyPlugin, get_family, register_family
from .loop import LoopConfig, OverrunPolicy, RealTimeLoop
from .manifest import SCHEMA_VERSION, GraphSpec, Manifest, TensorSpec
from .model import Model
from .stats import LoopSummary

__all__ = [
    "SCHEMA_VERSION",
    "Availability",
    "Backend",
    "BackendOptions",
    "BackendUnavailableError",
    "Bundle",
    "BundleError",
    "DeadlineStop",
    "FamilyPlugin",
    "GraphSpec",
    "GraphUnsupportedError",
    "LoopConfig",
    "LoopSummary",
    "Manifest",
    "Model",
    "OverrunPolicy",
    "RealTimeLoop",
    "TensorSpec",
    "backend_names",
    "backend_report",
    "check_bundle",
    "create_backend",
    "get_family",
    "load_bundle",
    "register_family",
]
