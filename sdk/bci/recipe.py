"""The training recipe of ``closedloop bci-train``: train until the decoder has learned, within a budget.

* **Validation split** (:func:`split_validation`): from each held-in session, a seeded
  random ``validation_fraction`` of the trials it may learn from (at least one where the
  session has two or more) is withheld from both stages and from the session's
  normalisation.
* **Stopping** (:func:`closedloop.sdk.bci.train.fit_ctc`): stage 1 is scored on the
  validation trials (greedy CER) every ``eval_every`` steps; after ``patience`` evaluations
  (and at least ``min_patience_steps`` steps) without a lower CER (counted once validation
  emits a character) its learning rate
  halves, and at such a plateau at the rate's floor it stops; when 80% of the step
  ceiling or of the time budget is used a final decay to the floor ends it there. It keeps
  the best evaluation's weights (:class:`closedloop.sdk.bci.train.PlateauSchedule`).
* **Scaling** (:func:`scaled_train_config`): unless set explicitly, the GRU's width
  follows the channel count, its depth the characters of training text, and the step
  ceiling the training trials (which grow with sessions).
* **Not learned** (:attr:`RecipeResult.problems`): best validation greedy CER above
  ``unlearned_cer`` or no character emitted, for stage 1 and for the two-stage decoder
  (stage 2's meta-learned alignment fitted on a few training sentences of each held-in
  session, scored on its validation trials).

docs/bci.md, "The training recipe", states the rules and their numbers.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from closedloop.common.atomic import refuse_existing
from closedloop.common.config import JsonConfig

from .progress import Progress, format_seconds

__all__ = ["Recipe", "RecipeFit", "RecipePlan", "RecipeResult", "fit_recipe", "plan_recipe", "scaled_train_config",
           "split_validation", "train_recipe", "validation_examples", "write_curve"]


# the scaled step ceiling's bounds (scaled_train_config): the floor's default (Recipe.min_steps) and the top
MIN_STEPS = 2000
MAX_STEPS = 20_000


@dataclass
class Recipe(JsonConfig):
    """What ``bci-train`` adds to a harness configuration's training settings."""

    validation_fraction: float = 0.1
    eval_every: int = 0  # 0: an eightieth of the step ceiling (5 epochs when scaled), at least 10 steps
    patience: int = 6
    time_budget_s: float = 1800.0  # stage 1 and stage 2 together; 0: none
    # the time budget's share kept for stage 2: stage 1 stops at (1 - share) of it, stage 2 at its end
    stage2_share: float = 0.1
    unlearned_cer: float = 0.4
    scale: bool = True  # model size and step ceiling from the data (scaled_train_config)
    seed: int = 0
    # multiplies the step ceiling, the time budget and the patience: 4 is bench_bci_robust.py's "4x budget",
    # the run against which the default one is judged (did it stop before it had learned?)
    budget: float = 1.0
    # the scaled step ceiling's floor (scaled_train_config): the ceiling is 400 epochs, at least this many steps
    min_steps: int = MIN_STEPS
    # the patience's floor in steps: at least this many steps without progress before the rate halves, however
    # close together the evaluations (an eightieth of a small recording's ceiling is a few dozen steps). Not
    # multiplied by ``budget``, which multiplies the patience counted in evaluations. 0: no floor
    min_patience_steps: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.validation_fraction < 1.0:
            raise ValueError(f"validation_fraction {self.validation_fraction}: use a fraction between 0 and 1 "
                             "(0.1 withholds a tenth of each held-in session's trials)")
        if self.patience < 1:
            raise ValueError(f"patience {self.patience}: at least 1 evaluation")
        if not (math.isfinite(self.time_budget_s) and self.time_budget_s >= 0):
            raise ValueError(f"time budget {self.time_budget_s} s: use a positive number of seconds, or 0 for none")
        if self.eval_every < 0:
            raise ValueError(f"eval_every {self.eval_every}: steps between validation evaluations, 1 or more (0: an "
                             "eightieth of the step ceiling)")
        if not 0.0 < self.unlearned_cer <= 1.0 or not math.isfinite(self.unlearned_cer):
            raise ValueError(f"unlearned_cer {self.unlearned_cer}: a validation greedy CER above which the decoder "
                             "has not learned, between 0 and 1 (0.4 is the default)")
        if not 0.0 <= self.stage2_share < 1.0:
            raise ValueError(f"stage2_share {self.stage2_share}: the fraction of the time budget kept for stage 2, "
                             "from 0 up to (not including) 1")
        if self.min_patience_steps < 0:
            raise ValueError(f"min_patience_steps {self.min_patience_steps}: a number of steps, 0 for no floor")
        if not 1 <= self.min_steps <= MAX_STEPS:
            raise ValueError(f"min_steps {self.min_steps}: the scaled ceiling's floor, from 1 to {MAX_STEPS} steps")
        if not (self.budget > 0 and self.budget <= 1000):
            raise ValueError(f"budget {self.budget}: a positive multiple of the default budget, up to 1000 (1 is the "
                             "default; 4 the robustness benchmark's longer run)")


