"""The methods compared in the harness, each a registered way to get a new session's decoder.

A method takes what was trained on held-in data (:class:`TrainedModels`), a held-out
session's calibration trials and normalisation, and returns an
:class:`~sdk.bci.models.AlignedDecoder` for that session. Registered methods:

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

All adaptive methods use :mod:`sdk.bci.calibrate`'s protocol: a grid of three values of
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

from sim.handwriting.types import Session, Trial

from .calibrate import (
    CalibrationConfig,
    calibrate_session,
    choose_by_validation,
    loo_folds,
    trials_to_examples,
)
from .data import Example, Normalization, collate, ctc_loss, resolve_device
from .meta import MetaAlignment
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


def _finetune(backbone: GRUBackbone, support: Sequence[Example], lr: float, steps: int,
              validation: Sequence[Example] | None, eval_every: int, device: torch.device
              ) -> tuple[GRUBackbone, list[int], list[float]]:
    bb = copy.deepcopy(backbone).to(device).eval()  # eval: dropout off, as in every other calibration
    for p in bb.parameters():
        p.requires_grad_(True)
    opt = torch.optim.Adam(bb.parameters(), lr=lr)
    sup = collate(support, device)
    val = collate(validation, device) if validation else None
    ckpts, losses = [], []
    for k in range(steps + 1):
        if val is not None and (k % eval_every == 0 or k == steps):
            with torch.no_grad():
                losses.append(float(ctc_loss(bb(val.x)[0], val)))
            ckpts.append(k)
        if k == steps:
            break
        loss = ctc_loss(bb(sup.x)[0], sup)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(bb.parameters(), 1.0)
        opt.step()
    return bb.eval(), ckpts, losses


@register_method("finetune", needs=("backbone",))
def finetune(models, session, calib, norm, config, options) -> Adapted:
    """Pooled backbone with every weight fine-tuned on the calibration sentences (Adam)."""
    bb = _need(models, "backbone", "finetune")
    device = resolve_device(config.device)
    t0 = time.perf_counter()
    ex = trials_to_examples(calib, norm)
    grid = tuple(options.get("finetune_lr_grid", (1e-4, 3e-4, 1e-3)))

    def run(knobs: list[float], steps: int, splits: list) -> tuple[list[int], np.ndarray]:
        curves, ck = [], []
        for i, lr in enumerate(knobs):
            fit, val = splits[i % len(splits)]
            _, ck, losses = _finetune(bb, [ex[j] for j in fit], lr, steps, [ex[j] for j in val], config.eval_every, device)
            curves.append(losses)
        return ck, np.array(curves).T

    with torch.backends.cudnn.flags(enabled=False):
        if config.tune and loo_folds(len(ex), config.folds):
            lr, steps, _ = choose_by_validation(run, grid, config.steps, len(ex), config.folds)
        else:
            lr, steps = float(grid[len(grid) // 2]), config.steps
        tuned, _, _ = _finetune(bb, ex, lr, steps, None, config.eval_every, device)
    model = AlignedDecoder(AffineAlignment(bb.n_inputs).to(device), tuned)
    return Adapted(model, {"optimizer": "adam (whole backbone)", "lr": lr, "steps": steps}, time.perf_counter() - t0)


def reference_layer(models: TrainedModels, session: Session) -> AlignedDecoder:
    """Drift reference: the session-layer decoder with the last held-in session's layer (by day)."""
    sm = models.reference_decoder()
    held = [(models.held_in_days[n], i) for i, n in enumerate(sm.session_names) if models.held_in_days[n] <= session.day]
    i = max(held or [(models.held_in_days[n], i) for i, n in enumerate(sm.session_names)])[1]
    return AlignedDecoder(sm.layers[i], sm.backbone)
