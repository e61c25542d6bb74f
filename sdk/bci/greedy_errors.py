"""Where the handwriting decoders' greedy CTC errors come from, per character, from a benchmark's results.

No training: it reads the decoded text of every evaluation trial that the iBCI benchmark keeps
(``runs[*].methods[*].sessions[*].texts`` and the drift reference's ``held_in`` /
``held_out_zero_shot`` blocks) and reports, for each decoder:

- per-character recall of greedy decoding: the share of a character's occurrences in the
  prompts that a minimum-edit alignment of decoded text to prompt matches exactly;
- the greedy CER as FALCON defines it (per session, mean over sessions, mean over seeds) and
  the same CER with each trial's missing sentence-final ``~`` / ``?`` restored (a
  counterfactual that sizes the end-of-sentence errors; nothing else is changed);
- where the results hold it, greedy decoding with end-of-trial completion (``greedy_end``):
  its CER and how often it ends with the prompt's final mark.

``python bench/bci_greedy_errors.py`` runs it on ``bench/results/bci/bci.json``.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from closedloop.sdk.bci.metrics import score_session

END_MARKS = "~?"


def matched_characters(hyp: str, ref: str) -> list[bool]:
    """For each character of ``ref``: is it matched exactly by a minimum-edit alignment of ``hyp``?"""
    n, m = len(ref), len(hyp)
    d = np.zeros((n + 1, m + 1), dtype=np.int32)
    d[:, 0] = np.arange(n + 1)
    d[0, :] = np.arange(m + 1)
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            d[i, j] = min(d[i - 1, j] + 1, d[i, j - 1] + 1, d[i - 1, j - 1] + (ref[i - 1] != hyp[j - 1]))
    hit = [False] * n
    i, j = n, m
    while i > 0 and j > 0:
        if ref[i - 1] == hyp[j - 1] and d[i, j] == d[i - 1, j - 1]:
            hit[i - 1] = True
            i, j = i - 1, j - 1
        elif d[i, j] == d[i - 1, j - 1] + 1:
            i, j = i - 1, j - 1
        elif d[i, j] == d[i - 1, j] + 1:
            i -= 1
        else:
            j -= 1
    return hit


def end_marks_missed(hyps: list[str], refs: list[str]) -> tuple[int, int]:
    """Of the prompts ending with a sentence-final mark (``~`` / ``?``), how many decoded texts lack it, and of how
    many: ``(missed, of)``."""
    ends = [(h, r[-1]) for h, r in zip(hyps, refs, strict=True) if r[-1:] and r[-1] in END_MARKS]
    return sum(not h.endswith(m) for h, m in ends), len(ends)


def with_end_restored(hyp: str, ref: str) -> str:
    """``hyp`` with the prompt's sentence-final mark appended when the decoded text does not end with it."""
    if ref and ref[-1] in END_MARKS and not hyp.endswith(ref[-1]):
        return hyp + ref[-1]
    return hyp


def decoders(run: dict) -> dict[str, dict]:
    """Every decoder of one seed's run: the methods (held-out) and the drift reference's two blocks."""
    out = {f"{name} (held-out)": m["sessions"] for name, m in run["methods"].items()}
    ref = run.get("reference") or {}
    if "held_in" in ref:
        out["reference, held-in"] = ref["held_in"]["sessions"]
    if "held_out_zero_shot" in ref:
        out["reference, zero-shot held-out"] = ref["held_out_zero_shot"]["sessions"]
    return out


