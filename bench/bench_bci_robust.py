"""Robustness of ``bci-train``'s recipe on generator settings it was not tuned on, as a grid of cells.

    python bench/bench_bci_robust.py               # the one-at-a-time grid around the default data (9 cells)
    python bench/bench_bci_robust.py --full        # every combination of the axes (72 cells)
    python bench/bench_bci_robust.py --tiny        # a smoke run: tiny data and models, 3 cells (*_tiny, not committed)
    python bench/bench_bci_robust.py --report      # the tables and the plot from the cells stored so far
    python bench/bench_bci_robust.py --address HOST:PORT   # the cells on a Ray cluster (docs/grid.md)
    python bench/bench_bci_robust.py --cell 0 --budget 1   # only some pieces: the default cell at the default budget
    python bench/bench_bci_robust.py --compare FOLDER_A FOLDER_B:x4   # pieces of two folders paired, greedy CER a / b

The axes (each a multiple of, or a change to, the generator's calibrated default,
``closedloop.sim.handwriting.HandwritingConfig``):

- ``signal``: the population's velocity and acceleration tuning depths, x0.5, x1, x2;
- ``drift``: ``DriftConfig.scale``, x0.5, x1, x2;
- ``held_in``: 8 or 21 held-in sessions (8: evenly spaced among FALCON H2's 21 dates, the last kept);
- ``trials``: 10, 40 (the default) or 50 trials per session;
- ``jumps``: off, or each session's own abrupt rotation, gain and baseline change
  (``HandwritingConfig.with_session_jumps()``).

The default grid varies one axis at a time around the default cell; ``--full`` crosses them all.
A cell is four independent pieces (:func:`run_cell`), each of which generates the cell's recording and
trains one method at one budget: the recipe's default budget and 4x it (``Recipe(budget=4)``: the step
ceiling, the time budget and the patience each x4); the two-stage decoder with the recipe
(:func:`closedloop.sdk.bci.recipe.fit_recipe`: validation split, early stopping, scaling) or the
session-layers baseline under the same rules (:func:`closedloop.sdk.bci.recipe.plan_recipe`: the same
validation trials, settings and budget). Each piece calibrates on each held-out day's first 3 sentences
and scores greedy CER/WER on the day's evaluation trials (:func:`closedloop.sdk.bci.evaluate.run_harness`,
beam search off). A piece's record (one JSON line in ``bench/results/bci_robust/bci_robust_cells.jsonl``,
:mod:`closedloop.sdk.grid`) holds its scores, texts and training summary; a rerun skips the pieces
already there, and ``--cell``/``--budget``/``--method`` choose pieces, so a grid too long for one
machine's sitting is run a piece at a time. The report (:func:`assemble`) joins a cell's four pieces and
adds the paired bootstrap (greedy CER, two-stage against session layers at the default budget, the
held-out trials resampled). The targets need three of a cell's pieces (both two-stage pieces, and the
default budget's session layers); the fourth, session layers at 4x, answers whether the baseline too gains from
a longer run, and no target waits for it. A cell missing one of the three is listed as pending with what it
has, and each target is counted over the cells whose pieces for it are in (the ratio: both two-stage pieces;
the methods: both default-budget pieces). Per piece, the report also counts the held-out sentence-end marks (``~``/``?``)
the greedy text lacks and gives the CER with them restored (:func:`end_marks`).

Targets (issue: "a decoder recipe that fits the user's recordings"): in every cell the default budget's
two-stage greedy CER within 1.25x of the 4x run's, and two-stage below session layers (the bootstrap
ratio's 95% interval below 1) in most cells. ``--report`` writes ``bci_robust.json``, ``bci_robust.md``
and ``bci_robust.png`` and says which cells meet them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

RESULTS = "bench/results/bci_robust"
# the pieces the two targets need: both budgets' two-stage (the ratio) and the default budget's session layers
# (the methods); 4x session layers is optional
TARGET_PIECES = (("x1", "two_stage"), ("x4", "two_stage"), ("x1", "session_layers"))
AXES: dict[str, tuple] = {"signal": (0.5, 1.0, 2.0), "drift": (0.5, 1.0, 2.0), "held_in": (8, 21),
                          "trials": (10, 40, 50), "jumps": (False, True)}
DEFAULT_CELL = {"signal": 1.0, "drift": 1.0, "held_in": 21, "trials": 40, "jumps": False}
BUDGETS = (1.0, 4.0)
CER_RATIO_TARGET = 1.25
METHODS = ("two_stage", "session_layers")


def one_at_a_time() -> list[dict]:
    """The default cell, then each axis's other values with the rest at their default."""
    cells = [dict(DEFAULT_CELL)]
    for axis, values in AXES.items():
        cells += [{**DEFAULT_CELL, axis: v} for v in values if v != DEFAULT_CELL[axis]]
    return cells


def every_combination() -> list[dict]:
    import itertools

    return [dict(zip(AXES, values, strict=True)) for values in itertools.product(*AXES.values())]


