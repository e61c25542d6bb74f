"""ONNX Runtime on the GPU: the CUDA (``ort-cuda``) and TensorRT (``ort-trt``) execution providers.

Found at run time, never required. A provider counts as available only when it is in
``onnxruntime.get_available_providers()`` *and* a session on a one-node probe graph
actually runs on it: a provider that is listed but cannot load its libraries (a missing
``libcudnn``, a CUDA driver older than the build) is reported unavailable with ONNX
Runtime's own words, rather than found out later as a slow CPU session.

ONNX Runtime falls back to the CPU silently in two ways, and both are refused here:

- **entirely**, when the provider fails to load: the session is built with the CPU
  provider alone (the session's ``get_providers()`` lacks the one asked for);
- **per node**, when the provider has no kernel for an op: those nodes run on the CPU,
  with a copy between host and device on each side of them. The backend profiles its
  first step (ORT's profiler records which provider ran each node) and refuses a graph
  with any node on the CPU, naming the nodes and their ops.

``ort-trt`` keeps TensorRT's engines in a cache folder (``BackendOptions.cache_dir``, else
``$CLOSEDLOOP_TRT_CACHE``, else ``~/.cache/closedloop/ort-trt``; a writable temporary
folder when none of these can be written), so only the first session on a machine pays
for the engine build. FP16 is off unless the graph is the bundle's ``fp16`` variant:
the fp32 graph runs at fp32, as its parity record says.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from ..errors import BackendUnavailableError
from ..manifest import GraphSpec
from .base import Availability, BackendOptions
from .onnxruntime_backend import _OrtBackend
from .registry import register_backend

_INSTALL_HINT = ("install onnxruntime-gpu (a CUDA 12 build, with its cuDNN and CUDA libraries) in place of "
                 "onnxruntime; on a Jetson the JetPack build of onnxruntime-gpu")

#: Words that mark ORT's log lines explaining why a provider did not load.
_REASON_MARKS = ("error", "fail", "cannot", "not in available", "not found", "unable", "falling back")


def _ort():
    import onnxruntime

    return onnxruntime


@contextlib.contextmanager
def _captured() -> Iterator[io.StringIO]:
    """ORT's messages while building a session: its C++ log (file descriptor 2), its Python fallback notice
    (printed to stdout) and its warnings, gathered so that a refusal can quote them."""
    buf = io.StringIO()
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    with tempfile.TemporaryFile(mode="w+b") as tmp, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for fd in saved:
                os.dup2(tmp.fileno(), fd)
            yield buf
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, old in saved.items():
                os.dup2(old, fd)
                os.close(old)
            tmp.seek(0)
            buf.write(tmp.read().decode(errors="replace"))
            for w in caught:
                buf.write(f"{w.category.__name__}: {w.message}\n")


def ort_reason(log: str, limit: int = 3) -> str:
    """The lines of ORT's output that say why a provider did not load (the last ``limit`` of them)."""
    lines = [ln.strip().strip("*").strip() for ln in log.splitlines()]
    hits = [ln for ln in lines if ln and any(m in ln.lower() for m in _REASON_MARKS)]
    return " | ".join(hits[-limit:]) if hits else "ONNX Runtime gave no reason"


def node_placements(profile_json: str | Path) -> dict[str, tuple[str, str]]:
    """``{node name: (op type, execution provider)}`` from an ORT profile (``end_profiling()``'s file)."""
    events = json.loads(Path(profile_json).read_text())
    out: dict[str, tuple[str, str]] = {}
    for e in events:
        args = e.get("args") or {}
        if e.get("cat") == "Node" and "provider" in args:
            name = str(e.get("name", "")).removesuffix("_kernel_time").removesuffix("_fence_before") \
                .removesuffix("_fence_after")
            out[name] = (str(args.get("op_name", "?")), str(args["provider"]))
    return out