def split_validation(sessions: Sequence[Any], fraction: float, seed: int = 0) -> tuple[list, dict[str, list[int]]]:
    """Withhold validation trials from every held-in session.

    Returns copies of ``sessions`` in which each held-in session's validation trials are
    added to its ``evaluation`` list (so :func:`~closedloop.sdk.bci.data.fit_indices`, and
    with it both stages and the session's normalisation, leave them out), and the
    validation trial indices per session name. A session with ``n`` trials to learn from
    gives ``round(fraction * n)`` of them, at least 1 when ``n >= 2``, none when ``n < 2``.
    """
    from .data import fit_indices

    out, val = [], {}
    for k, s in enumerate(sessions):
        if s.split != "held_in":
            out.append(s)
            continue
        idx = fit_indices(s)
        n_val = 0 if len(idx) < 2 else min(len(idx) - 1, max(1, round(fraction * len(idx))))
        pick = sorted(int(i) for i in np.random.default_rng([seed, k]).choice(idx, n_val, replace=False)) if n_val else []
        val[s.name] = pick
        out.append(dataclasses.replace(s, evaluation=sorted(set(s.evaluation) | set(pick))))
    return out, val


def validation_examples(train_sessions: Sequence[Any], val: dict[str, list[int]], std_floor: float) -> list:
    """The validation trials as examples, each normalised with its session's (training-trial) statistics and
    indexed by its place among the held-in sessions (as :func:`~closedloop.sdk.bci.train.held_in_examples`)."""
    from .data import make_examples, session_normalization

    held_in = [s for s in train_sessions if s.split == "held_in"]
    out = []
    for k, s in enumerate(held_in):
        if val.get(s.name):
            out += make_examples(s, val[s.name], session_normalization(s, std_floor), session_index=k)
    return out


def data_size(train_sessions: Sequence[Any]) -> dict:
    """Channels, held-in sessions, training trials and training characters (the scaling rule's inputs)."""
    from .data import fit_indices

    held_in = [s for s in train_sessions if s.split == "held_in"]
    trials = [s.trials[i] for s in held_in for i in fit_indices(s)]
    return {"channels": held_in[0].n_channels if held_in else 0, "sessions": len(held_in), "trials": len(trials),
            "characters": int(sum(len(t.sentence) for t in trials))}


