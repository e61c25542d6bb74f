"""The spine benchmark: per-step latency of a GRU decoder and an MLP policy on torch
eager, ONNX Runtime and the Numba backend, back to back and at the real cadence,
beside each step's floor; and the real-time loop's lateness at 1 kHz and 50 Hz.
The Numba backend is timed on fp32 and on the weight-storage variants (``numba/fp16w``:
weights in float16, ``numba/int8w``: int8 with a scale per row; float32 arithmetic),
each with its error against fp32 from the export.

Run with ``python bench/bench_spine.py`` or ``closedloop bench``; ``make demo`` runs a
short version. ``bench/bench_spine.py`` writes ``spine.json`` and ``spine_latency.png`` to
``bench/results/spine/``.
"""

from __future__ import annotations

import platform
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from closedloop.common.jsonout import write_json
from closedloop.export import export_bundle
from closedloop.runtime import LoopConfig, Model, RealTimeLoop, load_bundle
from closedloop.runtime.timing import _cpu_name, time_back_to_back

from .models import GRUDecoder, MLPPolicy
from .roofline import (
    cold_read_bandwidth_gbs,
    gru_flops,
    mlp_flops,
    read_bandwidth_gbs,
    single_core_peak_gflops,
)
from .zoo.report import host_kind

GRU_SHAPE = dict(n_inputs=192, n_hidden=256, n_layers=2, n_outputs=32)
MLP_SHAPE = dict(n_obs=40, n_actions=8, hidden=(256, 256))
METHODS = ("torch-eager", "onnxruntime", "numba")
STORED = ("fp16w", "int8w")  # the weight-storage variants, timed on numba as "numba/<variant>"


@dataclass
class SpineBenchConfig:
    back_to_back_steps: int = 5000
    cadence_s: float = 6.0  # per model and method, one step every 20 ms
    loop_s: float = 20.0  # per loop rate (1 kHz and 50 Hz)
    seed: int = 0
    out_dir: str | None = "bench/results/spine"
    name: str = "spine"
    bundle_dir: str | None = None  # keep the exported bundles here (default: a temp folder)

    @classmethod
    def quick(cls) -> SpineBenchConfig:
        """A few seconds per part: what ``make demo`` runs."""
        return cls(back_to_back_steps=1000, cadence_s=2.0, loop_s=3.0, out_dir=None, bundle_dir="out/demo")


def _pct(a: np.ndarray, q: float) -> float:
    return float(np.percentile(a, q)) / 1e3


def _stats(ns: np.ndarray) -> dict:
    return {
        "p50_us": _pct(ns, 50),
        "p99_us": _pct(ns, 99),
        "max_us": float(ns.max()) / 1e3,
        "mean_us": float(ns.mean()) / 1e3,
        "first_us": float(ns[0]) / 1e3,
        "n": int(ns.size),
    }


def _torch_step_fn(model: torch.nn.Module, kind: str, n_in: int, seed: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """(step, prewarm): prewarm runs the same computation without keeping the new state."""
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.standard_normal((1, n_in)).astype(np.float32))
    if kind == "recurrent":
        state = list(model.init_state(1))

        def step() -> None:
            with torch.inference_mode():
                _, state[0] = model.step(x, state[0])

        def prewarm() -> None:
            with torch.inference_mode():
                model.step(x, state[0])

        return step, prewarm

    def step_ff() -> None:
        with torch.inference_mode():
            model(x)

    return step_ff, step_ff


def _runtime_step_fn(bundle: Path, backend: str, n_in: int, seed: int,
                     variant: str = "fp32") -> tuple[Callable[[], None], Model]:
    m = Model(bundle, backend=backend, variant=variant)
    m.inputs[m.spec.data_inputs[0].name][...] = np.random.default_rng(seed).standard_normal((1, n_in))
    return m.run, m


def _time_at_cadence(
    step: Callable[[], None], rate_hz: float, duration_s: float, prewarm: Callable[[], None] | None = None
) -> np.ndarray:
    loop = RealTimeLoop(LoopConfig(rate_hz=rate_hz, duration_s=duration_s))
    loop.run(lambda k: step(), prewarm=prewarm)
    return loop.latency.samples()


