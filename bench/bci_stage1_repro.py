"""Does this machine train the iBCI benchmark's stage 1 the way the committed run did?

    python bench/bci_stage1_repro.py [--seed 0] [--steps 48]   # about 1.5 min per 48 steps on one core

Trains the first ``--steps`` stage-1 steps of the benchmark's recipe for one model seed on
the benchmark's data, averages the loss over the same windows as the committed
``bench/results/bci.json`` (``runs[i].loss_curves.backbone``) and prints both side by side.
Identical windows mean this machine reproduces the committed figures to the digit; any
difference (another CPU's floating-point kernels, another package version) means its
figures are a different draw of training noise, comparable with the committed ones only up
to the seed spread. Writes ``bench/results/bci_stage1_repro.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from closedloop.sdk.bci.benchmark import BciBenchConfig, generate_data
from closedloop.sdk.bci.train import train_backbone


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--committed", default="bench/results/bci.json")
    ap.add_argument("--out", default="bench/results/bci_stage1_repro.json")
    a = ap.parse_args()
    committed = json.loads(Path(a.committed).read_text())
    run = next((r for r in committed["runs"] if r["seed"] == a.seed), None)
    if run is None:
        raise SystemExit(f"{a.committed} has no run of seed {a.seed}; seeds: {[r['seed'] for r in committed['runs']]}")
    ref = run["loss_curves"]["backbone"]
    every = int(ref["every"])
    steps = max(every, a.steps - a.steps % every)

    torch.set_num_threads(1)  # as the benchmark's seed processes
    cfg = BciBenchConfig()
    sessions, _ = generate_data(cfg)
    recipe = replace(replace(cfg.harness, seed=a.seed, device="cpu").seeded().train, steps=steps, progress=False)
    t0 = time.perf_counter()
    _, log = train_backbone(sessions, recipe)
    wall = time.perf_counter() - t0
    mine = [float(np.mean(log.loss[i: i + every])) for i in range(0, steps, every)]
    theirs = [float(x) for x in ref["loss"][: len(mine)]]
    diffs = [abs(x - y) for x, y in zip(mine, theirs, strict=True)]

    print(f"stage 1, seed {a.seed}, {steps} steps ({wall:.0f} s), loss averaged over windows of {every} steps")
    print("| steps | committed | this machine | difference |")
    print("| --- | --- | --- | --- |")
    for i, (x, y, d) in enumerate(zip(theirs, mine, diffs, strict=True)):
        print(f"| {i * every}-{(i + 1) * every - 1} | {x:.6f} | {y:.6f} | {d:.2e} |")
    same = max(diffs) == 0.0
    print("identical: this machine reproduces the committed run" if same else
          f"different (max {max(diffs):.3g}): this machine's runs are another draw of training noise")
    out = {"command": "python bench/bci_stage1_repro.py " + f"--seed {a.seed} --steps {a.steps}",
           "seed": a.seed, "steps": steps, "every": every, "committed": theirs, "this_machine": mine,
           "max_abs_difference": max(diffs), "identical": same, "wall_s": wall,
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor(),
                       "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
