"""Pool several runs of the iBCI benchmark, so that training noise enters the comparison.

    python bench/pool_bci_runs.py                                     # recompute bench/results/bci/bci_pooled.*
    python bench/pool_bci_runs.py --add bench/results/bci/bci.json    # add a new run of bench_bci.py to the pool
    python bench/pool_bci_runs.py --runs A.json B.json --out DIR      # pool these results only (a new pool)

The pool (``bench/results/bci/bci_pooled.json``) keeps every pooled run's per-model held-out
beam WERs, the run's seeds, wall time, machine and harness differences, not the runs' full
results; the statistics (per-method mean, two-stage against each baseline with a cluster
bootstrap over seed numbers) are recomputed from it on every call. Method:
``closedloop.sdk.bci.pooling``. Writes ``STEM.json``, ``STEM.md`` and ``STEM.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from closedloop.common.atomic import atomic_write_bytes, atomic_write_text
from closedloop.sdk.bci.pooling import add_run, empty_pool, load_pool, markdown, plot, summarise

POOL = "bench/results/bci/bci_pooled.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool", default=POOL, help=f"the pool file to read and update (default {POOL})")
    ap.add_argument("--add", nargs="+", default=[], metavar="RESULT_JSON",
                    help="bench_bci.py result files to add to the pool")
    ap.add_argument("--label", help="the added run's label (one --add file; default 'run N (seeds ...)')")
    ap.add_argument("--runs", nargs="+", help="pool only these bench_bci.py result files (labelled by file name)")
    ap.add_argument("--out", help="results folder (default: the pool file's folder)")
    ap.add_argument("--stem", help="results file stem (default: the pool file's, bci_pooled with --runs)")
    a = ap.parse_args(argv)
    if a.label and len(a.add) != 1:
        ap.error("--label goes with exactly one --add file")
    try:
        if a.runs:
            missing = [p for p in a.runs if not Path(p).exists()]
            if missing:
                raise ValueError(f"no such result file(s): {missing}")
            pool = empty_pool()
            for p in a.runs:
                add_run(pool, json.loads(Path(p).read_text()), Path(p).stem)
        else:
            pool = load_pool(Path(a.pool)) if Path(a.pool).exists() else empty_pool()
            for p in a.add:
                add_run(pool, json.loads(Path(p).read_text()), a.label)
        if not pool["draws"]:
            raise ValueError(f"{a.pool} does not exist and nothing was added: run bench/bench_bci.py, then --add")
    except ValueError as exc:
        print(f"pool_bci_runs.py: error: {exc}", file=sys.stderr)
        return 2
    stem = a.stem or ("bci_pooled" if a.runs else Path(a.pool).stem)
    summarise(pool)
    pool["command"] = "python bench/pool_bci_runs.py" + (" --runs " + " ".join(a.runs) if a.runs else "")
    table = markdown(pool)
    print(table)
    out = Path(a.out) if a.out else Path(a.pool).parent
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / f"{stem}.json", json.dumps(pool, indent=1) + "\n")
    atomic_write_text(out / f"{stem}.md", table)
    atomic_write_bytes(out / f"{stem}.png", plot(pool))
    print(f"wrote {out / (stem + '.json')}, .md and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