def scaled_train_config(base: Any, size: dict, keep: frozenset[str] = frozenset(), min_steps: int = MIN_STEPS) -> Any:
    """``base`` (a TrainConfig) with the model size and step ceiling the data call for.

    * width: ``n_hidden`` = the channel count rounded up to a multiple of 32, within [64, 512]
      (the first layer does not squeeze the channels);
    * depth: 2 GRU layers from 20,000 characters of training text, else 1;
    * ceiling: ``steps`` = 400 epochs of the training trials in batches of ``batch_size``,
      within [``min_steps``, 20000] (a bound, not the plan: patience and the time budget end most runs).

    ``keep`` names what a user set and stays: ``"backbone"`` and/or ``"steps"``.
    """
    from .train import BackboneConfig

    width = min(512, max(64, 32 * math.ceil(size["channels"] / 32)))
    depth = 2 if size["characters"] >= 20_000 else 1
    steps = min(MAX_STEPS, max(min_steps, math.ceil(400 * size["trials"] / base.batch_size)))
    out = base
    if "backbone" not in keep:
        out = dataclasses.replace(out, backbone=BackboneConfig(width, depth, base.backbone.dropout))
    if "steps" not in keep:
        out = dataclasses.replace(out, steps=steps)
    return out


@dataclass
class RecipeResult:
    """What :func:`train_recipe` did. ``learned`` is False when ``problems`` is not empty."""

    bundle: str
    curve: str
    summary: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def learned(self) -> bool:
        return not self.problems

    def format(self) -> str:
        s = self.summary
        s1, s2 = s["stage1"], s["stage2"]
        lines = [
            f"stage 1 (pooled backbone {s['model']['n_hidden']}x{s['model']['n_layers']}): {s1['steps_run']} of "
            f"{s1['ceiling']} steps, {stop_text(s1['stop_reason'], s1.get('run_stop_reason'), s1['other_runs'])}; "
            "best validation greedy CER "
            f"{_pct(s1['best_val_CER'])} / WER {_pct(s1['best_val_WER'])} at step {s1['best_step']} "
            f"({s['validation']['trials']} validation trials); {format_seconds(s1['wall_s'])}"
            + (f" (and {format_seconds(s1['other_runs_wall_s'])} in {len(s1['other_runs'])} other run(s), not kept: "
               + ", ".join(f"seed {r['seed']}, {r['steps']} steps"
                           + (f", best validation CER {_pct(r['best_val_CER'])}" if r["best_val_CER"] is not None else "")
                           for r in s1["other_runs"]) + ")" if s1.get("other_runs") else ""),
            f"stage 2 (meta-learned alignment): {s2['steps']} meta-steps; two-stage validation greedy CER "
            f"{_pct(s2['val_CER'])} / WER {_pct(s2['val_WER'])}; {format_seconds(s2['wall_s'])}",
            f"total {format_seconds(s['wall_s'])}; curve {self.curve}",
        ]
        lines += [f"NOT LEARNED: {p}" for p in self.problems]
        return "\n".join(lines)


def _other_run(run: dict) -> dict:
    """A run stage 1 did not keep, for the summary: its seed, steps, time and best validation CER (None without)."""
    cers = [v["CER"] for v in run.get("validation") or []]
    return {"seed": run["seed"], "steps": len(run["loss"]), "wall_s": float(run["wall_s"]),
            "best_val_CER": min(cers) if cers else None}


def _pct(x: float | None) -> str:
    return "n/a" if x is None or x != x else f"{x:.1%}"


def _stage2_validation(backbone: Any, meta: Any, train_sessions: Sequence[Any], val: dict[str, list[int]],
                       harness: Any) -> dict:
    """The two-stage decoder on held-in data: per held-in session, the meta-learned alignment fitted (its inner loop,
    untuned) on the session's first ``meta.n_support`` training sentences, greedy CER on its validation trials."""
    from .calibrate import calibrate_session, trials_to_examples
    from .data import fit_indices, session_normalization
    from .metrics import to_words
    from .models import AlignedDecoder
    from .train import validation_scores

    config = dataclasses.replace(harness.calibration, optimizer="meta", tune=False)
    texts_rows = []
    model = AlignedDecoder(meta.new_alignment(), backbone)
    for s in train_sessions:
        if s.split != "held_in" or not val.get(s.name):
            continue
        norm = session_normalization(s, harness.calibration.std_floor)
        support = [s.trials[i] for i in fit_indices(s)[: harness.meta.n_support]]
        fitted = calibrate_session(model, support, config, meta=meta, normalization=norm).model
        ex = trials_to_examples([s.trials[i] for i in val[s.name]], norm)
        texts_rows.append((validation_scores(fitted, lambda x, b, m=fitted: m(x)[0], ex, next(backbone.parameters()).device),
                           sum(len(e.sentence) for e in ex), sum(len(to_words(e.sentence)) for e in ex)))
    if not texts_rows:
        return {"CER": float("nan"), "WER": float("nan"), "chars": 0, "ends_missed": 0, "ends_of": 0}
    n_c = sum(r[1] for r in texts_rows)
    n_w = sum(r[2] for r in texts_rows)
    return {"CER": sum(r[0]["CER"] * r[1] for r in texts_rows) / n_c,
            "WER": sum(r[0]["WER"] * r[2] for r in texts_rows) / max(n_w, 1),
            **{k: sum(r[0][k] for r in texts_rows) for k in ("chars", "ends_missed", "ends_of")}}


