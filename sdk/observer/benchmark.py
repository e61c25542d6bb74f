"""The certified neural observer benchmark: every plant, the certificate, the baselines, the training
time against the direct approach, and the runtime's step and load-time check.

``run_observer_benchmark(ObserverBenchConfig())`` (``python bench/bench_observer.py``) writes
``observer.json``, ``observer.md``, ``observer_estimates.png`` and ``observer_errors.png`` under
``bench/results/observer``. It first times one SDP solve and one simulated second on this machine and prints
the estimated run time; the plants in ``extra_plants`` join only while the estimate stays within
``budget_s``. The direct approach runs last, alone, capped at ``direct_cap_s``.

Notes
-----
Per plant: the two-stage observer is trained once per ``rho_slack`` in ``slacks``; the rule picks,
among the certified ones, the lowest final training loss (relative MSE against ``N = 0`` on model
rollouts from the training generator: training data only, never the test Monte Carlo), and among
those within ``slack_tolerance`` of it the smallest slack (the fastest certified decay). ``certify``
then bisects for the fastest certified ``rho`` in the full form; where the full SDP cannot reach the
margin (the X-29: error coordinates orders of magnitude apart), in the cheap form with stage 2's
certified ``P``. The local certificate (Clarabel only in the full form, to bound its time) and the
sampled coverage come with it.

Monte Carlo run ``i`` gives every observer the same initial error ``e0_i`` (uniform in the error
box, the compact set the certificate's coverage is about), the same measurement-noise seed and the
same disturbance (and X-29 model/actuator error) seed. The loop is closed on each observer's own
estimate, ``u = clip(-K z_hat)``, as deployed. ``luenberger`` is the neural observer's own linear
part (its model, its nonlinearity and ``L``, with ``N = 0``; ``L`` the steady-state Kalman gain on the
nonlinear plants, placed poles on the X-29, see ``closedloop.sdk.observer.systems``). The "after" RMSE scores
samples from ``steady_from_s`` on (the transient from the initial error left out). Noise amplification compares run 0 with
its noise-free twin through the estimation error, ``e_noisy - e_clean`` (in closed loop the noise
also moves the plant through ``u``, which is not estimation noise).
"""

from __future__ import annotations

import copy
import math
import os
import platform
import signal
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from closedloop.common.config import JsonConfig

from .baselines import make_baseline
from .bench_report import (  # noqa: F401  (re-exported: callers import the report from here)
    LINEAR_PART,
    NEURAL,
    NONLINEAR_PLANTS,
    STAGE1,
    markdown,
    targets,
    write_results,
)
from .certify import CertificateReport, LocalCertificate, _level_for, certify
from .direct import train_direct
from .lmi import best_decay_rate, solve_lmi
from .metrics import ObserverMetrics, observer_metrics, sample_box
from .network import ObserverNet
from .neural import NeuralObserver, ObserverModel, export_observer_bundle
from .simulate import SimResult, simulate
from .systems import ObserverSystem, observer_system
from .train import TrainConfig, TrainResult, _initial_net, train_observer, train_stage1, train_stage2

#: Plant options of the benchmark: the cart-pole's default has no disturbance; the X-29 gets actuator
#: and model error (seeded per run by ``dist_seed``).
_X29_ERRORS = {"gain_error": 0.05, "model_error": 0.02}
PLANT_OPTIONS: dict[str, dict[str, Any]] = {"cartpole": {"dist": "step", "dist_amp": 0.5, "dist_time_s": 1.0},
                                            **{f"x29-nd-{c}-{a}": _X29_ERRORS for c in ("pa", "ua") for a in ("lon", "lat")}}


