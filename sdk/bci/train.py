"""Stage 1: one GRU decoder trained with CTC on pooled held-in sessions.

The backbone sees every held-in session's training trials (its non-evaluation
trials), each normalised with its own session's statistics, through **no**
session-specific input layer: it must absorb cross-session variability itself, and
drift-suited augmentation (:class:`~closedloop.sdk.bci.augment.DriftAugmentation`, a fresh draw
per trial) widens the variability it sees. The same loop trains the baseline with
per-session input layers (:func:`train_session_layers`), so both get the same
recipe: Adam, cosine learning-rate decay, gradient clipping, the same augmentation
and number of steps.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from closedloop.common.config import JsonConfig
from closedloop.common.handwriting import Session

from .augment import DriftAugmentation, time_mask
from .data import (
    DEFAULT_STD_FLOOR,
    Batch,
    Example,
    collate,
    ctc_loss,
    fit_indices,
    iterate_batches,
    make_examples,
    resolve_device,
    session_normalization,
)
from .models import GRUBackbone, SessionInputDecoder


@dataclass
class BackboneConfig(JsonConfig):
    n_hidden: int = 256
    n_layers: int = 2
    dropout: float = 0.1


@dataclass
class TrainConfig(JsonConfig):
    """Stage-1 training (also used for the per-session-input-layer baseline)."""

    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    steps: int = 1500
    batch_size: int = 16
    lr: float = 3e-3
    lr_final_fraction: float = 0.05  # cosine decay from lr to lr * this
    warmup_steps: int = 0  # linear warm-up from lr / warmup_steps to lr before the cosine decay
    shortest_first_epochs: int = 1  # SortaGrad: the first epochs' batches shortest first (data.iterate_batches)
    weight_decay: float = 1e-5
    grad_clip: float = 1.0
    augmentation: DriftAugmentation = field(
        default_factory=lambda: DriftAugmentation(noise_std=0.3, offset_std=0.2, gain_std=0.15, walk_std=0.1)
    )
    time_mask_bins: int = 0
    # per-session input layers (baseline only): their learning rate relative to ``lr``. Adam moves every
    # one of a layer's C*C entries by about lr per step whatever its gradient, and each layer sees 1/n of
    # the data, so at the backbone's rate the layers fill with noise
    input_layer_lr_scale: float = 0.1
    std_floor: float = DEFAULT_STD_FLOOR
    # CTC training can sit on the plateau where the network emits blanks and the text's character statistics and
    # ignores its input. A run whose mean loss over the 25 steps before ``plateau_steps`` is above
    # ``plateau_fraction`` of its mean over the 25 steps before ``plateau_steps // 2`` has not left it: it is
    # restarted from a new initialisation (seed ``seed + 1000 * attempt``), at most ``max_restarts`` times; the last
    # attempt always runs to the end. Only runs longer than ``plateau_steps`` are checked; 0 turns the check off.
    plateau_steps: int = 200
    plateau_fraction: float = 0.8
    max_restarts: int = 2
    # validation (on when the trainer is given validation trials, as ``bci-train`` does; docs/bci.md, "The training
    # recipe"): greedy CER (and CTC loss) of the validation trials every ``eval_every`` steps; the run stops after
    # ``patience`` evaluations without progress at the rate's floor (counted from the first CER below STARTED_CER,
    # 75%), and the best checkpoint
    # is restored. ``steps`` is then a ceiling. ``time_budget_s`` (0: none) stops the run when it has used that much
    # wall time.
    eval_every: int = 50
    patience: int = 6
    patience_from_cer: float = 0.75  # STARTED_CER: patience counts from the first validation CER below this
    # an evaluation is progress when its validation CER is the lowest yet, or (with ``loss_progress`` set, in
    # (0, 1), e.g. 0.01) when its validation CTC loss per character is below (1 - ``loss_progress``) times the
    # lowest yet. None (the default) judges on the CER alone. The checkpoint kept is always the lowest CER's.
    loss_progress: float | None = None
    # with validation the learning rate follows the validation scores (ReduceLROnPlateau): after ``patience``
    # evaluations without progress it is multiplied by ``lr_reduce_factor`` and patience counts afresh; at a
    # plateau where one more reduction would take it below lr * lr_final_fraction the run stops. When the steps or
    # the time reach 1 - ``decay_fraction`` of the ceiling or of the time budget, a final cosine decay from the
    # current rate to that floor ends the run at the ceiling or the budget. PlateauSchedule; docs/bci.md
    lr_reduce_factor: float = 0.5
    decay_fraction: float = 0.2
    time_budget_s: float = 0.0
    seed: int = 0
    device: str = "auto"
    progress: bool = True

    def __post_init__(self) -> None:
        if self.loss_progress is not None and not 0.0 < self.loss_progress < 1.0:
            raise ValueError(f"train.loss_progress={self.loss_progress}: the fraction a validation loss must fall "
                             "below its lowest to count as progress, between 0 and 1 (e.g. 0.01), or null for the "
                             "CER alone")
        if self.plateau_steps and self.plateau_steps < 100:
            raise ValueError(f"train.plateau_steps={self.plateau_steps}: the plateau check compares two 25-step "
                             "windows half a check apart; use at least 100, or 0 to turn it off")


def restart_seed(seed: int, attempt: int) -> int:
    """Seed of restart ``attempt`` (0: the configured run) of a training with seed ``seed``."""
    return seed + 1000 * attempt


def on_plateau(loss: Sequence[float], plateau_steps: int, fraction: float, at: int | None = None) -> bool:
    """True when the loss over the 25 steps before ``at`` (default ``plateau_steps``) is above ``fraction`` of its
    level over the 25 steps before ``plateau_steps // 2``: the run has not left the plateau it reached early."""
    at = plateau_steps if at is None else at
    if not plateau_steps or len(loss) < max(at, plateau_steps):
        return False
    late = float(np.mean(loss[at - 25:at]))
    half = plateau_steps // 2
    early = float(np.mean(loss[half - 25:half]))
    return late > fraction * early


