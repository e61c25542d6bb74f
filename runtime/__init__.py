"""closedloop runtime: load a verified bundle and run it at a fixed rate. No torch here.

This package is what goes on a board. It depends on numpy, numba, onnxruntime and
(through ``firmware_bridge``) pyserial; TensorRT is found at run time when present.
"""

from closedloop.runtime.protect.scrubber import (
    ProtectionLayout,
    Scrubber,
    ScrubError,
    ScrubEvent,
    WeightsCorruptedError,
    attach_scrubber,
)

from . import replay as _replay  # noqa: F401  (registers the replay:// transport)
from .backends import Availability, Backend, BackendOptions, backend_names, backend_report, create_backend
from .bundle import Bundle, check_bundle, load_bundle
from .doctor import DoctorConfig, DoctorReport, run_doctor
from .errors import BackendUnavailableError, BundleError, GraphUnsupportedError
from .families import FamilyPlugin, get_family, register_family
from .loop import LoopConfig, OverrunPolicy, RealTimeLoop
from .manifest import SCHEMA_VERSION, GraphSpec, Manifest, TensorSpec, Window
from .model import Model
from .observe import CommandBatch, RunBatch, SessionObserver, StepBatch
from .realtime import RealtimeConfig, RealtimeError, RealtimeGrant, apply_realtime
from .recording import RecordingError, RecordingReader, RecordingWriter, RecordType
from .replay import ReplayReport, replay_recording
from .session import (
    DeviceChangedError,
    DeviceMismatchError,
    Session,
    SessionConfig,
    SessionError,
    SessionSummary,
    run_session,
)
from .signing import SigningError, TrustedKeys, generate_key_pair, seal_manifest, sign_bundle
from .stats import LoopSummary
from .timing import BenchConfig, BundleBench, bench_bundle, format_bench_table

__all__ = [
    "SCHEMA_VERSION",
    "Availability",
    "Backend",
    "BackendOptions",
    "BackendUnavailableError",
    "BenchConfig",
    "BundleBench",
    "Bundle",
    "BundleError",
    "DoctorConfig",
    "DoctorReport",
    "FamilyPlugin",
    "GraphSpec",
    "GraphUnsupportedError",
    "LoopConfig",
    "LoopSummary",
    "Manifest",
    "Model",
    "RealtimeConfig",
    "RealtimeError",
    "RecordingError",
    "RealtimeGrant",
    "RecordType",
    "RecordingReader",
    "RecordingWriter",
    "ReplayReport",
    "Session",
    "SessionObserver",
    "RunBatch",
    "CommandBatch",
    "StepBatch",
    "SessionConfig",
    "SessionError",
    "SessionSummary",
    "SigningError",
    "TrustedKeys",
    "DeviceChangedError",
    "DeviceMismatchError",
    "replay_recording",
    "run_session",
    "OverrunPolicy",
    "ProtectionLayout",
    "RealTimeLoop",
    "ScrubError",
    "ScrubEvent",
    "Scrubber",
    "TensorSpec",
    "Window",
    "WeightsCorruptedError",
    "apply_realtime",
    "attach_scrubber",
    "backend_names",
    "backend_report",
    "bench_bundle",
    "check_bundle",
    "create_backend",
    "format_bench_table",
    "generate_key_pair",
    "get_family",
    "load_bundle",
    "register_family",
    "run_doctor",
    "seal_manifest",
    "sign_bundle",
]