def _weight_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def run_spine_benchmark(cfg: SpineBenchConfig | None = None, report: Callable[[str], None] = print) -> dict:
    cfg = cfg or SpineBenchConfig()
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    models = {
        "gru": (GRUDecoder(**GRU_SHAPE).eval(), "recurrent", GRU_SHAPE["n_inputs"], 50.0),
        "mlp": (MLPPolicy(**MLP_SHAPE).eval(), "feedforward", MLP_SHAPE["n_obs"], 1000.0),
    }
    flops = {
        "gru": gru_flops(192, 256, 2, 32),
        "mlp": mlp_flops([40, 256, 256, 8]),
    }
    report("measuring this machine's single-core peak and read bandwidth ...")
    peak = single_core_peak_gflops()
    results: dict = {
        "config": asdict(cfg),
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "cpu": _cpu_name(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "single_core_peak_gflops": peak,
        } | host_kind(),
        "models": {},
    }
    work = Path(cfg.bundle_dir) if cfg.bundle_dir else Path(tempfile.mkdtemp(prefix="closedloop-bench-"))
    samples: dict[str, np.ndarray] = {}
    for mname, (module, kind, n_in, _rate) in models.items():
        report(f"exporting the {mname} to a bundle ...")
        bundle = export_bundle(
            module,
            work / mname,
            kind=kind,
            example_input=torch.zeros(1, n_in),
            rate_hz=50.0 if mname == "gru" else 1000.0,
            name=f"bench-{mname}",
            variants=STORED,
            tensorrt=False,
            overwrite=True,
            report=lambda s: None,
        )
        stored = load_bundle(bundle).graph().variants
        wbytes = _weight_bytes(module)
        bw = read_bandwidth_gbs(wbytes)
        bw_cold = cold_read_bandwidth_gbs(wbytes)
        t_flops = flops[mname] / (peak * 1e3)
        floor_us = max(t_flops, wbytes / (bw * 1e3))
        entry: dict = {
            "flops": flops[mname],
            "weight_bytes": wbytes,
            "read_bandwidth_gbs": bw,
            "cold_read_bandwidth_gbs": bw_cold,
            "floor_us": floor_us,
            "floor_bound": "flops" if t_flops > wbytes / (bw * 1e3) else "bandwidth",
            "floor_cold_us": max(t_flops, wbytes / (bw_cold * 1e3)),
            "methods": {},
            "variants": {v: {k: r.get(k) for k in ("within_tolerance", "tolerance", "weight_storage")}
                         | {k: r["parity_vs_fp32"].get(k) for k in ("max_abs", "max_rel")} for v, r in stored.items()},
        }
        for method in (*METHODS, *(f"numba/{v}" for v in STORED)):
            if method == "torch-eager":
                step, prewarm = _torch_step_fn(module, kind, n_in, cfg.seed)
                holder = None
            else:
                backend, _, variant = method.partition("/")
                step, holder = _runtime_step_fn(bundle, backend, n_in, cfg.seed, variant or "fp32")
                prewarm = holder.prewarm
            report(f"  {mname} / {method}: back to back x{cfg.back_to_back_steps}, then {cfg.cadence_s:g} s at 50 Hz "
                   "cold and prewarmed")
            b2b = time_back_to_back(step, cfg.back_to_back_steps)
            cad = _time_at_cadence(step, 50.0, cfg.cadence_s)
            warm = _time_at_cadence(step, 50.0, cfg.cadence_s, prewarm=prewarm)
            samples[f"{mname}/{method}/b2b"] = b2b
            samples[f"{mname}/{method}/cadence"] = cad
            samples[f"{mname}/{method}/prewarm"] = warm
            entry["methods"][method] = {
                "back_to_back": _stats(b2b),
                "cadence_50hz": _stats(cad),
                "cadence_50hz_prewarmed": _stats(warm),
            }
            if holder is not None:
                holder.close()
        results["models"][mname] = entry

    # Loop timing: the MLP at 1 kHz and the GRU at 50 Hz on the Numba backend, with the
    # default pacing (sleep, then spin the last 300 us), and the 1 kHz loop once more
    # spinning the whole period (no sleep: immune to slow wake-ups, costs a core).
    results["loops"] = {}
    for label, mname, rate, spin_us in (
        ("1000Hz", "mlp", 1000.0, 300),
        ("1000Hz-spin", "mlp", 1000.0, 1000),
        ("50Hz", "gru", 50.0, 300),
    ):
        step, holder = _runtime_step_fn(work / mname, "numba", models[mname][2], cfg.seed)
        report(f"loop: {mname} on numba at {rate:g} Hz for {cfg.loop_s:g} s, spin {spin_us} us ...")
        loop = RealTimeLoop(LoopConfig(rate_hz=rate, duration_s=cfg.loop_s, spin_us=spin_us))
        summary = loop.run(lambda k, s=step: s(), prewarm=holder.prewarm)
        results["loops"][label] = summary.to_dict() | {"model": mname, "spin_us": spin_us}
        samples[f"loop/{label}/lateness"] = loop.lateness.samples()
        holder.close()

    results["targets"] = _targets(results)
    report(format_table(results))
    if cfg.out_dir:
        out = Path(cfg.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / f"{cfg.name}.json", results, indent=2)
        _plot(samples, results, out / f"{cfg.name}_latency.png")
        report(f"wrote {out / (cfg.name + '.json')} and {out / (cfg.name + '_latency.png')}")
    return results


