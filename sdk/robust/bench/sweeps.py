"""The measurements: random-flip sweeps, targeted (Bit-Flip-Attack-style) sweeps, and full-scrub timing."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from .config import KEY, BitflipBenchConfig
from .memory import WeightMemory


def _model(bundle_path, variant, protected: bool):
    from closedloop.runtime import Model, load_bundle
    from closedloop.runtime.protect.scrubber import attach_scrubber

    backend = "numba" if variant is None else "onnxruntime"
    model = Model(load_bundle(bundle_path), backend=backend, variant=variant)
    scrubber = attach_scrubber(model, key=KEY if "unkeyed" not in str(bundle_path) else None) if protected else None
    return model, scrubber, WeightMemory(model, scrubber)


def _with_flips(ev, model, scrubber, mem, flips, scrub: bool) -> dict:
    mem.apply(flips)
    info = {}
    if scrub:
        t0 = time.perf_counter()
        events = scrubber.scrub_all(restore=True)
        info = {"scrub_ms": (time.perf_counter() - t0) * 1e3,
                "repaired": sum(e.status == "repaired" for e in events),
                "restored": sum(e.status == "restored" for e in events),
                "unrepairable": sum(e.status == "unrepairable" for e in events)}
    out = ev.evaluate(model, mem) | info
    mem.restore()
    return out


def random_sweep(ev, cfg: BitflipBenchConfig, variant: str | None, report) -> dict:
    from closedloop.sdk.robust.faults import random_flips

    out = {}
    conds = ["unprotected", "protected_noscrub", "protected_scrub"]
    if getattr(ev, "split_protected", False):  # flips only where the scheme reaches: the protected tensors
        conds.append("scrub_protected_flips_only")
    for cond in conds:
        bundle = ev.bundles["unprotected" if cond == "unprotected" else "protected"]
        model, scrubber, mem = _model(bundle, variant, cond != "unprotected")
        clean = ev.evaluate(model, mem)
        inits = mem.inits
        names = sorted(inits)
        if cond == "scrub_protected_flips_only":
            robust = model.bundle.manifest.extra["robust"]["precisions"][variant or "fp32"]
            names = sorted(set(robust["names"].values()) & set(inits))
        rows = []
        for n in ev.random_flips:
            for seed in getattr(ev, "seeds", cfg.seeds):
                flips = random_flips(inits, n, seed=1000 * n + seed, names=names)
                rows.append({"flips": n, "seed": seed, **_with_flips(ev, model, scrubber, mem, flips, cond in (
                    "protected_scrub", "scrub_protected_flips_only"))})
        out[cond] = {"clean": clean, "runs": rows}
        med = {n: np.median([r[ev.metric] for r in rows if r["flips"] == n]) for n in ev.random_flips}
        report(f"random {ev.name} {variant or 'fp32'} {cond}: clean {ev.metric} {clean[ev.metric]:.3f}; median by flips "
               + ", ".join(f"{n}: {v:.3f}" for n, v in med.items()))
    return out


def targeted_sweep(ev, cfg: BitflipBenchConfig, report) -> dict:
    from closedloop.runtime import load_bundle
    from closedloop.sdk.robust.attack import AttackConfig, bit_flip_attack

    attacks = {"bfa_vs_unprotected": ("unprotected", False), "bfa_vs_protected_keyed": ("protected", False),
               "adaptive_vs_protected_unkeyed": ("protected_unkeyed", True),
               "adaptive_vs_protected_keyed": ("protected", True)}
    out = {}
    data = ev.attack_data()
    for name, (which, adaptive) in attacks.items():
        t0 = time.perf_counter()
        res = bit_flip_attack(load_bundle(ev.bundles[which]), "int8",
                              AttackConfig(flips=max(cfg.targeted_flips), adaptive=adaptive, k=cfg.k), data=data,
                              report=lambda s: None)
        conds = ("unprotected",) if which == "unprotected" else ("noscrub", "scrub")
        rec = {"attack_s": time.perf_counter() - t0, "loss_trace": res.losses, "flips_found": len(res.flips)}
        for cond in conds:
            model, scrubber, mem = _model(ev.bundles[which], "int8", which != "unprotected")
            # the adaptive search commits sets of three flips, so its last checkpoint may fall short of the largest
            points = sorted({n for n in cfg.targeted_flips if n <= len(res.flips)} | {len(res.flips)})
            rows = [{"flips": n, **_with_flips(ev, model, scrubber, mem, res.flips[:n], cond == "scrub")}
                    for n in points]
            rec[cond] = rows
            report(f"targeted {name} [{cond}]: " + ", ".join(f"{r['flips']}: {r[ev.metric]:.3f}" for r in rows))
        out[name] = rec
    return out


def scrub_timing(cfg: BitflipBenchConfig, work: Path, report) -> dict:
    """Full-scrub time (median, one core) of the benchmark decoder (192 ch) and the 2x256 GRUDecoder."""
    import torch

    from closedloop.export import export_bundle
    from closedloop.runtime import Model, load_bundle
    from closedloop.runtime.protect.scrubber import attach_scrubber
    from closedloop.sdk.bci.benchmark import BciBenchConfig
    from closedloop.sdk.bci.models import AffineAlignment, AlignedDecoder, GRUBackbone
    from closedloop.sdk.models import GRUDecoder
    from closedloop.sdk.robust import finalize, protect, protect_bundle

    bc = BciBenchConfig().harness.train.backbone
    models = {f"bci benchmark decoder (192 ch, alignment + GRU {bc.n_hidden}x{bc.n_layers})":
              (AlignedDecoder(AffineAlignment(192), GRUBackbone(192, bc.n_hidden, bc.n_layers)), 192),
              "GRUDecoder 2x256 (192 ch)": (GRUDecoder(192, 256, 2, 32), 192)}
    if cfg.tiny:
        models = {"tiny GRU": (GRUDecoder(16, 32, 1, 32), 16)}
    out = {}
    for name, (m, c) in models.items():
        m.eval()
        plan = protect(m, torch.zeros(1, c), kind="recurrent", k=cfg.k, key=KEY)
        finalize(m, plan, KEY)
        path = export_bundle(m, work / f"timing_{len(out)}", kind="recurrent", example_input=torch.zeros(1, c),
                             rate_hz=50.0, variants=("fp16",), tensorrt=False, report=lambda s: None)
        protect_bundle(path, plan, KEY, report=lambda s: None)
        rec = {"weights": sum(p.numel() for p in m.parameters()),
               "protected_weights": plan.summary(m)["protected_weights"]}
        for backend, variant in (("numba", None), ("onnxruntime", None), ("onnxruntime", "fp16"),
                                 ("onnxruntime", "int8")):
            s = attach_scrubber(Model(load_bundle(path), backend=backend, variant=variant), key=KEY)
            ts = []
            for _ in range(cfg.timing_reps):
                t0 = time.perf_counter_ns()
                s.scrub_all()
                ts.append((time.perf_counter_ns() - t0) / 1e3)
            rec[f"{s.targets[0].name} {variant or 'fp32'}"] = {"blocks": s.stats.blocks, "median_us": float(np.median(ts)),
                                                              "p90_us": float(np.percentile(ts, 90))}
        out[name] = rec
        report(f"scrub timing {name}: " + ", ".join(f"{k}: {v['median_us']:.0f} us" for k, v in rec.items()
                                                   if isinstance(v, dict)))
    return out

