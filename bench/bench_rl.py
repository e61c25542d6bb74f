"""Benchmark: fine-tuning with sparse vs success-visitation rewards, as a grid of independent cells, and its deployment.

    python bench/bench_rl.py            # the project-push comparison (about 70 min on 2 loaded cores); bench/results/rl/
    python bench/bench_rl.py --tiny     # a smoke run of about a minute (outputs rl_tiny.*, not committed)
    python bench/bench_rl.py --cell PandaPush-v3:svm_her:0          # one cell, appended to bench/results/rl/cells/
    python bench/bench_rl.py --cell push:svm:1:bc --steps 10000     # the project's push, from a cloned prior
    python bench/bench_rl.py --cell PandaPush-v3,PandaPickAndPlace-v3:sparse_her,svm_her:0-4:bc --address HOST:PORT
                                        # 20 cells on a Ray cluster (or --workers N: a local Ray instance)
    python bench/bench_rl.py --report   # steps to 80/90% (bootstrap 95% intervals) and curves from cells/cells.jsonl

The comparison (no ``--cell``): four rewards (sparse, svm, potential, gail) x 3 seeds of behaviour
cloning then SAC on Panda push, two processes of one thread at a time; then the best policy deployed
through the runtime and the panda emulator (``closedloop.sdk.rl.benchmark``, docs/rl.md). Writes
``rl.json``, ``rl.md`` and ``rl_success.png``.

A cell (``--cell TASK:REWARD:SEED[:PRIOR]``) is one independent run, :func:`run_cell`:

- TASK: a panda-gym task (``PandaReach-v3``, ``PandaPush-v3``, ``PandaPickAndPlace-v3``) or the project's
  ``push``/``reach``/``pick_and_place``;
- REWARD: ``sparse``, ``svm``, ``potential``, ``gail``, each optionally ``_her`` (SB3's HER relabelling,
  ``future`` goals; ``sparse_her`` is SB3's own ``HerReplayBuffer``, the shaped ones
  :class:`~closedloop.sdk.rl.sb3.ShapedHerReplayBuffer`; panda-gym tasks only);
- PRIOR: ``scratch`` (default: SAC from random weights) or ``bc``: a weak cloned prior on the panda-gym
  Push and PickAndPlace tasks (:func:`closedloop.sdk.rl.panda_gym.fine_tune_gym`: cloning stops inside a
  10-30% success band), behaviour cloning from scripted demonstrations then
  :func:`closedloop.sdk.rl.finetune.fine_tune` on the project's tasks.

``--lam``, ``--beta``, ``--steps``, ``--prior-weight`` (the pull towards a cloned prior, ``bc`` cells) and
``--refit`` (the discriminator's gradient steps after each episode, ``ShapingConfig.updates_per_episode``)
away from their defaults are part of a cell's id (``PandaReach-v3:svm_her:0:scratch@lam=0.2``): a sweep
stores its cells beside the default's.

The deterministic policy is evaluated on ``--eval-episodes`` (default 100) fresh episodes every
``--eval-every`` steps; the record (one JSON line: the cell, its settings, the curve, wall time) is
appended to ``bench/results/rl/cells/cells.jsonl``, and a cell already there is skipped, so a grid
resumes where it stopped.  ``--report`` reads every line there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from closedloop.common.jsonout import write_json

RESULTS = "bench/results/rl"
CELLS = f"{RESULTS}/cells/cells.jsonl"
REWARDS = ("sparse", "svm", "potential", "gail")
PANDA_GYM = ("PandaReach-v3", "PandaPush-v3", "PandaPickAndPlace-v3")
PROJECT = ("reach", "push", "pick_and_place")
CELL_DEFAULTS = {"steps": 20_000, "eval_every": 2_000, "eval_episodes": 100, "lam": 0.05, "beta": 5.0,
                 "learning_starts": 1_000, "batch_size": 256, "net": [256, 256], "gamma": 0.95,
                 "prior_weight": 1.0, "refit": 10}


def parse_cell(text: str) -> dict:
    """``TASK:REWARD:SEED[:PRIOR]`` as a cell dict; a clear error for anything else."""
    parts = text.split(":")
    if len(parts) not in (3, 4):
        raise ValueError(f"--cell {text!r}: expected TASK:REWARD:SEED[:PRIOR], e.g. PandaPush-v3:svm_her:0")
    task, reward, seed = parts[:3]
    prior = parts[3] if len(parts) == 4 else "scratch"
    if task not in PANDA_GYM + PROJECT:
        raise ValueError(f"--cell task {task!r}: expected one of {PANDA_GYM + PROJECT}")
    base = reward.removesuffix("_her")
    if base not in REWARDS:
        raise ValueError(f"--cell reward {reward!r}: expected one of {REWARDS}, optionally with _her")
    if reward.endswith("_her") and task not in PANDA_GYM:
        raise ValueError(f"--cell {text!r}: HER needs a goal-conditioned (panda-gym) task, not {task!r}")
    if prior not in ("scratch", "bc"):
        raise ValueError(f"--cell prior {prior!r}: expected scratch or bc")
    if prior == "bc" and task == "PandaReach-v3":
        raise ValueError(f"--cell {text!r}: PandaReach-v3 is learned from scratch in a few thousand steps; a weak "
                         "cloned prior is for PandaPush-v3 and PandaPickAndPlace-v3 (and the project's tasks)")
    if not seed.isdigit():
        raise ValueError(f"--cell seed {seed!r}: expected a non-negative integer")
    return {"task": task, "reward": reward, "seed": int(seed), "prior": prior}


def _seeds(text: str) -> list[str]:
    """``3``, ``0-4`` (inclusive) or a mix with commas (``0-2,7``) as seed strings."""
    out = []
    for part in text.split(","):
        lo, dash, hi = part.partition("-")
        if dash and lo.isdigit() and hi.isdigit():
            if int(hi) < int(lo):
                raise ValueError(f"--cell seeds {part!r}: the range ends before it starts")
            out += [str(k) for k in range(int(lo), int(hi) + 1)]
        else:
            out.append(part)
    return out


def expand_cells(text: str) -> list[dict]:
    """``TASK:REWARD:SEED[:PRIOR]`` where each field may be a comma list and SEED also a range (``0-4``): every
    combination, each checked by :func:`parse_cell` (a combination that is not a cell is an error that names it,
    never skipped), in order, duplicates dropped. ``PandaPush-v3,PandaPickAndPlace-v3:sparse_her,svm_her:0-4:bc``
    is 20 cells."""
    import itertools

    parts = text.split(":")
    if len(parts) not in (3, 4):
        raise ValueError(f"--cell {text!r}: expected TASK:REWARD:SEED[:PRIOR], e.g. PandaPush-v3:svm_her:0")
    fields = [p.split(",") for p in parts]
    fields[2] = _seeds(parts[2])
    cells, seen = [], set()
    for combo in itertools.product(*fields):
        cell = parse_cell(":".join(combo))
        if (key := cell_id(cell)) not in seen:
            seen.add(key)
            cells.append(cell)
    return cells


def _grid_cell(config: dict, seed: int) -> dict:
    """:func:`run_cell` in :func:`closedloop.sdk.grid.run_grid`'s shape (the seed is in ``config``)."""
    return run_cell(config)