def placement_problem(provider: str, session_providers: list[str], placements: dict[str, tuple[str, str]],
                      reason: str = "") -> str | None:
    """Why a session does not really run on ``provider`` (None when it does)."""
    if provider not in session_providers:
        why = reason or "ONNX Runtime gave no reason"
        return f"ONNX Runtime fell back entirely to {session_providers}: {provider} did not load ({why})"
    on_cpu = {n: op for n, (op, p) in placements.items() if p == "CPUExecutionProvider"}
    if on_cpu:
        listed = ", ".join(f"{n} ({op})" for n, op in sorted(on_cpu.items())[:8])
        more = f" and {len(on_cpu) - 8} more" if len(on_cpu) > 8 else ""
        return (f"ONNX Runtime would run {len(on_cpu)} of {len(placements)} nodes on the CPU under {provider}: "
                f"{listed}{more}; the GPU provider has no kernel for them here. Use --backend onnxruntime for a "
                "CPU run, or change the model so that these ops are not needed")
    return None


def trt_cache_dir(options: BackendOptions) -> str:
    """A writable folder for TensorRT's engine cache (see the module's docstring for the order tried)."""
    tried = [options.cache_dir, os.environ.get("CLOSEDLOOP_TRT_CACHE"),
             str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "closedloop" / "ort-trt")]
    for d in tried:
        if not d:
            continue
        try:
            Path(d).mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=d):
                return d
        except OSError:
            continue
    d = os.path.join(tempfile.gettempdir(), f"closedloop-ort-trt-{os.getuid() if hasattr(os, 'getuid') else 0}")
    os.makedirs(d, exist_ok=True)
    return d


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(num: int, payload: bytes | int) -> bytes:
    if isinstance(payload, int):
        return _varint(num << 3) + _varint(payload)
    return _varint(num << 3 | 2) + _varint(len(payload)) + payload


def probe_model() -> bytes:
    """A one-node ONNX model, ``y = Relu(x)`` on float32 [1, 4], encoded by hand so that the runtime needs no
    ``onnx`` package to test a provider."""
    shape = _field(2, _field(1, _field(1, 1)) + _field(1, _field(1, 4)))  # TensorShapeProto: dims 1, 4
    ttype = _field(1, _field(1, 1) + shape)  # TypeProto.tensor_type: elem_type FLOAT
    x = _field(1, b"x") + _field(2, ttype)
    y = _field(1, b"y") + _field(2, ttype)
    node = _field(1, b"x") + _field(2, b"y") + _field(3, b"relu") + _field(4, b"Relu")
    graph = _field(1, node) + _field(2, b"probe") + _field(11, x) + _field(12, y)
    return _field(1, 8) + _field(8, _field(1, b"") + _field(2, 17)) + _field(7, graph)


def wants_fp16(path: str | Path, spec: GraphSpec) -> bool:
    """Whether ``path`` is the bundle's fp16 variant: the only graph a GPU provider may run at reduced precision."""
    rec = spec.variants.get("fp16") or {}
    return bool(rec) and Path(rec.get("file", "")).name == Path(path).name


def _cuda_options(options: BackendOptions) -> dict[str, Any]:
    # TF32 off: on Ampere and later, ORT's CUDA provider may otherwise run float32 matrix products at a 10-bit
    # mantissa, ~1e-3 off the graph's float32 arithmetic (the parity record's tolerance is 1e-4).
    return {"device_id": options.device_id, "use_tf32": 0}


_PROBED: dict[str, Availability] = {}