@dataclass
class ObserverBenchConfig(JsonConfig):
    """What the benchmark runs (defaults: about 10 minutes on 2 shared CPU cores, all seven plants)."""

    plants: tuple[str, ...] = ("flexible-joint", "van-der-pol", "cartpole", "x29-nd-pa-lon")
    extra_plants: tuple[str, ...] = ("x29-nd-ua-lon", "x29-nd-pa-lat", "x29-nd-ua-lat")
    budget_s: float = 840.0  # extra plants join while the estimate fits (the whole run must stay < 15 min)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(hidden=(16, 16), stage1_steps=100, horizon=80))
    slacks: tuple[float, ...] = (0.5, 0.75, 0.9)
    slack_tolerance: float = 0.02
    certify_iters: int = 6
    local_iters: int = 4
    coverage_eps: float = 1e-3
    coverage_beta: float = 1e-6
    baselines: tuple[str, ...] = ("luenberger", "ekf", "high-gain", "leso")
    mc_runs: int = 20
    duration_s: float = 2.0
    substeps: int = 2
    settle_fraction: float = 0.05
    steady_from_s: float = 0.5  # the "after the transient" RMSE column scores t >= this
    direct_plant: str = "flexible-joint"
    direct_cap_s: float = 300.0
    runtime_steps: int = 20000
    check_repeats: int = 50
    seed: int = 0
    estimate_plant: str = "van-der-pol"
    out_dir: str = "bench/results/observer"
    stem: str = "observer"

    @classmethod
    def smoke(cls, out_dir: str = "bench/results/observer") -> ObserverBenchConfig:
        """Seconds: one plant, a tiny network, two short runs."""
        tiny = TrainConfig(hidden=(4,), stage1_steps=4, horizon=10, n_traj=4, n_points=32, stage2_rounds=3,
                           stage2_steps=10, polish_rounds=1, polish_steps=4)
        return cls(plants=("van-der-pol",), extra_plants=(), train=tiny, slacks=(0.75,), certify_iters=2,
                   local_iters=1, coverage_eps=0.1, coverage_beta=0.01, mc_runs=2, duration_s=0.2, steady_from_s=0.1,
                   direct_plant="van-der-pol", direct_cap_s=30.0, runtime_steps=200,
                   check_repeats=3, out_dir=out_dir, stem="observer_smoke")



# --- training, certificate ---------------------------------------------------------------------------
def train_with_slack_rule(model: ObserverModel, cfg: ObserverBenchConfig) -> tuple[TrainResult, ObserverNet, dict]:
    """Two-stage training for each slack; returns (the selected result, its stage-1 net, the record)."""
    trials, nets = [], []
    for slack in cfg.slacks:
        tcfg = replace(cfg.train, rho_slack=slack)
        t0 = time.perf_counter()
        s1 = train_stage1(model, tcfg)
        stage1_net = copy.deepcopy(s1.net)
        res = train_stage2(s1, model)
        loss = [h["final_accuracy"] for h in res.history if "final_accuracy" in h]
        trials.append({"rho_slack": slack, "certified": res.certified, "target_rho": res.rho,
                       "train_loss_stage1": loss[0], "train_loss": loss[-1], "train_s": time.perf_counter() - t0,
                       "times": res.times})
        nets.append((res, stage1_net))
    ok = [i for i, t in enumerate(trials) if t["certified"]]
    if not ok:
        raise RuntimeError(f"{model.name}: no slack in {cfg.slacks} reached a certificate")
    low = min(trials[i]["train_loss"] for i in ok)
    pick = min((i for i in ok if trials[i]["train_loss"] <= low * (1 + cfg.slack_tolerance)),
               key=lambda i: trials[i]["rho_slack"])
    rule = (f"lowest final training loss (relative MSE vs N = 0 on model rollouts), ties within "
            f"{cfg.slack_tolerance:.0%} to the smallest slack")
    return nets[pick][0], nets[pick][1], {"trials": trials, "selected": cfg.slacks[pick], "rule": rule}