def run_cells(cells: list[dict], path: Path, address: str | None = None, workers: int | None = None,
              backend: str = "auto") -> list[dict]:
    """``cells`` on a Ray cluster (``address``) or a local Ray instance of ``workers`` processes
    (:func:`closedloop.sdk.grid.run_grid`), each record appended to ``path`` as it finishes; cells already in
    ``path`` (either record form, :func:`finished_cells`) are skipped. Returns the grid's records of the cells run."""
    from closedloop.sdk.grid import Cell, run_grid

    done, todo = finished_cells(path), []
    for c in cells:
        if cell_id(c) in done:
            print(f"{cell_id(c)}: already in {path}, skipped", flush=True)
        else:
            todo.append(c)
    if not todo:
        return []
    path.parent.mkdir(parents=True, exist_ok=True)
    records = run_grid(_grid_cell, [Cell(c, c["seed"], name=cell_id(c)) for c in todo], results=path,
                       address=address, workers=workers, backend=backend, desc="bench_rl")
    for r in records:
        if r["status"] != "ok":
            print(f"cell {r['key']} failed: {r['error'].splitlines()[0]}", file=sys.stderr)
    return records


#: settings that make another experiment of the same task, reward, seed and prior (the lambda*beta sweep):
#: named in the cell's id when they differ from :data:`CELL_DEFAULTS`
SWEPT = ("lam", "beta", "steps", "prior_weight", "refit")