@dataclass
class TrainingLog:
    """Loss per step and wall time of one training run."""

    loss: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    device: str = "cpu"
    n_trials: int = 0
    what: str = ""
    seed: int = 0  # the seed of the run kept (``restart_seed`` of the configured one after restarts)
    restarts: list[dict] = field(default_factory=list)  # abandoned runs: seed, loss curve, wall_s
    on_plateau: bool = False  # the kept run itself failed the plateau check (every restart was used)
    # with validation trials: one row per evaluation ({"step", "CER", "WER", "chars"}: greedy decoding, FALCON's
    # scores, characters emitted), the best row's step (its weights are the ones kept), why the run ended
    validation: list[dict] = field(default_factory=list)
    best_step: int = 0
    # what ended the training: "ceiling" (ran every step), "patience", "time_budget"; after restarts, what ended the
    # last run, which need not be the run kept (``run_stop_reason``); "plateau_restart" for a run the plateau check
    # ended to restart from a new seed
    stop_reason: str = "ceiling"
    run_stop_reason: str = ""  # what ended the run kept ("" : the same as ``stop_reason``)
    final_lr: float = 0.0  # the learning rate of the last step (the cosine decay's progress when the run ended)
    # with validation: whether the run ended with its stopping rule met (a plateau at the rate's floor), None without;
    # False for a run that its time budget or ceiling ended while it was still improving
    converged: bool | None = None
    decay_step: int | None = None  # with validation: the step a final decay began at (ceiling or time budget)
    lr_reductions: list[int] = field(default_factory=list)  # with validation: the steps the rate was reduced at

    @property
    def steps_run(self) -> int:
        return len(self.loss)

    def best(self) -> dict | None:
        """The validation row whose weights were kept (None without validation)."""
        return next((v for v in self.validation if v["step"] == self.best_step), None)

    def to_dict(self) -> dict:
        return {"what": self.what, "loss": self.loss, "wall_s": self.wall_s, "device": self.device,
                "n_trials": self.n_trials, "seed": self.seed, "restarts": self.restarts, "on_plateau": self.on_plateau,
                "validation": self.validation, "best_step": self.best_step, "stop_reason": self.stop_reason,
                "run_stop_reason": self.run_stop_reason or self.stop_reason,
                "steps_run": self.steps_run, "final_lr": self.final_lr, "converged": self.converged,
                "decay_step": self.decay_step, "lr_reductions": self.lr_reductions}

    def warning(self) -> str | None:
        """A sentence for the user when training had to restart or never left the CTC plateau, else None."""
        if self.on_plateau and self.validation:
            return (f"{self.what}: validation greedy CER never came below {STARTED_CER:.0%} in {self.steps_run} steps "
                    f"({len(self.restarts)} restart(s) used): the model ignores its input. Raise --steps or "
                    "--time-budget, lower train.lr, or check that the inputs carry the signal")
        if self.on_plateau:
            return (f"{self.what}: the loss never left the CTC plateau ({len(self.restarts)} restart(s) used): the "
                    "model mostly ignores its input. Train longer (train.steps), lower train.lr, or check that the "
                    "inputs carry the signal (normalisation, channel count)")
        if self.restarts:
            why = (f"no validation greedy CER had come below {STARTED_CER:.0%}" if self.validation else
                   "the loss had not left the CTC plateau")
            spent = sum(r["wall_s"] for r in self.restarts)
            return (f"{self.what}: restarted {len(self.restarts)} time(s) because {why} after "
                    f"{min(len(r['loss']) for r in self.restarts)} steps ({spent:.0f} s in the other run(s)); kept "
                    f"seed {self.seed}" + (f", the run with the best validation CER "
                                           f"({self.best()['CER']:.1%})" if self.best() else ""))
        return None

    def smoothed(self, window: int = 25) -> np.ndarray:
        """Running mean of the loss (for plots and tests)."""
        x = np.asarray(self.loss, dtype=np.float64)
        if len(x) < window:
            return x
        return np.convolve(x, np.ones(window) / window, mode="valid")


