"""The backend registry and automatic choice of the fastest available backend.

Adding a backend is one class plus ``@register_backend``; selection is by name or
``"auto"``, which times every available backend that supports the graph on the
graph itself and keeps the one with the lowest p99 step time. ``choose_backend`` does
the same over several variants of one graph (fp32 and the variants a runtime may pick
by itself), keeping a variant only when it is clearly faster than fp32.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import BackendUnavailableError
from ..manifest import GraphSpec
from .base import Availability, Backend, BackendOptions

_BACKENDS: dict[str, type[Backend]] = {}


def register_backend(cls: type[Backend]) -> type[Backend]:
    if cls.name in _BACKENDS and _BACKENDS[cls.name] is not cls:
        raise ValueError(f"backend name {cls.name!r} is already registered by {_BACKENDS[cls.name].__qualname__}")
    _BACKENDS[cls.name] = cls
    return cls


def backend_names() -> list[str]:
    return sorted(_BACKENDS, key=lambda n: (_BACKENDS[n].preference, n))


def get_backend_class(name: str) -> type[Backend]:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise BackendUnavailableError(
            f"unknown backend {name!r}; known backends: {', '.join(backend_names())} (or 'auto')"
        ) from None


def backend_report(path: Path | None = None, spec: GraphSpec | None = None) -> dict[str, Availability]:
    """Availability of every registered backend here (and for a graph, if given)."""
    report: dict[str, Availability] = {}
    for name in backend_names():
        cls = _BACKENDS[name]
        a = cls.availability()
        if a and path is not None and spec is not None:
            runs = cls.supports(path, spec)  # every backend says the same thing the same way where it runs
            a = Availability(True, f"{a.reason}; runs this graph" if a.reason else "runs this graph") if runs else runs
        report[name] = a
    return report


@dataclass
class BackendChoice:
    """What auto-selection measured, so a user can see why a backend was chosen."""

    chosen: str
    p99_us: dict[str, float] = field(default_factory=dict)  # by backend (fp32), or "backend/variant"
    p50_us: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    variant: str = "fp32"


#: A variant (an approximation of the fp32 graph, within its tolerance) is chosen over fp32 only when
#: its p99 is below this fraction of fp32's best: a timing within noise keeps the exact graph.
VARIANT_MARGIN = 0.95


def choose_backend(paths: dict[str, Path], spec: GraphSpec, options: BackendOptions | None = None,
                   candidates: list[str] | None = None) -> tuple[Backend, BackendChoice]:
    """The fastest backend over the graph's variants ``paths`` (``{"fp32": path, variant: path, ...}``).

    Each variant gets ``create_backend("auto", ...)``; the fastest variant wins if its p99 is at most
    ``VARIANT_MARGIN`` of fp32's. The choice's timings are keyed by backend for fp32 and by
    ``"backend/variant"`` for the others.
    """
    total = BackendChoice(chosen="")
    best: tuple[float, str, Backend] | None = None
    fp32_p99 = float("inf")
    for variant, path in paths.items():
        try:
            b, c = create_backend("auto", path, spec, options, candidates)
        except BackendUnavailableError as exc:
            if variant == "fp32":
                raise
            total.skipped[f"variant {variant}"] = str(exc)
            continue
        tag = "" if variant == "fp32" else f"/{variant}"
        total.p99_us |= {f"{k}{tag}": v for k, v in c.p99_us.items()}
        total.p50_us |= {f"{k}{tag}": v for k, v in c.p50_us.items()}
        total.skipped |= {f"{k}{tag}": v for k, v in c.skipped.items()}
        p99 = c.p99_us[c.chosen]
        if variant == "fp32":
            fp32_p99 = p99
        good = best is None or (p99 < best[0] and (variant == "fp32" or p99 <= VARIANT_MARGIN * fp32_p99))
        if good:
            if best is not None:
                best[2].close()
            best = (p99, variant, b)
        else:
            b.close()
    assert best is not None  # fp32 comes first and raises if nothing runs it
    total.chosen, total.variant = best[2].name, best[1]
    return best[2], total


def time_backend(backend: Backend, steps: int = 300, warmup: int = 30, seed: int = 0) -> np.ndarray:
    """Per-step wall times (ns) of ``backend.run()`` on random data inputs."""
    rng = np.random.default_rng(seed)
    for t in backend.spec.data_inputs:
        arr = backend.inputs[t.name]
        if arr.dtype.kind == "f":
            arr[...] = rng.standard_normal(arr.shape).astype(arr.dtype)
    for _ in range(warmup):
        backend.run()
    out = np.empty(steps, dtype=np.int64)
    clock = time.perf_counter_ns
    for i in range(steps):
        t0 = clock()
        backend.run()
        out[i] = clock() - t0
    return out


def create_backend(
    name: str,
    path: Path,
    spec: GraphSpec,
    options: BackendOptions | None = None,
    candidates: list[str] | None = None,
) -> tuple[Backend, BackendChoice]:
    """Build the named backend, or with ``name='auto'`` the fastest one that runs this graph."""
    options = options or BackendOptions()
    if name != "auto":
        cls = get_backend_class(name)
        a = cls.availability()
        if a:
            a = cls.supports(path, spec)
        if not a:
            raise BackendUnavailableError(f"backend {name!r} cannot run {path.name}: {a.reason}")
        return cls(path, spec, options), BackendChoice(chosen=name)

    choice = BackendChoice(chosen="")
    best: tuple[float, int, Backend] | None = None
    for n in candidates or backend_names():
        cls = get_backend_class(n)
        a = cls.availability()
        if a:
            a = cls.supports(path, spec)
        if not a:
            choice.skipped[n] = a.reason
            continue
        try:
            b = cls(path, spec, options)
        except Exception as exc:  # a backend that fails to build is skipped, and the reason kept
            choice.skipped[n] = f"failed to build: {exc}"
            continue
        times = time_backend(b)
        p99 = float(np.percentile(times, 99)) / 1e3
        choice.p99_us[n] = p99
        choice.p50_us[n] = float(np.median(times)) / 1e3
        key = (p99, cls.preference)
        if best is None or key < best[:2]:
            if best is not None:
                best[2].close()
            best = (p99, cls.preference, b)
        else:
            b.close()
    if best is None:
        raise BackendUnavailableError(
            f"no backend can run {path.name}: " + "; ".join(f"{k}: {v}" for k, v in choice.skipped.items())
        )
    choice.chosen = best[2].name
    # Reset buffers the timing run scribbled on.
    for arr in best[2].inputs.values():
        arr[...] = 0
    return best[2], choice
