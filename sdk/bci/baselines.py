"""The methods compared in the harness, each a registered way to get a new session's decoder.

A method takes what was trained on held-in data (:class:`TrainedModels`), a held-out
session's calibration trials and normalisation, and returns an
:class:`~closedloop.sdk.bci.models.AlignedDecoder` for that session. Registered methods:

``zero_shot``
    The pooled stage-1 backbone with an identity alignment; no adaptation.
``session_layers``
    The usual approach: per-session affine input layers trained jointly with a
    backbone on held-in data. The new session's layer starts from the *nearest*
    held-in session's layer, nearest meaning the layer whose decoder has the lowest
    CTC loss on the new session's calibration sentences (a calibration-data distance;
    ``nearest="day"`` picks the latest held-in session instead), and is fitted on
    the calibration sentences with Adam.
``finetune``
    The pooled backbone, every weight fine-tuned with Adam on the calibration sentences.
``alignment``
    The pooled backbone, frozen; the alignment layer fitted from identity with Adam
    (no meta-learning), in the same parameterisation as the two-stage method's
    (``options["alignment_form"]``, the harness's ``meta.form`` and ``meta.rank``).
``two_stage``
    The method: pooled backbone, frozen; the alignment layer starts from the
    meta-learned initialisation and takes the meta-learned steps.

All adaptive methods use :mod:`closedloop.sdk.bci.calibrate`'s protocol: a grid of three values of
their one knob, a step budget, and leave-one-sentence-out validation on the
calibration sentences to choose both.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from closedloop.common.handwriting import Session, Trial

from .calibrate import (
    CalibrationConfig,
    StackedAdam,
    calibrate_session,
    choose_by_validation,
    loo_folds,
    task_axis,
    trials_to_examples,
)
from .data import Example, Normalization, collate, ctc_loss, resolve_device
from .fastgru import stacked_backbone
from .meta import MetaAlignment, per_task_ctc
from .models import AffineAlignment, AlignedDecoder, GRUBackbone, SessionInputDecoder, alignment_params
from .train import TrainingLog


@dataclass
class TrainedModels:
    """Everything trained on held-in data for one seed, and how long each took."""

    backbone: GRUBackbone | None = None
    meta: MetaAlignment | None = None
    session_model: SessionInputDecoder | None = None
    # the drift reference's decoder when its recipe differs from session_model's (None: session_model is it)
    reference_model: SessionInputDecoder | None = None
    held_in_days: dict[str, float] = field(default_factory=dict)
    logs: dict[str, TrainingLog] = field(default_factory=dict)

    def reference_decoder(self) -> SessionInputDecoder:
        """The drift reference's per-session-input-layer decoder: its own, or the session_layers one it shares."""
        if self.reference_model is not None:
            return self.reference_model
        return _need(self, "session_layers", "drift reference")


@dataclass
class Adapted:
    model: AlignedDecoder
    info: dict = field(default_factory=dict)
    wall_s: float = 0.0


MethodFn = Callable[[TrainedModels, Session, Sequence[Trial], Normalization, CalibrationConfig, dict], Adapted]


@dataclass
class Method:
    name: str
    needs: tuple[str, ...]  # what must be trained first: "backbone", "meta", "session_layers"
    adapt: MethodFn
    doc: str = ""


METHODS: dict[str, Method] = {}


def register_method(name: str, needs: tuple[str, ...]) -> Callable[[MethodFn], MethodFn]:
    def deco(fn: MethodFn) -> MethodFn:
        METHODS[name] = Method(name, needs, fn, (fn.__doc__ or "").strip().splitlines()[0])
        return fn
    return deco


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise KeyError(f"unknown method {name!r}; registered methods: {sorted(METHODS)}")
    return METHODS[name]


def _need(models: TrainedModels, what: str, method: str):
    attr = {"backbone": "backbone", "meta": "meta", "session_layers": "session_model"}[what]
    value = getattr(models, attr)
    if value is None:
        raise ValueError(f"method {method!r} needs the {what} trained first (see sdk.bci.evaluate.train_models)")
    return value