def held_in_examples(sessions: Sequence[Session], std_floor: float = DEFAULT_STD_FLOOR) -> list[Example]:
    """Training trials of every held-in session, each normalised with its own session's statistics."""
    held_in = [s for s in sessions if s.split == "held_in"]
    if not held_in:
        raise ValueError(f"none of the {len(sessions)} sessions is held-in; stage 1 trains on held-in sessions")
    out: list[Example] = []
    for k, s in enumerate(held_in):
        out += make_examples(s, fit_indices(s), session_normalization(s, std_floor), session_index=k)
    return out


def cosine_lr(step: int, steps: int, lr: float, final_fraction: float, warmup: int = 0,
              elapsed: float = 0.0) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay from ``lr`` to ``lr * final_fraction``.

    The decay's progress is the larger of the steps' share of ``steps`` and ``elapsed``, the share of a wall-time
    budget used, so a run stopped by its budget has decayed by then as one stopped by its ceiling has."""
    if step < warmup:
        return lr * (step + 1) / warmup
    done = min(1.0, max((step - warmup) / max(steps - warmup, 1), elapsed))
    return lr * (final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * done)))


@dataclass
class PlateauSchedule:
    """A validated run's learning rate: warm-up, then ``lr`` times ``scale``, which :meth:`reduce` multiplies by
    ``factor`` at each plateau of the validation scores (down to ``lr * final_fraction``), until :meth:`begin` starts
    the final decay: a cosine from the current rate to ``lr * final_fraction`` whose progress is the larger of its
    steps' share of ``length`` and its time's share of what is left to ``deadline``; the run ends when that decay
    is done (:meth:`finished`).

    The rate comes down as fast as the validation scores stop improving (ReduceLROnPlateau, the "newbob" rule of
    speech recognition recipes), not on a calendar set by the ceiling: a larger budget (ceiling, time, patience)
    waits longer at each rate but walks down the same rates.
    """

    lr: float
    final_fraction: float
    factor: float
    warmup: int
    deadline: float | None = None
    scale: float = 1.0
    start: int | None = None
    length: float = math.inf
    t_start: float = 0.0
    from_scale: float = 1.0
    reason: str = ""

    def reduce(self) -> bool:
        """One reduction at a plateau; False (nothing changed) when it would go below the floor."""
        if self.scale * self.factor < self.final_fraction * (1 - 1e-9):
            return False
        self.scale *= self.factor
        return True

    def begin(self, step: int, now: float, reason: str, length: float = math.inf) -> None:
        self.start, self.t_start, self.reason, self.length = step, now, reason, max(1.0, length)
        self.from_scale = self.scale

    def progress(self, step: int, now: float) -> float:
        if self.start is None:
            return 0.0
        p = (step - self.start) / self.length
        if self.deadline is not None and self.deadline > self.t_start:
            p = max(p, (now - self.t_start) / (self.deadline - self.t_start))
        return min(1.0, p)

    def finished(self, step: int, now: float) -> bool:
        return self.start is not None and self.progress(step, now) >= 1.0

    def at(self, step: int, now: float) -> float:
        """The rate for the step of index ``step`` (0-based): the final decay's last step runs at the floor."""
        if step < self.warmup:
            return self.lr * self.scale * (step + 1) / self.warmup
        if self.start is None:
            return self.lr * self.scale
        p = self.progress(step + 1, now)
        lo = min(self.final_fraction, self.from_scale)
        return self.lr * (lo + (self.from_scale - lo) * 0.5 * (1 + math.cos(math.pi * p)))


