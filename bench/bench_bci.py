"""iBCI handwriting benchmark: every calibration method on the default synthetic FALCON H2-like data.

    python bench/bench_bci.py          # 3 seeds; 39 min on 2 CPU cores; writes bench/results/bci/bci.*
    python bench/bench_bci.py --tiny   # about a minute; writes bench/results/bci/bci_tiny.* (not committed)
    python bench/bench_bci.py --ablate tuning_rotation --seeds 0 --methods session_layers two_stage
                                       # one drift component off: writes bci_ablate_tuning_rotation.*
    python bench/bench_bci.py --reference   # also the drift reference (its own frozen recipe; ~11 min more)
    python bench/bench_bci.py --data FOLDER # every method on your FALCON H2-layout NWB files: bci_data.*

It prints the estimated run time before it starts. Each finished training or scoring task is kept
in ``OUT/cells/STEM/`` (models as ``.pt``, an index in ``cells.jsonl``) as it ends, so a run that
was killed continues where it stopped when started again with the same options; ``--fresh`` runs
everything again. A new run of the default benchmark
joins the pooled comparison over runs with ``python bench/pool_bci_runs.py --add RESULT.json``.
Methods, metrics and the harness: ``closedloop.sdk.bci.benchmark`` and docs/bci.md.
"""

import argparse
import sys

from closedloop.sdk.bci.benchmark import BciBenchConfig, run_bci_benchmark

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny data and models (about a minute)")
    ap.add_argument("--seeds", type=int, nargs="+", help="model seeds (default 0 1 2)")
    ap.add_argument("--jobs", type=int, help="worker processes sharing the seeds' training and scoring tasks (default: CPU cores)")
    ap.add_argument("--device", help="auto (default), cpu or cuda")
    ap.add_argument("--out", default="bench/results/bci", help="results folder (default bench/results/bci)")
    ap.add_argument("--stem", help="results file stem (default bci, bci_tiny with --tiny), e.g. to keep the committed run")
    ap.add_argument("--config", help="a BciBenchConfig JSON file (overrides the defaults)")
    ap.add_argument("--ablate", help="switch one drift component off in the data (or 'all'): the drift ablation")
    ap.add_argument("--methods", nargs="+", help="methods to run (default: all)")
    ap.add_argument("--data-seed", type=int,
                    help="generate the recording from this seed (default 0, the benchmark's): a replication on "
                         "another recording of the same frozen generator; results go to bci_data{SEED}.*")
    ap.add_argument("--data", metavar="FOLDER",
                    help="run on a folder of FALCON H2-layout NWB files (held-in / held-out from the file names) "
                         "instead of the generator; results go to bci_data.* (bci_tiny_data.* with --tiny)")
    ap.add_argument("--reference", action="store_true",
                    help="also train and score the drift reference (bench/calibrate_bci_drift.py; ~11 more minutes)")
    ap.add_argument("--fresh", action="store_true",
                    help="run every task again, ignoring the finished ones an earlier run of the same configuration "
                         "kept in OUT/cells/STEM/ (by default a rerun continues from them)")
    a = ap.parse_args()
    cfg = BciBenchConfig.load(a.config) if a.config else (BciBenchConfig.tiny() if a.tiny else BciBenchConfig())
    cfg.out_dir = a.out
    if a.seeds:
        cfg.seeds = tuple(a.seeds)
    if a.jobs:
        cfg.jobs = a.jobs
    if a.device:
        from closedloop.sdk.bci.data import resolve_device

        try:
            resolve_device(a.device)  # a device this machine lacks is refused before any data are generated
        except ValueError as exc:
            sys.exit(f"bench_bci.py: error: {exc}")
        cfg.harness.device = a.device
    if a.stem:
        cfg.stem = a.stem
    if a.methods:
        cfg.harness.methods = tuple(a.methods)
    if a.reference:
        cfg.harness.reference = True
    if a.data_seed is not None and a.data_seed != cfg.data_seed:
        cfg.data_seed = a.data_seed
        cfg.stem = f"{cfg.stem}_data{a.data_seed}"
    if a.ablate:
        cfg.ablate = a.ablate
        cfg.stem = f"{cfg.stem}_ablate_{a.ablate}"
    if a.data:
        from closedloop.sdk.bci.benchmark import load_data_folder

        try:
            load_data_folder(a.data)  # a folder without FALCON files is refused before anything is trained
        except ValueError as exc:
            sys.exit(f"bench_bci.py: error: {exc}")
        cfg.data_dir = a.data
        if not a.stem:
            cfg.stem = f"{cfg.stem}_data"
    if a.fresh:
        cfg.resume = False
    run_bci_benchmark(cfg)
    sys.exit(0)
