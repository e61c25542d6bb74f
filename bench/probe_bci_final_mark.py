"""How a stage-1 backbone places the sentence-final mark in time, and what end-of-trial completion makes of it.

    python bench/probe_bci_final_mark.py --seed 0                  # held-in sessions 2 9 15 20
    python bench/probe_bci_final_mark.py --seed 0 --sessions 21 22 # held-out days (zero-shot: no calibration)

Uses the benchmark's stage-1 backbone of model seed S on the benchmark's data (trained once
with the benchmark recipe and kept under ``--cache``, shared with ``bench/explore_bci_meta.py``:
about 6-9 min on one core the first time). For each evaluation trial of the chosen sessions,
each normalised with its own session's statistics, it reports:

- where the mark's probability sits: its peak and its sum over the bins after the pen stops
  (from the generator's pen kinematics), and whether greedy decoding emits it;
- what end-of-trial completion does: plain (append a character when CTC's odds of "one more"
  against "nothing more" exceed 1) and under the sentence-end rule ``~?``.

Prints a table and writes ``bench/results/bci_final_mark_probe.json``. Findings in docs/bci.md,
"Greedy decoding and the sentence-final mark".
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from explore_bci_meta import cached  # noqa: E402

from closedloop.sdk.bci.benchmark import BciBenchConfig, generate_data  # noqa: E402
from closedloop.sdk.bci.charset import BLANK, decode, encode  # noqa: E402
from closedloop.sdk.bci.data import make_examples, session_normalization  # noqa: E402
from closedloop.sdk.bci.decoding import end_completion, greedy_decode  # noqa: E402
from closedloop.sdk.bci.train import train_backbone  # noqa: E402
from closedloop.sim.handwriting import generate_session  # noqa: E402

WRITING = 5  # column of the pen features: the writing term (1 while the sentence is being written)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0, help="model seed")
    ap.add_argument("--sessions", type=int, nargs="+", default=[2, 9, 15, 20], help="session indices (0-20 held-in)")
    ap.add_argument("--cache", default="/tmp/closedloop_bci_cache")
    ap.add_argument("--out", default="bench/results/bci_final_mark_probe.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    bench = BciBenchConfig()
    sessions, hw = generate_data(bench)
    harness = replace(bench.harness, seed=a.seed, reference=False).seeded()
    backbone, _ = cached("backbone", train_backbone, sessions, harness.train, Path(a.cache))
    backbone.eval()
    rows = []
    for i in a.sessions:
        s = generate_session(hw, i, with_kinematics=True)
        kin = s.meta["kinematics"]
        examples = make_examples(s, list(s.evaluation), session_normalization(s))
        for k, e in zip(s.evaluation, examples, strict=True):
            with torch.no_grad():
                logp = backbone(torch.from_numpy(e.x)[None])[0][0].numpy()
            mark = e.sentence[-1]
            stop = int(np.flatnonzero(kin[k].features[:, WRITING] > 0.5).max()) + 1
            p = np.exp(logp[:, encode(mark)[0]])
            plain, odds = end_completion(logp)
            rule, _ = end_completion(logp, "~?")
            rows.append({"session": s.name, "trial": int(k), "mark": mark, "bins_after_stop": int(len(p) - stop),
                         "peak_after_stop": float(p[stop:].max(initial=0.0)), "sum_after_stop": float(p[stop:].sum()),
                         "greedy_emits": greedy_decode(logp).endswith(mark),
                         "plain_completion": decode([plain]) if plain != BLANK else "", "plain_odds": odds,
                         "rule_completion": decode([rule]) if rule != BLANK else ""})
    n = len(rows)
    plain = Counter((r["mark"], r["plain_completion"]) for r in rows)
    rule_right = sum(r["rule_completion"] == r["mark"] or (r["rule_completion"] == "" and r["greedy_emits"]) for r in rows)
    summary = {
        "seed": a.seed, "sessions": [int(i) for i in a.sessions], "trials": n,
        "greedy_emits_mark": sum(r["greedy_emits"] for r in rows),
        "median_peak_after_stop": float(np.median([r["peak_after_stop"] for r in rows])),
        "median_sum_after_stop": float(np.median([r["sum_after_stop"] for r in rows])),
        "median_bins_after_stop": float(np.median([r["bins_after_stop"] for r in rows])),
        "plain_completion_fired": sum(r["plain_completion"] != "" for r in rows),
        "plain_completion_right": sum(r["plain_completion"] == r["mark"] for r in rows),
        "plain_odds_quantiles_10_50_90": np.quantile([r["plain_odds"] for r in rows], [0.1, 0.5, 0.9]).tolist(),
        "rule_completion_right": rule_right,
        "plain_outcomes": {f"{m}->{c or 'none'}": v for (m, c), v in sorted(plain.items())},
    }
    print(f"seed {a.seed}, sessions {a.sessions}: {n} evaluation trials")
    print(f"  greedy emits the final mark: {summary['greedy_emits_mark']} / {n}")
    print(f"  p(mark) after the pen stops: median peak {summary['median_peak_after_stop']:.3f}, median sum "
          f"{summary['median_sum_after_stop']:.2f} over a median {summary['median_bins_after_stop']:.0f} bins")
    print(f"  plain completion: fired {summary['plain_completion_fired']}, right {summary['plain_completion_right']}; "
          f"odds 10/50/90%: {', '.join(f'{q:.2f}' for q in summary['plain_odds_quantiles_10_50_90'])}")
    print(f"  sentence-end rule: right final mark {rule_right} / {n}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, "trials": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