def cell_id(cell: dict) -> str:
    """``TASK:REWARD:SEED:PRIOR``, then ``@key=value,...`` for each of :data:`SWEPT` set away from its default."""
    base = f"{cell['task']}:{cell['reward']}:{cell['seed']}:{cell.get('prior', 'scratch')}"
    extra = [f"{k}={cell[k]:g}" for k in SWEPT if k in cell and cell[k] != CELL_DEFAULTS[k]]
    return base + ("@" + ",".join(extra) if extra else "")


def _panda_gym_cell(cell: dict, s: dict) -> dict:
    from closedloop.sdk.rl.panda_gym import fine_tune_gym

    return fine_tune_gym(cell["task"], cell["reward"].removesuffix("_her"), cell["seed"], prior=cell["prior"],
                         her=cell["reward"].endswith("_her"), steps=s["steps"], eval_every=s["eval_every"],
                         eval_episodes=s["eval_episodes"], lam=s["lam"], beta=s["beta"], gamma=s["gamma"],
                         net=tuple(s["net"]), batch_size=s["batch_size"], learning_starts=s["learning_starts"],
                         prior_weight=s["prior_weight"], refit=s["refit"],
                         log=lambda line: print(line, file=sys.stderr, flush=True))


def run_cell(cell: dict) -> dict:
    """One independent cell (task x reward x seed x prior): train, evaluate, return its record (JSON-able).

    ``cell`` holds ``task``, ``reward``, ``seed``, optionally ``prior`` and any of :data:`CELL_DEFAULTS`
    (``steps``, ``eval_every``, ``eval_episodes``, ``lam``, ``beta``, ...).  A plain top-level function of
    one dict, so a grid runner can ship cells to other processes or machines.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    cell = parse_cell(cell_id(cell).split("@")[0]) | {k: v for k, v in cell.items()
                                                      if k not in ("task", "reward", "seed", "prior")}
    s = CELL_DEFAULTS | {k: cell[k] for k in CELL_DEFAULTS if k in cell}
    if s["eval_episodes"] < 1 or s["eval_every"] < 1 or s["steps"] < 1 or s["refit"] < 1:
        raise ValueError(f"cell {cell_id(cell)}: steps, eval_every, eval_episodes and refit must be >= 1")
    if s["prior_weight"] < 0:
        raise ValueError(f"cell {cell_id(cell)}: prior_weight {s['prior_weight']} must be >= 0")
    if cell["prior"] == "scratch" and s["prior_weight"] != CELL_DEFAULTS["prior_weight"]:
        raise ValueError(f"cell {cell_id(cell)}: --prior-weight is the pull towards a cloned prior; "
                         "give the cell the PRIOR 'bc' or drop it")
    if cell["reward"].startswith("sparse") and s["refit"] != CELL_DEFAULTS["refit"]:
        raise ValueError(f"cell {cell_id(cell)}: --refit sets the discriminator's schedule; the sparse reward has none")
    t0 = time.perf_counter()
    torch.manual_seed(cell["seed"])
    np.random.seed(cell["seed"])
    extra: dict = {}
    if cell["task"] in PANDA_GYM:
        out = _panda_gym_cell(cell, s)
        curve = out["curve"]
        if "prior" in out:
            extra["prior"] = out["prior"]
    else:
        from closedloop.sdk.rl import FineTuneConfig, ShapingConfig
        from closedloop.sdk.rl.finetune import fine_tune
        from closedloop.sdk.rl.panda_gym import WEAK_PRIOR_BAND

        ft = FineTuneConfig(task=cell["task"], seed=cell["seed"], total_steps=s["steps"], eval_every=s["eval_every"],
                            eval_episodes=s["eval_episodes"], gamma=s["gamma"], net=tuple(s["net"]),
                            shaping=ShapingConfig(kind=cell["reward"], lam=s["lam"], beta=s["beta"],
                                                  updates_per_episode=s["refit"]),
                            prior_weight=s["prior_weight"],
                            prior_band=None if cell["prior"] == "scratch" else WEAK_PRIOR_BAND)
        if cell["prior"] == "scratch":
            ft.demos, ft.bc_epochs, ft.critic_pretrain_steps, ft.actor_warmup_steps, ft.prior_weight = 1, 0, 0, 0, 0.0
        result = fine_tune(ft)
        curve = result.curve
        if "prior" in result.record:
            extra["prior"] = result.record["prior"]
    return {"id": cell_id(cell), "cell": {k: cell[k] for k in ("task", "reward", "seed", "prior")}, "settings": s,
            "curve": [[int(a), float(b)] for a, b in curve], **extra, "wall_s": time.perf_counter() - t0,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def finished_cells(path: Path) -> dict[str, dict]:
    """The finished cells' records by id. A line is a record of :func:`run_cell` (a cell run here) or a
    :func:`closedloop.sdk.grid.run_grid` record holding one (a cell run on Ray: ``--address`` / ``--workers``);
    a failed grid record is not a finished cell, and a torn last line is ignored."""
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a run killed mid-write
                continue
            if "key" in rec and "id" not in rec:  # a grid record
                if rec.get("status") != "ok":
                    continue
                rec = rec["result"]
            out[rec["id"]] = rec
    return out


def run_and_append(cell: dict, path: Path) -> dict | None:
    """Run ``cell`` unless ``path`` already has it; append its record as one JSON line."""
    if cell_id(cell) in finished_cells(path):
        print(f"{cell_id(cell)}: already in {path}, skipped", flush=True)
        return None
    rec = run_cell(cell)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(rec) + "\n")
    print(f"{rec['id']}: curve {rec['curve']} in {rec['wall_s']:.0f} s -> {path}", flush=True)
    return rec


def steps_to(curve, level: float) -> int | None:
    for step, rate in curve:
        if rate >= level:
            return int(step)
    return None


def bootstrap_mean(values: np.ndarray, n: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """Mean and percentile-bootstrap 95% interval of the mean (resampling seeds)."""
    rng = np.random.default_rng(seed)
    boots = values[rng.integers(0, len(values), size=(n, len(values)))].mean(1)
    return float(values.mean()), float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))


def bootstrap_ratio(a: np.ndarray, b: np.ndarray, n: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """mean(a) / mean(b) and its percentile-bootstrap 95% interval, the seeds of each side resampled apart."""
    rng = np.random.default_rng(seed)
    ra = a[rng.integers(0, len(a), size=(n, len(a)))].mean(1)
    rb = b[rng.integers(0, len(b), size=(n, len(b)))].mean(1)
    boots = ra / np.maximum(rb, 1e-9)
    return float(a.mean() / b.mean()), float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))


def group_key(rec: dict) -> tuple[str, str, str]:
    """(task, reward, prior) labels a record's seeds are pooled under: the shaped reward's settings in its
    label; a non-default pull towards the cloned prior, and a step budget other than the default, in the
    prior's (they apply to every reward, so the sparse baseline under the same pull and budget stays the
    comparison, and one seed's runs at two budgets are never pooled)."""
    c, st = rec["cell"], CELL_DEFAULTS | rec["settings"]
    reward = c["reward"]
    if not reward.startswith("sparse"):
        refit = f", refit {st['refit']}" if st["refit"] != CELL_DEFAULTS["refit"] else ""
        reward = f"{reward} (lam {st['lam']:g}, beta {st['beta']:g}{refit})"
    prior = c["prior"]
    if prior == "bc" and st["prior_weight"] != CELL_DEFAULTS["prior_weight"]:
        prior = f"bc, pull {st['prior_weight']:g}"
    if st["steps"] != CELL_DEFAULTS["steps"]:
        prior = f"{prior}, {st['steps']:,} steps"
    return c["task"], reward, prior