def write_curve(log: Any, meta_log: Any, path: str | Path) -> Path:
    """Stage 1's training loss and validation CER, and stage 2's query loss, as a PNG (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    ax = axes[0]
    ax.plot(np.arange(1, len(log.loss) + 1), log.loss, lw=0.6, color="0.6", label="training loss")
    if len(log.loss) >= 25:
        ax.plot(np.arange(25, len(log.loss) + 1), log.smoothed(25), color="C0", label="mean of 25 steps")
    if log.validation:
        ax.plot([v["step"] for v in log.validation], [v["loss"] for v in log.validation], "s-", ms=3,
                color="C1", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("CTC loss per character (log scale)")
    if log.loss and min(log.loss) > 0:
        ax.set_yscale("log")  # the first steps' loss is 100x the trained one: a linear axis hides the learning
    ax.set_title("stage 1: pooled backbone")
    if log.validation:
        ax2 = ax.twinx()
        steps = [v["step"] for v in log.validation]
        ax2.plot(steps, [v["CER"] for v in log.validation], "o-", ms=3, color="C3", label="validation greedy CER")
        ax2.axvline(log.best_step, color="C3", ls=":", lw=1)
        ax2.set_ylabel("validation greedy CER", color="C3")
        ax2.set_ylim(0, 1.05 * max(max(v["CER"] for v in log.validation), 0.01))
    ax.legend(loc="upper right", fontsize=8)
    axes[1].plot(np.arange(1, len(meta_log.loss) + 1), meta_log.loss, color="C2")
    axes[1].set_xlabel("meta-step")
    axes[1].set_ylabel("query CTC loss")
    axes[1].set_title("stage 2: meta-learned alignment")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


@dataclass
class RecipeFit:
    """What :func:`fit_recipe` trained: the models, the sessions without their validation trials, the
    validation trials per session, the stage logs, stage 2's validation scores and the settings used."""

    models: Any
    train_sessions: list
    validation: dict[str, list[int]]
    validation_examples: list
    harness: Any
    size: dict
    best: dict
    two_stage: dict
    problems: list[str]
    meta_s: float
    wall_s: float
    deadline: float | None

    def summary(self, recipe: Recipe) -> dict:
        """The JSON summary ``bci-train --json`` prints (less the bundle's and the curve's paths)."""
        tc, log, meta_log = self.harness.train, self.models.logs["backbone"], self.models.logs["meta"]
        out = {
            "learned": not self.problems, "problems": self.problems, "threshold_CER": recipe.unlearned_cer,
            "data": self.size,
            "model": {"n_hidden": tc.backbone.n_hidden, "n_layers": tc.backbone.n_layers, "scaled": recipe.scale},
            "validation": {"fraction": recipe.validation_fraction, "seed": recipe.seed,
                           "trials": len(self.validation_examples),
                           "per_session": {k: len(v) for k, v in self.validation.items()}},
            "stage1": {"steps_run": log.steps_run, "ceiling": tc.steps, "stop_reason": log.stop_reason,
                       "run_stop_reason": getattr(log, "run_stop_reason", "") or log.stop_reason,
                       "best_step": log.best_step, "best_val_CER": self.best["CER"], "best_val_WER": self.best["WER"],
                       "eval_every": tc.eval_every, "patience": tc.patience, "lr_reductions": log.lr_reductions,
                       "decay_step": log.decay_step, "final_lr": log.final_lr, "restarts": len(log.restarts),
                       # the runs not kept (restarted off the CTC plateau, or beaten by a later one on validation)
                       "other_runs": [_other_run(r) for r in log.restarts],
                       "other_runs_wall_s": float(sum(r["wall_s"] for r in log.restarts)),
                       "wall_s": log.wall_s, "final_loss": float(np.mean(log.loss[-25:])) if log.loss else None,
                       "validation": log.validation},
            "stage2": {"steps": len(meta_log.loss), "stop_reason": meta_log.stop_reason,
                       "val_CER": self.two_stage["CER"], "val_WER": self.two_stage["WER"],
                       "val_chars": self.two_stage["chars"],
                       "val_end_marks": {"missed": self.two_stage["ends_missed"], "of": self.two_stage["ends_of"]},
                       "wall_s": self.meta_s},
            "time_budget_s": recipe.time_budget_s * recipe.budget, "stage2_share": recipe.stage2_share,
            "budget": recipe.budget, "wall_s": self.wall_s,
        }
        out["stage1"]["still_improving"] = still_improving(log)
        out["warnings"] = self.warnings()
        return out

    def warnings(self) -> list[str]:
        """Sentences for the user about a decoder that trained but may be worse than it could be: stage 1 ended by
        its time budget or ceiling while it was still improving, or had to restart off the CTC plateau; or the
        two-stage decoder, learned, leaves the sentence-end mark off most validation sentences that end with one
        (:func:`end_mark_warning`)."""
        log = self.models.logs["backbone"]
        out = [w] if (w := log.warning()) is not None else []
        if self.problems and (rose := rising_validation_loss(getattr(log, "validation", []))) is not None:
            (low_step, low), (last_step, last) = rose
            # not learned, and the validation loss went up while training went on: a longer run will not help
            out.append(f"stage 1's validation loss rose from {low:.3f} (step {low_step}) to {last:.3f} "
                       f"(step {last_step}) while it trained: the model fits the training trials without "
                       "generalising to held-back ones of the same days, so more steps will not help; check that the "
                       "inputs carry the signal (the right channels and bins, each cue on its trial) before training "
                       "longer")
        elif still_improving(log):
            limit = "time budget" if log.stop_reason == "time_budget" else "step ceiling"
            flag = "--time-budget" if limit == "time budget" else "--steps"
            out.append(("the decoder has NOT LEARNED (below), though " if self.problems else "")
                       + f"stage 1 was still improving when its {limit} ended it (best validation CER at step "
                       f"{log.best_step} of {log.steps_run}): a longer run (--budget 2, or a larger {flag}) may fit "
                       "the held-in days better; the validation trials come from those days, so judge a longer run "
                       "on a later day of your own (closedloop evaluate LONGER --against THIS): where days drift apart "
                       "it can score worse there")
        if not self.problems and (w := end_mark_warning(self.two_stage)) is not None:  # not learned says more
            out.append(w)
        return out


