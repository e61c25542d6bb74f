"""Time any bundle on this machine: "will my model make its deadline on this board?".

``bench_bundle`` runs one graph of a bundle at batch 1 with one thread on every backend
and every variant (fp32 and the manifest's reduced-precision variants) that can run it
here, and says why for each pair that cannot. Each pair is timed three ways: back to
back (``steps`` steps, the steady state), and paced by the real-time loop at the
bundle's rate for ``paced_s`` seconds, cold (as is: between steps other work evicts
weights and code from the caches) and prewarmed (``Model.prewarm`` just before each
deadline). Each mode gives p50/p99/max in microseconds, whether p99 meets the deadline
(one period, 1/rate_hz), and the ratio of p50 to the step's roofline floor
(``closedloop.runtime.roofline``; the cold mode against the floor of weights read from memory).

``closedloop bench BUNDLE`` is the command; it runs with no torch installed. The result
is plain JSON-ready data (``BundleBench.to_dict``); the raw samples stay in
``BundleBench.samples`` for plots.
"""

from __future__ import annotations

import os
import platform
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from . import backends as _backends
from .backends import backend_names, backend_report, get_backend_class
from .bundle import Bundle, load_bundle
from .errors import BackendUnavailableError
from .loop import LoopConfig, RealTimeLoop
from .model import Model
from .roofline import (
    GraphCost,
    cold_read_bandwidth_gbs,
    graph_cost,
    read_bandwidth_gbs,
    single_core_peak_gflops,
)

MODES = ("back_to_back", "paced_cold", "paced_prewarmed")
MODE_LABELS = {"back_to_back": "back to back", "paced_cold": "paced, cold", "paced_prewarmed": "paced, prewarmed"}


@dataclass
class BenchConfig:
    """What ``bench_bundle`` times. The defaults finish a small model in well under 20 s."""

    steps: int = 2000  # back to back
    paced_s: float = 1.0  # per pair and paced mode, at the bundle's rate
    backends: list[str] | None = None  # None: every registered backend
    variants: list[str] | None = None  # None: fp32 and every variant the bundle holds
    graph: str = "main"
    rate_hz: float | None = None  # None: the bundle's rate_hz
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 2:
            raise ValueError(f"steps must be at least 2 (back-to-back steps to time), got {self.steps}")
        if not self.paced_s > 0:
            raise ValueError(f"paced_s must be > 0 seconds, got {self.paced_s}")
        if self.rate_hz is not None and not self.rate_hz > 0:
            raise ValueError(f"rate_hz must be > 0 Hz, got {self.rate_hz}")


@dataclass
class MachineRoofline:
    """This machine's single-core peak and the read bandwidths for each working-set size, each measured once
    when first needed (``peak_gflops=None`` until then)."""

    peak_gflops: float | None = None
    processor: str = field(default_factory=lambda: _cpu_name())
    python: str = field(default_factory=platform.python_version)
    cpu_count: int = field(default_factory=lambda: os.cpu_count() or 1)
    read_gbs: dict[int, float] = field(default_factory=dict)
    cold_read_gbs: dict[int, float] = field(default_factory=dict)

    def peak(self) -> float:
        """Single-core peak (GFLOP/s), measured on first use."""
        if self.peak_gflops is None:
            self.peak_gflops = single_core_peak_gflops()
        return self.peak_gflops

    def bandwidths(self, n_bytes: int) -> tuple[float, float]:
        """(cache, memory) read bandwidth in GB/s for ``n_bytes`` of weights, measured once per size."""
        if n_bytes not in self.read_gbs:
            self.read_gbs[n_bytes] = read_bandwidth_gbs(n_bytes)
            self.cold_read_gbs[n_bytes] = cold_read_bandwidth_gbs(n_bytes)
        return self.read_gbs[n_bytes], self.cold_read_gbs[n_bytes]

    def to_dict(self) -> dict:
        return {"processor": self.processor, "python": self.python, "cpu_count": self.cpu_count,
                "single_core_peak_gflops": self.peak()}