class _OrtGpuBackend(_OrtBackend):
    """An ORT session on one GPU provider that refuses to run on the CPU (see the module's docstring)."""

    provider: ClassVar[str]
    missing_hint: ClassVar[str] = f": {_INSTALL_HINT}"

    @classmethod
    def availability(cls) -> Availability:
        if cls.name not in _PROBED:
            _PROBED[cls.name] = cls._probe()
        return _PROBED[cls.name]

    @classmethod
    def _probe(cls) -> Availability:
        listed = super().availability()  # importable, and the provider in this build
        if not listed.available:
            return listed
        ort = _ort()
        try:
            import numpy as np

            so = ort.SessionOptions()
            so.log_severity_level = 2
            with _captured() as log:
                sess = ort.InferenceSession(probe_model(), sess_options=so,
                                            providers=cls._provider_list(BackendOptions(), fp16=False))
                got = sess.get_providers()
                y = sess.run(None, {"x": np.array([[-1.0, 0.0, 2.0, -3.0]], dtype=np.float32)})[0]
        except Exception as exc:  # noqa: BLE001 - any failure to build the probe means "not usable here"
            return Availability(False, f"{cls.provider} is listed but a session on it failed: {exc}")
        problem = placement_problem(cls.provider, got, {}, ort_reason(log.getvalue()))
        if problem:
            return Availability(False, f"{cls.provider} is listed but does not load: {problem}")
        if y.tolist() != [[0.0, 0.0, 2.0, 0.0]]:
            return Availability(False, f"{cls.provider} ran the probe graph wrongly (Relu gave {y.tolist()})")
        return Availability(True, f"onnxruntime {ort.__version__} {cls.provider}")

    @classmethod
    def _provider_list(cls, options: BackendOptions, fp16: bool) -> list[Any]:
        return [(cls.provider, _cuda_options(options)), "CPUExecutionProvider"]

    def _providers(self) -> list:
        return self._provider_list(self.options, wants_fp16(self.path, self.spec))

    def _make_session(self, ort, so):
        self._profile_dir = tempfile.TemporaryDirectory(prefix="closedloop-ort-profile-")
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(self._profile_dir.name, "ort")
        with _captured() as log:
            sess = ort.InferenceSession(str(self.path), sess_options=so, providers=self._providers())
        self._build_log = log.getvalue()
        problem = placement_problem(self.provider, sess.get_providers(), {}, ort_reason(self._build_log))
        if problem:
            self._profile_dir.cleanup()
            raise BackendUnavailableError(f"backend {self.name!r} refused {self.path.name}: {problem}")
        return sess

    def _after_first_run(self) -> None:
        try:
            profile = self._sess.end_profiling()  # profiles the first step only; later steps run unprofiled
            self.placements = node_placements(profile)
        finally:
            self._profile_dir.cleanup()
        problem = placement_problem(self.provider, self._sess.get_providers(), self.placements)
        if problem:
            self._sess = None
            raise BackendUnavailableError(f"backend {self.name!r} refused {self.path.name}: {problem}")

    def describe(self) -> str:
        by: dict[str, int] = {}
        for _op, p in getattr(self, "placements", {}).values():
            by[p.removesuffix("ExecutionProvider")] = by.get(p.removesuffix("ExecutionProvider"), 0) + 1
        nodes = ", ".join(f"{n} nodes on {p}" for p, n in sorted(by.items()))
        return f"{self.name} ({nodes})" if nodes else self.name


@register_backend
class OrtCudaBackend(_OrtGpuBackend):
    name = "ort-cuda"
    provider = "CUDAExecutionProvider"
    preference = 15


@register_backend
class OrtTrtBackend(_OrtGpuBackend):
    """TensorRT through ONNX Runtime: nodes TensorRT cannot take go to the CUDA provider (reported in
    ``describe()``), never to the CPU."""

    name = "ort-trt"
    provider = "TensorrtExecutionProvider"
    preference = 10

    @classmethod
    def _provider_list(cls, options: BackendOptions, fp16: bool) -> list[Any]:
        opts = {"device_id": options.device_id, "trt_fp16_enable": fp16, "trt_engine_cache_enable": True,
                "trt_engine_cache_path": trt_cache_dir(options)}
        return [(cls.provider, opts), ("CUDAExecutionProvider", _cuda_options(options)), "CPUExecutionProvider"]