@register_method("zero_shot", needs=("backbone",))
def zero_shot(models, session, calib, norm, config, options) -> Adapted:
    """Pooled backbone, identity alignment, no adaptation."""
    bb = _need(models, "backbone", "zero_shot")
    return Adapted(AlignedDecoder(AffineAlignment(bb.n_inputs).to(bb.readout.weight.device), bb))


def mean_calibration_loss(model: AlignedDecoder, examples: Sequence[Example], device: torch.device) -> float:
    batch = collate(examples, device)
    with torch.no_grad():
        return float(ctc_loss(model.to(device).eval()(batch.x)[0], batch))


def nearest_session_layer(sm: SessionInputDecoder, days: dict[str, float], session: Session,
                          examples: Sequence[Example], how: str, device: torch.device) -> tuple[int, dict]:
    """Index of the held-in input layer to start from: lowest calibration CTC loss (``"loss"``) or latest day (``"day"``)."""
    if how == "day":
        earlier = [(days[n], i) for i, n in enumerate(sm.session_names) if days[n] <= session.day] or \
                  [(days[n], i) for i, n in enumerate(sm.session_names)]
        return max(earlier)[1], {"nearest_by": "day"}
    if how != "loss":
        raise ValueError(f"nearest={how!r}; expected 'loss' or 'day'")
    losses = [mean_calibration_loss(AlignedDecoder(layer, sm.backbone), examples, device) for layer in sm.layers]
    return int(np.argmin(losses)), {"nearest_by": "calibration CTC loss", "losses": losses}


@register_method("session_layers", needs=("session_layers",))
def session_layers(models, session, calib, norm, config, options) -> Adapted:
    """Per-session input layers; the new layer starts from the nearest held-in layer and is fitted with Adam."""
    sm = _need(models, "session_layers", "session_layers")
    device = resolve_device(config.device)
    idx, info = nearest_session_layer(sm, models.held_in_days, session, trials_to_examples(calib, norm),
                                      options.get("nearest", "loss"), device)
    start = AlignedDecoder(copy.deepcopy(sm.layers[idx]), sm.backbone)
    res = calibrate_session(start, calib, _with(config, optimizer="adam"), normalization=norm)
    return Adapted(res.model, {**res.chosen, "start_layer": sm.session_names[idx], **info}, res.wall_s)


@register_method("alignment", needs=("backbone",))
def alignment_from_identity(models, session, calib, norm, config, options) -> Adapted:
    """Frozen pooled backbone; alignment layer fitted from identity with Adam (no meta-learning)."""
    bb = _need(models, "backbone", "alignment")
    start = AlignedDecoder(AffineAlignment(bb.n_inputs).to(bb.readout.weight.device), bb)
    form, rank = options.get("alignment_form", ("full", 0))
    params = alignment_params(form, bb.n_inputs, rank, options.get("seed", 0))
    res = calibrate_session(start, calib, _with(config, optimizer="adam"), normalization=norm, start=params)
    return Adapted(res.model, res.chosen, res.wall_s)


@register_method("two_stage", needs=("backbone", "meta"))
def two_stage(models, session, calib, norm, config, options) -> Adapted:
    """Frozen pooled backbone; meta-learned alignment initialisation and step sizes."""
    bb = _need(models, "backbone", "two_stage")
    meta = _need(models, "meta", "two_stage")
    start = AlignedDecoder(meta.new_alignment(), bb)
    res = calibrate_session(start, calib, _with(config, optimizer="meta"), meta=meta, normalization=norm)
    return Adapted(res.model, res.chosen, res.wall_s)


def _with(config: CalibrationConfig, **changes) -> CalibrationConfig:
    return CalibrationConfig.from_dict({**config.to_dict(), **changes})