def local_certificate(model: ObserverModel, net: ObserverNet, *, vbar: float = 1.0, margin: float = 1e-4,
                      iters: int = 4, P_fixed: np.ndarray | None = None) -> LocalCertificate:
    """``certify.local_certificate`` with Clarabel only for the full form (its SCS fallback takes about 13 s
    per solve here), or the cheap form with ``P_fixed``."""
    t0 = time.perf_counter()
    em, lft = model.error_model(), net.lft()
    slope = math.tanh(vbar) / vbar
    w_lo = np.concatenate([[slope if a == "tanh" else 0.0] * k for a, k in zip(lft.activations, lft.widths,
                                                                               strict=True)])
    kw = {"P_fixed": P_fixed} if P_fixed is not None else {"solvers": ("CLARABEL",)}
    search = best_decay_rate(em, lft, margin=margin, iters=iters, w_lo=w_lo, **kw)
    if search.best is None:
        return LocalCertificate(vbar, False, time_s=time.perf_counter() - t0)
    P = search.best.P
    c = _level_for(P, net.weights(), list(net.activations), em.Cd, vbar)
    corners = np.array(np.meshgrid(*[(-b, b) for b in model.error_box])).reshape(model.n_z, -1).T
    box_v = float(np.max(np.einsum("bi,ij,bj->b", corners, P, corners)))
    return LocalCertificate(vbar, True, search.best.rho, c, math.sqrt(c / float(np.linalg.eigvalsh(P)[-1])),
                            math.sqrt(c / box_v), time.perf_counter() - t0)


def certify_observer(model: ObserverModel, trained: TrainResult, cfg: ObserverBenchConfig) -> tuple[CertificateReport, dict]:
    """Bisection for the fastest certified rate (full form; where the full SDP misses the margin, the
    cheap form with stage 2's ``P``), local certificate, coverage, one full and one cheap solve, timed."""
    margin, net = cfg.train.margin, trained.net
    kw = {"margin": margin, "iters": cfg.certify_iters, "local_vbar": None, "coverage_eps": cfg.coverage_eps,
          "coverage_beta": cfg.coverage_beta, "seed": cfg.seed}
    rep = certify(model, net, **kw)
    full_max_eig, P_fixed = rep.max_eig, None
    if not rep.certified and trained.certified:
        P_fixed = trained.certificate.P
        rep = certify(model, net, P_fixed=P_fixed, **kw)
    if not rep.certified:
        return rep, {"certified": False, "max_eig": rep.max_eig, "full_form_max_eig": full_max_eig}
    rep.local = local_certificate(model, net, margin=margin, iters=cfg.local_iters, P_fixed=P_fixed)
    em, lft = model.error_model(), net.lft()
    full = solve_lmi(em, lft, rep.rho, margin=margin)
    cheap = solve_lmi(em, lft, rep.rho, margin=margin, P_fixed=rep.P)
    lo, cov = rep.local, rep.coverage
    out = {"certified": True, "form": rep.form, "full_form_max_eig": full_max_eig, "rho": rep.rho, "decay_rate_per_s": rep.decay_rate_per_s, "margin": margin,
           "max_eig": rep.max_eig, "lmi_size": model.n_z + lft.n_hidden + em.Gf.shape[1],
           "bisection_s": rep.times["sdp_s"], "bisection_solves": len(rep.bisection),
           "full_solve_s": full.solve_time_s, "full_solver": full.solver, "full_feasible": full.feasible,
           "cheap_solve_s": cheap.solve_time_s, "cheap_solver": cheap.solver, "cheap_feasible": cheap.feasible,
           "local": {**asdict(lo), "level_at_search_cap": bool(lo.level >= 1e12)},
           "coverage": asdict(cov) if cov else None}
    return rep, out


# --- Monte Carlo -------------------------------------------------------------------------------------
class _LinearPart(NeuralObserver):
    """The neural observer with ``N = 0``: its own model, nonlinearity and gain ``L``."""

    def __init__(self, model: ObserverModel):
        super().__init__(model, [], [])

    def correction(self, r: np.ndarray) -> Any:
        return 0.0


def _stats(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=float)
    fin = a[np.isfinite(a)]
    return {"mean": float(fin.mean()) if fin.size else math.inf, "std": float(fin.std()) if fin.size else 0.0,
            "median": float(np.median(a)) if not np.isnan(a).any() else math.nan,
            "worst": float(a.max()) if not np.isnan(a).any() else math.nan, "n_inf": int((~np.isfinite(a)).sum())}


