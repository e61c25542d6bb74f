"""The bit-flip benchmark's report: the Markdown table, the targets and one plot per family."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _median(rows, n, key):
    return float(np.median([r[key] for r in rows if r["flips"] == n]))


def plots(results: dict, out: Path, stem: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for fam in [f for f in results if isinstance(results[f], dict) and "random" in results[f]]:
        rec, metric = results[fam], results[fam]["metric"]
        panels = list(rec["random"].items()) + ([("targeted", None)] if "targeted" in rec else [])
        fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
        for ax, (prec, conds) in zip(axes[0], panels, strict=True):
            if conds is None:
                for attack, r in rec["targeted"].items():
                    for cond in ("unprotected", "noscrub", "scrub"):
                        if cond in r:
                            ax.plot([x["flips"] for x in r[cond]], [x[metric] for x in r[cond]], "o-",
                                    label=f"{attack} [{cond}]")
                ax.set_xlabel("targeted bit flips (int8 weights)")
                ax.set_title(f"{fam}: targeted flips")
                ax.legend(fontsize=6)
            else:
                for cond, c in conds.items():
                    ns = sorted({x["flips"] for x in c["runs"]})
                    ax.plot(ns, [_median(c["runs"], n, metric) for n in ns], "o-", label=cond)
                ax.set_xscale("log")
                ax.set_xlabel("random bit flips")
                ax.set_title(f"{fam}: {prec} weights, random flips")
                ax.legend()
            ax.set_ylabel(f"{metric} (median over seeds)")
            if metric == "state_rmse":
                ax.set_yscale("log")
        fig.tight_layout()
        p = out / f"{stem}_{fam}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(str(p))
    return paths


def markdown(results: dict) -> str:
    lines = ["# Bit flips in deployed weights", "", "Written by `python bench/bench_bitflip.py`.", ""]
    for fam in [f for f in results if isinstance(results[f], dict) and "random" in results[f]]:
        rec, metric = results[fam], results[fam]["metric"]
        pr = rec["protection"]
        lines += [f"## {fam} ({metric})", "",
                  f"Protected {pr['protected_weights']} of {pr['all_weights']} weights ({pr['protected_fraction']:.1%}), "
                  f"k={pr['k']}, keyed={pr['keyed']}; not protected: {', '.join(pr['skipped']) or 'none'}.", "",
                  "| model | " + " | ".join(f"{p} {metric}" for p in rec["random"]) + " |",
                  "| --- |" + " --- |" * len(rec["random"])]
        for name, cond in (("unprotected", "unprotected"), ("protected", "protected_noscrub")):
            lines.append(f"| {name} | " + " | ".join(f"{rec['random'][p][cond]['clean'][metric]:.4f}"
                                                     for p in rec["random"]) + " |")
        extra = rec.get("extra", "WER")  # mean over seeds, in brackets
        lines += ["", f"Random flips, median {metric} over seeds (and mean {extra}); scrub events: repaired / "
                  "restored from the last-good copy / unrepairable, summed over seeds (protected_scrub)."
                  + (" scrub_protected_flips_only: scrubbed, the flips drawn only over the protected tensors."
                     if any("scrub_protected_flips_only" in c for c in rec["random"].values()) else ""), ""]
        if "clean_cost" in rec:
            cc = rec["clean_cost"]
            lines += [f"Clean {metric} (torch) over fine-tuning seeds {cc['seeds']}: unconstrained "
                      + ", ".join(f"{v:.4f}" for v in cc["unprotected"]) + f" (mean {cc['unprotected_mean']:.4f}); "
                      "constrained " + ", ".join(f"{v:.4f}" for v in cc["protected"])
                      + f" (mean {cc['protected_mean']:.4f}); {cc['relative']:+.1%}.", ""]
        for prec, conds in rec["random"].items():
            ns = sorted({r["flips"] for r in conds["unprotected"]["runs"]})
            lines += [f"### {prec}", "", "| flips | " + " | ".join(conds) + " | scrub events |",
                      "| --- |" + " --- |" * (len(conds) + 1)]
            for n in ns:
                cells = []
                for c in conds.values():
                    ex = np.mean([r[extra] for r in c["runs"] if r["flips"] == n])
                    cells.append(f"{_median(c['runs'], n, metric):.4f} ({ex:.2f})")
                sr = [r for r in conds["protected_scrub"]["runs"] if r["flips"] == n]
                evs = " / ".join(str(sum(r[k] for r in sr)) for k in ("repaired", "restored", "unrepairable"))
                lines.append(f"| {n} | " + " | ".join(cells) + f" | {evs} |")
            lines.append("")
        if "targeted" in rec:
            lines += [f"### targeted flips (int8 weights; {metric})", ""]
            for attack, r in rec["targeted"].items():
                for cond in ("unprotected", "noscrub", "scrub"):
                    if cond in r:
                        lines.append(f"- {attack} [{cond}]: " + ", ".join(
                            f"{x['flips']}: {x[metric]:.3f}" + (f" (rep {x['repaired']}, rest {x['restored']})"
                                                               if "repaired" in x else "") for x in r[cond]))
            lines.append("")
    if "scrub_timing" in results:
        lines += ["## Full scrub time (one core, median)", ""]
        for name, rec in results["scrub_timing"].items():
            lines.append(f"- {name}: {rec['protected_weights']} of {rec['weights']} weights protected; " + ", ".join(
                f"{k}: {v['median_us']:.0f} us ({v['blocks']} blocks)" for k, v in rec.items() if isinstance(v, dict)))
    lines += ["", "## Targets", ""] + [f"- {t}" for t in results.get("targets", [])]
    return "\n".join(lines) + "\n"


def targets(results: dict) -> list[str]:
    out = []
    for fam in [f for f in results if isinstance(results[f], dict) and "random" in results[f]]:
        rec, metric = results[fam], results[fam]["metric"]
        sign = -1.0 if rec.get("higher_is_better") else 1.0  # worse = sign * (value - reference) > 0
        r = rec["random"]["fp32"]
        cu, cp = r["unprotected"]["clean"][metric], r["protected_noscrub"]["clean"][metric]
        rel = sign * (cp - cu) / max(abs(cu), 1e-9)
        out.append(f"{fam}: constrained clean {metric} within 2% (relative) of unconstrained: {cp:.4f} vs {cu:.4f} "
                   f"({rel:+.1%} worse) -> {'MET' if rel <= 0.02 else 'NOT MET'}")
        if len(rec.get("clean_cost", {}).get("seeds", [])) > 1:
            cc = rec["clean_cost"]
            out.append(f"{fam}: the same, mean over fine-tuning seeds {cc['seeds']} (torch): {cc['protected_mean']:.4f} "
                       f"vs {cc['unprotected_mean']:.4f} ({cc['relative']:+.1%}; per seed "
                       + ", ".join(f"{v:+.1%}" for v in cc["per_seed_relative"])
                       + f") -> {'MET' if cc['relative'] <= 0.02 else 'NOT MET'}")
        for prec, conds in rec["random"].items():
            if 100 not in {x["flips"] for x in conds["unprotected"]["runs"]}:
                continue
            c, cu = conds["protected_scrub"]["clean"][metric], conds["unprotected"]["clean"][metric]
            sc = _median(conds["protected_scrub"]["runs"], 100, metric)
            un = _median(conds["unprotected"]["runs"], 100, metric)
            ok = sign * (sc - c) <= 0.01 * abs(c) + 1e-12 and sign * (un - cu) > 0.01 * abs(cu)
            out.append(f"{fam} {prec}, 100 random flips: scrubbed {metric} {sc:.4f} (clean {c:.4f}), unprotected "
                       f"{un:.4f} (clean {cu:.4f}) -> {'MET' if ok else 'NOT MET'} (scrubbed within 1% of clean, "
                       "unprotected not)")
    if "scrub_timing" in results:
        t = [v for rec in results["scrub_timing"].values() for v in rec.values() if isinstance(v, dict)]
        worst = max(v["median_us"] for v in t)
        out.append(f"full scrub under 1 ms on one core: worst median {worst:.0f} us -> "
                   f"{'MET' if worst < 1000 else 'NOT MET'}")
    return out

