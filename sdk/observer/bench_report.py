"""The observer benchmark's report: the targets, ``observer.md``, the two plots, the JSON record.

Split from ``closedloop.sdk.observer.benchmark`` (which runs the benchmark and re-exports these). Every
number's definition: the module notes of ``closedloop.sdk.observer.benchmark`` and ``docs/observer.md``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from closedloop.common.jsonout import write_json

from .simulate import SimResult

if TYPE_CHECKING:
    from .benchmark import ObserverBenchConfig

NONLINEAR_PLANTS = ("flexible-joint", "van-der-pol", "cartpole")
NEURAL, STAGE1, LINEAR_PART = "neural", "neural-stage1", "luenberger"

# --- targets and report -------------------------------------------------------------------------------
def targets(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The benchmark's targets, each with what was measured and whether it was met."""
    res, baselines = record["results"], record["config"]["baselines"]
    out = [{"target": "every plant gets a certified observer",
            "measured": ", ".join(f"{p} {'yes' if r['certificate']['certified'] else 'NO'}" for p, r in res.items()),
            "met": all(r["certificate"]["certified"] for r in res.values())}]
    for p in (p for p in NONLINEAR_PLANTS if p in res):
        mc = res[p]["monte_carlo"]
        best = min(baselines, key=lambda b: mc[b]["state_rmse"]["mean"])
        ours, theirs = mc[NEURAL]["state_rmse"]["mean"], mc[best]["state_rmse"]["mean"]
        out.append({"target": f"{p}: neural state RMSE below the best classical baseline",
                    "measured": f"{ours:.4g} vs {best} {theirs:.4g} ({ours / theirs:.3g}x; "
                                f"vs luenberger {ours / mc[LINEAR_PART]['state_rmse']['mean']:.3g}x)",
                    "met": ours < theirs, "ratio": ours / theirs, "best_baseline": best})
    d = record.get("training_time") or {}
    if "speedup" in d:
        bound = ">= " if d["speedup_is_lower_bound"] else ""
        out.append({"target": "two-stage reaches a certificate >= 5x faster than direct (same network)",
                    "measured": f"{bound}{d['speedup']:.1f}x ({d['plant']}: {d['two_stage_s']:.1f} s vs "
                                f"{d['direct_s']:.1f} s{' (capped)' if d['direct_capped'] else ''})",
                    "met": d["speedup"] >= 5.0})
    rt = {p: r["runtime"] for p, r in res.items() if "runtime" in r}
    if rt:
        p99 = max(r["step_us"]["p99"] for r in rt.values())
        chk = max(r["check_ms"]["median"] for r in rt.values())
        out.append({"target": "observer step p99 < 50 us (runtime Numba step)",
                    "measured": f"worst plant p99 {p99:.2f} us", "met": p99 < 50.0})
        out.append({"target": "load-time certificate check < 10 ms",
                    "measured": f"worst plant median {chk:.2f} ms (max {max(r['check_ms']['max'] for r in rt.values()):.2f})",
                    "met": chk < 10.0})
    return out


def _f(x: Any, fmt: str = ".3g") -> str:
    return "-" if x is None else ("inf" if isinstance(x, float) and math.isinf(x) else format(x, fmt))


