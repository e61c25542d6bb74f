"""Run the bit-flip benchmark: every family evaluator, random and targeted flips, scrub timing, the report."""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from closedloop.common.jsonout import write_json

from .config import BitflipBenchConfig
from .evaluate_bci import BciEvaluator
from .evaluate_observer import ObserverEvaluator
from .evaluate_policy import PolicyEvaluator
from .report import markdown, plots, targets
from .sweeps import random_sweep, scrub_timing, targeted_sweep

# A family evaluator: built from (config, work folder, report), it trains and exports its bundles
# (``bundles``: unprotected, protected, protected_unkeyed), and ``evaluate(model, mem)`` scores a runtime model.
EVALUATORS = {"bci": BciEvaluator, "observer": ObserverEvaluator, "policy": PolicyEvaluator}


def run_bitflip_benchmark(cfg: BitflipBenchConfig, report=print) -> dict:
    """Run every family of ``cfg.families``; write ``STEM.json``, ``STEM.md`` and one PNG per family to ``cfg.out_dir``."""
    t0 = time.perf_counter()
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bitflip-") as tmp:
        work = Path(tmp)
        results = {"config": asdict(cfg)}
        if cfg.merge and (out / f"{cfg.stem}.json").is_file():
            results = json.loads((out / f"{cfg.stem}.json").read_text()) | {"config": asdict(cfg)}
        for fam in cfg.families:
            ev = EVALUATORS[fam](cfg, work, report)
            rec = {"protection": ev.plan_summary, "metric": ev.metric, "extra": ev.extra,
                   "higher_is_better": getattr(ev, "higher_is_better", False), "random": {}}
            for variant in ev.precisions:
                rec["random"][variant or "fp32"] = random_sweep(ev, cfg, variant, report)
            if ev.targeted:
                rec["targeted"] = targeted_sweep(ev, cfg, report)
            if hasattr(ev, "clean_cost"):
                rec["clean_cost"] = ev.clean_cost
            results[fam] = rec
        if cfg.timing:
            results["scrub_timing"] = scrub_timing(cfg, work, report)
    results["targets"] = targets(results)
    results["wall_s"] = time.perf_counter() - t0
    results["machine"] = {"cpus": os.cpu_count(), "torch_threads": 1}
    write_json(out / f"{cfg.stem}.json", results)
    (out / f"{cfg.stem}.md").write_text(markdown(results))
    results["plots"] = plots(results, out, cfg.stem)
    for line in results["targets"]:
        report(line)
    report(f"wall {results['wall_s'] / 60:.1f} min; wrote {out / cfg.stem}.json, .md and {results['plots']}")
    return results