def _summary(runs: list[ObserverMetrics], box: np.ndarray, n_x: int, steady: list[float]) -> dict[str, Any]:
    scaled = [float(np.sqrt(np.sum((np.asarray(m.state_rmse_each) / box[:n_x]) ** 2))) for m in runs]
    return {"state_rmse": _stats([m.state_rmse for m in runs]), "state_rmse_scaled": _stats(scaled),
            "state_rmse_steady": _stats(steady),
            "disturbance_rmse": _stats([m.disturbance_rmse for m in runs]),
            "settling_time_s": _stats([m.settling_time_s for m in runs]),
            "peak_error": _stats([m.peak_error for m in runs]), "peak_ratio": _stats([m.peak_ratio for m in runs]),
            "noise_amplification": runs[0].noise_amplification,
            "cost_us": {"p50": float(np.median([m.cost_us["p50"] for m in runs])),
                        "p99": float(np.median([m.cost_us["p99"] for m in runs]))}}


def monte_carlo_all(system: ObserverSystem, model: ObserverModel, observers: dict[str, Any],
                    cfg: ObserverBenchConfig) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, SimResult]]:
    """Every observer on the same runs; returns (summaries, median error-norm traces, run 0 of each)."""
    errors = sample_box(system.error_box, cfg.mc_runs, seed=cfg.seed)
    box, x0 = system.error_box, system.nominal_x0

    def u_fn(t: float, zh: np.ndarray) -> np.ndarray:
        return np.clip(-model.K @ zh, model.u_low, model.u_high)

    metrics: dict[str, list[ObserverMetrics]] = {k: [] for k in observers}
    steady: dict[str, list[float]] = {k: [] for k in observers}
    traces: dict[str, list[np.ndarray]] = {k: [] for k in observers}
    first: dict[str, SimResult] = {}
    opts = PLANT_OPTIONS.get(system.name, {})
    for i, e0 in enumerate(errors):
        plant = system.make_plant(**opts, dist_seed=cfg.seed + i)
        z0 = np.r_[x0, plant.disturbance(0.0)]
        kw = {"seed": cfg.seed + i, "x0": x0, "z0_hat": z0 - e0, "substeps": cfg.substeps}
        for name, obs in observers.items():
            with np.errstate(all="ignore"):
                res = simulate(plant, obs, u_fn, cfg.duration_s, system.dt, system.meas_noise_std, **kw)
                clean = None
                if i == 0:
                    c = simulate(plant, obs, u_fn, cfg.duration_s, system.dt, 0.0, **kw)
                    clean = replace(c, z_hat=c.z_hat - c.z + res.z)  # zhat - clean' = e_clean - e_noisy
                    first[name] = res
                metrics[name].append(observer_metrics(res, scale=box, fraction=cfg.settle_fraction, clean=clean,
                                                      noise_std=system.meas_noise_std, Cd=system.Cd))
                steady[name].append(observer_metrics(res, scale=box, from_s=cfg.steady_from_s).state_rmse)
                traces[name].append(np.linalg.norm(res.error / box, axis=1))
        getattr(plant, "close", lambda: None)()
    summaries = {k: _summary(v, box, system.n_x, steady[k]) for k, v in metrics.items()}
    return summaries, {k: np.median(np.array(v), axis=0) for k, v in traces.items()}, first


# --- training time: two-stage vs direct -----------------------------------------------------------------
class _Capped(BaseException):
    """Raised by the alarm when the direct approach runs past its cap."""


def training_time_comparison(plant: str, train_cfg: dict[str, Any], cap_s: float) -> dict[str, Any]:
    """Wall clock to a certificate, same network and settings: two-stage, then direct (capped at ``cap_s``)."""
    torch.set_num_threads(1)
    cfg = TrainConfig.from_dict(train_cfg)
    model = ObserverModel.from_system(observer_system(plant))
    t0 = time.perf_counter()
    two = train_observer(model, cfg)
    two_s = time.perf_counter() - t0

    def alarm(signum: int, frame: Any) -> None:
        raise _Capped

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, cap_s)
    t0, direct = time.perf_counter(), None
    try:
        direct = train_direct(model, cfg)
    except _Capped:
        pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    direct_s = time.perf_counter() - t0
    capped = direct is None
    return {"plant": plant, "hidden": list(cfg.hidden), "stage1_steps": cfg.stage1_steps, "rho_slack": cfg.rho_slack,
            "two_stage_s": two_s, "two_stage_certified": two.certified,
            "two_stage_times": two.times, "direct_times": direct.times if direct else None,
            "direct_s": direct_s, "direct_capped": capped, "cap_s": cap_s,
            "direct_certified": bool(direct and direct.certified),
            "direct_sdp_solves": direct.times["sdp_solves"] if direct else None,
            "speedup": direct_s / two_s, "speedup_is_lower_bound": capped or not (direct and direct.certified)}


