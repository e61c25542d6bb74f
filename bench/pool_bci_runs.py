"""Pool several runs of the iBCI benchmark, so that training noise enters the comparison.

    python bench/pool_bci_runs.py        # the default benchmark's runs; writes bench/results/bci_pooled.{json,md,png}
    python bench/pool_bci_runs.py --runs bench/results/bci.json bench/results/bci_seeds345.json

Each benchmark run (``bench/bench_bci.py``) reports a paired bootstrap over evaluation
sentences: it holds the trained models fixed, so it says nothing about how much another
training seed would move a method. Here every trained model of every run is one draw
(a run x seed), scored by its held-out beam WER (FALCON's per-session mean). The table gives
each method's mean over draws and the two-stage method's ratio to every baseline, with a 95%
interval from a *cluster* bootstrap over seed numbers: runs of the same seed share its
initialisation, batch order and augmentation draws (they differ by float rounding in
other code versions), so a seed number is resampled with all its runs. The evaluation
sentences are the same in every run, so their sampling noise is not in this interval (the
per-run sentence bootstrap covers that).

Runs are pooled only if they are the same benchmark: the same recording (data
configuration) and methods; other differences of the harness configuration between runs
are listed in the output.
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import numpy as np

from closedloop.runtime.atomic import atomic_write_bytes, atomic_write_text

DEFAULT_RUNS = ("bci.json", "bci_rerun_session9.json", "bci_session11.json", "bci_seeds345.json", "bci_seeds678.json",
                "bci_seeds91011.json", "bci_compiled.json", "bci_seeds121314.json",
                "bci_seeds151617.json")
METHOD = "two_stage"


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def load_runs(paths: list[Path]) -> tuple[list[dict], list[str]]:
    """Draws (one per run x seed) and the harness settings that differ between runs."""
    draws, first, notes = [], None, []
    for path in paths:
        doc = json.loads(path.read_text())
        bench = doc.get("benchmark")
        if bench is None:
            raise ValueError(f"{path} has no 'benchmark' record: not a bench/bench_bci.py result")
        key = (json.dumps(bench["data_config"], sort_keys=True), bench["bench_config"].get("ablate", ""),
               tuple(doc["runs"][0]["methods"]))
        harness = _flat(bench["bench_config"]["harness"])
        if first is None:
            first = (key, harness, path)
        elif key != first[0]:
            raise ValueError(f"{path} is not the same benchmark as {first[2]} (another recording, drift ablation "
                             "or method list): pool only runs of one benchmark")
        else:
            diff = sorted(k for k in set(harness) | set(first[1]) if harness.get(k) != first[1].get(k))
            if diff:
                notes.append(f"{path.name} differs from {first[2].name} in " + ", ".join(
                    f"{k} ({first[1].get(k)!r} -> {harness.get(k)!r})" for k in diff))
        for run in doc["runs"]:
            draws.append({"run": path.stem, "seed": run["seed"],
                          "wer": {m: v["mean"]["beam"]["WER"] for m, v in run["methods"].items()}})
    return draws, notes


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+", help=f"result JSONs (default: {', '.join(DEFAULT_RUNS)} in --dir)")
    ap.add_argument("--dir", default="bench/results")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--stem", default="bci_pooled")
    a = ap.parse_args()
    paths = [Path(p) for p in a.runs] if a.runs else [Path(a.dir) / p for p in DEFAULT_RUNS]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise SystemExit(f"no such result file(s): {missing}; run bench/bench_bci.py or pass --runs")
    draws, notes = load_runs(paths)
    methods = list(draws[0]["wer"])
    mean = {m: float(np.mean([d["wer"][m] for d in draws])) for m in methods}
    std = {m: float(np.std([d["wer"][m] for d in draws], ddof=1)) if len(draws) > 1 else 0.0 for m in methods}
    versus = {b: cluster_bootstrap_ratio(draws, METHOD, b) for b in methods if b != METHOD}

    lines = [f"Pooled over {len(draws)} trained models ({len(paths)} runs: "
             + ", ".join(p.name for p in paths) + f"; seed numbers {sorted({d['seed'] for d in draws})}). "
             "Held-out beam WER (%), mean over sessions per model, then mean ± std over models.", "",
             "| method | WER | per model |", "| --- | --- | --- |"]
    for m in methods:
        per = " ".join(f"{100 * d['wer'][m]:.2f}" for d in draws)
        lines.append(f"| {m} | {100 * mean[m]:.2f} ± {100 * std[m]:.2f} | {per} |")
    lines += ["", f"{METHOD} against each baseline: ratio of pooled mean WERs; 95% interval and P(better) from "
              f"10,000 cluster-bootstrap resamples of the {len({d['seed'] for d in draws})} seed numbers (training "
              "noise; the evaluation sentences are fixed). With this few seed numbers the interval is rough: "
              "it can only reflect the spread between them.", "", "| against | ratio | 95% | P(better) |", "| --- | --- | --- | --- |"]
    for b, r in versus.items():
        lines.append(f"| {b} | {r['ratio']:.2f} | [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}] | {r['p_better']:.2f} |")
    if notes:
        lines += ["", "Harness settings that differ between the pooled runs:", ""] + [f"- {n}" for n in notes]
    table = "\n".join(lines)
    print(table)
    out = Path(a.out)
    doc = {"command": "python bench/pool_bci_runs.py" + (" --runs " + " ".join(a.runs) if a.runs else ""),
           "runs": [str(p) for p in paths], "draws": draws, "mean": mean, "std": std, "versus": versus,
           "config_differences": notes}
    atomic_write_text(out / f"{a.stem}.json", json.dumps(doc, indent=2))
    atomic_write_text(out / f"{a.stem}.md", table + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    runs = sorted({d["run"] for d in draws}, key=[p.stem for p in paths].index)
    for i, m in enumerate(methods):
        for j, run in enumerate(runs):
            ys = [100 * d["wer"][m] for d in draws if d["run"] == run]
            ax.scatter(np.full(len(ys), i + (j - (len(runs) - 1) / 2) * 0.12), ys, s=14, label=run if i == 0 else None)
        ax.hlines(100 * mean[m], i - 0.3, i + 0.3, color="k")
    ax.set_xticks(range(len(methods)), methods)
    ax.set_ylabel("held-out beam WER (%)")
    ax.set_title("every trained model of every pooled run (line: pooled mean)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, dpi=120, format="png")
    atomic_write_bytes(out / f"{a.stem}.png", png.getvalue())
    print(f"wrote {out / (a.stem + '.json')}, .md and .png")


if __name__ == "__main__":
    main()
