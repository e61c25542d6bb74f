"""Native TensorRT backend (optional; found at run time, never required).

Runs a serialized engine that the bundle carries for this GPU and TensorRT version
(``GraphSpec.tensorrt_engines``, built by ``export`` on the target, e.g. a Jetson).
Uses the name-based tensor API of TensorRT 10 and 11 (``set_tensor_address`` +
``execute_async_v3``) and CUDA through ``cuda-python``. Host buffers are the
backend's numpy arrays; device buffers are allocated once at construction.
TensorRT cannot be installed on machines that reach only the public package index,
so on such machines this backend reports itself unavailable with the reason.
"""

from __future__ import annotations

from pathlib import Path

from ..manifest import GraphSpec
from .base import Availability, Backend, BackendOptions
from .registry import register_backend


def _cudart():
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
    except ImportError:
        from cuda import cudart  # older cuda-python
    return cudart


def _check(result):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA call failed with error {err}")
    return rest[0] if len(rest) == 1 else rest


def gpu_identity() -> tuple[str, str] | None:
    """(GPU name, TensorRT version) here, or None if either is missing."""
    try:
        import tensorrt as trt

        cudart = _cudart()
        props = _check(cudart.cudaGetDeviceProperties(0))
        name = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
        return name.strip("\x00 "), trt.__version__
    except Exception:  # noqa: BLE001 - any failure means "not available here"
        return None


def matching_engine(path: Path, spec: GraphSpec) -> dict | None:
    ident = gpu_identity()
    if ident is None:
        return None
    gpu, version = ident
    for e in spec.tensorrt_engines:
        if e.get("gpu") == gpu and e.get("tensorrt_version") == version:
            return e
    return None


@register_backend
class TensorrtBackend(Backend):
    name = "tensorrt"
    preference = 5

    @classmethod
    def availability(cls) -> Availability:
        try:
            import tensorrt as trt
        except ImportError:
            return Availability(False, "tensorrt is not installed (optional; JetPack ships it)")
        try:
            cudart = _cudart()
            count = _check(cudart.cudaGetDeviceCount())
        except Exception as exc:  # noqa: BLE001
            return Availability(False, f"no usable CUDA device ({exc})")
        if count < 1:
            return Availability(False, "no CUDA device")
        return Availability(True, f"tensorrt {trt.__version__}")

    @classmethod
    def supports(cls, path: Path, spec: GraphSpec) -> Availability:
        if matching_engine(path, spec) is None:
            ident = gpu_identity()
            return Availability(
                False,
                f"the bundle has no TensorRT engine for {ident} "
                f"(it has {[(e.get('gpu'), e.get('tensorrt_version')) for e in spec.tensorrt_engines]}); "
                "export on this device to build one",
            )
        return Availability(True)

    def __init__(self, path: Path, spec: GraphSpec, options: BackendOptions | None = None):
        super().__init__(path, spec, options)
        import tensorrt as trt

        cudart = _cudart()
        self._cudart = cudart
        entry = matching_engine(path, spec)
        engine_path = Path(path).parent / entry["file"]  # type: ignore[index]
        logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(logger)
        self._engine = self._runtime.deserialize_cuda_engine(engine_path.read_bytes())
        if self._engine is None:
            raise RuntimeError(f"TensorRT could not deserialize {engine_path}")
        self._ctx = self._engine.create_execution_context()
        self._stream = _check(cudart.cudaStreamCreate())
        self._device: dict[str, int] = {}
        h2d = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        d2h = cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        self._copies_in: list[tuple] = []
        self._copies_out: list[tuple] = []
        for name, arr in {**self.inputs, **self.outputs}.items():
            ptr = _check(cudart.cudaMalloc(arr.nbytes))
            self._device[name] = ptr
            self._ctx.set_tensor_address(name, int(ptr))
        for name, arr in self.inputs.items():
            self._ctx.set_input_shape(name, arr.shape)
            self._copies_in.append((self._device[name], arr.ctypes.data, arr.nbytes, h2d, self._stream))
        for name, arr in self.outputs.items():
            self._copies_out.append((arr.ctypes.data, self._device[name], arr.nbytes, d2h, self._stream))
        self.run()

    def run(self) -> None:
        cudart = self._cudart
        for c in self._copies_in:
            cudart.cudaMemcpyAsync(*c)
        self._ctx.execute_async_v3(self._stream)
        for c in self._copies_out:
            cudart.cudaMemcpyAsync(*c)
        cudart.cudaStreamSynchronize(self._stream)

    def close(self) -> None:
        for ptr in self._device.values():
            self._cudart.cudaFree(ptr)
        self._device.clear()


def engine_file_name(graph_file: str, gpu: str, trt_version: str) -> str:
    """Engine file name keyed by GPU and TensorRT version (engines are not portable)."""
    safe = "".join(c if c.isalnum() else "-" for c in gpu).strip("-").lower()
    return f"{Path(graph_file).stem}.{safe}.trt{trt_version}.engine"


