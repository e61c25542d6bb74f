"""Calibrate a new session from a few sentences by fitting only the alignment layer.

:func:`calibrate_session` takes an :class:`~sdk.bci.models.AlignedDecoder` and the
session's calibration trials (FALCON: its first three sentences), computes the
session's normalisation from those trials, and fits the alignment layer
:math:`(A, b)` by gradient steps on the CTC loss, either

* ``optimizer="meta"``: the meta-learned inner loop (:mod:`sdk.bci.meta`): steps
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
adaptive method in :mod:`sdk.bci.baselines` gets the same grid size and folds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from sim.handwriting.types import Trial

from .charset import encode
from .config import JsonConfig
from .data import DEFAULT_STD_FLOOR, Example, Normalization, collate, resolve_device
from .meta import MetaAlignment, task_losses
from .models import AffineAlignment, AlignedDecoder, GRUBackbone

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


def fit_alignment_batch(
    backbone: GRUBackbone,
    start: tuple[torch.Tensor, torch.Tensor],
    support: Sequence[Sequence[Example]],
    knobs: Sequence[float],
    steps: int,
    optimizer: str,
    meta: MetaAlignment | None = None,
    validation: Sequence[Sequence[Example]] | None = None,
    eval_every: int = 1,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, list[int], np.ndarray]:
    """Fit one alignment per task at once (tasks share the backbone, each has its own knob and sentences).

    Returns the fitted ``(A, b)`` per task, the checkpoint steps, and the validation
    loss per checkpoint and task (empty without ``validation``).
    """
    n = len(support)
    sup = collate([e for task in support for e in task], device)
    val = collate([e for task in validation for e in task], device) if validation else None
    knob = torch.tensor(list(knobs), dtype=torch.float32, device=device)
    w = start[0].to(device).expand(n, -1, -1).clone()
    b = start[1].to(device).expand(n, -1).clone()
    if optimizer == "meta":
        if meta is None:
            raise ValueError("optimizer='meta' needs the MetaAlignment from meta_train_alignment")
        aw, ab = (a.detach().to(device) for a in meta.step_sizes())
    mw, vw, mb, vb = torch.zeros_like(w), torch.zeros_like(w), torch.zeros_like(b), torch.zeros_like(b)
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    checkpoints: list[int] = []
    curve: list[np.ndarray] = []

    def record(k: int) -> None:
        if val is not None and (k % eval_every == 0 or k == steps):
            with torch.no_grad():
                curve.append(task_losses(backbone, val.x, val, w, b, n, reduce=False).cpu().numpy())
            checkpoints.append(k)

    record(0)
    for k in range(1, steps + 1):
        wd, bd = w.requires_grad_(), b.requires_grad_()
        gw, gb = torch.autograd.grad(task_losses(backbone, sup.x, sup, wd, bd, n), (wd, bd))
        with torch.no_grad():
            if optimizer == "meta":
                w = w - knob[:, None, None] * aw * gw
                b = b - knob[:, None] * ab * gb
            else:
                mw.mul_(beta1).add_((1 - beta1) * gw)
                vw.mul_(beta2).add_((1 - beta2) * gw * gw)
                mb.mul_(beta1).add_((1 - beta1) * gb)
                vb.mul_(beta2).add_((1 - beta2) * gb * gb)
                c1, c2 = 1 - beta1**k, 1 - beta2**k
                w = w - knob[:, None, None] * (mw / c1) / ((vw / c2).sqrt() + eps)
                b = b - knob[:, None] * (mb / c1) / ((vb / c2).sqrt() + eps)
        record(k)
    return w.detach(), b.detach(), checkpoints, np.array(curve)


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
) -> CalibrationResult:
    """Fit only ``model``'s alignment layer to a new session's calibration trials.

    Parameters
    ----------
    model
        The decoder to calibrate; its alignment is the starting point (identity, a
        neighbouring session's input layer, or ``meta.new_alignment()``). It is not
        modified: the result holds a new alignment and the *same* backbone object.
    calib_trials
        The session's calibration trials (raw spike counts and prompted sentences).
    config
        Optimiser, step budget and the tuning grid.
    meta
        The meta-learned step sizes (needed for ``optimizer="meta"``).
    normalization
        The session's normalisation; by default computed from ``calib_trials``.
    """
    config = config or CalibrationConfig()
    device = resolve_device(config.device)
    t0 = time.perf_counter()
    norm = normalization or Normalization.from_trials(calib_trials, config.std_floor)
    examples = trials_to_examples(calib_trials, norm)
    backbone = model.backbone.to(device).eval()
    start = (model.alignment.weight.detach().clone(), model.alignment.bias.detach().clone())
    is_meta = config.optimizer == "meta"
    if is_meta:
        if meta is None:
            raise ValueError("optimizer='meta' needs the MetaAlignment returned by meta_train_alignment")
        meta = meta.to(device)
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
                _, _, ck, curve = fit_alignment_batch(backbone, start, sup, knobs, n_steps, config.optimizer, meta,
                                                      val, every, device)
                return ck, curve

            if config.tune:
                knob, n_steps, cv = choose_by_validation(run, grid, steps, len(examples), config.folds)
            else:
                knob, n_steps, cv = default, steps, {}
            w, b, _, _ = fit_alignment_batch(backbone, start, [examples], [knob], n_steps, config.optimizer, meta,
                                             device=device)
    finally:
        for p, f in zip(backbone.parameters(), flags, strict=True):
            p.requires_grad_(f)
    alignment = AffineAlignment(model.n_inputs).to(device).load(w[0], b[0])
    chosen = {"optimizer": config.optimizer, ("step_scale" if is_meta else "lr"): knob, "steps": n_steps}
    return CalibrationResult(AlignedDecoder(alignment, backbone), norm, chosen, cv, time.perf_counter() - t0)
