"""Where the handwriting decoders' greedy CTC errors come from, per character, from the iBCI benchmark's results.

    python bench/bci_greedy_errors.py          # reads bench/results/bci/bci.json; seconds, no training
    python bench/bci_greedy_errors.py --results OTHER_RUN.json --out DIR --stem NAME

Per decoder: per-character recall of greedy decoding, FALCON's greedy CER with and without
each trial's missing sentence-final mark restored, and greedy decoding with end-of-trial
completion where the results hold it (``closedloop.sdk.bci.greedy_errors``). Writes
``STEM.json``, ``STEM.md`` and ``STEM.png`` (recall per character) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from closedloop.sdk.bci.greedy_errors import analyse, markdown, plot

RESULTS = "bench/results/bci"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=f"{RESULTS}/bci.json", help="a bench_bci.py results JSON")
    ap.add_argument("--out", default=RESULTS, help=f"results folder (default {RESULTS})")
    ap.add_argument("--stem", default="bci_greedy_errors")
    a = ap.parse_args(argv)
    path = Path(a.results)
    if not path.exists():
        print(f"{path} does not exist: run python bench/bench_bci.py first (it writes the decoded texts)",
              file=sys.stderr)
        return 2
    results = json.loads(path.read_text())
    if not results.get("runs"):
        print(f"{path} holds no per-seed runs (runs[*].methods[*].sessions[*].texts); was it written by "
              "bench/bench_bci.py?", file=sys.stderr)
        return 2
    analysis = analyse(results)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(analysis, str(path))
    (out / f"{a.stem}.md").write_text(md)
    (out / f"{a.stem}.json").write_text(json.dumps({"source": str(path), "decoders": analysis}, indent=1))
    plot(analysis, out / f"{a.stem}.png")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
