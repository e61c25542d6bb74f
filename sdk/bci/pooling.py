"""Pool several runs of the iBCI benchmark, so that training noise enters the comparison.

Each benchmark run (``bench/bench_bci.py``) reports a paired bootstrap over evaluation
sentences: it holds the trained models fixed, so it says nothing about how much another
training seed would move a method. Here every trained model of every run is one draw
(a run x seed), scored by its held-out beam WER (FALCON's per-session mean). The pool gives
each method's mean over draws and the two-stage method's ratio to every baseline, with a 95%
interval from a *cluster* bootstrap over seed numbers: runs of the same seed share its
initialisation, batch order and augmentation draws (they differ by float rounding in
other code versions), so a seed number is resampled with all its runs. The evaluation
sentences are the same in every run, so their sampling noise is not in this interval (the
per-run sentence bootstrap covers that).

Runs are pooled only if they are the same benchmark: the same recording (data
configuration), drift ablation and methods; other differences of the harness configuration
between runs are listed. A pool is a compact JSON file (per-model numbers, each run's key
facts and its harness differences, never the runs' full results): ``run_record`` turns one
benchmark result into a pool entry, ``add_run`` checks and appends it, ``summarise``
computes the statistics, ``markdown`` and ``plot`` report them.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np

METHOD = "two_stage"
POOL_FORMAT = 1


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _seed_label(seeds: list[int]) -> str:
    if len(seeds) > 1 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}-{seeds[-1]}"
    return ", ".join(str(s) for s in seeds)


def run_record(doc: dict, label: str, source: dict | None = None) -> tuple[dict, dict, dict, list[dict]]:
    """One ``bench_bci.py`` result as a pool entry: (benchmark key, flat harness settings, run facts, draws)."""
    bench = doc.get("benchmark")
    if bench is None or not doc.get("runs"):
        raise ValueError(f"{label} has no 'benchmark' record or no runs: not a bench/bench_bci.py result")
    key = {"data_config": bench["data_config"], "ablate": bench["bench_config"].get("ablate", ""),
           "methods": list(doc["runs"][0]["methods"])}
    harness = _flat(bench["bench_config"]["harness"])
    draws = [{"run": label, "seed": run["seed"],
              "wer": {m: v["mean"]["beam"]["WER"] for m, v in run["methods"].items()}} for run in doc["runs"]]
    seeds = [run["seed"] for run in doc["runs"]]
    paired = (doc.get("summary") or {}).get("paired", {}).get("session_layers")
    facts = {"label": label, "seeds": seeds, "wall_s": bench.get("wall_s"),
             "bins_per_s": (bench.get("estimate") or {}).get("bins_per_s"), "machine": bench.get("machine"),
             "vs_session_layers": ({k: paired[k] for k in ("ratio", "ratio_95", "p_better")} if paired else None),
             "source": source}
    facts["fingerprint"] = fingerprint(draws, bench.get("wall_s"))
    return key, harness, facts, draws


def fingerprint(draws: list[dict], wall_s: float | None) -> str:
    """What identifies a run whatever its label: its seeds' WERs and its wall time."""
    text = json.dumps([[[d["seed"], d["wer"]] for d in draws], wall_s], sort_keys=True, default=float)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _same(a: dict, b: dict) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def empty_pool() -> dict:
    return {"format": POOL_FORMAT, "benchmark": None, "reference_harness": None, "runs": [], "draws": []}


def add_run(pool: dict, doc: dict, label: str | None = None, source: dict | None = None) -> dict:
    """Append one ``bench_bci.py`` result to ``pool`` (in place); refuses another benchmark or a run already in it."""
    label = label or f"run {len(pool['runs']) + 1} (seeds {_seed_label([r['seed'] for r in doc.get('runs', [])])})"
    key, harness, facts, draws = run_record(doc, label, source)
    if any(r["label"] == label for r in pool["runs"]):
        raise ValueError(f"the pool already has a run labelled {label!r}")
    if any(r["fingerprint"] == facts["fingerprint"] for r in pool["runs"]):
        raise ValueError(f"{label} is already in the pool (the same per-model numbers and wall time)")
    if pool["benchmark"] is None:
        pool["benchmark"], pool["reference_harness"] = key, harness
    elif not _same(key, pool["benchmark"]):
        first = pool["runs"][0]["label"]
        raise ValueError(f"{label} is not the same benchmark as {first} (another recording, drift ablation "
                         "or method list): pool only runs of one benchmark")
    ref = pool["reference_harness"]
    facts["harness_differences"] = {k: [ref.get(k), harness.get(k)] for k in sorted(set(harness) | set(ref))
                                    if harness.get(k) != ref.get(k)}
    pool["runs"].append(facts)
    pool["draws"].extend(draws)
    return pool


def cluster_bootstrap_ratio(draws: list[dict], a: str, b: str, n_boot: int = 10000, seed: int = 0) -> dict:
    """Pooled mean WER of ``a`` over ``b``'s, resampling seed numbers (each with all its runs)."""
    seeds = sorted({d["seed"] for d in draws})
    by_seed = {s: [d for d in draws if d["seed"] == s] for s in seeds}
    sums = np.array([[sum(d["wer"][a] for d in by_seed[s]), sum(d["wer"][b] for d in by_seed[s])] for s in seeds])
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(seeds), size=(n_boot, len(seeds)))
    tot = sums[picks].sum(1)  # (n_boot, 2): resampled totals (equal draws per seed number keep means proportional)
    ratios = tot[:, 0] / np.maximum(tot[:, 1], 1e-12)
    ratio = sums[:, 0].sum() / sums[:, 1].sum()
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return {"ratio": float(ratio), "ci95": [float(lo), float(hi)], "p_better": float(np.mean(ratios < 1.0)),
            "n_seed_numbers": len(seeds), "n_draws": len(draws)}