def rising_validation_loss(validation: list[dict],
                           margin: float = 1.05) -> tuple[tuple[int, float], tuple[int, float]] | None:
    """``(step, loss)`` of the lowest validation loss and of the last when the loss rose for good: at least 6
    evaluations, the lowest in the first half, and every evaluation of the last third above it by ``margin``; else
    None. The
    sign of a model that fits its training trials and nothing else (a recording with no signal), told apart
    from the early ups and downs of a run that is still learning."""
    losses = [(v["step"], v["loss"]) for v in validation if "loss" in v]
    n = len(losses)
    if n < 6:
        return None
    k = min(range(n), key=lambda i: losses[i][1])
    tail = losses[max(k + 1, n - n // 3):]
    if k > n // 2 or len(tail) < 2 or any(v <= margin * losses[k][1] for _, v in tail):
        return None
    return losses[k], losses[-1]


def end_mark_warning(scores: dict, share: float = 0.5) -> str | None:
    """A sentence for the user when the decoder's greedy text lacks the sentence-end mark (``~`` / ``?``) on more
    than ``share`` of the validation sentences that end with one (``scores``: :func:`validation_scores`' counts).
    The mark is the last thing a CTC decoder learns (a few labels per batch), and a run stopped before it learned
    it scores about one character per sentence worse on greedy text; ``greedy_end`` and a bundle with end
    completion write it anyway, plain greedy does not."""
    missed, of = scores.get("ends_missed", 0), scores.get("ends_of", 0)
    if not of or missed <= share * of:
        return None
    return (f"the decoder leaves the sentence-end mark off {missed} of {of} validation sentences that end with one: "
            "greedy text will not end sentences (evaluate's greedy_end, and a bundle written with --end-completion "
            "sentence-end, complete them); a longer run usually learns the mark (--budget 2, or --min-patience-steps "
            "500 with few trials per session)")


def _reason(reason: str) -> str:
    from .train import STARTED_CER

    return {"ceiling": "the step ceiling", "time_budget": "the time budget", "patience": "patience",
            "plateau_restart": f"the plateau-restart rule (no validation CER below {STARTED_CER:.0%} by its check "
                               "step)"}.get(reason, reason)


def stop_text(reason: str, run_reason: str | None = None, others: list | None = None) -> str:
    """``stopped by ...``: what ended stage 1 (``reason``) and, where the run kept is an earlier one than the last
    (restarts), what ended that one (``run_reason``)."""
    text = f"stopped by {_reason(reason)}"
    if run_reason and run_reason != reason:
        seed = f" from seed {others[-1]['seed']}" if others else ""
        text += (f" in its last restart{seed} (not kept); the run kept, the one with the best validation CER, had "
                 f"been ended by {_reason(run_reason)}")
    return text


def still_improving(log: Any, margin: float = 0.01) -> bool:
    """Stage 1 stopped by its time budget or ceiling while its validation CER was still coming down: the run had not
    converged (:attr:`~closedloop.sdk.bci.train.TrainingLog.converged`), its best evaluation is among its last
    ones (the last third of its evaluations, at least the last one and at most the last 6) and that best is at
    least ``margin`` (1 percentage point) below every evaluation before them. A run whose CER sat still for most of
    its evaluations, or that the plateau-restart rule ended, was not still improving: nothing says a longer one
    would do better."""
    rows = [v for v in getattr(log, "validation", []) if "CER" in v]
    if log.converged is not False or len(rows) < 2 or getattr(log, "run_stop_reason", "") == "plateau_restart":
        return False
    recent = max(1, min(6, len(rows) // 3))
    before, last = rows[:-recent], rows[-recent:]
    best = min(v["CER"] for v in last)
    return log.best_step in {v["step"] for v in last} and best <= min(v["CER"] for v in before) - margin


@dataclass
class RecipePlan:
    """What the recipe decides before training: the validation split, the (scaled) settings and the budget."""

    train_sessions: list
    validation: dict[str, list[int]]
    validation_examples: list
    harness: Any
    size: dict
    every: int
    patience: int
    budget_s: float
    t0: float
    stage2_share: float = 0.0

    @property
    def deadline(self) -> float | None:
        """The end of the whole time budget (None: no budget)."""
        return self.t0 + self.budget_s if self.budget_s else None

    @property
    def stage1_deadline(self) -> float | None:
        """Stage 1's end: the budget less the share kept for stage 2."""
        return self.t0 + self.budget_s * (1.0 - self.stage2_share) if self.budget_s else None


def plan_recipe(sessions: Sequence[Any], harness: Any, recipe: Recipe, keep: frozenset[str] = frozenset(),
                t0: float | None = None) -> RecipePlan:
    """The recipe's validation split, scaled training settings, evaluation spacing, patience and time budget
    (from ``t0``, default now), nothing trained: :func:`fit_recipe`'s first step, and what a baseline trained
    under the same rules starts from."""
    budget_s = recipe.time_budget_s * recipe.budget
    patience = max(1, round(recipe.patience * recipe.budget))
    held_in = [s for s in sessions if s.split == "held_in"]
    if not held_in:
        raise ValueError(f"none of the {len(sessions)} sessions is held-in: training needs held-in sessions "
                         "(FALCON H2's held-in files, or `closedloop generate-data`)")
    train_sessions, val = split_validation(sessions, recipe.validation_fraction, recipe.seed)
    size = data_size(train_sessions)
    tc = scaled_train_config(harness.train, size, keep, recipe.min_steps) if recipe.scale else harness.train
    if recipe.budget != 1:
        tc = dataclasses.replace(tc, steps=max(1, round(tc.steps * recipe.budget)))
    every = recipe.eval_every or max(10, tc.steps // 80)
    if recipe.budget != 1 and not recipe.eval_every:  # the same evaluation spacing as the default budget's
        every = max(10, round(tc.steps / recipe.budget) // 80)
    patience = max(patience, math.ceil(recipe.min_patience_steps / every))
    tc = dataclasses.replace(tc, eval_every=every, patience=patience, progress=False)
    harness = dataclasses.replace(harness, train=tc)
    val_ex = validation_examples(train_sessions, val, tc.std_floor)
    if not val_ex:
        raise ValueError("no held-in session has the 2 or more training trials a validation split needs")
    return RecipePlan(train_sessions, val, val_ex, harness, size, every, patience, budget_s,
                      time.perf_counter() if t0 is None else t0, recipe.stage2_share)


def fit_recipe(sessions: Sequence[Any], harness: Any, *, recipe: Recipe | None = None,
               keep: frozenset[str] = frozenset(), progress: Progress | None = None) -> RecipeFit:
    """Both stages of the two-stage decoder with the recipe (validation, early stopping, scaling, the not-learned
    check), nothing written. ``harness`` is a seeded :class:`~closedloop.sdk.bci.evaluate.HarnessConfig`; ``keep``
    names the training settings the user set, which scaling leaves alone (:func:`scaled_train_config`)."""
    from .baselines import TrainedModels
    from .meta import meta_train_alignment
    from .train import train_backbone

    recipe = recipe or Recipe()
    progress = progress or Progress()
    t0 = time.perf_counter()
    plan = plan_recipe(sessions, harness, recipe, keep, t0)
    train_sessions, val, val_ex, harness, size = (plan.train_sessions, plan.validation, plan.validation_examples,
                                                  plan.harness, plan.size)
    tc, every, patience, budget_s, deadline = harness.train, plan.every, plan.patience, plan.budget_s, plan.deadline
    held_in = [s for s in sessions if s.split == "held_in"]
    progress.note(f"validation: {len(val_ex)} trials withheld ({recipe.validation_fraction:.0%} of each held-in "
                  f"session's, seed {recipe.seed}); data: {size['channels']} channels, {size['sessions']} sessions, "
                  f"{size['trials']} training trials, {size['characters']} characters; model "
                  f"{tc.backbone.n_hidden}x{tc.backbone.n_layers}, at most {tc.steps} steps, validation every "
                  f"{every}, patience {patience}" + (f", time budget {format_seconds(budget_s)}" if deadline else ""))
    bar = progress.stage("stage 1: pooled backbone", tc.steps, plan.stage1_deadline)
    backbone, log = train_backbone(train_sessions, tc, val_ex, bar, plan.stage1_deadline)
    best = log.best() or {"CER": float("nan"), "WER": float("nan"), "chars": 0}
    bar.close(f"{log.steps_run} steps, {stop_text(log.stop_reason, log.run_stop_reason, log.restarts)}, best "
              f"validation CER {_pct(best['CER'])} at "
              f"step {log.best_step} (restored)")
    meta_cfg = harness.meta
    t_meta = time.perf_counter()
    progress.note(f"stage 2: meta-learning, at most {meta_cfg.meta_steps} meta-steps"
                  + (f", until the time budget's end ({format_seconds(max(0.0, deadline - t_meta))} left)"
                     if deadline else ""))
    bar2 = progress.stage("stage 2: meta-learning", meta_cfg.meta_steps, deadline)
    try:
        meta, meta_log = meta_train_alignment(backbone, train_sessions, dataclasses.replace(meta_cfg, progress=False),
                                              progress=bar2, deadline=deadline)
    finally:
        bar2.close()
    two_stage = _stage2_validation(backbone, meta, train_sessions, val, harness)
    meta_s = time.perf_counter() - t_meta
    progress.note(f"stage 2: {len(meta_log.loss)} meta-steps, stopped by {meta_log.stop_reason}; two-stage validation "
                  f"greedy CER {_pct(two_stage['CER'])} ({format_seconds(meta_s)})")

    problems = []
    threshold = recipe.unlearned_cer
    for what, row in (("stage 1 (pooled backbone)", best), ("stage 2 (two-stage decoder)", two_stage)):
        if not row["chars"]:
            problems.append(f"{what} emits no characters on the validation trials")
        elif not row["CER"] <= threshold:
            problems.append(f"{what} validation greedy CER {_pct(row['CER'])} is above the {threshold:.0%} "
                            "threshold")
    if problems:
        # a run stopped early may need more steps, unless its validation loss rose for good (more will not help)
        longer = log.stop_reason != "patience" and rising_validation_loss(log.validation) is None
        hint = ("raise --steps or --time-budget" if longer else
                "check the data (channels carry the signal, sentences match the trials) or a larger model "
                "(--config train.backbone)")
        problems[-1] += f"; {hint}"
    models = TrainedModels(held_in_days={s.name: float(s.day) for s in held_in}, backbone=backbone, meta=meta)
    models.logs.update(backbone=log, meta=meta_log)
    return RecipeFit(models, train_sessions, val, val_ex, harness, size, best, two_stage, problems, meta_s,
                     time.perf_counter() - t0, deadline)


def train_recipe(sessions: Sequence[Any], harness: Any, out: str | Path, *, recipe: Recipe | None = None,
                 keep: frozenset[str] = frozenset(), progress: Progress | None = None,
                 provenance: dict | None = None, end_completion: str | None = None,
                 overwrite: bool = False) -> RecipeResult:
    """Train the two-stage decoder with the recipe (:func:`fit_recipe`) and write the calibratable bundle ``out``
    and its curve ``<out>.curve.png``.

    A decoder that has not learned is still written; the result's ``problems`` say why it is not usable.
    """
    from .workflow import end_completion_marks, export_pooled_bundle

    refuse_existing(out, overwrite)  # before the training, not after it
    end_completion_marks(sessions, end_completion)  # so is a cue that breaks the sentence-end rule
    recipe = recipe or Recipe()
    fit = fit_recipe(sessions, harness, recipe=recipe, keep=keep, progress=progress)
    log, meta_log = fit.models.logs["backbone"], fit.models.logs["meta"]
    path = export_pooled_bundle(fit.models, fit.train_sessions, fit.harness, out, provenance={
        **(provenance or {}), "validation": {"fraction": recipe.validation_fraction, "seed": recipe.seed,
                                             "trials": fit.validation},
        # kept by calibration too: calibrate and evaluate warn about a bundle whose decoder had not learned
        "recipe": {"learned": not fit.problems, "problems": list(fit.problems)}}, end_completion=end_completion,
        overwrite=overwrite)
    curve = write_curve(log, meta_log, Path(str(path).removesuffix(".zip") + ".curve.png"))
    summary = {"bundle": str(path), "curve": str(curve), **fit.summary(recipe)}
    return RecipeResult(str(path), str(curve), summary, fit.problems)