def baseline_reward(reward: str, task_rewards: set[str]) -> str | None:
    """The sparse baseline ``reward`` is compared with, like for like in relabelling: a shaped reward with HER
    against sparse + HER (the strong baseline of goal-conditioned panda-gym tasks, the target's); one without HER
    against sparse without HER where that ran (what the bonus does on its own), else sparse + HER. None where
    neither ran or ``reward`` is that baseline itself (sparse without HER is compared with sparse + HER: what
    relabelling does)."""
    order = ("sparse_her",) if reward.split(" (")[0].endswith("_her") else ("sparse", "sparse_her")
    return next((r for r in order if r in task_rewards and r != reward), None)


def report(path: Path, out: Path) -> dict:
    """Steps to 80%/90% per (task, reward, prior) with bootstrap 95% intervals over seeds, and learning curves.

    A seed that never reaches a level counts at its budget (so that mean is a lower bound, marked ``>=``).
    """
    recs = list(finished_cells(path).values())
    if not recs:
        raise SystemExit(f"--report: no cells in {path}; run some with --cell first")
    groups: dict[tuple, list[dict]] = {}
    for r in recs:
        groups.setdefault(group_key(r), []).append(r)
    table = []
    reached: dict[tuple, np.ndarray] = {}
    for (task, reward, prior), rs in sorted(groups.items()):
        row = {"task": task, "reward": reward, "prior": prior, "seeds": sorted(r["cell"]["seed"] for r in rs),
               "eval_episodes": min(r["settings"]["eval_episodes"] for r in rs),
               "prior_success": [r["curve"][0][1] for r in rs]}
        final = np.array([r["curve"][-1][1] for r in rs], float)  # the last evaluation, at the cell's budget
        row["final_success"] = dict(zip(("mean", "lo", "hi"), bootstrap_mean(final), strict=True)) | {
            "per_seed": final.tolist()}
        for level in (0.8, 0.9):
            hits = [steps_to(r["curve"], level) for r in rs]
            budget = [r["settings"]["steps"] for r in rs]
            vals = np.array([h if h is not None else b for h, b in zip(hits, budget, strict=True)], float)
            mean, lo, hi = bootstrap_mean(vals)
            row[f"to_{int(level * 100)}"] = {"per_seed": hits, "mean": mean, "ci95": [lo, hi],
                                            "all_reached": all(h is not None for h in hits)}
            reached[(task, reward, prior, level)] = vals
        table.append(row)
    for row in table:  # the target's ratio: steps to 80% against the sparse baseline's, same task and prior
        ran = {r["reward"] for r in table if (r["task"], r["prior"]) == (row["task"], row["prior"])}
        base_reward = baseline_reward(row["reward"], ran)
        if base_reward is None:
            continue
        base = reached[(row["task"], base_reward, row["prior"], 0.8)]
        ratio, lo, hi = bootstrap_ratio(reached[(row["task"], row["reward"], row["prior"], 0.8)], base)
        sparse_row = next(r for r in table if (r["task"], r["reward"], r["prior"]) == (row["task"], base_reward,
                                                                                        row["prior"]))
        # a sparse seed that never reached 80% counts at its budget, which can only shrink the ratio's true value:
        # with every seed of this reward there, the ratio is an upper bound; otherwise it says nothing sure
        bound = "exact" if sparse_row["to_80"]["all_reached"] else "upper bound"
        if not row["to_80"]["all_reached"]:
            bound = "unknown"
        # the target is stated against sparse + HER on a standard panda-gym task; a project task's ratio is shown
        row["ratio_to_sparse_80"] = {"baseline": base_reward, "ratio": ratio, "ci95": [lo, hi], "bound": bound,
                                     "target_met": bool(base_reward == "sparse_her" and bound != "unknown"
                                                        and ratio <= 0.5 and hi < 1)}
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# RL cells: steps to 80% / 90% success", "",
             f"From `{path}` ({len(recs)} cells; `python bench/bench_rl.py --report`). Mean over seeds with a "
             "percentile-bootstrap 95% interval (10,000 resamples of the seeds); `>=`: some seed never reached the "
             "level and counts at its budget.", "",
             "| task | reward | prior | seeds | eval episodes | success at step 0 | success at the end [95%] | "
             "seeds reaching 80% | steps to 80% | steps to 90% | 80% steps / the sparse baseline's [95%] |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in table:
        cells = []
        for k in ("to_80", "to_90"):
            v = row[k]
            cells.append(f"{'' if v['all_reached'] else '>= '}{v['mean']:,.0f} [{v['ci95'][0]:,.0f}, {v['ci95'][1]:,.0f}]")
        r80 = row.get("ratio_to_sparse_80")
        mark = {"exact": "", "upper bound": "<= ", "unknown": "~"}
        vs = "" if r80 is None or r80["baseline"] == "sparse_her" else " (vs sparse, no HER)"
        ratio = "-" if r80 is None else (f"{mark[r80['bound']]}{r80['ratio']:.2f} [{r80['ci95'][0]:.2f}, "
                                         f"{r80['ci95'][1]:.2f}]{vs}{' (target met)' if r80['target_met'] else ''}")
        n80, fs = sum(h is not None for h in row["to_80"]["per_seed"]), row["final_success"]
        lines.append(f"| {row['task']} | {row['reward']} | {row['prior']} | {len(row['seeds'])} | {row['eval_episodes']} | "
                     f"{np.mean(row['prior_success']):.2f} | {fs['mean']:.2f} [{fs['lo']:.2f}, {fs['hi']:.2f}] | "
                     f"{n80} of {len(row['seeds'])} | {cells[0]} | {cells[1]} | "
                     f"{ratio} |")
    lines += ["", "The sparse baseline is like for like in relabelling: a reward with HER against sparse + HER; one "
              "without HER against sparse without HER where that ran (marked `vs sparse, no HER`; the project's "
              "tasks have no HER), else sparse + HER; sparse without HER against sparse + HER. Target: steps to 80% <= 0.5x sparse + HER's on a "
              "panda-gym task with the 95% interval of the ratio below 1. `<=`: some baseline seed never reached 80% "
              "and counts at its budget, so the ratio is an upper bound; `~`: some seed of this reward never reached "
              "it, so the ratio is not known and cannot meet the target. A prior label ending in a step count: cells "
              "run with that budget instead of the default 20,000."]
    (out / "cells.md").write_text("\n".join(lines) + "\n")
    _plot_cells(groups, out / "cells_success.png")
    result = {"cells": len(recs), "table": table}
    write_json(out / "cells_report.json", result)
    print("\n".join(lines))
    return result


