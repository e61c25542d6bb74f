"""Aggregate harness runs over seeds into the results table (markdown + JSON) and the WER-vs-days plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from closedloop.common.jsonout import write_json

from .decoding import DECODERS
from .metrics import edit_distance, to_words


def _ms(values: Sequence[float]) -> dict:
    v = np.asarray(values, dtype=np.float64)
    return {"mean": float(v.mean()), "std": float(v.std()), "values": v.tolist()}


def _agg_scores(blocks: Sequence[dict]) -> dict:
    """Mean/std over seeds of {decoder: {CER, WER}} blocks."""
    out = {}
    for dec in DECODERS:
        rows = [b[dec] for b in blocks if dec in b]
        if rows:
            out[dec] = {k: _ms([r[k] for r in rows]) for k in ("CER", "WER")}
    return out


def summarize(runs: Sequence[dict]) -> dict:
    """Combine :func:`closedloop.sdk.bci.evaluate.run_harness` outputs (one per seed) into one summary."""
    if not runs:
        raise ValueError("no runs to summarize")
    first = runs[0]
    out: dict = {"seeds": [r["seed"] for r in runs], "sessions": first["sessions"], "methods": {}}
    for m in first["methods"]:
        per = [r["methods"][m] for r in runs]
        out["methods"][m] = {
            "mean": _agg_scores([p["mean"] for p in per]),
            "sessions": {s: _agg_scores([p["sessions"][s] for p in per]) for s in first["sessions"]},
            "train_s": _ms([p["train_s"] for p in per]),
            "calibrate_s": _ms([p["calibrate_s"] for p in per]),
            "chosen": [p["chosen"] for p in per],
        }
    if all("reference" in r for r in runs):
        out["reference"] = {k: _agg_scores([r["reference"][k]["mean"] for r in runs])
                            for k in ("held_in", "held_out_zero_shot")}
        out["reference"]["published"] = first["reference"]["published"]
    if all("meta" in r for r in runs):
        out["meta"] = [r["meta"] for r in runs]
    texts = [sc.get("texts", {}) for r in runs for v in r["methods"].values() for sc in v["sessions"].values()]
    if "two_stage" in first["methods"] and texts and all(texts):
        dec = "beam" if all("beam" in t for t in texts) else "greedy"  # beam_width 0: greedy only
        out["paired"] = {b: paired_bootstrap(runs, "two_stage", b, dec) for b in first["methods"] if b != "two_stage"}
    return out


def _word_distances(predictions: Sequence[str], ref_words: Sequence[list[str]]) -> np.ndarray:
    """Per-trial word edit distances (FALCON's word split)."""
    return np.asarray([edit_distance(to_words(p), r) for p, r in zip(predictions, ref_words, strict=True)], float)


def _char_distances(predictions: Sequence[str], references: Sequence[str]) -> np.ndarray:
    """Per-trial character edit distances."""
    return np.asarray([edit_distance(p, r) for p, r in zip(predictions, references, strict=True)], float)


def paired_bootstrap(runs: Sequence[dict], method: str, against: str, decoder: str = "beam", n_boot: int = 2000,
                     seed: int = 0, metric: str = "WER") -> dict:
    """``method``'s mean held-out WER (or CER: ``metric="CER"``) against ``against``'s: difference and ratio with
    95% bootstrap intervals.

    The figure is the benchmark's (WER per session, mean over sessions, mean over seeds).
    In each replicate the evaluation trials of every seed and session are resampled with
    replacement, the same trials for both methods (paired), so the interval says how much
    the comparison could move with other evaluation sentences of the same sessions; the
    spread over model seeds is the separate ``± std`` of the tables. ``p_better`` is the
    fraction of replicates in which ``method`` has the lower WER.
    """
    if metric not in ("WER", "CER"):
        raise ValueError(f"metric {metric!r}: expected 'WER' or 'CER'")
    rng = np.random.default_rng(seed)
    wa, wb = np.zeros(n_boot), np.zeros(n_boot)
    point_a = point_b = 0.0
    k = 0
    for r in runs:
        sess_a, sess_b = r["methods"][method]["sessions"], r["methods"][against]["sessions"]
        for name in sess_a:
            refs = sess_a[name]["texts"]["reference"]
            if metric == "WER":
                ref_units: Sequence = [to_words(t) for t in refs]
                distances = _word_distances
            else:
                ref_units, distances = refs, _char_distances
            n = np.asarray([len(w) for w in ref_units], float)
            da = distances(sess_a[name]["texts"][decoder], ref_units)
            db = distances(sess_b[name]["texts"][decoder], ref_units)
            idx = rng.integers(0, len(n), (n_boot, len(n)))
            words = n[idx].sum(1)
            wa += da[idx].sum(1) / words
            wb += db[idx].sum(1) / words
            point_a += da.sum() / n.sum()
            point_b += db.sum() / n.sum()
            k += 1
    wa, wb, point_a, point_b = wa / k, wb / k, point_a / k, point_b / k
    ratio = np.divide(wa, wb, out=np.full(n_boot, np.inf), where=wb > 0)
    key = metric.lower()
    return {"method": method, "against": against, "decoder": decoder, "metric": metric, "n_boot": n_boot,
            key: point_a, f"{key}_against": point_b, "difference": point_a - point_b,
            "difference_95": [float(v) for v in np.percentile(wa - wb, [2.5, 97.5])],
            "ratio": point_a / point_b if point_b > 0 else float("inf"),
            "ratio_95": [float(v) for v in _percentiles(ratio)],
            "p_better": float(np.mean(wa < wb))}


def _percentiles(x: np.ndarray) -> np.ndarray:
    """2.5th and 97.5th percentiles of ratios that may be inf (a replicate over a zero error rate). With inf among
    them each bound is a replicate itself (no interpolation, which would make inf - inf a NaN): inf where the bound
    reaches those replicates (no finite bound: "inf" in tables, null in JSON)."""
    if np.isfinite(x).all():
        return np.percentile(x, [2.5, 97.5])
    return np.percentile(x, [2.5, 97.5], method="inverted_cdf")


def _pct(block: dict | None, key: str) -> str:
    if not block:
        return "-"
    return f"{100 * block[key]['mean']:.2f} ± {100 * block[key]['std']:.2f}"


def _decoder_cells(block: dict) -> str:
    """CER and WER of every decoder in table order ("-" where one was not run)."""
    return " | ".join(f"{_pct(block.get(dec), 'CER')} | {_pct(block.get(dec), 'WER')}" for dec in DECODERS)


def markdown_table(summary: dict, title: str = "iBCI handwriting: held-out sessions") -> str:
    """The results as markdown: mean table, per-session WER/CER table, and the drift reference."""
    seeds = summary["seeds"]
    lines = [f"## {title}", "",
             f"Mean over held-out sessions, then mean ± std over {len(seeds)} seed(s) {seeds}; percentages. "
             "Train s: held-in training time the method needs; calibrate s: all held-out sessions.", "",
             "Greedy + end: greedy with end-of-trial completion (the sentence-final mark greedy decoding leaves "
             "out; docs/bci.md).", "",
             "| method | CER greedy | WER greedy | CER greedy + end | WER greedy + end | CER beam | WER beam | train s "
             "| calibrate s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for m, v in summary["methods"].items():
        lines.append(f"| {m} | {_decoder_cells(v['mean'])} | {v['train_s']['mean']:.1f} | {v['calibrate_s']['mean']:.1f} |")
    sessions = summary["sessions"]
    for dec in DECODERS:
        if not any(dec in v["mean"] for v in summary["methods"].values()):
            continue
        for key in ("WER", "CER"):
            head = " | ".join(f"{s} (+{sessions[s]['days_since_last_held_in']:.0f} d)" for s in sessions)
            lines += ["", f"{key} per held-out session, {dec} decoding (mean ± std over seeds):", "",
                      f"| method | {head} |", "| --- |" + " --- |" * len(sessions)]
            for m, v in summary["methods"].items():
                cells = " | ".join(_pct(v["sessions"][s].get(dec), key) for s in sessions)
                lines.append(f"| {m} | {cells} |")
    ref = summary.get("reference")
    if ref:
        pub = ref["published"]
        lines += ["", "Drift reference (per-session input layers; held-out decoded zero-shot with the last held-in "
                  f"session's layer). Published FALCON H2: held-in CER {100 * pub['held_in_CER']:.2f}%, zero-shot "
                  f"held-out CER {100 * pub['held_out_zero_shot_CER'][0]:.0f}-{100 * pub['held_out_zero_shot_CER'][1]:.0f}%.",
                  "", "| | CER greedy | WER greedy | CER greedy + end | WER greedy + end | CER beam | WER beam |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for k in ("held_in", "held_out_zero_shot"):
            lines.append(f"| {k} | {_decoder_cells(ref[k])} |")
    lines += _paired_table(summary) + _chosen_steps_table(summary) + _meta_table(summary)
    return "\n".join(lines) + "\n"


def _paired_table(summary: dict) -> list[str]:
    """Two-stage against each baseline, with 95% intervals from resampling evaluation trials (paired)."""
    paired = summary.get("paired")
    if not paired:
        return []
    first = next(iter(paired.values()))
    lines = ["", f"Two-stage against each baseline, {first['decoder']} WER (mean over sessions and seeds), 95% "
             f"intervals from {first['n_boot']} paired bootstrap resamples of the evaluation trials (sentence "
             "sampling only; the seed spread is the ± std above). P(better): share of resamples in which two-stage "
             "has the lower WER.", "",
             "| against | two-stage WER | its WER | difference (points) | 95% | ratio | 95% | P(better) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for b, p in paired.items():
        lo, hi = p["difference_95"]
        rlo, rhi = p["ratio_95"]
        lines.append(f"| {b} | {100 * p['wer']:.2f} | {100 * p['wer_against']:.2f} | {100 * p['difference']:+.2f} | "
                     f"[{100 * lo:+.2f}, {100 * hi:+.2f}] | {p['ratio']:.2f} | [{rlo:.2f}, {rhi:.2f}] | "
                     f"{p['p_better']:.2f} |")
    return lines


def _chosen_steps_table(summary: dict) -> list[str]:
    """Calibration steps each adaptive method chose (over sessions and seeds): shows when the step budget binds."""
    rows = []
    for m, v in summary["methods"].items():
        steps = [c["steps"] for per_seed in v["chosen"] for c in per_seed.values() if "steps" in c]
        if steps:
            rows.append(f"| {m} | {min(steps)} | {float(np.median(steps)):.0f} | {max(steps)} | {len(steps)} |")
    if not rows:
        return []
    return ["", "Calibration steps chosen by cross-validation on the calibration sentences (all sessions and seeds):",
            "", "| method | min | median | max | fits |", "| --- | --- | --- | --- | --- |", *rows]


def _meta_table(summary: dict) -> list[str]:
    """What meta-learning changed, per seed: the initialisation's distance from identity and the step sizes."""
    metas = summary.get("meta")
    if not metas:
        return []
    lines = ["", "Meta-learned alignment per seed: distance of the initialisation from identity and the learned "
             "per-parameter step sizes (5% / 50% / 95% quantiles).", "",
             "| seed | init offset (Frobenius) | init offset (max entry) | weight step sizes | bias step sizes |",
             "| --- | --- | --- | --- | --- |"]
    for seed, m in zip(summary["seeds"], metas, strict=True):
        qw = " / ".join(f"{x:.3g}" for x in m["step_weight_quantiles"])
        qb = " / ".join(f"{x:.3g}" for x in m["step_bias_quantiles"])
        lines.append(f"| {seed} | {m['init_weight_offset_fro']:.3g} | {m['init_weight_offset_max']:.3g} | {qw} | {qb} |")
    return lines


def plot_wer_vs_days(summary: dict, path: str | Path) -> Path:
    """PNG: WER against days since the last held-in session, one line per method, one panel per decoder."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sessions = summary["sessions"]
    names = sorted(sessions, key=lambda s: sessions[s]["days_since_last_held_in"])
    days = [sessions[s]["days_since_last_held_in"] for s in names]
    decs = [d for d in DECODERS if any(d in v["mean"] for v in summary["methods"].values())]
    fig, axes = plt.subplots(1, len(decs), figsize=(5.5 * len(decs), 4), squeeze=False, sharey=True)
    for ax, dec in zip(axes[0], decs, strict=True):
        for m, v in summary["methods"].items():
            if dec not in v["mean"]:
                continue
            y = [100 * v["sessions"][s][dec]["WER"]["mean"] for s in names]
            e = [100 * v["sessions"][s][dec]["WER"]["std"] for s in names]
            ax.errorbar(days, y, yerr=e, marker="o", capsize=3, label=m)
        ax.set_xlabel("days since the last held-in session")
        ax.set_title(f"{dec} decoding")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("WER (%)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_results(summary: dict, runs: Sequence[dict], folder: str | Path, stem: str = "bci",
                  extra: dict | None = None) -> dict[str, Path]:
    """Write ``STEM.json`` (summary + runs without loss curves), ``STEM.md`` and ``STEM_wer_vs_days.png``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    slim = [{k: v for k, v in r.items() if k != "logs"} | {"loss_curves": _thin(r.get("logs", {}))} for r in runs]
    paths = {"json": folder / f"{stem}.json", "md": folder / f"{stem}.md", "png": folder / f"{stem}_wer_vs_days.png"}
    write_json(paths["json"], {"summary": summary, "runs": slim, **(extra or {})})
    paths["md"].write_text(markdown_table(summary))
    plot_wer_vs_days(summary, paths["png"])
    return paths


def _thin(logs: dict, points: int = 100) -> dict:
    """Loss curves subsampled to about ``points`` values each (the JSON stays small)."""
    out = {}
    for k, log in logs.items():
        loss = log.get("loss", [])
        step = max(1, len(loss) // points)
        out[k] = {"every": step, "loss": [float(np.mean(loss[i: i + step])) for i in range(0, len(loss), step)],
                  "wall_s": log.get("wall_s", 0.0)}
        if "restarts" in log:  # stage-1 style runs: which seed was kept, which runs were abandoned on the plateau
            out[k] |= {"seed": log["seed"], "restarted_seeds": [r["seed"] for r in log["restarts"]],
                       "on_plateau": log["on_plateau"]}
    return out