def tiny_cells() -> list[dict]:
    """The smoke grid: the tiny recording's defaults, weak signal, and session jumps."""
    base = {"signal": 1.0, "drift": 1.0, "held_in": 3, "trials": 8, "jumps": False}
    return [base, {**base, "signal": 0.5}, {**base, "jumps": True}]


def recording_config(cell: dict, data_seed: int, tiny: bool = False):
    """The generator's configuration for ``cell`` (see the module docstring for the axes)."""
    from closedloop.sim.handwriting import HandwritingConfig
    from closedloop.sim.handwriting.config import FALCON_H2_HELD_IN_DATES

    hw = HandwritingConfig.tiny(data_seed) if tiny else HandwritingConfig(seed=data_seed)
    dates = hw.held_in_dates if tiny else FALCON_H2_HELD_IN_DATES
    n = int(cell["held_in"])
    if not 1 <= n <= len(dates):
        raise ValueError(f"held_in {n}: between 1 and {len(dates)} sessions")
    picks = sorted({int(round(i)) for i in np.linspace(0, len(dates) - 1, n)})
    pop = dataclasses.replace(hw.population, velocity_depth=hw.population.velocity_depth * cell["signal"],
                              accel_depth=hw.population.accel_depth * cell["signal"])
    drift = dataclasses.replace(hw.drift, scale=hw.drift.scale * cell["drift"])
    hw = dataclasses.replace(hw, held_in_dates=tuple(dates[i] for i in picks), trials_per_session=int(cell["trials"]),
                             population=pop, drift=drift)
    return hw.with_session_jumps() if cell["jumps"] else hw


def _trim_log(summary: dict) -> dict:
    out = json.loads(json.dumps(summary, default=float))
    stage1 = out.get("stage1", {})
    rows = stage1.pop("validation", None) or []
    # the validation curve as [step, CER, loss per character] rows: enough to see where a stopping rule acted,
    # a few kB a piece
    stage1["val_curve"] = [[int(r["step"]), round(float(r["CER"]), 5), round(float(r["loss"]), 5)] for r in rows]
    return out


def train_and_score(sessions: list, harness, budget: float, seed: int, method: str, scale: bool = True,
                    recipe_settings: dict | None = None) -> dict:
    """One piece of a cell: ``method`` trained with the recipe at ``budget`` and scored on the held-out days.

    ``two_stage``: :func:`~closedloop.sdk.bci.recipe.fit_recipe` (both stages, as ``bci-train``).
    ``session_layers``: the baseline under the same rules (:func:`~closedloop.sdk.bci.recipe.plan_recipe`: the
    same validation trials, scaled settings, patience and time budget)."""
    from closedloop.sdk.bci.baselines import TrainedModels
    from closedloop.sdk.bci.evaluate import run_harness
    from closedloop.sdk.bci.recipe import Recipe, fit_recipe, plan_recipe
    from closedloop.sdk.bci.train import train_session_layers

    if method not in METHODS:
        raise ValueError(f"method {method!r}: expected one of {METHODS}")
    recipe = Recipe(budget=budget, seed=seed, scale=scale, **(recipe_settings or {}))
    t0 = time.perf_counter()
    if method == "two_stage":
        fit = fit_recipe(sessions, harness, recipe=recipe)
        models, train_sessions, used = fit.models, fit.train_sessions, fit.harness
        training = _trim_log(fit.summary(recipe))
    else:
        plan = plan_recipe(sessions, harness, recipe)
        model, log = train_session_layers(plan.train_sessions, plan.harness.session_recipe(),
                                          plan.validation_examples, None, plan.deadline)
        models = TrainedModels(session_model=model, logs={"session_layers": log},
                               held_in_days={s.name: float(s.day) for s in sessions if s.split == "held_in"})
        train_sessions, used = plan.train_sessions, plan.harness
        best = log.best() or {}
        training = {"steps_run": log.steps_run, "stop_reason": log.stop_reason, "best_step": log.best_step,
                    "best_val_CER": best.get("CER"), "wall_s": log.wall_s}
    h = dataclasses.replace(used, methods=(method,), reference=False, beam_width=0, progress=False)
    block = run_harness(train_sessions, h, models=models)["methods"][method]
    scores = {"greedy_CER": block["mean"]["greedy"]["CER"], "greedy_WER": block["mean"]["greedy"]["WER"],
              "sessions": {name: {"greedy_CER": v["greedy"]["CER"], "texts": {
                  "reference": v["texts"]["reference"], "greedy": v["texts"]["greedy"]}}
                  for name, v in block["sessions"].items()}}
    return {"budget": budget, "method": method, "scores": scores, "training": training,
            "wall_s": time.perf_counter() - t0}


def _tiny_harness(seed: int):
    from closedloop.sdk.bci.workflow import train_harness

    return train_harness(None, tiny=True, seed=seed, device="cpu")