def markdown(record: dict[str, Any]) -> str:
    """``observer.md``: targets, certificates, Monte Carlo per plant, training time, runtime."""
    cfg, res = record["config"], record["results"]
    methods = [NEURAL, STAGE1, *cfg["baselines"]]
    lines = ["## Certified neural observer benchmark", "",
             f"{len(res)} plants, network {tuple(cfg['train']['hidden'])} tanh, {cfg['train']['stage1_steps']} stage-1 "
             f"steps; {cfg['mc_runs']} Monte Carlo runs of {cfg['duration_s']:g} s per plant with measurement noise "
             f"and a disturbance; wall time {record['wall_s'] / 60:.1f} min on {record['machine']['cpus']} shared "
             f"cores. Method and definitions: `docs/observer.md`, `sdk/observer/benchmark.py`.", "",
             "### Targets", "", "| target | measured | met |", "| --- | --- | --- |"]
    lines += [f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else 'NO'} |" for t in record["targets"]]
    lines += ["", "### Certificates", "",
              "rho: certified decay per step (V(e+) <= rho^2 V(e), globally), rate -ln(rho)/dt; local: the LMI with the "
              "sector [tanh(1), 1] in the largest level set where |v| <= 1 (radius of the largest ball, fraction of "
              "the error box); coverage: N samples of the box, violations, P(violation) <= eps with confidence "
              "1 - beta; times: bisection (all solves), one full-form and one cheap-form (P fixed) solve.", "",
              "| plant | slack | rho | 1/s | max eig | local rho / radius / box frac | coverage N, viol (eps, beta) "
              "| sampled rho | bisection s | full s | cheap s | train s |", "| --- " * 12 + "|"]
    for p, r in res.items():
        c, tr = r["certificate"], r["training"]
        chosen = next(t for t in tr["trials"] if t["rho_slack"] == tr["selected"])
        if not c["certified"]:
            lines.append(f"| {p} | {tr['selected']} | NOT CERTIFIED | | {_f(c['max_eig'])} |" + " |" * 7)
            continue
        lo, cov = c["local"], c["coverage"]
        loc = (f"{lo['rho']:.6f} / {lo['radius']:.3g} / {lo['box_fraction']:.3g}" + (" (cap)" if lo["level_at_search_cap"] else "")
               if lo["feasible"] else "none")
        lines.append(f"| {p} | {tr['selected']} | {c['rho']:.6f}{'' if c['form'] == 'full' else ' (cheap)'} | {c['decay_rate_per_s']:.3g} | {c['max_eig']:.3g} | "
                     f"{loc} | {cov['n_samples']}, {cov['violations']} ({cov['eps']:g}, {cov['beta']:g}) | "
                     f"{cov['sampled_rho']:.6f} | {c['bisection_s']:.1f} ({c['bisection_solves']}) | "
                     f"{c['full_solve_s']:.2f} | {c['cheap_solve_s']:.2f} | {chosen['train_s']:.1f} |")
    lines += ["", "Slack sweep (final training loss: relative MSE vs N = 0 on model rollouts; training data only):", "",
              "| plant | " + " | ".join(f"slack {s}" for s in cfg["slacks"]) + " |", "| --- " * (1 + len(cfg["slacks"])) + "|"]
    for p, r in res.items():
        lines.append(f"| {p} | " + " | ".join(f"{t['train_loss']:.3f} (stage 1 {t['train_loss_stage1']:.3f})"
                                              + ("" if t["certified"] else " uncert.") for t in r["training"]["trials"]) + " |")
    lines += ["", "### Monte Carlo", "",
              f"Mean ± std over runs. State RMSE in plant units (norm over states), scaled: per error-box half-width; "
              f"after {cfg['steady_from_s']:g} s: the state RMSE of samples from then on (the transient from the "
              "initial error left out: noise and disturbance tracking); "
              f"settling: median time into {cfg['settle_fraction']:.0%} of the initial error norm (n never settled); "
              "peak: max |e / box| over initial; noise amplification: run 0 vs its noise-free twin (<1 filters); "
              f"cost: Python update, median p50 / p99. `{STAGE1}`: the stage-1 network, not certified (what the "
              "certificate costs); `luenberger`: the neural observer with N = 0.", ""]
    for p, r in res.items():
        mc = r["monte_carlo"]
        lines += [f"**{p}**", "", f"| method | state RMSE | scaled | after {cfg['steady_from_s']:g} s | dist RMSE | "
                  "settling s (never) | peak |e/box| | peak ratio | noise amp | cost us |", "| --- " * 10 + "|"]
        for m in methods:
            s = mc[m]
            lines.append(f"| {m} | {_f(s['state_rmse']['mean'])} ± {_f(s['state_rmse']['std'], '.2g')} | "
                         f"{_f(s['state_rmse_scaled']['mean'])} | {_f(s['state_rmse_steady']['mean'])} | "
                         f"{_f(s['disturbance_rmse']['mean'])} | "
                         f"{_f(s['settling_time_s']['median'])} ({s['settling_time_s']['n_inf']}) | "
                         f"{_f(s['peak_error']['mean'])} | {_f(s['peak_ratio']['mean'])} | {_f(s['noise_amplification'])} | "
                         f"{s['cost_us']['p50']:.1f} / {s['cost_us']['p99']:.1f} |")
        lines.append("")
    d = record.get("training_time") or {}
    lines += ["### Training time to a certificate (same network and settings)", ""]
    if "speedup" in d:
        lines += [f"{d['plant']}, hidden {tuple(d['hidden'])}, {d['stage1_steps']} steps, slack {d['rho_slack']}: "
                  f"two-stage {d['two_stage_s']:.1f} s ({d['two_stage_times']['stage2_sdp_solves']:.0f} stage-2 SDPs, certified "
                  f"{d['two_stage_certified']}); direct {d['direct_s']:.1f} s "
                  + (f"(capped at {d['cap_s']:.0f} s without a certificate)" if d["direct_capped"] else
                     f"({_f(d['direct_sdp_solves'], '.0f')} SDPs, certified {d['direct_certified']})")
                  + f": {'>= ' if d['speedup_is_lower_bound'] else ''}{d['speedup']:.1f}x.", ""]
    else:
        lines += [f"not measured: {d}", ""]
    lines += ["### Runtime (exported bundle, `observer` family)", "",
              "| plant | step p50 us | step p99 us | step max us | check median ms | check max ms | load_bundle ms |",
              "| --- " * 7 + "|"]
    for p, r in res.items():
        if "runtime" in r:
            rt = r["runtime"]
            lines.append(f"| {p} | {rt['step_us']['p50']:.2f} | {rt['step_us']['p99']:.2f} | {rt['step_us']['max']:.1f} | "
                         f"{rt['check_ms']['median']:.2f} | {rt['check_ms']['max']:.2f} | {rt['load_bundle_ms']:.1f} |")
    return "\n".join(lines) + "\n"