def _targets(r: dict) -> list[dict]:
    g = r["models"]["gru"]["methods"]
    m = r["models"]["mlp"]["methods"]
    gm = r["models"]["gru"]
    modes = {"back_to_back": "back to back", "cadence_50hz": "50 Hz, cold", "cadence_50hz_prewarmed": "50 Hz, prewarmed"}
    t = []
    for mode, label in modes.items():
        ratio = g["torch-eager"][mode]["p99_us"] / g["numba"][mode]["p99_us"]
        t.append({"target": f"numba GRU p99 >= 3x faster than torch eager ({label})", "value": f"{ratio:.2f}x", "met": ratio >= 3})
    fp16_tol = gm["variants"].get("fp16w", {}).get("tolerance") or {"abs": 1e-2, "rel": 1e-2}
    for v, rec in gm["variants"].items():
        if f"numba/{v}" not in g:
            continue
        ratio = g["torch-eager"]["back_to_back"]["p99_us"] / g[f"numba/{v}"]["back_to_back"]["p99_us"]
        close = rec["max_abs"] <= fp16_tol["abs"] or rec["max_rel"] <= fp16_tol["rel"]
        t.append({"target": f"numba GRU, {v} variant: p99 >= 3x faster than torch eager (back to back), its error "
                            "within the fp16 variant's tolerance",
                  "value": f"{ratio:.2f}x; max abs {rec['max_abs']:.2g} vs fp32 (tolerance {fp16_tol['abs']:g})",
                  "met": ratio >= 3 and close and bool(rec["within_tolerance"])})
    for mode, label, floor in (
        ("back_to_back", "back to back, vs cache-resident floor", gm["floor_us"]),
        ("cadence_50hz", "50 Hz cold, vs cold-memory floor", gm["floor_cold_us"]),
        ("cadence_50hz_prewarmed", "50 Hz prewarmed, vs cache-resident floor", gm["floor_us"]),
    ):
        fr = g["numba"][mode]["p50_us"] / floor
        t.append({"target": f"numba GRU p50 within 3x of its floor ({label})", "value": f"{fr:.2f}x of {floor:.1f} us", "met": fr <= 3})
    for mode, label in modes.items():
        p = m["numba"][mode]["p99_us"]
        t.append({"target": f"numba MLP step p99 < 20 us ({label})", "value": f"{p:.1f} us", "met": p < 20})
    for key, label in (("1000Hz", "sleep + 300 us spin"), ("1000Hz-spin", "spinning the whole period")):
        lk = r["loops"][key]["missed_fraction"]
        t.append({"target": f"1 kHz loop < 0.1% missed deadlines ({label})", "value": f"{100 * lk:.3f}%", "met": lk < 0.001})
    return t