def piece_host() -> dict:
    """Where a piece runs (its record keeps it): a time-budgeted piece's steps depend on the machine."""
    import platform

    from closedloop.runtime.timing import _cpu_name

    return {"cpu": _cpu_name(), "cores": os.cpu_count(), "machine": platform.machine(),
            "python": platform.python_version(), "torch_threads": 1}


def run_cell(config: dict, seed: int) -> dict:
    """A piece of the grid (module level, for Ray's workers): one method at one budget on the cell's recording.

    ``config`` holds the cell's axes, ``budget`` (1 or 4), ``method`` (``two_stage`` or ``session_layers``),
    ``tiny`` and ``data_seed``. The four pieces of a cell run apart (the longest, a 4x budget, is about 2 h of
    one core at full size), and :func:`assemble` joins them for the report.
    """
    import torch

    from closedloop.sdk.bci.workflow import train_harness
    from closedloop.sim.handwriting import generate_recording

    torch.set_num_threads(1)
    tiny = bool(config.get("tiny"))
    cell = {k: config[k] for k in AXES}
    hw = recording_config(cell, int(config.get("data_seed", 0)), tiny)
    sessions = generate_recording(hw)
    harness = _tiny_harness(seed) if tiny else train_harness(None, seed=seed, device="cpu")
    out: dict = {"cell": cell, "seed": seed, "data": {"held_in": len(hw.held_in_dates),
                                                      "held_out": len(hw.held_out_dates),
                                                      "trials": hw.trials_per_session, "channels": hw.n_channels},
                 "host": piece_host()}
    # tiny: bci-train --tiny's sizes, not scaled
    return out | train_and_score(sessions, harness, float(config["budget"]), seed, config["method"], scale=not tiny,
                                 recipe_settings=config.get("recipe"))


def _paired(pieces: dict, a: tuple[str, str], b: tuple[str, str], seed: int) -> dict:
    """Greedy CER of piece ``a`` over piece ``b`` (keys of ``pieces``: ``(budget, method)``), the held-out trials
    resampled in pairs (:func:`closedloop.sdk.bci.report.paired_bootstrap`)."""
    from closedloop.sdk.bci.report import paired_bootstrap

    both = {"methods": {" ".join(k): {"sessions": pieces[k]["scores"]["sessions"]} for k in (a, b)}}
    return paired_bootstrap([both], " ".join(a), " ".join(b), decoder="greedy", n_boot=2000, seed=seed, metric="CER")


def assemble(records: list[dict]) -> list[dict]:
    """The pieces joined into cells: per (cell, seed) and budget, the scores of the methods whose pieces are in,
    the two-stage recipe's summary and the session layers' training, and, once both default-budget pieces are
    in, the paired bootstrap (greedy CER, two-stage against session layers). A cell missing one of the pieces
    the targets need (:data:`TARGET_PIECES`) is ``pending`` (with what it has); one with a failed piece is
    ``failed``; ``missing`` lists every piece not in, the optional 4x session-layers one included. Once both
    two-stage pieces are in, the same bootstrap pairs the default budget against the 4x run."""
    groups: dict[str, dict] = {}
    for rec in records:
        base = rec["key"].rsplit("_x", 1)[0]
        g = groups.setdefault(base, {"key": base, "pieces": {}, "errors": []})
        if rec.get("status") != "ok":
            g["errors"].append(rec.get("error", "failed"))
            continue
        r = rec["result"]
        g["pieces"][(f"x{r['budget']:g}", r["method"])] = r
    out = []
    for key, g in groups.items():
        if g["errors"]:
            out.append({"key": key, "status": "failed", "error": g["errors"][0]})
            continue
        first = next(iter(g["pieces"].values()))
        result: dict = {"cell": first["cell"], "seed": first["seed"], "data": first["data"]}
        for b in BUDGETS:
            pieces = {m: g["pieces"][(f"x{b:g}", m)] for m in METHODS if (f"x{b:g}", m) in g["pieces"]}
            if not pieces:
                continue
            result[f"x{b:g}"] = {"scores": {m: p["scores"] for m, p in pieces.items()},
                                 "wall_s": sum(p["wall_s"] for p in pieces.values())}
            if "two_stage" in pieces:
                result[f"x{b:g}"]["recipe"] = pieces["two_stage"]["training"]
            if "session_layers" in pieces:
                result[f"x{b:g}"]["session_layers_training"] = pieces["session_layers"]["training"]

        if all(("x1", m) in g["pieces"] for m in METHODS):  # the methods compare at the default budget
            result["paired_greedy_CER"] = _paired(g["pieces"], ("x1", "two_stage"), ("x1", "session_layers"), first["seed"])
        if ("x1", "two_stage") in g["pieces"] and ("x4", "two_stage") in g["pieces"]:  # the budgets, paired
            result["paired_budgets_CER"] = _paired(g["pieces"], ("x1", "two_stage"), ("x4", "two_stage"), first["seed"])
        missing = [(f"x{b:g}", m) for b in BUDGETS for m in METHODS if (f"x{b:g}", m) not in g["pieces"]]
        status = "pending" if any(p in TARGET_PIECES for p in missing) else "ok"
        out.append({"key": key, "status": status, "missing": [f"{b} {m}" for b, m in missing], "result": result})
    return out


