"""Calibrate a new session from a few sentences by fitting only the alignment layer.

:func:`calibrate_session` takes an :class:`~closedloop.sdk.bci.models.AlignedDecoder` and the
session's calibration trials (FALCON: its first three sentences), computes the
session's normalisation from those trials, and fits the alignment layer
:math:`(A, b)` by gradient steps on the CTC loss, either

* ``optimizer="meta"``: the meta-learned inner loop (:mod:`closedloop.sdk.bci.meta`): steps
  :math:`\\theta \\leftarrow \\theta - s\\,\\alpha \\odot \\nabla L` with the learned per-parameter
  step sizes :math:`\\alpha` and a scale :math:`s`; or
* ``optimizer="adam"``: plain Adam with learning rate ``lr`` (the non-meta baseline).

The backbone is never updated: it is shared by the returned model, with gradients
switched off for the duration, and stays bit-identical.

Choices on calibration data only. With ``tune=True`` the one knob of each optimiser
(Adam's learning rate, or the meta step scale :math:`s`) and the number of steps are
chosen by leave-one-sentence-out cross-validation on the calibration sentences: for
each fold and each grid value the layer is fitted on the other sentences and the CTC
loss of the left-out sentence is recorded at checkpoints; the (value, steps) pair
with the lowest mean validation loss is then refitted on all sentences. Every
adaptive method in :mod:`closedloop.sdk.bci.baselines` gets the same grid size and folds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from closedloop.common.config import JsonConfig
from closedloop.common.handwriting import Trial

from .charset import encode
from .data import DEFAULT_STD_FLOOR, Example, Normalization, collate, resolve_device
from .meta import MetaAlignment, task_losses
from .models import AffineAlignment, AlignedDecoder, GRUBackbone, compose_alignment

OPTIMIZERS = ("adam", "meta")


@dataclass
class CalibrationConfig(JsonConfig):
    """How a new session is calibrated (``optimizer`` ``"adam"`` or ``"meta"``)."""

    optimizer: str = "adam"
    steps: int = 20  # Adam: maximum steps (meta: meta_max_steps)
    lr: float = 1e-3  # Adam learning rate when not tuned
    lr_grid: tuple[float, ...] = (3e-4, 1e-3, 3e-3)
    step_scale: float = 1.0  # meta step-size scale when not tuned
    step_scale_grid: tuple[float, ...] = (0.5, 1.0, 2.0)
    meta_max_steps: int = 0  # 0: twice the meta-trained inner steps
    eval_every: int = 10  # Adam checkpoints for choosing the step count (meta: every step)
    tune: bool = True
    folds: int = 3  # leave-one-sentence-out folds (at most the number of calibration sentences)
    std_floor: float = DEFAULT_STD_FLOOR
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r} is not one of {OPTIMIZERS}")


@dataclass
class CalibrationResult:
    """The calibrated decoder, its session normalisation and what was chosen."""

    model: AlignedDecoder
    normalization: Normalization
    chosen: dict = field(default_factory=dict)
    validation: dict = field(default_factory=dict)
    wall_s: float = 0.0


def trials_to_examples(trials: Sequence[Trial], normalization: Normalization) -> list[Example]:
    return [Example(normalization.apply(t.spikes), np.asarray(encode(t.sentence)), t.sentence) for t in trials]


def loo_folds(n: int, folds: int) -> list[tuple[list[int], list[int]]]:
    """Leave-one-out splits ``(fit, validate)`` of ``n`` sentences, at most ``folds`` of them."""
    if n < 2:
        return []
    return [([j for j in range(n) if j != i], [i]) for i in range(min(folds, n))]


def task_axis(values: torch.Tensor, dims: int) -> torch.Tensor:
    """``values`` (n,) shaped (n, 1, ...) to scale tensors with a task axis and ``dims`` more."""
    return values.view(-1, *([1] * dims))


class StackedAdam:
    """Adam (``torch.optim.Adam``'s update, no weight decay) on parameters with a leading task axis.

    Each task has its own learning rate ``lr[t]``; the tasks do not interact. :meth:`step`
    takes the gradients and returns the new parameters (new tensors, the old are untouched).
    """

    def __init__(self, params: dict[str, torch.Tensor], lr: torch.Tensor,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        self.params = dict(params)
        self.lr = {k: task_axis(lr, v.dim() - 1) for k, v in params.items()}
        self.m1 = {k: torch.zeros_like(v) for k, v in params.items()}
        self.m2 = {k: torch.zeros_like(v) for k, v in params.items()}
        self.betas, self.eps, self.k = betas, eps, 0

    @torch.no_grad()
    def step(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.k += 1
        beta1, beta2 = self.betas
        c1, c2 = 1 - beta1**self.k, 1 - beta2**self.k
        for name, g in grads.items():
            self.m1[name].mul_(beta1).add_((1 - beta1) * g)
            self.m2[name].mul_(beta2).add_((1 - beta2) * g * g)
            self.params[name] = self.params[name] - self.lr[name] * (self.m1[name] / c1) / (
                (self.m2[name] / c2).sqrt() + self.eps)
        return dict(self.params)


def fit_alignment_batch(
    backbone: GRUBackbone,
    start: dict[str, torch.Tensor],
    support: Sequence[Sequence[Example]],
    knobs: Sequence[float],
    steps: int,
    optimizer: str,
    meta: MetaAlignment | None = None,
    validation: Sequence[Sequence[Example]] | None = None,
    eval_every: int = 1,
    device: torch.device | str = "cpu",
) -> tuple[dict[str, torch.Tensor], list[int], np.ndarray]:
    """Fit one alignment per task at once (tasks share the backbone, each has its own knob and sentences).

    ``start`` holds the parameters of one alignment form (:func:`~closedloop.sdk.bci.models.alignment_params`;
    ``{"weight": A, "bias": b}`` for a full map), without a task axis. Returns the fitted
    parameters per task (compose them with :func:`~closedloop.sdk.bci.models.compose_alignment`), the
    checkpoint steps, and the validation loss per checkpoint and task (empty without ``validation``).
    """
    n = len(support)
    sup = collate([e for task in support for e in task], device)
    val = collate([e for task in validation for e in task], device) if validation else None
    knob = torch.tensor(list(knobs), dtype=torch.float32, device=device)
    names = list(start)
    p = {k: start[k].detach().to(device).expand(n, *start[k].shape).clone() for k in names}
    scale = {k: task_axis(knob, start[k].dim()) for k in names}
    if optimizer == "meta":
        if meta is None:
            raise ValueError("optimizer='meta' needs the MetaAlignment from meta_train_alignment")
        if set(meta.log_step) != set(names):
            raise ValueError(f"the meta step sizes are for {sorted(meta.log_step)}, the start has {sorted(names)}")
        alpha = {k: a.detach().to(device) for k, a in meta.step_sizes().items()}
    adam = StackedAdam(p, knob) if optimizer != "meta" else None
    checkpoints: list[int] = []
    curve: list[np.ndarray] = []

    def record(k: int) -> None:
        if val is not None and (k % eval_every == 0 or k == steps):
            with torch.no_grad():
                curve.append(task_losses(backbone, val.x, val, *compose_alignment(p), n, reduce=False).cpu().numpy())
            checkpoints.append(k)

    record(0)
    for k in range(1, steps + 1):
        leaves = {name: v.requires_grad_() for name, v in p.items()}
        grads = torch.autograd.grad(task_losses(backbone, sup.x, sup, *compose_alignment(leaves), n),
                                    [leaves[name] for name in names])
        with torch.no_grad():
            if optimizer == "meta":
                for name, g in zip(names, grads, strict=True):
                    p[name] = p[name] - scale[name] * alpha[name] * g
            else:
                p = adam.step(dict(zip(names, grads, strict=True)))
        record(k)
    return {k: v.detach() for k, v in p.items()}, checkpoints, np.array(curve)


def choose_by_validation(
    run: Callable[[list[float], int, list[tuple[list[int], list[int]]]], tuple[list[int], np.ndarray]],
    grid: Sequence[float], steps: int, n_sentences: int, folds: int,
) -> tuple[float, int, dict]:
    """Pick (knob, steps) with the lowest leave-one-out validation loss.

    ``run(knobs, steps, splits)`` fits every (knob, split) pair, knob-major, and returns
    the checkpoints and a (checkpoints, len(knobs) * len(splits)) loss array.
    """
    splits = loo_folds(n_sentences, folds)
    if not splits:
        return float(grid[len(grid) // 2]), steps, {}
    knobs = [g for g in grid for _ in splits]
    ckpts, losses = run(knobs, steps, splits)
    mean = losses.reshape(len(ckpts), len(grid), len(splits)).mean(-1)  # (checkpoints, grid)
    ci, gi = np.unravel_index(int(np.argmin(mean)), mean.shape)
    return float(grid[gi]), int(ckpts[ci]), {"grid": list(grid), "checkpoints": ckpts, "mean_loss": mean.tolist()}


def calibrate_session(
    model: AlignedDecoder,
    calib_trials: Sequence[Trial],
    config: CalibrationConfig | None = None,
    meta: MetaAlignment | None = None,
    normalization: Normalization | None = None,
    start: dict[str, torch.Tensor] | None = None,
) -> CalibrationResult:
    """Fit only ``model``'s alignment layer to a new session's calibration trials.

    Parameters
    ----------
    model
        The decoder to calibrate; with ``optimizer="adam"`` and no ``start`` its alignment
        is the starting point (identity, or a neighbouring session's input layer); with
        ``optimizer="meta"`` the start is ``meta``'s initialisation. It is not modified:
        the result holds a new alignment and the *same* backbone object.
    calib_trials
        The session's calibration trials (raw spike counts and prompted sentences).
    config
        Optimiser, step budget and the tuning grid.
    meta
        The meta-learned step sizes (needed for ``optimizer="meta"``).
    normalization
        The session's normalisation; by default computed from ``calib_trials``.
    start
        The alignment's parameters to start from and fit (:func:`~closedloop.sdk.bci.models.alignment_params`):
        by default the meta-learned initialisation with ``optimizer="meta"``, else the full
        map of ``model``'s alignment.
    """
    config = config or CalibrationConfig()
    device = resolve_device(config.device)
    t0 = time.perf_counter()
    norm = normalization or Normalization.from_trials(calib_trials, config.std_floor)
    examples = trials_to_examples(calib_trials, norm)
    backbone = model.backbone.to(device).eval()
    is_meta = config.optimizer == "meta"
    if is_meta:
        if meta is None:
            raise ValueError("optimizer='meta' needs the MetaAlignment returned by meta_train_alignment")
        meta = meta.to(device)
    if start is None:
        start = ({k: v.detach() for k, v in meta.init.items()} if is_meta else
                 {"weight": model.alignment.weight.detach(), "bias": model.alignment.bias.detach()})
    steps = (config.meta_max_steps or 2 * meta.inner_steps) if is_meta else config.steps
    every = 1 if is_meta else config.eval_every
    grid = config.step_scale_grid if is_meta else config.lr_grid
    default = config.step_scale if is_meta else config.lr
    flags = [p.requires_grad for p in backbone.parameters()]
    for p in backbone.parameters():
        p.requires_grad_(False)
    try:
        with torch.backends.cudnn.flags(enabled=False):
            def run(knobs: list[float], n_steps: int, splits: list) -> tuple[list[int], np.ndarray]:
                sup = [[examples[j] for j in fit] for _ in grid for fit, _ in splits]
                val = [[examples[j] for j in v] for _ in grid for _, v in splits]
                _, ck, curve = fit_alignment_batch(backbone, start, sup, knobs, n_steps, config.optimizer, meta,
                                                      val, every, device)
                return ck, curve

            if config.tune:
                knob, n_steps, cv = choose_by_validation(run, grid, steps, len(examples), config.folds)
            else:
                knob, n_steps, cv = default, steps, {}
            fitted, _, _ = fit_alignment_batch(backbone, start, [examples], [knob], n_steps, config.optimizer, meta,
                                               device=device)
            w, b = compose_alignment(fitted)
    finally:
        for p, f in zip(backbone.parameters(), flags, strict=True):
            p.requires_grad_(f)
    alignment = AffineAlignment(model.n_inputs).to(device).load(w[0], b[0])
    chosen = {"optimizer": config.optimizer, ("step_scale" if is_meta else "lr"): knob, "steps": n_steps}
    return CalibrationResult(AlignedDecoder(alignment, backbone), norm, chosen, cv, time.perf_counter() - t0)
