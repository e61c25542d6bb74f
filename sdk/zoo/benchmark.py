"""The zoo benchmark: the full-size zoo models' step latency on torch eager, ONNX Runtime and Numba.

For each model: export the ``full()`` size with every reduced-precision variant the exporter makes
(in a child process, so a variant that crashes its converter costs that variant, not the run), then
time one step at batch 1 on one thread, back to back, on torch eager (the module's ``step`` with its
state, or ``forward`` on one window) and on each runtime backend and variant that can run the bundle
here (``Model.run``: one step, state carried; for a windowed model one run on a full window). The
backends take turns in ``rounds`` interleaved rounds, so a burst of load elsewhere on the machine falls
on all of them and the ratios stay fair. A pair that cannot run here is a row with the reason.

Beside the timings: each step's roofline floor (``closedloop.runtime.roofline``: FLOPs at this core's
peak or weights at cache bandwidth), the variants' error against fp32 from the manifest, and a streaming
check on every backend (recurrent: ``Model.step`` bin by bin against the torch module's ``step``;
windowed: ``Model.feed`` frame by frame against ``Model.step`` on each window). The issue's targets are
judged from these numbers (``zoo_targets``), never stated. ``bench/bench_zoo.py`` is the entry point;
``closedloop.sdk.zoo.report`` formats the tables and the plot.
"""

from __future__ import annotations

import multiprocessing
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from closedloop.export.variants import VARIANT_TOLERANCES, VARIANTS
from closedloop.runtime import BackendUnavailableError, Model, load_bundle
from closedloop.runtime.timing import MachineRoofline, stats_us

from .catalog import ZOO, ZooEntry, make_bundle
from .report import format_zoo_table, host_kind, write_zoo_results

RUNTIME_BACKENDS = ("onnxruntime", "numba")


@dataclass
class ZooBenchConfig:
    steps: int = 15000  # back to back per method, split over the rounds
    rounds: int = 5
    warmup: int = 200
    stream_steps: int = 48  # outputs compared in the streaming check (bins, or windows after the first fills)
    models: tuple[str, ...] | None = None  # None: the whole zoo
    variants: tuple[str, ...] | None = None  # None: every variant the exporter makes
    seed: int = 0
    out_dir: str | None = "bench/results/zoo"
    name: str = "zoo"
    bundle_dir: str | None = None  # keep the exported bundles here (default: a temp folder)

    @classmethod
    def quick(cls, out_dir: str | None = "bench/results/zoo") -> ZooBenchConfig:
        """Seconds per model, fp32 only; written as ``zoo_quick.*`` (git ignores it)."""
        return cls(steps=600, rounds=3, warmup=50, stream_steps=16, variants=(), out_dir=out_dir, name="zoo_quick")


def _export_child(name: str, out: str, variants: tuple[str, ...], seed: int) -> None:
    make_bundle(name, "full", out, seed=seed, variants=variants)


def _export(name: str, out: Path, variants: tuple[str, ...], seed: int) -> int:
    """Export in a child process; its exit code (negative: killed by that signal)."""
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    p = ctx.Process(target=_export_child, args=(name, str(out), variants, seed))
    p.start()
    p.join()
    return int(p.exitcode or 0)


def _why(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name} while building or checking it"
    return f"export failed (exit code {code})"


def export_full(name: str, out: Path, variants: tuple[str, ...], seed: int,
                report: Callable[[str], None]) -> tuple[Path, dict[str, str]]:
    """The full-size bundle of ``name`` with every variant that builds; ``{variant: why}`` for the rest."""
    code = _export(name, out, variants, seed)
    if code == 0:
        return out, {}
    report(f"  {name}: export with variants {list(variants)} failed ({_why(code)}); trying each variant alone")
    dropped = {}
    for v in variants:
        c = _export(name, out.with_name(out.name + f"-{v}"), (v,), seed)
        if c != 0:
            dropped[v] = f"the {v} variant was not built: {_why(c)}"
    keep = tuple(v for v in variants if v not in dropped)
    code = _export(name, out, keep, seed)
    if code != 0:
        raise RuntimeError(f"zoo model {name!r} does not export even with variants {list(keep)}: {_why(code)}")
    return out, dropped