def _plots(record: dict[str, Any], traces: dict[str, dict[str, np.ndarray]], runs0: dict[str, dict[str, SimResult]],
           cfg: ObserverBenchConfig, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    plant = cfg.estimate_plant if cfg.estimate_plant in runs0 else next(iter(runs0))
    runs, box = runs0[plant], np.asarray(record["results"][plant]["system"]["error_box"])
    best = next((t["best_baseline"] for t in record["targets"] if t.get("best_baseline") and plant in t["target"]), "ekf")
    shown = [m for m in (NEURAL, LINEAR_PART, best) if m in runs]
    n = runs[NEURAL].z.shape[1]
    fig, axes = plt.subplots(n, 1, figsize=(8, 2.2 * n), sharex=True)
    for i, ax in enumerate(np.atleast_1d(axes)):
        for k, m in enumerate(shown):  # each observer closes its own loop: its own truth, dashed
            ax.plot(runs[m].t, runs[m].z[:, i], f"C{k}--", lw=1.0, alpha=0.8, label=f"truth ({m} loop)")
            ax.plot(runs[m].t, runs[m].z_hat[:, i], f"C{k}", lw=1.3, label=f"{m} estimate")
        true_i = np.concatenate([runs[m].z[:, i] for m in shown])
        ax.set_ylim(true_i.min() - box[i], true_i.max() + box[i])
        ax.set_ylabel("d" if i >= runs[NEURAL].n_x else f"x{i + 1}")
    np.atleast_1d(axes)[0].legend(fontsize=7, ncol=3)
    np.atleast_1d(axes)[-1].set_xlabel("t (s)")
    fig.suptitle(f"{plant}: estimate vs truth, Monte Carlo run 0 (u = clip(-K z_hat) on each observer's estimate)")
    fig.tight_layout()
    paths.append(out / f"{cfg.stem}_estimates.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    cols = min(4, len(traces))
    rows = math.ceil(len(traces) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, (p, tr) in zip(axes.flat, traces.items(), strict=False):
        t = np.arange(len(next(iter(tr.values())))) * record["results"][p]["system"]["dt"]
        for k, (m, v) in enumerate(tr.items()):
            ax.semilogy(t, np.where(np.isfinite(v), v, np.nan), f"C{k}", lw=1.0, label=m)
        ax.set_title(p, fontsize=9)
        ax.set_xlabel("t (s)")
    for ax in list(axes.flat)[len(traces):]:
        ax.axis("off")
    axes[0, 0].set_ylabel("median |e / error box|")
    axes[0, 0].legend(fontsize=6)
    fig.suptitle(f"Estimation error norm over time, median of {cfg.mc_runs} Monte Carlo runs")
    fig.tight_layout()
    paths.append(out / f"{cfg.stem}_errors.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def write_results(record: dict[str, Any], traces: dict[str, dict[str, np.ndarray]],
                  runs0: dict[str, dict[str, SimResult]], cfg: ObserverBenchConfig, report: Any = print) -> list[Path]:
    """Write JSON, markdown and the two plots; print the targets and the Monte Carlo table."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{cfg.stem}.json", out / f"{cfg.stem}.md"]
    write_json(paths[0], _jsonable(record))
    text = markdown(record)
    paths[1].write_text(text)
    paths += _plots(record, traces, runs0, cfg, out)
    report(text)
    report(f"wall time {record['wall_s'] / 60:.1f} min; wrote " + ", ".join(str(p) for p in paths))
    return paths
