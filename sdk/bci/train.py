"""Stage 1: one GRU decoder trained with CTC on pooled held-in sessions.

The backbone sees every held-in session's training trials (its non-evaluation
trials), each normalised with its own session's statistics, through **no**
session-specific input layer: it must absorb cross-session variability itself, and
drift-suited augmentation (:class:`~sdk.bci.augment.DriftAugmentation`, a fresh draw
per trial) widens the variability it sees. The same loop trains the baseline with
per-session input layers (:func:`train_session_layers`), so both get the same
recipe: Adam, cosine learning-rate decay, gradient clipping, the same augmentation
and number of steps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from sim.handwriting.types import Session

from .augment import DriftAugmentation, time_mask
from .config import JsonConfig
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
    seed: int = 0
    device: str = "auto"
    progress: bool = True


@dataclass
class TrainingLog:
    """Loss per step and wall time of one training run."""

    loss: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    device: str = "cpu"
    n_trials: int = 0
    what: str = ""

    def to_dict(self) -> dict:
        return {"what": self.what, "loss": self.loss, "wall_s": self.wall_s, "device": self.device, "n_trials": self.n_trials}

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


def cosine_lr(step: int, steps: int, lr: float, final_fraction: float, warmup: int = 0) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay from ``lr`` to ``lr * final_fraction``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    done = (step - warmup) / max(steps - warmup, 1)
    return lr * (final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * done)))


def fit_ctc(
    module: nn.Module,
    forward: Callable[[torch.Tensor, Batch], torch.Tensor],
    examples: Sequence[Example],
    config: TrainConfig,
    what: str,
    lr_scales: dict[int, float] | None = None,
) -> TrainingLog:
    """Train ``module`` in place: ``forward(x, batch) -> logp`` on augmented batches, CTC loss, Adam.

    ``lr_scales`` maps ``id(parameter)`` to a learning-rate factor (default 1).
    """
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    gen = torch.Generator().manual_seed(config.seed + 1)
    module.to(device).train()
    params = [p for p in module.parameters() if p.requires_grad]
    scales = lr_scales or {}
    groups: dict[float, list] = {}
    for p in params:
        groups.setdefault(scales.get(id(p), 1.0), []).append(p)
    opt = torch.optim.Adam([{"params": ps, "scale": k} for k, ps in groups.items()], lr=config.lr,
                           weight_decay=config.weight_decay)
    log = TrainingLog(device=str(device), n_trials=len(examples), what=what)
    batches = iterate_batches(examples, config.batch_size, rng, config.shortest_first_epochs)
    t0 = time.perf_counter()
    bar = tqdm(range(config.steps), desc=what, disable=not config.progress, leave=False)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = g["scale"] * cosine_lr(step, config.steps, config.lr, config.lr_final_fraction, config.warmup_steps)
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
    module.eval()
    log.wall_s = time.perf_counter() - t0
    return log


def train_backbone(sessions: Sequence[Session], config: TrainConfig | None = None) -> tuple[GRUBackbone, TrainingLog]:
    """Stage 1: a GRU backbone on pooled held-in sessions, no session-specific input layer.

    Parameters
    ----------
    sessions
        The recording; only ``split == "held_in"`` sessions are used, and only their
        non-evaluation trials.
    config
        Model size, optimiser and augmentation.

    Returns
    -------
    backbone, log
        The trained backbone (eval mode, on ``config.device``) and the loss curve.
    """
    config = config or TrainConfig()
    examples = held_in_examples(sessions, config.std_floor)
    torch.manual_seed(config.seed)
    bc = config.backbone
    backbone = GRUBackbone(examples[0].x.shape[1], bc.n_hidden, bc.n_layers, bc.dropout)
    log = fit_ctc(backbone, lambda x, b: backbone(x)[0], examples, config, "stage 1: pooled backbone")
    return backbone, log


def train_session_layers(
    sessions: Sequence[Session], config: TrainConfig | None = None
) -> tuple[SessionInputDecoder, TrainingLog]:
    """The usual multi-session decoder: one affine input layer per held-in session, trained jointly with a backbone."""
    config = config or TrainConfig()
    held_in = [s for s in sessions if s.split == "held_in"]
    examples = held_in_examples(sessions, config.std_floor)
    torch.manual_seed(config.seed)
    bc = config.backbone
    model = SessionInputDecoder([s.name for s in held_in],
                                GRUBackbone(examples[0].x.shape[1], bc.n_hidden, bc.n_layers, bc.dropout))
    scales = {id(p): config.input_layer_lr_scale for p in model.layers.parameters()}
    log = fit_ctc(model, lambda x, b: model(x, b.session)[0], examples, config, "session input layers", scales)
    return model, log