# --- runtime ----------------------------------------------------------------------------------------
def runtime_timing(model: ObserverModel, net: ObserverNet, report: CertificateReport, folder: Path,
                   y: np.ndarray, u: np.ndarray, cfg: ObserverBenchConfig) -> dict[str, Any]:
    """Export the bundle; time the load-time certificate check (fresh bundle object each time) and the
    family's Numba step on recorded measurements (each call timed, Python call overhead included)."""
    from closedloop.runtime.bundle import Bundle, load_bundle
    from closedloop.runtime.families import get_family
    from closedloop.runtime.families.observer.certificate import check_bundle_certificate
    from closedloop.runtime.model import Model

    t0 = time.perf_counter()
    path = export_observer_bundle(NeuralObserver(model, net), report, folder / model.name, overwrite=True,
                                  report=lambda s: None)
    export_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    bundle = load_bundle(path)
    load_ms = (time.perf_counter() - t0) * 1e3
    check_ms, passed = [], True
    for _ in range(cfg.check_repeats):
        fresh = Bundle(root=bundle.root, manifest=bundle.manifest, source=bundle.source)
        t0 = time.perf_counter()
        passed &= check_bundle_certificate(fresh).passed
        check_ms.append((time.perf_counter() - t0) * 1e3)
    fam = get_family("observer")(bundle, Model(bundle, backend="onnxruntime"))
    y, u = np.ascontiguousarray(y, dtype=float), np.ascontiguousarray(u, dtype=float)
    n, warm = len(y), 200
    ns = np.empty(cfg.runtime_steps + warm, dtype=np.int64)
    clock = time.perf_counter_ns
    for k in range(ns.size):
        yk, uk = y[k % n], u[k % n]
        t = clock()
        fam.step(yk, uk)
        ns[k] = clock() - t
    us = ns[warm:] / 1e3
    return {"export_s": export_s, "load_bundle_ms": load_ms, "check_passed": passed,
            "check_ms": {"median": float(np.median(check_ms)), "max": float(np.max(check_ms))},
            "step_us": {"p50": float(np.percentile(us, 50)), "p99": float(np.percentile(us, 99)),
                        "max": float(us.max()), "n": int(us.size)}}


# --- the whole benchmark --------------------------------------------------------------------------------
def calibrate() -> dict[str, float]:
    """One full-form SDP (16-16 on the flexible joint) and one simulated second: this machine's speed."""
    system = observer_system("flexible-joint")
    model = ObserverModel.from_system(system)
    net = _initial_net(model, TrainConfig(hidden=(16, 16)))
    t0 = time.perf_counter()
    solve_lmi(model.error_model(), net.lft(), 1.0)
    sdp_s = time.perf_counter() - t0
    plant, obs = system.make_plant(), make_baseline("luenberger", system)
    simulate(plant, obs, None, 0.05, system.dt, 1e-3, substeps=2)  # warm-up
    t0 = time.perf_counter()
    simulate(plant, obs, None, 0.5, system.dt, 1e-3, substeps=2)
    return {"sdp_s": sdp_s, "sim_s_per_s": (time.perf_counter() - t0) / 0.5}


def estimate_s(cfg: ObserverBenchConfig, plants: tuple[str, ...], cal: dict[str, float]) -> dict[str, float]:
    """Rough wall time from the calibration (constants fitted on 2 shared cores)."""
    tc, sdp = cfg.train, cal["sdp_s"]
    per_train = 0.03 * tc.stage1_steps * tc.n_traj * tc.horizon / 640 + 6 * sdp + 1
    cert = (cfg.certify_iters + cfg.local_iters + 4) * sdp
    mc = (len(cfg.baselines) + 2) * (cfg.mc_runs + 1) * cfg.duration_s * cal["sim_s_per_s"]
    direct = per_train + min(cfg.direct_cap_s, 1.4 * (tc.stage1_steps + 1) * sdp)
    main = len(plants) * (len(cfg.slacks) * per_train + cert + mc + 3) + 10
    return {"total_s": main + direct, "plants_s": main, "direct_s": direct}