def _plot_cells(groups: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({k[0] for k in groups})
    cols = min(2, len(tasks))
    rows_n = -(-len(tasks) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(6.5 * cols, 5.2 * rows_n), squeeze=False)
    for ax in axes.flat[len(tasks):]:
        ax.set_visible(False)
    for ax, task in zip(axes.flat, tasks, strict=False):
        mine = [(key, rs) for key, rs in sorted(groups.items()) if key[0] == task]
        palette = plt.get_cmap("tab10" if len(mine) <= 10 else "tab20")
        for i, ((_, reward, prior), rs) in enumerate(mine):
            n = min(len(r["curve"]) for r in rs)
            steps = np.array([p[0] for p in rs[0]["curve"][:n]])
            rates = np.array([[p[1] for p in r["curve"][:n]] for r in rs])
            colour = palette(i)
            ax.plot(steps, rates.mean(0), color=colour, label=f"{reward} ({prior}, {len(rs)} seeds)")
            if len(rs) > 1:
                ci = np.array([bootstrap_mean(rates[:, j])[1:] for j in range(n)])
                ax.fill_between(steps, ci[:, 0], ci[:, 1], color=colour, alpha=0.15)
        ax.set_title(task, fontsize=10)
        ax.set_xlabel("environment steps")
        ax.set_ylabel("success: mean over seeds, bootstrap 95% band")
        ax.set_ylim(-0.02, 1.02)
        ax.axhline(0.8, color="0.6", lw=0.8, ls=":")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=1 if len(mine) > 4 else 2, fontsize=7,
                  frameon=False)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a smoke run of about a minute (outputs rl_tiny.*)")
    ap.add_argument("--out", default=RESULTS, help=f"results folder (default {RESULTS})")
    ap.add_argument("--workers", type=int, default=None,
                    help="parallel runs (default 2); with --cell, that many at once on a local Ray instance "
                         "(without it and --address, one after another in this process)")
    ap.add_argument("--cell", action="append", metavar="TASK:REWARD:SEED[:PRIOR]",
                    help="run independent cells (repeatable) and append them to --cells; each field may be a comma "
                         "list and SEED a range, e.g. PandaPush-v3,PandaPickAndPlace-v3:sparse_her,svm_her:0-4:bc")
    ap.add_argument("--address", default=None,
                    help="with --cell: run the cells on this Ray cluster (HOST:PORT of `ray start --head`)")
    ap.add_argument("--cells", default=CELLS, help=f"the cells' JSON-lines file (default {CELLS})")
    ap.add_argument("--report", action="store_true", help="tables and curves from the cells in --cells")
    for key in ("steps", "eval_every", "eval_episodes", "learning_starts", "batch_size", "refit"):
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, default=None,
                        help=f"cell setting (default {CELL_DEFAULTS[key]})")
    for key in ("lam", "beta", "prior_weight"):
        ap.add_argument(f"--{key.replace('_', '-')}", type=float, default=None,
                        help=f"cell setting (default {CELL_DEFAULTS[key]})")
    a = ap.parse_args(argv)
    if a.workers is not None and a.workers < 1:
        ap.error(f"--workers {a.workers}: expected 1 or more")
    if a.address and not a.cell:
        ap.error("--address runs --cell cells on a Ray cluster: give the cells with --cell")
    if a.cell or a.report:
        settings = {k: getattr(a, k) for k in CELL_DEFAULTS if getattr(a, k, None) is not None}
        cells: list[dict] = []
        for text in a.cell or []:
            try:
                cells += [c | settings for c in expand_cells(text)]
            except ValueError as e:
                ap.error(str(e))
        if len(cells) > 1 or a.address or a.workers:
            print(f"{len(cells)} cells -> {a.cells}", flush=True)
        if cells and (a.address or a.workers):
            run_cells(cells, Path(a.cells), address=a.address, workers=a.workers)
        else:
            for cell in cells:
                run_and_append(cell, Path(a.cells))
        if a.report:
            report(Path(a.cells), Path(a.cells).parent)
        return 0
    from closedloop.sdk.rl.benchmark import full_config, run_rl_benchmark, tiny_config

    cfg = tiny_config() if a.tiny else full_config()
    if a.workers:
        cfg["workers"] = a.workers
    stem = "rl_tiny" if a.tiny else "rl"
    run_rl_benchmark(cfg, Path(a.out), stem, tiny=a.tiny)
    print((Path(a.out) / f"{stem}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