def _torch_step(entry: ZooEntry, module: torch.nn.Module, seed: int) -> Callable[[], None]:
    inputs = list(entry.example_inputs(module, seed).values())
    if entry.kind == "recurrent":
        state = list(module.init_state(1))

        def step() -> None:
            with torch.inference_mode():
                _, *new = module.step(*inputs, *state)
            state[:] = new

        return step

    def forward() -> None:
        with torch.inference_mode():
            module(*inputs)

    return forward


def _runtime_model(bundle: Path, backend: str, variant: str, seed: int) -> Model:
    m = Model(bundle, backend=backend, variant=None if variant == "fp32" else variant)
    rng = np.random.default_rng(seed)
    for t in m.spec.data_inputs:
        m.inputs[t.name][...] = rng.standard_normal(m.inputs[t.name].shape)
    return m


def _interleaved(steps: dict[str, Callable[[], None]], cfg: ZooBenchConfig) -> dict[str, np.ndarray]:
    """Every method's step times (ns), the methods taking turns in ``cfg.rounds`` rounds."""
    for step in steps.values():
        for _ in range(cfg.warmup):
            step()
    per_round = max(cfg.steps // cfg.rounds, 1)
    out: dict[str, list[np.ndarray]] = {k: [] for k in steps}
    clock = time.perf_counter_ns
    for _ in range(cfg.rounds):
        for key, step in steps.items():
            ns = np.empty(per_round, dtype=np.int64)
            for i in range(per_round):
                t0 = clock()
                step()
                ns[i] = clock() - t0
            out[key].append(ns)
    return {k: np.concatenate(v) for k, v in out.items()}


def _streaming_check(entry: ZooEntry, module: torch.nn.Module, model: Model, bundle: Path, backend: str,
                     cfg: ZooBenchConfig) -> dict:
    """Streaming against offline on one backend: the largest difference, and against what."""
    rng = np.random.default_rng(cfg.seed + 1)
    n = cfg.stream_steps if entry.layout is None else int(module.window) + entry.hop * (cfg.stream_steps - 1)
    frames = rng.poisson(2.0, size=(n, entry.frame_size(module))).astype(np.float32)
    model.reset()
    worst = 0.0
    if entry.kind == "recurrent":
        states = module.init_state(1)
        with torch.inference_mode():
            for x in frames:
                want, *states = module.step(torch.from_numpy(x[None]), *states)
                worst = max(worst, float(np.max(np.abs(model.step(x[None]) - want.numpy()))))
        return {"against": "torch module step by step", "steps": len(frames), "max_abs_diff": worst}
    if entry.layout is None:
        return {"against": "not streamed (one measurement per step, no state or window)", "steps": 0,
                "max_abs_diff": 0.0}
    offline = Model(bundle, backend=backend)
    w = model.window("x")
    assert w is not None
    runs = 0
    for i, f in enumerate(frames):
        y = model.feed(f)
        if y is not None:
            win = frames[i - w.length + 1 : i + 1]
            x = win.T[None] if w.layout == "channel_major" else win[None]
            worst = max(worst, float(np.max(np.abs(y - offline.step(x)))))
            runs += 1
    offline.close()
    return {"against": "Model.step on each window offline", "steps": runs, "max_abs_diff": worst}


def _bench_model(entry: ZooEntry, bundle: Path, dropped: dict[str, str], machine: MachineRoofline,
                 cfg: ZooBenchConfig, report: Callable[[str], None]) -> tuple[dict, dict[str, np.ndarray]]:
    from closedloop.runtime.roofline import graph_cost

    module = entry.build("full", cfg.seed)
    b = load_bundle(bundle)
    spec = b.graph()
    variants = ["fp32", *spec.variants]
    steps: dict[str, Callable[[], None]] = {"torch-eager/fp32": _torch_step(entry, module, cfg.seed)}
    rows: dict[str, dict] = {"torch-eager/fp32": {"method": "torch-eager", "variant": "fp32", "status": "timed"}}
    models: dict[str, Model] = {}
    for backend in RUNTIME_BACKENDS:
        for v in variants:
            key = f"{backend}/{v}"
            row: dict = {"method": backend, "variant": v}
            rows[key] = row
            try:
                models[key] = _runtime_model(bundle, backend, v, cfg.seed)
            except BackendUnavailableError as exc:
                row |= {"status": "skipped", "reason": str(exc)}
                continue
            steps[key] = models[key].run
            row["status"] = "timed"
    for v, why in dropped.items():
        rows[f"*/{v}"] = {"method": "*", "variant": v, "status": "skipped", "reason": why}
    report(f"  {entry.name}: timing {', '.join(steps)} ({cfg.steps} steps each, {cfg.rounds} rounds)")
    samples = _interleaved(steps, cfg)
    cost = graph_cost(b.graph_path(), spec)
    peak = machine.peak()
    for key, ns in samples.items():
        rows[key] |= stats_us(ns)
        if key.startswith("torch"):
            continue
        wbytes = graph_cost(b.graph_path("main", rows[key]["variant"])).weight_bytes
        floor, bound = cost.floor_us(peak, machine.bandwidths(wbytes)[0])
        rows[key] |= {"weight_bytes": wbytes, "floor_us": floor, "floor_bound": bound,
                      "p50_over_floor": rows[key]["p50_us"] / floor if floor > 0 else None}
    streaming = {}
    for key, m in models.items():
        if key.endswith("/fp32"):
            streaming[key.split("/")[0]] = _streaming_check(entry, module, m, bundle, key.split("/")[0], cfg)
        m.close()
    entry_record = {
        "summary": entry.summary, "shape": entry.describe("full"), "kind": entry.kind, "rate_hz": entry.rate_hz,
        "flops": cost.flops, "parameters": sum(p.numel() for p in module.parameters()),
        "parity_fp32": {k: spec.parity.get(k) for k in ("max_abs", "max_rel", "within_tolerance")},
        "variants": {v: {"within_tolerance": r.get("within_tolerance"), "tolerance": r.get("tolerance"),
                         "max_abs": r["parity_vs_fp32"].get("max_abs"), "max_rel": r["parity_vs_fp32"].get("max_rel")}
                     for v, r in spec.variants.items()},
        "variants_not_built": dropped,
        "rows": list(rows.values()),
        "streaming": streaming,
    }
    return entry_record, {f"{entry.name}/{k}": v for k, v in samples.items()}


def run_zoo_benchmark(cfg: ZooBenchConfig | None = None, report: Callable[[str], None] = print) -> dict:
    """Export and time every zoo model at full size; write the results when ``cfg.out_dir`` is set."""
    cfg = cfg or ZooBenchConfig()
    torch.set_num_threads(1)
    names = list(cfg.models or ZOO)
    variants = tuple(VARIANTS) if cfg.variants is None else tuple(cfg.variants)
    work = Path(cfg.bundle_dir) if cfg.bundle_dir else Path(tempfile.mkdtemp(prefix="closedloop-zoo-"))
    started = time.perf_counter()
    report("measuring this core's peak (for the floors) ...")
    machine = MachineRoofline()
    results: dict = {"config": asdict(cfg), "machine": machine.to_dict() | host_kind(),
                     "torch": torch.__version__, "variants_requested": list(variants), "models": {}}
    bundles = {}
    for name in names:  # every export before any timing: the children fork from a process with no sessions open
        report(f"exporting {name} (full) with variants {list(variants)} ...")
        bundles[name] = export_full(name, work / name, variants, cfg.seed, report)
    samples: dict[str, np.ndarray] = {}
    for name in names:
        record, s = _bench_model(ZOO[name], *bundles[name], machine, cfg, report)
        results["models"][name] = record
        samples |= s
    results["wall_s"] = time.perf_counter() - started
    results["targets"] = zoo_targets(results)
    report(format_zoo_table(results))
    if cfg.out_dir:
        written = write_zoo_results(results, samples, Path(cfg.out_dir), cfg.name)
        report("wrote " + ", ".join(str(p) for p in written))
    return results


def _row(record: dict, method: str, variant: str = "fp32") -> dict | None:
    for r in record["rows"]:
        if r["method"] == method and r["variant"] == variant and r["status"] == "timed":
            return r
    return None


def zoo_targets(results: dict) -> list[dict]:
    """The issue's targets, each judged from this run's numbers: ``{target, value, met}``."""
    t: list[dict] = []
    models = results["models"]
    missing = {n: next((r.get("reason", "") for r in m["rows"] if r["method"] == "numba" and r["variant"] == "fp32"), "")
               for n, m in models.items() if _row(m, "numba") is None}
    t.append({"target": "the Numba backend runs every zoo model",
              "value": f"{len(models) - len(missing)}/{len(models)}"
                       + (": not " + "; ".join(f"{n} ({why})" for n, why in missing.items()) if missing else ""),
              "met": not missing})
    for name, m in models.items():
        nb, ort, te = _row(m, "numba"), _row(m, "onnxruntime"), _row(m, "torch-eager")
        if nb is None or ort is None:
            continue
        ratio = nb["p99_us"] / ort["p99_us"]
        t.append({"target": f"{name}: numba p99 <= ONNX Runtime p99",
                  "value": f"{nb['p99_us']:.1f} vs {ort['p99_us']:.1f} us (numba/ORT {ratio:.2f})", "met": ratio <= 1.0})
        if m["kind"] == "recurrent" and te is not None:
            speed = te["p99_us"] / nb["p99_us"]
            t.append({"target": f"{name}: numba p99 >= 3x faster than torch eager p99",
                      "value": f"{speed:.2f}x ({nb['p99_us']:.1f} vs {te['p99_us']:.1f} us)", "met": speed >= 3.0})
    if "gru" in models:
        m = models["gru"]
        te = _row(m, "torch-eager")
        # a variant counts when its error against fp32 is within the fp16 variant's tolerance (abs or rel)
        fp16 = (m["variants"].get("fp16") or {}).get("tolerance") or VARIANT_TOLERANCES["fp16"].to_dict()

        def close(v: str) -> bool:
            r = m["variants"][v]
            return bool(r["within_tolerance"]) and ((r["max_abs"] is not None and r["max_abs"] <= fp16["abs"])
                                                    or (r["max_rel"] is not None and r["max_rel"] <= fp16["rel"]))

        options = [(v, r) for v in ["fp32", *m["variants"]]
                   if (r := _row(m, "numba", v)) is not None and (v == "fp32" or close(v))]
        if te is not None and options:
            v, best = min(options, key=lambda o: o[1]["p99_us"])
            speed = te["p99_us"] / best["p99_us"]
            not_run = [x for x in m["variants"] if _row(m, "numba", x) is None]
            error = "" if v == "fp32" else f", max abs {m['variants'][v]['max_abs']:.2g} vs fp32"
            t.append({"target": "GRU 2x256 (192 inputs): numba >= 3x torch eager p99, fp32 or a variant whose error is "
                                f"within the fp16 variant's tolerance (this host: {results['machine'].get('host_kind', '?')})",
                      "value": f"{speed:.2f}x with {v}{error}"
                               + (f" (numba cannot run {', '.join(not_run)} here)" if not_run else ""),
                      "met": speed >= 3.0})
    if results["variants_requested"]:  # (--quick asks for none: nothing to judge)
        t.append(_variant_target(models))
    diffs = [(n, b, s) for n, m in models.items() for b, s in m["streaming"].items() if s["steps"]]
    bad = [f"{n}/{b} {s['max_abs_diff']:.3g}" for n, b, s in diffs
           if s["max_abs_diff"] > (1e-4 if models[n]["kind"] == "recurrent" else 0.0)]
    t.append({"target": "streaming equals offline for every recurrent and windowed model",
              "value": f"{len(diffs) - len(bad)}/{len(diffs)} model/backend pairs "
                       "(windowed: identical; recurrent: within 1e-4 of torch)" + (f"; off: {', '.join(bad)}" if bad else ""),
              "met": not bad and bool(diffs)})
    return t


def _variant_target(models: dict) -> dict:
    outside = [f"{n}/{v} (max abs {r['max_abs']:.3g}, tolerance {r['tolerance']})"
               for n, m in models.items() for v, r in m["variants"].items() if not r["within_tolerance"]]
    n_var = sum(len(m["variants"]) for m in models.values())
    not_built = [f"{n}/{v}" for n, m in models.items() for v in m["variants_not_built"]]
    return {"target": "every variant within its stated tolerance against fp32",
            "value": f"{n_var - len(outside)}/{n_var} within" + (f"; outside: {', '.join(outside)}" if outside else "")
                     + (f"; not built: {', '.join(not_built)}" if not_built else ""),
            "met": not outside and not not_built}