def run_observer_benchmark(cfg: ObserverBenchConfig, report: Any = print) -> dict[str, Any]:
    """Run everything, write the results, print the tables; returns the JSON record."""
    t_start = time.perf_counter()
    torch.set_num_threads(1)
    cal = calibrate()
    plants = tuple(dict.fromkeys(cfg.plants))
    for extra in cfg.extra_plants:
        if estimate_s(cfg, plants + (extra,), cal)["total_s"] <= cfg.budget_s:
            plants += (extra,)
    est = estimate_s(cfg, plants, cal)
    skipped = [p for p in cfg.extra_plants if p not in plants]
    report(f"observer benchmark: {len(plants)} plants {list(plants)}" + (f" (left out for time: {skipped})" if skipped else ""))
    report(f"estimated wall time {est['total_s'] / 60:.1f} min (one 16-16 SDP {cal['sdp_s']:.2f} s, "
           f"{cal['sim_s_per_s']:.3f} s per simulated s; budget {cfg.budget_s / 60:.1f} min); direct approach "
           f"capped at {cfg.direct_cap_s:.0f} s")
    results: dict[str, Any] = {}
    traces: dict[str, dict[str, np.ndarray]] = {}
    runs0: dict[str, dict[str, SimResult]] = {}
    with tempfile.TemporaryDirectory(prefix="observer-bench-") as tmp:
        for name in plants:
            t0 = time.perf_counter()
            system = observer_system(name)
            model = ObserverModel.from_system(system)
            trained, net1, training = train_with_slack_rule(model, cfg)
            cert_report, cert = certify_observer(model, trained, cfg)
            observers = {NEURAL: NeuralObserver(model, trained.net), STAGE1: NeuralObserver(model, net1)}
            observers.update({b: _LinearPart(model) if b == LINEAR_PART else make_baseline(b, system)
                              for b in cfg.baselines})
            mc, traces[name], runs0[name] = monte_carlo_all(system, model, observers, cfg)
            results[name] = {"system": {"n_z": system.n_z, "n_y": system.n_y, "dt": system.dt,
                                        "error_box": system.error_box.tolist(), "omega_o": system.omega_o,
                                        "nonlinearity": model.nonlinearity.get("name", "none"),
                                        "plant_options": PLANT_OPTIONS.get(name, {})},
                             "training": training, "certificate": cert, "monte_carlo": mc}
            if cert_report.certified:
                r0 = runs0[name][NEURAL]
                results[name]["runtime"] = runtime_timing(model, trained.net, cert_report, Path(tmp), r0.y, r0.u, cfg)
            results[name]["wall_s"] = time.perf_counter() - t0
            report(f"  {name}: {results[name]['wall_s']:.0f} s ({time.perf_counter() - t_start:.0f} s so far)")
    # Alone, after the rest, so that both approaches are timed under the same load.
    slack = results[cfg.direct_plant]["training"]["selected"] if cfg.direct_plant in results else cfg.train.rho_slack
    t0 = time.perf_counter()
    direct = training_time_comparison(cfg.direct_plant, replace(cfg.train, rho_slack=slack).to_dict(), cfg.direct_cap_s)
    report(f"  two-stage vs direct ({cfg.direct_plant}): {time.perf_counter() - t0:.0f} s")
    record = {"config": cfg.to_dict(), "plants": list(plants), "left_out_for_time": skipped,
              "estimate": est, "calibration": cal, "results": results, "training_time": direct,
              "machine": {"platform": platform.platform(), "python": platform.python_version(),
                          "cpus": os.cpu_count(), "loadavg_at_end": list(os.getloadavg()), "torch": torch.__version__}}
    record["targets"] = targets(record)
    record["wall_s"] = time.perf_counter() - t_start
    write_results(record, traces, runs0, cfg, report)
    return record