def finetune_batch(backbone: GRUBackbone, support: Sequence[Sequence[Example]], lrs: Sequence[float], steps: int,
                   validation: Sequence[Sequence[Example]] | None = None, eval_every: int = 1,
                   device: torch.device | str = "cpu", max_grad_norm: float = 1.0
                   ) -> tuple[dict[str, torch.Tensor], list[int], np.ndarray]:
    """Fine-tune one copy of every backbone weight per task at once (Adam, learning rate ``lrs[t]``).

    Each task has its own sentences (the same number per task) and its own copy of the
    weights, clipped to gradient norm ``max_grad_norm`` per task; the copies run as one
    batch (:func:`closedloop.sdk.bci.fastgru.stacked_backbone`), in evaluation mode (dropout off, as in
    every other calibration). Returns the fitted weights with a task axis (names as in
    ``backbone.named_parameters()``), the checkpoint steps, and the validation loss per
    checkpoint and task (empty without ``validation``).
    """
    n = len(support)
    sup = collate([e for task in support for e in task], device)
    val = collate([e for task in validation for e in task], device) if validation else None
    for what, batch in (("support", sup), ("validation", val)):
        if batch is not None and batch.x.shape[0] % n:
            raise ValueError(f"every task needs the same number of {what} sentences; got {batch.x.shape[0]} for {n} tasks")
    params = {k: v.detach().to(device).expand(n, *v.shape).clone() for k, v in backbone.named_parameters()}
    adam = StackedAdam(params, torch.tensor(list(lrs), dtype=torch.float32, device=device))

    def losses(p: dict[str, torch.Tensor], batch) -> torch.Tensor:
        x = batch.x.view(n, -1, *batch.x.shape[1:])
        return per_task_ctc(stacked_backbone(p, x, backbone.n_layers).flatten(0, 1), batch, n)

    checkpoints: list[int] = []
    curve: list[np.ndarray] = []
    for k in range(steps + 1):
        if val is not None and (k % eval_every == 0 or k == steps):
            with torch.no_grad():
                curve.append(losses(params, val).cpu().numpy())
            checkpoints.append(k)
        if k == steps:
            break
        leaves = {name: v.requires_grad_() for name, v in params.items()}
        grads = dict(zip(leaves, torch.autograd.grad(losses(leaves, sup).sum(), list(leaves.values())), strict=True))
        with torch.no_grad():  # torch.nn.utils.clip_grad_norm_, per task
            norm = torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()
            coef = (max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
            grads = {name: g * task_axis(coef, g.dim() - 1) for name, g in grads.items()}
        params = adam.step(grads)
    return {k: v.detach() for k, v in params.items()}, checkpoints, np.array(curve)


@register_method("finetune", needs=("backbone",))
def finetune(models, session, calib, norm, config, options) -> Adapted:
    """Pooled backbone with every weight fine-tuned on the calibration sentences (Adam)."""
    bb = _need(models, "backbone", "finetune")
    device = resolve_device(config.device)
    t0 = time.perf_counter()
    ex = trials_to_examples(calib, norm)
    grid = tuple(options.get("finetune_lr_grid", (1e-4, 3e-4, 1e-3)))

    def run(knobs: list[float], steps: int, splits: list) -> tuple[list[int], np.ndarray]:
        sup = [[ex[j] for j in splits[i % len(splits)][0]] for i in range(len(knobs))]
        val = [[ex[j] for j in splits[i % len(splits)][1]] for i in range(len(knobs))]
        _, ck, curve = finetune_batch(bb, sup, knobs, steps, val, config.eval_every, device)
        return ck, curve

    if config.tune and loo_folds(len(ex), config.folds):
        lr, steps, _ = choose_by_validation(run, grid, config.steps, len(ex), config.folds)
    else:
        lr, steps = float(grid[len(grid) // 2]), config.steps
    fitted, _, _ = finetune_batch(bb, [ex], [lr], steps, device=device)
    tuned = copy.deepcopy(bb).to(device).eval()
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            p.copy_(fitted[name][0])
    model = AlignedDecoder(AffineAlignment(bb.n_inputs).to(device), tuned)
    return Adapted(model, {"optimizer": "adam (whole backbone)", "lr": lr, "steps": steps}, time.perf_counter() - t0)


def reference_layer(models: TrainedModels, session: Session) -> AlignedDecoder:
    """Drift reference: the session-layer decoder with the last held-in session's layer (by day)."""
    sm = models.reference_decoder()
    held = [(models.held_in_days[n], i) for i, n in enumerate(sm.session_names) if models.held_in_days[n] <= session.day]
    i = max(held or [(models.held_in_days[n], i) for i, n in enumerate(sm.session_names)])[1]
    return AlignedDecoder(sm.layers[i], sm.backbone)