def cell_name(cell: dict, seed: int, tiny: bool) -> str:
    parts = [f"signal{cell['signal']:g}", f"drift{cell['drift']:g}", f"in{cell['held_in']}",
             f"trials{cell['trials']}", "jumps" if cell["jumps"] else "nojumps", f"seed{seed}"]
    return ("tiny:" if tiny else "") + "_".join(parts)


def end_marks(scores: dict) -> dict:
    """How much of a piece's greedy CER is the sentence-final mark: the held-out prompts ending in ``~`` / ``?``
    whose greedy text lacks that mark, and the CER (mean over days, as ``greedy_CER``) with those marks restored
    (a counterfactual: nothing else changes; :func:`closedloop.sdk.bci.greedy_errors.with_end_restored`)."""
    from closedloop.sdk.bci.greedy_errors import end_marks_missed, with_end_restored
    from closedloop.sdk.bci.metrics import score_session

    missed = total = 0
    restored = []
    for day in scores["sessions"].values():
        refs, hyps = day["texts"]["reference"], day["texts"]["greedy"]
        day_missed, day_of = end_marks_missed(hyps, refs)
        missed, total = missed + day_missed, total + day_of
        restored.append(score_session([with_end_restored(h, r) for h, r in zip(hyps, refs, strict=True)], refs).cer)
    return {"missed": missed, "of": total, "CER_end_restored": float(np.mean(restored))}


def piece_rows(records: list[dict]) -> list[dict]:
    """Every finished piece (the grid's records, before :func:`assemble`): greedy CER and :func:`end_marks`."""
    rows = []
    for rec in records:
        if rec.get("status") != "ok":
            continue
        r = rec["result"]
        host = r.get("host") or {}
        rows.append({"key": rec["key"].rsplit("_x", 1)[0], "budget": r["budget"], "method": r["method"],
                     "commit": (rec.get("config") or {}).get("commit"), "greedy_CER": r["scores"]["greedy_CER"],
                     "end_marks": end_marks(r["scores"]),
                     "host": f"{host['cpu']}, {host['cores']} cores" if host.get("cpu") else None})
    return rows


def summarize(records: list[dict]) -> dict:
    """Per cell, what its pieces so far allow: both budgets' two-stage and session-layers greedy CER, the default
    budget's ratio to the 4x run (both two-stage pieces in), the paired bootstrap (both default-budget pieces in);
    and for each target, how many of the cells that can be judged on it meet it."""
    rows = []
    for rec in records:
        if rec.get("status") == "failed":
            rows.append({"key": rec["key"], "failed": rec.get("error", "")})
            continue
        r = rec["result"]
        row: dict = {"key": rec["key"], "cell": r["cell"], "seed": r["seed"]}
        if rec.get("status") == "pending":
            row["pending"] = True
        row["missing"] = rec.get("missing", [])
        for b, suffix in ((1.0, ""), (4.0, "_x4")):
            part = r.get(f"x{b:g}", {})
            for m in METHODS:
                if m in part.get("scores", {}):
                    row[f"{m}_CER{suffix}"] = part["scores"][m]["greedy_CER"]
            if "recipe" in part:
                stage1 = part["recipe"]["stage1"]
                row[f"stage1_steps{suffix}"] = stage1["steps_run"]
                row[f"stage1_stop{suffix}"] = stage1["stop_reason"]
                row[f"learned{suffix}"] = part["recipe"]["learned"]
                if stage1.get("best_val_CER") is not None:
                    row[f"best_val_CER{suffix}"] = stage1["best_val_CER"]
                if stage1.get("val_curve"):
                    row[f"val_curve{suffix}"] = stage1["val_curve"]
        if "two_stage_CER" in row and "two_stage_CER_x4" in row:
            ts, ts4 = row["two_stage_CER"], row["two_stage_CER_x4"]
            ratio = ts / ts4 if ts4 > 0 else (1.0 if ts == 0 else float("inf"))
            row.update(ratio_to_x4=ratio, within_ratio=bool(ratio <= CER_RATIO_TARGET))
            if "paired_budgets_CER" in r:  # the ratio's paired bootstrap interval (held-out trials resampled)
                row["ratio_to_x4_95"] = r["paired_budgets_CER"]["ratio_95"]
        if "best_val_CER" in row and "val_curve_x4" in row:
            row["same_steps"] = same_steps(row["best_val_CER"], row["stage1_steps"], row["val_curve_x4"])
        if "paired_greedy_CER" in r:
            p = r["paired_greedy_CER"]
            row.update(two_stage_vs_session_layers=p["ratio"], two_stage_vs_session_layers_95=p["ratio_95"],
                       two_stage_better=bool(p["ratio_95"][1] < 1))
        row["wall_s"] = sum(r.get(f"x{b:g}", {}).get("wall_s", 0.0) for b in BUDGETS)
        rows.append(row)
    ratio_rows = [r for r in rows if "within_ratio" in r]
    method_rows = [r for r in rows if "two_stage_better" in r]
    return {"cells": rows, "n_cells": len(rows), "n_ok": sum("failed" not in r and "pending" not in r for r in rows),
            "n_pending": sum("pending" in r for r in rows),
            "n_all_pieces": sum("failed" not in r and not r.get("missing") for r in rows),
            "n_ratio": len(ratio_rows), "within_ratio": sum(r["within_ratio"] for r in ratio_rows),
            "n_methods": len(method_rows), "two_stage_better": sum(r["two_stage_better"] for r in method_rows),
            "targets": {"ratio_to_x4_at_most": CER_RATIO_TARGET, "within_ratio_in": "every cell",
                        "two_stage_better_in": "most cells"}}