def summarise(pool: dict) -> dict:
    """``pool`` with its statistics: per-method mean and std over draws, two-stage against each baseline."""
    draws = pool["draws"]
    methods = list(draws[0]["wer"])
    pool["mean"] = {m: float(np.mean([d["wer"][m] for d in draws])) for m in methods}
    pool["std"] = {m: float(np.std([d["wer"][m] for d in draws], ddof=1)) if len(draws) > 1 else 0.0
                   for m in methods}
    pool["versus"] = {b: cluster_bootstrap_ratio(draws, METHOD, b) for b in methods if b != METHOD}
    first = pool["runs"][0]["label"]
    pool["config_differences"] = [
        f"{r['label']} differs from {first} in " + ", ".join(f"{k} ({a!r} -> {b!r})"
                                                             for k, (a, b) in r["harness_differences"].items())
        for r in pool["runs"] if r["harness_differences"]]
    return pool


def markdown(pool: dict) -> str:
    draws, methods = pool["draws"], list(pool["mean"])
    seeds = sorted({d["seed"] for d in draws})
    lines = [f"Pooled over {len(draws)} trained models ({len(pool['runs'])} runs of `python bench/bench_bci.py`; "
             f"seed numbers {_seed_label(seeds)}). Held-out beam WER (%), mean over sessions per model, then "
             "mean ± std over models.", "",
             "| method | WER | per model |", "| --- | --- | --- |"]
    for m in methods:
        per = " ".join(f"{100 * d['wer'][m]:.2f}" for d in draws)
        lines.append(f"| {m} | {100 * pool['mean'][m]:.2f} ± {100 * pool['std'][m]:.2f} | {per} |")
    lines += ["", f"{METHOD} against each baseline: ratio of pooled mean WERs; 95% interval and P(better) from "
              f"10,000 cluster-bootstrap resamples of the {len(seeds)} seed numbers (training noise; the evaluation "
              "sentences are fixed). With this few seed numbers the interval is rough: it can only reflect the "
              "spread between them.", "", "| against | ratio | 95% | P(better) |", "| --- | --- | --- | --- |"]
    for b, r in pool["versus"].items():
        lines.append(f"| {b} | {r['ratio']:.2f} | [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}] | {r['p_better']:.2f} |")
    lines += ["", "The pooled runs: held-out beam WER (%), mean over the run's seeds; the run's own ratio against "
              "session layers with its paired bootstrap over evaluation sentences; wall time and the estimate's "
              "training throughput (bins/s per worker) on the machine the run records.", "",
              "| run | seeds | " + " | ".join(methods) + " | two-stage / session layers [95%] | wall (min) | bins/s "
              "| machine |", "| --- | --- |" + " --- |" * len(methods) + " --- | --- | --- | --- |"]
    for r in pool["runs"]:
        mine = [d for d in draws if d["run"] == r["label"]]
        cells = " | ".join(f"{100 * np.mean([d['wer'][m] for d in mine]):.2f}" for m in methods)
        vs = r.get("vs_session_layers")
        vs_cell = f"{vs['ratio']:.2f}x [{vs['ratio_95'][0]:.2f}, {vs['ratio_95'][1]:.2f}]" if vs else "-"
        mach = r.get("machine") or {}
        mach_cell = ", ".join(part for part in (f"{mach['cpus']} CPUs" if "cpus" in mach else "",
                                                str(mach.get("platform", "")).split("-with-")[0],
                                                f"torch {mach['torch']}" if "torch" in mach else "") if part) or "-"
        wall = f"{r['wall_s'] / 60:.1f}" if r.get("wall_s") else "-"
        bins = f"{r['bins_per_s'] / 1e3:.1f}k" if r.get("bins_per_s") else "-"
        lines.append(f"| {r['label']} | {_seed_label(r['seeds'])} | {cells} | {vs_cell} | {wall} | {bins} | "
                     f"{mach_cell} |")
    if pool["config_differences"]:
        lines += ["", "Harness settings that differ between the pooled runs:", ""]
        lines += [f"- {n}" for n in pool["config_differences"]]
    return "\n".join(lines) + "\n"


def plot(pool: dict) -> bytes:
    """Every trained model of every pooled run per method, with the pooled mean: a PNG's bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    draws, methods = pool["draws"], list(pool["mean"])
    runs = [r["label"] for r in pool["runs"]]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for i, m in enumerate(methods):
        for j, run in enumerate(runs):
            ys = [100 * d["wer"][m] for d in draws if d["run"] == run]
            ax.scatter(np.full(len(ys), i + (j - (len(runs) - 1) / 2) * 0.08), ys, s=14,
                       label=run if i == 0 else None)
        ax.hlines(100 * pool["mean"][m], i - 0.38, i + 0.38, color="k")
    ax.set_xticks(range(len(methods)), methods)
    ax.set_ylabel("held-out beam WER (%)")
    ax.set_title("every trained model of every pooled run (line: pooled mean)", fontsize=9)
    ax.legend(fontsize=6)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, dpi=120, format="png")
    plt.close(fig)
    return png.getvalue()


def load_pool(path: Path) -> dict:
    pool = json.loads(Path(path).read_text())
    if pool.get("format") != POOL_FORMAT or "runs" not in pool:
        raise ValueError(f"{path} is not a pool file (format {POOL_FORMAT}) of bench/pool_bci_runs.py")
    return pool