# validation greedy CER below which a run has started to learn (an untrained network's random characters score
# 80-140%): patience counts only from then, and a run that has not reached it by the plateau check is on the plateau
STARTED_CER = 0.75


@dataclass
class PlateauCounter:
    """Evaluations without progress since the last one with it (``stale``). Progress is a validation CER below
    every earlier one, or a validation loss below ``1 - loss_progress`` times every earlier one (None: the CER
    alone). Evaluations count only once some CER has come below ``started_cer``."""

    started_cer: float = STARTED_CER
    loss_progress: float | None = None
    best_cer: float = math.inf
    best_loss: float = math.inf
    stale: int = 0

    @property
    def started(self) -> bool:
        """Some validation CER so far is below ``started_cer``."""
        return self.best_cer < self.started_cer

    def update(self, cer: float, loss: float) -> bool:
        """Count one evaluation; True when its CER is the lowest yet (its weights are the ones to keep)."""
        lower_loss = self.loss_progress is not None and loss < (1 - self.loss_progress) * self.best_loss
        self.best_loss = min(self.best_loss, loss)
        if cer < self.best_cer:
            self.best_cer, self.stale = cer, 0
            return True
        if lower_loss:
            self.stale = 0
        elif self.started:
            self.stale += 1
        return False


def validation_scores(module: nn.Module, forward: Callable[[torch.Tensor, Batch], torch.Tensor],
                      examples: Sequence[Example], device: torch.device | str = "cpu") -> dict:
    """Greedy decoding of ``examples`` (no augmentation, eval mode): CER and WER pooled over the trials (FALCON's
    edit distances summed over trials, divided by the references' characters and words), characters emitted, and
    the CTC loss per character (the trials' negative log-likelihoods summed, divided by their characters), and
    the sentence-end marks (``~`` / ``?``): of the trials whose sentence ends with one (``ends_of``), those whose
    greedy text lacks it (``ends_missed``)."""
    from .decoding import greedy_decode
    from .greedy_errors import end_marks_missed
    from .metrics import score_session

    was_training = module.training
    module.eval()
    texts: list[str] = []
    loss_sum = 0.0
    with torch.no_grad():
        for i in range(0, len(examples), 32):
            chunk = examples[i: i + 32]
            batch = collate(chunk, device)
            out = forward(batch.x, batch)
            loss_sum += float(ctc_loss(out, batch, reduction="sum"))
            logp = out.cpu().numpy()
            texts += [greedy_decode(logp[k, : e.x.shape[0]]) for k, e in enumerate(chunk)]
    module.train(was_training)
    refs = [e.sentence for e in examples]
    score = score_session(texts, refs)
    missed, of = end_marks_missed(texts, refs)
    return {"CER": score.cer, "WER": score.wer, "chars": sum(len(t) for t in texts),
            "loss": loss_sum / max(1, sum(len(e.labels) for e in examples)), "ends_missed": missed, "ends_of": of}