@dataclass
class BundleBench:
    """The timing of one bundle: a row per backend and variant, plus the raw samples (ns)."""

    bundle: str
    name: str
    family: str
    kind: str
    graph: str
    rate_hz: float
    flops: int
    flops_exact: bool
    rows: list[dict]
    config: dict
    machine: dict
    samples: dict[tuple[str, str, str], np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def deadline_us(self) -> float:
        return 1e6 / self.rate_hz

    def timed(self) -> list[dict]:
        return [r for r in self.rows if r["status"] == "timed"]

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "samples"}
        return d | {"deadline_us": self.deadline_us}


def _cpu_name() -> str:
    """The CPU's model name where the OS says it (Linux), else the platform's machine type."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def stats_us(ns: np.ndarray) -> dict:
    """p50/p99/max/mean (us) and the count of step times given in ns."""
    return {"p50_us": float(np.percentile(ns, 50)) / 1e3, "p99_us": float(np.percentile(ns, 99)) / 1e3,
            "max_us": float(ns.max()) / 1e3, "mean_us": float(ns.mean()) / 1e3, "n": int(ns.size)}


def time_back_to_back(step: Callable[[], None], steps: int) -> np.ndarray:
    """Each of ``steps`` calls of ``step``, timed alone (ns), one after the other."""
    out = np.empty(steps, dtype=np.int64)
    clock = time.perf_counter_ns
    for i in range(steps):
        t0 = clock()
        step()
        out[i] = clock() - t0
    return out


def _paced(step: Callable[[], None], rate_hz: float, seconds: float, prewarm: Callable[[], None] | None) -> np.ndarray:
    loop = RealTimeLoop(LoopConfig(rate_hz=rate_hz, duration_s=seconds))
    summary = loop.run(lambda k: step(), prewarm=prewarm)
    # the loop turns Ctrl-C and SIGTERM into a clean stop of itself; a benchmark stops altogether (130, 143)
    if summary.stopped_by == "interrupt":
        raise KeyboardInterrupt
    if summary.stopped_by == "terminated":
        signal.raise_signal(signal.SIGTERM)  # the loop's handler is gone: the caller's own handling applies
    return loop.latency.samples()


def requested_pairs(bundle: Bundle, cfg: BenchConfig) -> tuple[list[str], list[str]]:
    """The backends and variants ``cfg`` asks of ``bundle``, checked by name before anything is timed.

    Raises ``BackendUnavailableError`` for an unknown backend, ``BundleError`` for a graph or variant
    the bundle lacks (each naming the ones there are).
    """
    spec = bundle.graph(cfg.graph)
    broken = _unimported_backends()
    names = cfg.backends or [*backend_names(), *broken]
    for n in names:
        if n in broken:
            if cfg.backends:
                raise BackendUnavailableError(f"backend {n!r} cannot run here: {broken[n]}")
            continue
        get_backend_class(n)  # an unknown name raises, listing the known ones
    variants = cfg.variants or ["fp32", *spec.variants]
    for v in variants:
        bundle.graph_path(cfg.graph, v)  # a variant the bundle lacks raises, listing the ones it has
    here = backend_report()
    why: dict[tuple[str, str], list[str]] = {}
    for n in names:
        for v in variants:
            reason = _cannot_run(n, bundle.graph_path(cfg.graph, v), spec, here, broken)
            if reason is None:
                return list(names), list(variants)
            why.setdefault((n, reason), []).append(v)
    raise _none_can_run(bundle, why)  # said before anything is measured or timed


def _cannot_run(name: str, path, spec, here: dict, broken: dict[str, str]) -> str | None:
    """Why backend ``name`` cannot run the graph at ``path`` here, or None when it can."""
    if name in broken:
        return broken[name]
    able = here[name] and get_backend_class(name).supports(path, spec)
    return None if able else (able.reason or "unavailable here")


def _none_can_run(b: Bundle, why: dict[tuple[str, str], list[str]]) -> BackendUnavailableError:
    label = b.manifest.name or str(b.source)
    return BackendUnavailableError(
        f"no backend asked for can run {label} here: "
        + "; ".join(f"{n} ({', '.join(vs)}): {reason}" for (n, reason), vs in why.items())
        + f". `closedloop backends {b.source}` lists what this machine has")


def _unimported_backends() -> dict[str, str]:
    """Backends whose module failed to import here (so the registry lacks them) -> why."""
    err = getattr(_backends, "NUMBA_IMPORT_ERROR", None)
    return {"numba": f"the numba backend did not import ({err})"} if err else {}


def bench_bundle(
    bundle: str | Path | Bundle,
    cfg: BenchConfig | None = None,
    machine: MachineRoofline | None = None,
    report: Callable[[str], None] = print,
) -> BundleBench:
    """Time ``bundle`` on every backend and variant that can run it here (see the module's docstring).

    Raises ``BundleError`` for something that is not a readable bundle, an unknown variant or
    graph, and ``BackendUnavailableError`` for an unknown backend or when no pair asked for
    can run here (naming why for each).
    """
    cfg = cfg or BenchConfig()
    b = bundle if isinstance(bundle, Bundle) else load_bundle(bundle)
    spec = b.graph(cfg.graph)
    backends, variants = requested_pairs(b, cfg)
    machine = machine or MachineRoofline()
    rate = cfg.rate_hz or b.manifest.rate_hz
    label = b.manifest.name or str(b.source)
    cost = graph_cost(b.graph_path(cfg.graph), spec)
    costs: dict[str, GraphCost] = {}
    rows: list[dict] = []
    samples: dict[tuple[str, str, str], np.ndarray] = {}
    here = backend_report()
    broken = _unimported_backends()
    for name in backends:
        for variant in variants:
            row: dict = {"backend": name, "variant": variant}
            if variant != "fp32":  # its parity against fp32, as the export measured it (None: not recorded)
                row["within_tolerance"] = spec.variants.get(variant, {}).get("within_tolerance")
            rows.append(row)
            path = b.graph_path(cfg.graph, variant)
            reason = _cannot_run(name, path, spec, here, broken)
            if reason is not None:
                row |= {"status": "skipped", "reason": reason}
                continue
            try:
                model = Model(b, backend=name, graph=cfg.graph, variant=None if variant == "fp32" else variant)
            except Exception as exc:  # noqa: BLE001 - a pair that fails to build is reported, not fatal
                row |= {"status": "skipped", "reason": f"failed to build: {exc}".splitlines()[0]}
                continue
            try:
                report(f"  {label}: {name} / {variant}: {cfg.steps} steps back to back, then {cfg.paced_s:g} s "
                       f"at {rate:g} Hz cold and prewarmed")
                row |= {"status": "timed"} | _time_pair(model, cfg, rate, samples, (name, variant))
            finally:
                model.close()
            if variant not in costs:
                costs[variant] = GraphCost(cost.flops, graph_cost(path).weight_bytes, cost.exact)
            row |= _floor(costs[variant], machine, row["modes"])
            row["meets_deadline"] = all(m["meets_deadline"] for m in row["modes"].values())
    result = BundleBench(
        bundle=str(b.source), name=b.manifest.name, family=b.manifest.family, kind=spec.kind, graph=cfg.graph,
        rate_hz=rate, flops=cost.flops, flops_exact=cost.exact, rows=rows, config=asdict(cfg),
        machine=machine.to_dict(), samples=samples,
    )
    if not result.timed():  # every pair that could run failed to build
        why: dict[tuple[str, str], list[str]] = {}
        for r in rows:
            why.setdefault((r["backend"], r["reason"]), []).append(r["variant"])
        raise _none_can_run(b, why)
    return result


def _time_pair(model: Model, cfg: BenchConfig, rate: float, samples: dict, key: tuple[str, str]) -> dict:
    rng = np.random.default_rng(cfg.seed)
    for t in model.spec.data_inputs:
        arr = model.inputs[t.name]
        if arr.dtype.kind == "f":
            arr[...] = rng.standard_normal(arr.shape)
    step = model.run
    prewarm = getattr(model, "prewarm", None)
    first = time_back_to_back(step, 1)
    runs = {"back_to_back": time_back_to_back(step, cfg.steps),
            "paced_cold": _paced(step, rate, cfg.paced_s, None)}
    if prewarm is not None:
        runs["paced_prewarmed"] = _paced(step, rate, cfg.paced_s, prewarm)
    deadline_us = 1e6 / rate
    modes = {}
    for mode, ns in runs.items():
        samples[(key[0], key[1], mode)] = ns
        s = stats_us(ns)
        modes[mode] = s | {"meets_deadline": s["p99_us"] <= deadline_us}
    return {"first_step_us": float(first[0]) / 1e3, "modes": modes}


def _floor(cost: GraphCost, machine: MachineRoofline, modes: dict) -> dict:
    read, cold = machine.bandwidths(cost.weight_bytes)
    floor, bound = cost.floor_us(machine.peak(), read)
    floor_cold, _ = cost.floor_us(machine.peak(), cold)
    for mode, s in modes.items():
        s["floor_us"] = floor_cold if mode == "paced_cold" else floor
        s["floor_ratio"] = s["p50_us"] / s["floor_us"] if s["floor_us"] > 0 else None  # a graph with no work
    return {"weight_bytes": cost.weight_bytes, "read_bandwidth_gbs": read, "cold_read_bandwidth_gbs": cold,
            "floor_us": floor, "floor_bound": bound, "floor_cold_us": floor_cold}


def _si(n: float, unit: str) -> str:
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g} {prefix}{unit}"
    return f"{n:.0f} {unit}"


def _ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.1f}x"


def format_bench_table(bench: BundleBench) -> str:
    """The table ``closedloop bench BUNDLE`` prints: one line per backend, variant and mode."""
    deadline = bench.deadline_us
    exact = "" if bench.flops_exact else " (a lower bound: some shapes unknown)"
    lines = [
        f"{bench.name or bench.bundle} ({bench.bundle}): {bench.family}, {bench.kind}, graph {bench.graph!r}, "
        f"{bench.rate_hz:g} Hz, deadline {deadline:.1f} us; {_si(bench.flops, 'FLOP')}{exact} per step",
        f"batch 1, one thread; peak {bench.machine['single_core_peak_gflops']:.1f} GFLOP/s on one core "
        f"({bench.machine['processor']})",
        f"{'backend':<21} {'variant':<7} {'mode':<17} {'p50 us':>9} {'p99 us':>9} {'max us':>9} "
        f"{'p99<=deadline':>13} {'floor us':>9} {'p50/floor':>9}",
    ]
    skipped: dict[str, list[dict]] = {}
    for r in bench.rows:
        if r["status"] != "timed":
            skipped.setdefault(r["backend"], []).append(r)
            continue
        for mode, s in r["modes"].items():
            lines.append(
                f"{r['backend']:<21} {r['variant']:<7} {MODE_LABELS[mode]:<17} {s['p50_us']:9.1f} {s['p99_us']:9.1f} "
                f"{s['max_us']:9.1f} {'yes' if s['meets_deadline'] else 'NO':>13} {s['floor_us']:9.2f} "
                f"{_ratio(s['floor_ratio']):>9}")
    for backend, rs in skipped.items():
        reasons = {r["reason"] for r in rs}
        if len(reasons) == 1 and len(rs) > 1:
            lines.append(f"skipped {backend} (every variant): {reasons.pop()}")
        else:
            lines += [f"skipped {backend} / {r['variant']}: {r['reason']}" for r in rs]
    timed = bench.timed()
    if timed:
        r = timed[0]
        lines.append(
            f"floor: the larger of FLOPs at peak and weights ({_si(r['weight_bytes'], 'B')} for {r['variant']}) at "
            f"read bandwidth ({r['read_bandwidth_gbs']:.1f} GB/s from cache; paced cold: "
            f"{r['cold_read_bandwidth_gbs']:.1f} GB/s from memory)")
        ok = [f"{x['backend']}/{x['variant']}" + (" (outside its parity tolerance)"
                                                  if x.get("within_tolerance") is False else "")
              for x in timed if x["meets_deadline"]]
        lines.append(f"p99 within the {deadline:.1f} us deadline in every mode: {', '.join(ok) if ok else 'none'}")
        off = sorted({x["variant"] for x in timed if x.get("within_tolerance") is False})
        if off:
            lines.append(f"variant{'s' if len(off) > 1 else ''} {', '.join(off)} differ from fp32 beyond {'their' if len(off) > 1 else 'its'} "
                         "parity tolerance (closedloop inspect shows by how much): fast, but not the model; a session "
                         "chooses such a variant only when asked by name")
    return "\n".join(lines)


__all__ = ["BenchConfig", "BundleBench", "MachineRoofline", "bench_bundle", "format_bench_table", "requested_pairs",
           "stats_us"]