def analyse(results: dict) -> dict:
    table: dict[str, dict] = {}
    for run in results["runs"]:
        for name, sessions in decoders(run).items():
            row = table.setdefault(name, {"cer": [], "cer_end_restored": [], "cer_greedy_end": [], "hit": Counter(),
                                          "n": Counter(), "hit_end": Counter(), "n_final": Counter()})
            cer, cer_end, cer_ge = [], [], []
            for s in sessions.values():
                refs, greedy = s["texts"]["reference"], s["texts"]["greedy"]
                cer.append(score_session(greedy, refs).cer)
                cer_end.append(score_session([with_end_restored(h, r) for h, r in zip(greedy, refs, strict=True)],
                                             refs).cer)
                for h, r in zip(greedy, refs, strict=True):
                    for ch, ok in zip(r, matched_characters(h, r), strict=True):
                        row["n"][ch] += 1
                        row["hit"][ch] += ok
                if "greedy_end" in s["texts"]:  # results that hold end-of-trial completion
                    ge = s["texts"]["greedy_end"]
                    cer_ge.append(score_session(ge, refs).cer)
                    for h, r in zip(ge, refs, strict=True):
                        row["n_final"][r[-1:]] += 1
                        row["hit_end"][r[-1:]] += h[-1:] == r[-1:]
            row["cer"].append(float(np.mean(cer)))
            row["cer_end_restored"].append(float(np.mean(cer_end)))
            if cer_ge:
                row["cer_greedy_end"].append(float(np.mean(cer_ge)))
    out = {}
    for name, row in table.items():
        out[name] = {
            "greedy_CER": float(np.mean(row["cer"])),
            "greedy_CER_end_restored": float(np.mean(row["cer_end_restored"])),
            "per_seed_CER": row["cer"],
            "per_seed_CER_end_restored": row["cer_end_restored"],
            "recall": {ch: row["hit"][ch] / row["n"][ch] for ch in sorted(row["n"])},
            # greedy_end: its CER, and the share of prompts ending in ~ / ? whose decoded text ends with that mark
            "greedy_end_CER": float(np.mean(row["cer_greedy_end"])) if row["cer_greedy_end"] else None,
            "greedy_end_final_mark": ({m: row["hit_end"][m] / row["n_final"][m] for m in END_MARKS if row["n_final"][m]}
                                      if row["cer_greedy_end"] else None),
            "count": {ch: row["n"][ch] for ch in sorted(row["n"])},
        }
    return out


def markdown(analysis: dict, source: str) -> str:
    lines = [f"# Greedy CTC errors per character ({source})", "",
             "Greedy CER: FALCON's (per session, mean over sessions), mean over seeds. 'End restored': the same with each",
             "trial's missing sentence-final `~` / `?` appended (a counterfactual; nothing else changed).", "",
             "Greedy + end: the harness's greedy decoding with end-of-trial completion under the sentence-end rule",
             "(measured, where the results hold it); 'final mark right': share of prompts ending in `~` / `?` whose",
             "greedy + end text ends with the same mark.", "",
             "| decoder | greedy CER | with the end mark restored | greedy + end CER | final mark right `~` / `?` "
             "| recall `~` | recall `?` | recall `'` | recall `,` | lowest other |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, a in analysis.items():
        rec = a["recall"]
        others = sorted((v, ch) for ch, v in rec.items() if ch not in "~?',")[:3]
        ge, fm = a["greedy_end_CER"], a["greedy_end_final_mark"]
        lines.append(f"| {name} | {100 * a['greedy_CER']:.2f}% | {100 * a['greedy_CER_end_restored']:.2f}% | "
                     + (f"{100 * ge:.2f}% | " if ge is not None else "- | ")
                     + (" / ".join(f"{fm.get(m, float('nan')):.2f}" for m in END_MARKS) + " | " if fm else "- | ")
                     + " | ".join(f"{rec.get(ch, float('nan')):.2f}" for ch in "~?',")
                     + " | " + ", ".join(f"`{ch}` {v:.2f}" for v, ch in others) + " |")
    return "\n".join(lines) + "\n"


def plot(analysis: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(analysis)
    chars = sorted(analysis[names[0]]["count"], key=lambda c: -analysis[names[0]]["count"][c])
    fig, ax = plt.subplots(figsize=(12, 4))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        ax.bar(np.arange(len(chars)) + k * width, [analysis[name]["recall"].get(c, np.nan) for c in chars],
               width, label=name)
    ax.set_xticks(np.arange(len(chars)) + 0.4 - width / 2)
    ax.set_xticklabels(chars)
    ax.set_ylabel("greedy recall")
    ax.set_xlabel("character (most frequent first)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7, ncol=2, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

