"""The backend interface: one class per way of running a graph.

A backend owns preallocated input and output arrays. The caller writes into
``backend.inputs[name]`` in place and calls ``run()``; results appear in
``backend.outputs[name]``, overwritten by the next call. Nothing is allocated or
compiled in ``run()``: all of that happens in the constructor, so the first timed
step is as fast as the rest. A backend reports whether it can run here
(``availability``) and whether it can run a given graph (``supports``), so that the
runtime can choose among backends and say why one was passed over.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from ..manifest import GraphSpec


@dataclass(frozen=True)
class Availability:
    available: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.available


@dataclass
class BackendOptions:
    """Settings shared by every backend; each uses the ones that apply to it."""

    batch: int = 1
    threads: int = 1  # one intra-op thread: two caused millisecond outliers on a loaded 2-core box
    device_id: int = 0
    cache_dir: str | None = None  # where compiled artefacts (TensorRT engines) may be cached


class Backend(ABC):
    """Runs one graph of a bundle on preallocated buffers."""

    name: ClassVar[str]
    #: Order among equally fast backends when auto-selecting (lower is preferred).
    preference: ClassVar[int] = 50

    def __init__(self, path: Path, spec: GraphSpec, options: BackendOptions | None = None):
        self.path = Path(path)
        self.spec = spec
        self.options = options or BackendOptions()
        b = self.options.batch
        self.inputs: dict[str, np.ndarray] = {
            t.name: np.zeros(t.concrete_shape(b), dtype=np.dtype(t.dtype)) for t in spec.inputs
        }
        self.outputs: dict[str, np.ndarray] = {
            t.name: np.zeros(t.concrete_shape(b), dtype=np.dtype(t.dtype)) for t in spec.outputs
        }

    @classmethod
    @abstractmethod
    def availability(cls) -> Availability:
        """Whether this backend's libraries and hardware are present here."""

    @classmethod
    def supports(cls, path: Path, spec: GraphSpec) -> Availability:
        """Whether this backend can run this graph (default: any graph)."""
        return Availability(True)

    @abstractmethod
    def run(self) -> None:
        """Compute ``outputs`` from ``inputs`` in place."""

    def set_initializers(self, initializers: dict[str, np.ndarray]) -> None:
        """Replace weights (for example after a scrubber repaired them). Optional."""
        raise NotImplementedError(f"backend {self.name!r} cannot replace weights in place")

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""

    def describe(self) -> str:
        return self.name