def plateau_check_step(config: TrainConfig, validated: bool) -> int:
    """The step at which a run is checked for the CTC plateau (0: never). With validation, a quarter of the ceiling
    if that is later than ``plateau_steps``: the ceiling then scales with the data, and so does the time a run needs
    to leave the plateau."""
    if not config.plateau_steps:
        return 0
    at = max(config.plateau_steps, config.steps // 4) if validated else config.plateau_steps
    return at if config.steps > at else 0


def fit_ctc(
    module: nn.Module,
    forward: Callable[[torch.Tensor, Batch], torch.Tensor],
    examples: Sequence[Example],
    config: TrainConfig,
    what: str,
    lr_scales: dict[int, float] | None = None,
    seed: int | None = None,
    stop_on_plateau: bool = False,
    validation: Sequence[Example] | None = None,
    progress: Any = None,
    deadline: float | None = None,
) -> TrainingLog:
    """Train ``module`` in place: ``forward(x, batch) -> logp`` on augmented batches, CTC loss, Adam.

    ``lr_scales`` maps ``id(parameter)`` to a learning-rate factor (default 1). ``seed``
    (default ``config.seed``) seeds batches and augmentation. ``stop_on_plateau`` ends the
    run at the plateau check when it fails it (``log.on_plateau``).

    With ``validation`` trials the run is scored on them every ``config.eval_every`` steps
    (:func:`validation_scores`), stops after ``config.patience`` evaluations without progress
    (:class:`PlateauCounter`: a lower CER, or with ``config.loss_progress`` a lower loss; counted from the first
    CER below ``config.patience_from_cer``, :data:`STARTED_CER`) at the learning rate's floor (each earlier
    plateau reduces the rate: :class:`PlateauSchedule`), or at ``deadline`` (``time.perf_counter()`` seconds)
    or after ``config.time_budget_s``, and the best evaluation's weights are restored; the plateau check then
    asks whether a validation CER has come below ``config.patience_from_cer`` instead of reading the loss.
    Without validation the rate follows :func:`cosine_lr` over the ceiling (or the deadline, whichever comes
    first). ``progress`` (a :class:`~closedloop.sdk.bci.progress.StageProgress`) is told every step.
    """
    seed = config.seed if seed is None else seed
    device = resolve_device(config.device)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    module.to(device).train()
    params = [p for p in module.parameters() if p.requires_grad]
    scales = lr_scales or {}
    groups: dict[float, list] = {}
    for p in params:
        groups.setdefault(scales.get(id(p), 1.0), []).append(p)
    opt = torch.optim.Adam([{"params": ps, "scale": k} for k, ps in groups.items()], lr=config.lr,
                           weight_decay=config.weight_decay)
    log = TrainingLog(device=str(device), n_trials=len(examples), what=what, seed=seed)
    validated = bool(validation)
    check = plateau_check_step(config, validated)
    batches = iterate_batches(examples, config.batch_size, rng, config.shortest_first_epochs)
    t0 = time.perf_counter()
    if config.time_budget_s:
        deadline = min(deadline or math.inf, t0 + config.time_budget_s)
    horizon = deadline - t0 if deadline is not None and deadline > t0 else None
    best_state = None
    plateau = PlateauCounter(config.patience_from_cer, config.loss_progress)
    bar = tqdm(range(config.steps), desc=what, disable=not config.progress or progress is not None, leave=False)

    def evaluate(step: int) -> None:
        nonlocal best_state
        row = {"step": step, **validation_scores(module, forward, validation, device)}
        log.validation.append(row)
        if plateau.update(row["CER"], row["loss"]):
            best_state, log.best_step = copy.deepcopy(module.state_dict()), step
        if progress is not None:
            progress.validated(step, row, log.best())

    schedule = PlateauSchedule(config.lr, config.lr_final_fraction, config.lr_reduce_factor, config.warmup_steps,
                               deadline)
    for step in bar:
        now = time.perf_counter()
        if validated:
            lr = schedule.at(step, now)
        else:
            lr = cosine_lr(step, config.steps, config.lr, config.lr_final_fraction, config.warmup_steps,
                           (now - t0) / horizon if horizon else 0.0)
        for g in opt.param_groups:
            g["lr"] = g["scale"] * lr
        log.final_lr = lr
        batch = collate(next(batches), device)
        x = config.augmentation(batch.x, gen, per="trial")
        x = time_mask(x, config.time_mask_bins, gen)
        loss = ctc_loss(forward(x, batch), batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(params, config.grad_clip)
        opt.step()
        log.loss.append(float(loss.detach()))
        if step % 10 == 0:
            bar.set_postfix(loss=f"{np.mean(log.loss[-10:]):.3f}")
        done = step + 1
        now = time.perf_counter()
        out_of_time = deadline is not None and now >= deadline
        decayed = validated and schedule.finished(done, now)
        evaluated = validated and (done % config.eval_every == 0 or done == config.steps or done == check
                                   or out_of_time or decayed)
        if evaluated:
            evaluate(done)
        if progress is not None:
            progress.step(done, float(np.mean(log.loss[-10:])))
        if done == check:
            stuck = (not plateau.started if validated
                     else on_plateau(log.loss, check, config.plateau_fraction))
            if stuck:
                log.on_plateau = True
                if stop_on_plateau:
                    log.stop_reason = "plateau_restart"
                    break
        if not validated:
            if out_of_time:
                log.stop_reason = "time_budget"
                break
            continue
        if decayed:
            log.stop_reason = schedule.reason
            break
        if schedule.start is None:
            if evaluated and plateau.stale >= config.patience:  # a plateau: a lower rate, or the end at the floor
                if not schedule.reduce():
                    log.stop_reason = "patience"
                    break
                log.lr_reductions.append(done)
                plateau.stale = 0
            share = 1.0 - config.decay_fraction
            if done >= share * config.steps:  # the end in sight: the final decay
                schedule.begin(done, now, "ceiling", config.steps - done)
            elif horizon and now - t0 >= share * horizon:
                schedule.begin(done, now, "time_budget")
            log.decay_step = schedule.start
        if out_of_time:
            log.stop_reason = "time_budget"
            break
    if validated:
        log.converged = log.stop_reason == "patience" or plateau.stale >= config.patience
    if log.on_plateau and len(log.loss) == config.steps:  # ran to the end anyway: did it leave the plateau later?
        log.on_plateau = (not plateau.started if validated
                          else on_plateau(log.loss, check, config.plateau_fraction, at=config.steps))
    if best_state is not None:
        module.load_state_dict(best_state)
    module.eval()
    log.wall_s = time.perf_counter() - t0
    return log


def _plateau_reason(log: TrainingLog, config: TrainConfig) -> str:
    """What made a run count as on the CTC plateau at its check step, for the restart's note."""
    cers = [v["CER"] for v in log.validation if "CER" in v]
    if cers:
        return (f"no validation CER below {STARTED_CER:.0%} by step {log.steps_run} (best {min(cers):.0%}): "
                "still on the CTC plateau")
    return (f"the training loss had not fallen below {config.plateau_fraction:g} of its early level by step "
            f"{log.steps_run}: still on the CTC plateau")


def fit_ctc_restarting(build: Callable[[], tuple[nn.Module, Callable, dict[int, float] | None]],
                       examples: Sequence[Example], config: TrainConfig, what: str,
                       validation: Sequence[Example] | None = None, progress: Any = None,
                       deadline: float | None = None) -> tuple[nn.Module, TrainingLog]:
    """``fit_ctc`` on ``build()``'s model, restarted from a new initialisation while it sits on the CTC plateau.

    ``build`` makes a fresh ``(module, forward, lr_scales)`` after ``torch.manual_seed``
    of the attempt's seed (``restart_seed``); see ``TrainConfig.plateau_steps``. A run
    that hits ``deadline`` (or the time budget) is kept whatever its state.
    """
    runs: list[tuple[nn.Module, TrainingLog]] = []
    if config.time_budget_s:  # one budget for the run and its restarts
        deadline = min(deadline or math.inf, time.perf_counter() + config.time_budget_s)
        config = replace(config, time_budget_s=0.0)
    for attempt in range(config.max_restarts + 1):
        seed = restart_seed(config.seed, attempt)
        torch.manual_seed(seed)
        module, forward, scales = build()
        last = attempt == config.max_restarts
        if progress is not None and attempt:
            progress.restart(attempt, seed, _plateau_reason(runs[-1][1], config))
        log = fit_ctc(module, forward, examples, config, what, scales, seed=seed, stop_on_plateau=not last,
                      validation=validation, progress=progress, deadline=deadline)
        runs.append((module, log))
        if not log.on_plateau or last or log.stop_reason == "time_budget":
            # with validation, the run kept is the one with the best validation CER (a restart can do worse than
            # the run it replaced); without, the last one
            best = log.best()
            last_reason = log.stop_reason
            if best is not None:
                module, log = min(runs, key=lambda run: b["CER"] if (b := run[1].best()) is not None else math.inf)
            # the summary's stop_reason says what ended the training (the last run); the run kept may be an earlier
            # one that the plateau check ended to restart
            log.run_stop_reason, log.stop_reason = log.stop_reason, last_reason
            log.restarts = [{"seed": r.seed, "loss": r.loss, "wall_s": r.wall_s, "validation": r.validation}
                            for _, r in runs if r is not log]
            return module, log
    raise AssertionError("unreachable")


def train_backbone(sessions: Sequence[Session], config: TrainConfig | None = None,
                   validation: Sequence[Example] | None = None, progress: Any = None,
                   deadline: float | None = None) -> tuple[GRUBackbone, TrainingLog]:
    """Stage 1: a GRU backbone on pooled held-in sessions, no session-specific input layer.

    Parameters
    ----------
    sessions
        The recording; only ``split == "held_in"`` sessions are used, and only their
        non-evaluation trials.
    config
        Model size, optimiser and augmentation.
    validation, progress, deadline
        Validation trials (normalised like the training trials, e.g. from
        :func:`closedloop.sdk.bci.recipe.split_validation`) for early stopping and the best
        checkpoint, a progress reporter and a wall-clock deadline: see :func:`fit_ctc`.

    Returns
    -------
    backbone, log
        The trained backbone (eval mode, on ``config.device``) and the loss curve.
    """
    config = config or TrainConfig()
    examples = held_in_examples(sessions, config.std_floor)
    bc = config.backbone

    def build():
        backbone = GRUBackbone(examples[0].x.shape[1], bc.n_hidden, bc.n_layers, bc.dropout)
        return backbone, lambda x, b: backbone(x)[0], None

    return fit_ctc_restarting(build, examples, config, "stage 1: pooled backbone", validation, progress, deadline)


def train_session_layers(
    sessions: Sequence[Session], config: TrainConfig | None = None, validation: Sequence[Example] | None = None,
    progress: Any = None, deadline: float | None = None,
) -> tuple[SessionInputDecoder, TrainingLog]:
    """The usual multi-session decoder: one affine input layer per held-in session, trained jointly with a backbone."""
    config = config or TrainConfig()
    held_in = [s for s in sessions if s.split == "held_in"]
    examples = held_in_examples(sessions, config.std_floor)
    bc = config.backbone

    def build():
        model = SessionInputDecoder([s.name for s in held_in],
                                    GRUBackbone(examples[0].x.shape[1], bc.n_hidden, bc.n_layers, bc.dropout))
        scales = {id(p): config.input_layer_lr_scale for p in model.layers.parameters()}
        return model, lambda x, b: model(x, b.session)[0], scales

    return fit_ctc_restarting(build, examples, config, "session input layers", validation, progress, deadline)