def format_table(r: dict) -> str:
    lines = [
        "per-step latency, batch 1, one core (us); 50 Hz = one step every 20 ms inside the real-time loop",
        f"{'model':5} {'method':12} {'b2b p50':>8} {'b2b p99':>8} {'cold p50':>8} {'cold p99':>8} "
        f"{'warm p50':>8} {'warm p99':>8} {'first':>7} {'floor':>6} {'cold fl':>7}",
    ]
    for mname, entry in r["models"].items():
        for method, s in entry["methods"].items():
            b, c, w = s["back_to_back"], s["cadence_50hz"], s["cadence_50hz_prewarmed"]
            lines.append(
                f"{mname:5} {method:12} {b['p50_us']:8.1f} {b['p99_us']:8.1f} {c['p50_us']:8.1f} {c['p99_us']:8.1f} "
                f"{w['p50_us']:8.1f} {w['p99_us']:8.1f} {b['first_us']:7.1f} {entry['floor_us']:6.1f} {entry['floor_cold_us']:7.1f}"
            )
    lines.append("(cold: at 50 Hz as is; warm: at 50 Hz with the loop's prewarm just before each deadline;"
                 " floor: FLOPs at peak or fp32 weights at cache bandwidth; cold fl: weights from memory;"
                 " numba/fp16w, numba/int8w: weights stored in float16 / int8, float32 arithmetic)")
    for mname, entry in r["models"].items():
        for v, rec in entry.get("variants", {}).items():
            lines.append(f"{mname} {v}: max abs {rec['max_abs']:.2g}, max rel {rec['max_rel']:.2g} vs fp32 "
                         f"({'within' if rec['within_tolerance'] else 'OUTSIDE'} tolerance {rec['tolerance']['abs']:g})")
    lines.append("")
    lines.append(f"{'loop':11} {'model':5} {'steps':>7} {'late p50':>9} {'late p99':>9} {'late max':>9} {'overruns':>9} {'missed':>8}")
    for rate, s in r["loops"].items():
        lines.append(
            f"{rate:11} {s['model']:5} {s['steps']:7d} {s['lateness_p50_us']:9.1f} {s['lateness_p99_us']:9.1f} "
            f"{s['lateness_max_us']:9.1f} {s['overruns']:9d} {100 * s['missed_fraction']:7.3f}%"
        )
    if "targets" in r:
        lines.append("")
        for t in r["targets"]:
            lines.append(f"[{'met' if t['met'] else 'NOT MET'}] {t['target']}: {t['value']}")
    return "\n".join(lines)


def _plot(samples: dict[str, np.ndarray], results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # A grid a person reads at a glance: one row per model (back to back, cold, prewarmed), the loop below.
    fig = plt.figure(figsize=(16, 12))
    grid = fig.add_gridspec(3, 3)
    titles = {"b2b": "back to back", "cadence": "one step / 20 ms, cold", "prewarm": "one step / 20 ms, prewarmed"}
    for row, mname in enumerate(("gru", "mlp")):
        for col, mode in enumerate(("b2b", "cadence", "prewarm")):
            ax = fig.add_subplot(grid[row, col])
            all_us = np.concatenate([samples[f"{mname}/{m}/{mode}"] for m in METHODS]) / 1e3
            bins = np.logspace(np.log10(max(all_us.min(), 0.5)), np.log10(all_us.max() * 1.05), 60)
            for method in METHODS:
                ax.hist(samples[f"{mname}/{method}/{mode}"] / 1e3, bins=bins, histtype="step", label=method)
            ax.axvline(results["models"][mname]["floor_us"], color="k", ls="--", lw=0.8, label="floor")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("step latency (us)")
            ax.set_title(f"{mname}, {titles[mode]}")
            ax.legend(fontsize=7)
    ax = fig.add_subplot(grid[2, :])
    for key in ("loop/1000Hz/lateness", "loop/1000Hz-spin/lateness", "loop/50Hz/lateness"):
        us = samples[key] / 1e3
        ax.hist(np.clip(us, 0.1, None), bins=np.logspace(-1, np.log10(max(us.max(), 1.0) * 1.05), 60), histtype="step", label=key.split("/")[1])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("loop lateness (us)")
    ax.set_title("real-time loop lateness")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