def same_steps(best: float, steps: int, curve_x4: list) -> dict:
    """Where a 4x run's lead comes from: the best validation CER of the default-budget run (``best``, over its
    ``steps`` stage-1 steps) against the 4x run's best among its evaluations up to the same step, and over its
    whole run (``curve_x4``: ``[step, CER, loss]`` rows). If the 4x run is no better by the same step, its lead
    is the steps the default budget did not reach; if it is already better there, the schedule (the 4x patience
    and the later end-of-budget decay) is part of it."""
    by_then = [c for s, c, _ in curve_x4 if s <= steps]
    return {"steps": int(steps), "best_val_CER": best,
            "best_val_CER_x4_by_then": min(by_then) if by_then else float("nan"),
            "best_val_CER_x4": min(c for _, c, _ in curve_x4)}


def _pct(x: float) -> str:
    return "-" if x != x else f"{100 * x:.1f}"


def markdown(summary: dict, machine: str) -> str:
    lines = [f"# Robustness of the bci-train recipe ({summary['n_ok']} of {summary['n_cells']} cells measured for "
             f"both targets, {summary.get('n_all_pieces', 0)} with all four pieces)", "",
             f"Measured by `python bench/bench_bci_robust.py` on {machine}.", "",
             "| signal | drift | held-in | trials | jumps | seed | two-stage CER % (x1) | (x4) | ratio x1 / x4 [95%] | "
             "session layers % (x1) | (x4) | two-stage / session layers [95%] | stage-1 steps x1 / x4 (stop) | "
             "learned | pieces missing |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def pct(row: dict, field: str) -> str:
        return _pct(row[field]) if field in row else "-"

    for r in summary["cells"]:
        if "failed" in r:
            lines.append(f"| {r['key']} | failed: {r['failed'][:80]} |" + " |" * 13)
            continue
        c = r["cell"]
        ratio = "-"
        if "ratio_to_x4" in r:
            ratio = f"{r['ratio_to_x4']:.2f}"
            if "ratio_to_x4_95" in r:
                ratio += " [{:.2f}, {:.2f}]".format(*r["ratio_to_x4_95"])
            ratio += "" if r["within_ratio"] else " (over)"
        methods = "-"
        if "two_stage_vs_session_layers" in r:
            lo, hi = r["two_stage_vs_session_layers_95"]
            methods = f"{r['two_stage_vs_session_layers']:.2f} [{lo:.2f}, {hi:.2f}]"
        steps = (f"{r.get('stage1_steps', '-')} / {r.get('stage1_steps_x4', '-')} "
                 f"({r.get('stage1_stop', '-')} / {r.get('stage1_stop_x4', '-')})")
        learned = {True: "yes", False: "NO"}.get(r.get("learned"), "-")
        lines.append(
            f"| {c['signal']:g}x | {c['drift']:g}x | {c['held_in']} | {c['trials']} | {'yes' if c['jumps'] else 'no'} "
            f"| {r['seed']} | {pct(r, 'two_stage_CER')} | {pct(r, 'two_stage_CER_x4')} | {ratio} | "
            f"{pct(r, 'session_layers_CER')} | {pct(r, 'session_layers_CER_x4')} | {methods} | {steps} | {learned} | "
            f"{', '.join(r.get('missing', [])) or '-'} |")
    if summary.get("n_pending"):
        lines += ["", f"- {summary['n_pending']} of {summary['n_cells']} cell(s) lack a piece a target needs; each "
                  "target below is counted over the cells whose pieces for it are in."]
    if summary.get("n_all_pieces", 0) < summary["n_cells"] - summary.get("n_pending", 0):
        lines += ["", "- The 4x session-layers piece (does the baseline gain from a longer run too?) is optional: "
                  "no target needs it."]
    lines += ["", f"- Default budget within {CER_RATIO_TARGET}x of the 4x run (two-stage greedy CER): "
              f"{summary['within_ratio']} of {summary['n_ratio']} cells with both two-stage pieces "
              "(target: every cell).",
              f"- Two-stage below session layers (paired bootstrap 95% interval of the greedy-CER ratio below 1): "
              f"{summary['two_stage_better']} of {summary['n_methods']} cells with both default-budget pieces "
              "(target: most cells)."]
    paired = [r for r in summary["cells"] if "same_steps" in r]
    if paired:
        lines += ["", "The two budgets at the same step (two-stage, stage 1's validation greedy CER on the held-in "
                  "sessions' withheld trials): the default budget's best, the 4x run's best by the same step, and "
                  "the 4x run's best over its whole run. A 4x run that is better only after that step owes its lead "
                  "to the steps the default budget did not reach; the held-out CER above can still move otherwise "
                  "(a closer fit to the held-in days need not carry over to later ones).", "",
                  "| cell | default budget's steps | its best validation CER % | 4x run's best by then % | "
                  "4x run's best % |", "| --- | --- | --- | --- | --- |"]
        for r in paired:
            q = r["same_steps"]
            lines.append(f"| {r['key']} | {q['steps']} | {_pct(q['best_val_CER'])} | "
                         f"{_pct(q['best_val_CER_x4_by_then'])} | {_pct(q['best_val_CER_x4'])} |")
    if summary.get("pieces"):
        hosts: dict[str, int] = {}
        for piece in summary["pieces"]:
            name = piece.get("host") or "not recorded"
            hosts[name] = hosts.get(name, 0) + 1
        lines += ["", "Where the pieces ran (their records' `host`; a time budget's steps depend on it): "
                  + "; ".join(f"{h}: {n}" for h, n in sorted(hosts.items())) + "."]
        lines += ["", "Sentence-end marks per piece: held-out prompts ending in `~` / `?` whose greedy text lacks "
                  "the mark, and the greedy CER with those marks restored (nothing else changed).", "",
                  "| cell | budget | method | greedy CER % | end marks missed | CER % with the marks restored |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for p in summary["pieces"]:
            e = p["end_marks"]
            lines.append(f"| {p['key']} | x{p['budget']:g} | {p['method']} | {_pct(p['greedy_CER'])} | "
                         f"{e['missed']} of {e['of']} | {_pct(e['CER_end_restored'])} |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator, ScalarFormatter

    full = [r for r in summary["cells"] if "ratio_to_x4" in r]  # both two-stage pieces in
    rows = [r for r in summary["cells"] if "two_stage_vs_session_layers" in r]  # both default-budget pieces in
    curves = [r for r in summary["cells"] if "val_curve" in r and "val_curve_x4" in r]  # both pieces' curves
    fig, axes = plt.subplots(1, 3 if curves else 2, figsize=(16.5 if curves else 11, 4))
    x4 = np.array([r["two_stage_CER_x4"] for r in full])
    x1 = np.array([r["two_stage_CER"] for r in full])
    ax = axes[0]
    ax.scatter(100 * x4, 100 * x1, c=["C0" if r["within_ratio"] else "C3" for r in full])
    top = 100 * max([*x1, *x4, 0.01]) * 1.1
    ax.plot([0, top], [0, top], "k:", lw=1, label="equal")
    ax.plot([0, top], [0, CER_RATIO_TARGET * top], "C3--", lw=1, label=f"{CER_RATIO_TARGET}x")
    ax.set_xlabel("two-stage greedy CER %, 4x budget")
    ax.set_ylabel("two-stage greedy CER %, default budget")
    ax.set_title(f"default vs 4x budget ({len(full)} cells with both pieces)", fontsize=9)
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.set_title(f"two-stage vs session layers, default budget ({len(rows)} cells)", fontsize=9)
    ratios = [r["two_stage_vs_session_layers"] for r in rows]
    lo = [r["two_stage_vs_session_layers"] - r["two_stage_vs_session_layers_95"][0] for r in rows]
    hi = [r["two_stage_vs_session_layers_95"][1] - r["two_stage_vs_session_layers"] for r in rows]
    ax.errorbar(np.arange(len(rows)), ratios, yerr=[lo, hi], fmt="o", capsize=3)
    ax.axhline(1.0, color="k", ls=":", lw=1)
    ax.set_xticks(np.arange(len(rows)))
    ax.set_xticklabels([cell_name(r["cell"], r["seed"], False).rsplit("_seed", 1)[0].replace("_", "\n")
                        for r in rows], fontsize=5)
    ax.set_ylabel("greedy CER ratio, two-stage / session layers")
    if curves:
        ax = axes[2]
        for i, r in enumerate(curves):
            label = cell_name(r["cell"], r["seed"], False).rsplit("_seed", 1)[0]
            for field, style, suffix in (("val_curve", "-", " (default)"), ("val_curve_x4", "--", " (4x)")):
                steps, cer = zip(*[(s, c) for s, c, _ in r[field]], strict=True)
                ax.plot(steps, 100 * np.asarray(cer), style, color=f"C{i}", lw=1, label=label + suffix)
            ax.axvline(r["stage1_steps"], color=f"C{i}", ls=":", lw=0.8)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(FixedLocator([0.2, 0.5, 1, 2, 5, 10, 20, 50, 100]))
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("stage-1 step")
        ax.set_ylabel("validation greedy CER % (held-in, withheld trials)")
        ax.set_title("two-stage stage 1: default budget (solid, ends at the dotted line) and 4x (dashed)", fontsize=9)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _side(spec: str) -> tuple[Path, float | None]:
    """``FOLDER`` or ``FOLDER:xB`` (a budget, 1 or 4) -> the folder's cells file and the budget, if one."""
    folder, _, budget = spec.rpartition(":x") if ":x" in spec else (spec, "", "")
    b = float(budget) if budget else None
    if b is not None and b not in BUDGETS:
        raise SystemExit(f"bench_bci_robust.py: error: --compare {spec}: budget x{budget} is not one of "
                         f"{', '.join(f'x{x:g}' for x in BUDGETS)}")
    path = Path(folder) / "bci_robust_cells.jsonl"
    if not path.exists():
        raise SystemExit(f"bench_bci_robust.py: error: --compare {spec}: no {path}; give a results folder "
                         "that holds pieces (a --out of an earlier run)")
    return path, b


def compare(spec_a: str, spec_b: str) -> list[dict]:
    """Pieces of two results folders paired by cell, seed and method (and budget, unless a side names one with
    ``FOLDER:xB``; a side without one then takes the other's): greedy CER of each, the sentence-end marks each
    misses (:func:`end_marks`), and the ratio a / b with the paired bootstrap over the held-out trials
    (:func:`_paired`, the report's own). For a recipe change measured in its own ``--out`` folder against the
    grid's pieces, or a piece against another seed's folder."""
    from closedloop.sdk.grid import read_results

    (path_a, budget_a), (path_b, budget_b) = _side(spec_a), _side(spec_b)
    if (budget_a is None) != (budget_b is None):  # a side without a budget takes the other side's
        budget_a, budget_b = budget_a or budget_b, budget_b or budget_a
    sides = []
    for path, budget in ((path_a, budget_a), (path_b, budget_b)):
        pieces = {}
        for key, rec in read_results(path).items():
            if rec.get("status") != "ok" or (budget is not None and rec["result"]["budget"] != budget):
                continue
            r = rec["result"]
            pieces[(key.rsplit("_x", 1)[0], r["method"], None if budget is not None else r["budget"])] = rec
        sides.append(pieces)
    rows = []
    for k in sorted(sides[0].keys() & sides[1].keys(), key=str):
        a, b = sides[0][k]["result"], sides[1][k]["result"]
        paired = _paired({("a", ""): a, ("b", ""): b}, ("a", ""), ("b", ""), a["seed"])
        rows.append({"cell": k[0], "method": k[1], "budget_a": a["budget"], "budget_b": b["budget"],
                     "greedy_CER_a": a["scores"]["greedy_CER"], "greedy_CER_b": b["scores"]["greedy_CER"],
                     "recipe_a": (sides[0][k].get("config") or {}).get("recipe") or {},
                     "recipe_b": (sides[1][k].get("config") or {}).get("recipe") or {},
                     "end_marks_a": end_marks(a["scores"]), "end_marks_b": end_marks(b["scores"]),
                     "ratio": paired["ratio"], "ratio_95": paired["ratio_95"]})
    return rows


def compare_markdown(rows: list[dict], spec_a: str, spec_b: str) -> str:
    lines = [f"a = {spec_a}, b = {spec_b}: held-out greedy CER (mean of the held-out days), ratio a / b with its 95% "
             "interval (paired bootstrap over held-out trials, 2000 resamples)", "",
             "| cell | method | budgets a, b | CER a % | CER b % | end marks missed a, b | a / b [95%] |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lo, hi = r["ratio_95"]
        ea, eb = r["end_marks_a"], r["end_marks_b"]
        lines.append(f"| {r['cell']} | {r['method']} | x{r['budget_a']:g}, x{r['budget_b']:g} | "
                     f"{_pct(r['greedy_CER_a'])} | {_pct(r['greedy_CER_b'])} | {ea['missed']} / {ea['of']}, "
                     f"{eb['missed']} / {eb['of']} | {r['ratio']:.2f} [{lo:.2f}, {hi:.2f}] |")
    if not rows:
        lines.append("| (no piece of the same cell, seed and method in both) | | | | | | |")
    return "\n".join(lines) + "\n"


def _machine() -> str:
    import platform

    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def report(cells_path: Path, out_dir: Path, stem: str) -> dict:
    from closedloop.sdk.grid import read_results

    records = list(read_results(cells_path).values())
    if not records:
        raise SystemExit(f"bench_bci_robust.py: error: no cells in {cells_path}; run the grid first")
    summary = summarize(assemble(records))
    summary["pieces"] = piece_rows(records)
    summary["machine"] = _machine()
    tmp = out_dir / f".{stem}.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2, default=float))
    os.replace(tmp, out_dir / f"{stem}.json")
    (out_dir / f"{stem}.md").write_text(markdown(summary, summary["machine"]))
    plot(summary, out_dir / f"{stem}.png")
    print(markdown(summary, summary["machine"]))
    print(f"wrote {out_dir / stem}.json, .md, .png")
    return summary


def _commit() -> str | None:
    """The checkout's commit (with ``+dirty`` for uncommitted changes), recorded with each piece: a piece's result
    belongs to the recipe it ran."""
    import subprocess

    try:
        here = Path(__file__).resolve().parent
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             check=True).stdout.strip()
        # code only: a report rebuilt into bench/results, or a docs edit, does not change what a piece runs
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ":/",
                                ":(exclude,top)bench/results", ":(exclude,top)docs", ":(exclude,top,glob)**/*.md"],
                               cwd=here, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("+dirty" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--full", action="store_true", help="every combination of the axes (72 cells)")
    p.add_argument("--tiny", action="store_true", help="the smoke grid: tiny data and models (3 cells, about a minute)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="model seeds (default 0)")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--report", action="store_true", help="only the tables and the plot from the stored cells")
    p.add_argument("--address", default=None, help="a Ray cluster's address (default: a local Ray instance)")
    p.add_argument("--workers", type=int, default=None,
                   help="pieces at once on a local Ray instance (default: cores); 1: one after another in this "
                        "process, with the training's progress on this terminal")
    p.add_argument("--out", default=RESULTS, help=f"results folder (default {RESULTS})")
    p.add_argument("--cell", type=int, nargs="+", default=None,
                   help="only the design's cells of these indices (0: the default cell)")
    p.add_argument("--budget", type=float, choices=BUDGETS, default=None, help="only the pieces of this budget")
    p.add_argument("--method", choices=METHODS, default=None, help="only the pieces of this method")
    p.add_argument("--min-steps", type=int, default=None,
                   help="a Recipe.min_steps other than the default (the scaled ceiling's floor), to try a rule "
                        "change; with --out elsewhere, so its pieces stay apart from the default recipe's")
    p.add_argument("--min-patience-steps", type=int, default=None,
                   help="a Recipe.min_patience_steps other than the default (the patience's floor in steps), to try a "
                        "rule change; with --out elsewhere")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), default=None,
                   help="pair the pieces of two results folders (FOLDER or FOLDER:x1 / FOLDER:x4 for one budget) by "
                        "cell, seed and method, and print greedy CER a / b with its paired bootstrap interval; "
                        "with --json, the rows as JSON")
    p.add_argument("--json", action="store_true", help="with --compare: the rows as JSON on stdout")
    a = p.parse_args(argv)
    if a.compare:
        rows = compare(*a.compare)
        print(json.dumps(rows, indent=2, default=float) if a.json else compare_markdown(rows, *a.compare), end="")
        return 0
    if a.json:
        p.error("--json goes with --compare")
    settings = {k: v for k, v in (("min_steps", a.min_steps), ("min_patience_steps", a.min_patience_steps))
                if v is not None}
    if settings and Path(a.out) == Path(RESULTS):
        p.error(f"--{next(iter(settings)).replace('_', '-')} changes the recipe: give it its own --out folder")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "bci_robust_tiny" if a.tiny else "bci_robust"
    cells_path = out / f"{stem}_cells.jsonl"
    if not a.report:
        from closedloop.sdk.grid import Cell, run_grid

        designs = tiny_cells() if a.tiny else every_combination() if a.full else one_at_a_time()
        if a.cell is not None:
            if bad := [i for i in a.cell if not 0 <= i < len(designs)]:
                p.error(f"--cell {bad[0]}: the design has cells 0 to {len(designs) - 1}")
            designs = [designs[i] for i in a.cell]
        budgets = [b for b in BUDGETS if a.budget is None or b == a.budget]
        methods = [m for m in METHODS if a.method is None or m == a.method]
        commit = _commit()
        cells = [Cell({**c, "tiny": a.tiny, "data_seed": a.data_seed, "budget": b, "method": m, "commit": commit,
                       "recipe": settings}, seed,
                      name=f"{cell_name(c, seed, a.tiny)}_x{b:g}_{m}")
                 for c in designs for seed in a.seeds for b in budgets for m in methods]
        print(f"{len(cells)} pieces ({len(designs)} cells x {len(a.seeds)} seeds x {len(budgets)} budgets x "
              f"{len(methods)} methods) -> {cells_path}", flush=True)
        # --workers 1 without --address: in this process (run_grid's rule; its training progress on this
        # terminal, no Ray instance to start or to lose); more, or a cluster: Ray
        records = run_grid(run_cell, cells, results=cells_path, address=a.address, workers=a.workers,
                           desc="bci_robust")
        failed = [r for r in records if r["status"] != "ok"]
        for r in failed:
            print(f"cell {r['key']} failed: {r['error'].splitlines()[0]}", file=sys.stderr)
    report(cells_path, out, stem)
    return 0


if __name__ == "__main__":
    sys.exit(main())
