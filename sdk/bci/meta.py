"""Stage 2: meta-learn the alignment layer's initialisation and per-parameter step sizes.

The backbone from stage 1 is frozen. In front of it sits the alignment layer
:math:`x \\mapsto A x + b` (:class:`~closedloop.sdk.bci.models.AffineAlignment`). Calibrating a new
session is :math:`K` gradient steps on its three calibration sentences,

.. math::  \\theta_{k+1} = \\theta_k - \\alpha \\odot \\nabla_\\theta L_{\\text{support}}(\\theta_k),
           \\qquad \\theta = (A, b),\\ \\theta_0 \\text{ and } \\alpha \\text{ learned},

which is Meta-SGD (Li et al. 2017): the initialisation :math:`\\theta_0` and one step size
per parameter :math:`\\alpha = e^{s}` (learned in log space so it stays positive) are
meta-learned so that the adapted layer decodes the *other* sentences of the same
session well (the outer, query loss).

Tasks come from held-in sessions: a task is one held-in session with a fresh
synthetic drift drawn for it (:class:`~closedloop.sdk.bci.augment.DriftAugmentation` applied
once to all its sentences: channel gains, offsets, mixing, a wandering offset,
dropped channels; stronger than stage-1 augmentation), three random support
sentences and ``n_query`` other query sentences. The drifted task is then
re-normalised from its three support sentences only, exactly as a held-out
session is, so the tasks carry the same normalisation noise as real held-out days.

Gradients through the inner loop are first-order by default (``second_order=False``):
the inner gradients :math:`g_k` are treated as constants, so
:math:`\\partial\\theta_K/\\partial\\theta_0 = I` and
:math:`\\partial\\theta_K/\\partial\\alpha = -\\sum_k g_k`; the step sizes still get a
gradient. ``second_order=True`` differentiates through the inner gradients
(double backward through the GRU and through :func:`closedloop.sdk.bci.ctc.ctc_nll`, since
``F.ctc_loss`` has no second derivative; several times slower).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from closedloop.common.config import JsonConfig
from closedloop.common.handwriting import Session

from . import fastgru
from .augment import DriftAugmentation
from .ctc import ctc_nll
from .data import (
    DEFAULT_STD_FLOOR,
    Batch,
    Example,
    collate,
    ctc_loss,
    fit_indices,
    make_examples,
    resolve_device,
    session_normalization,
)
from .models import (
    ALIGNMENT_FORMS,
    AffineAlignment,
    GRUBackbone,
    affine,
    alignment_params,
    compose_alignment,
)
from .train import TrainingLog


@dataclass
class MetaConfig(JsonConfig):
    """Stage-2 meta-learning of the alignment layer."""

    inner_steps: int = 5
    n_support: int = 3
    n_query: int = 4
    tasks_per_step: int = 4
    meta_steps: int = 300
    outer_lr_init: float = 3e-4  # Adam on (A0, b0): small, or its sign-like steps add noise to every entry
    outer_lr_step: float = 2e-2  # Adam on the log step sizes
    init_step_size: float = 0.1
    form: str = "full"  # alignment parameterisation, sdk.bci.models.ALIGNMENT_FORMS
    rank: int = 0  # rank of the cross-channel part for form "lowrank"
    second_order: bool = False
    drift: DriftAugmentation = field(
        default_factory=lambda: DriftAugmentation(gain_std=0.3, offset_std=0.3, mixing_std=0.2, walk_std=0.1,
                                                  dropout_p=0.05, swap_p=0.1, noise_std=0.05)
    )
    renormalize: bool = True
    renormalize_std_floor: float = 0.1  # in normalised units
    std_floor: float = DEFAULT_STD_FLOOR
    seed: int = 0
    device: str = "auto"
    progress: bool = True

    def __post_init__(self) -> None:
        if self.form not in ALIGNMENT_FORMS:
            raise ValueError(f"meta.form {self.form!r} is not one of {ALIGNMENT_FORMS}")
        if self.form == "lowrank" and self.rank < 1:
            raise ValueError(f"meta.form 'lowrank' needs meta.rank >= 1 (the rank of the cross-channel part), got {self.rank}")


def task_losses(backbone: GRUBackbone, x: torch.Tensor, batch: Batch, weight: torch.Tensor, bias: torch.Tensor,
                n_tasks: int, reduce: bool = True, twice_differentiable: bool = False) -> torch.Tensor:
    """Mean CTC loss per task of sequences ``x`` grouped task-major, each task with its own map ``weight[t]``, ``bias[t]``.

    Summed over tasks (so each task's gradient is that of its own mean), or one value
    per task with ``reduce=False``. ``twice_differentiable`` uses :func:`closedloop.sdk.bci.ctc.ctc_nll`
    (second-order meta-learning) instead of ``F.ctc_loss``.
    """
    per_task = x.shape[0] // n_tasks
    if per_task * n_tasks != x.shape[0]:
        raise ValueError(f"{x.shape[0]} sequences do not split into {n_tasks} equal tasks")
    w = weight.repeat_interleave(per_task, dim=0)
    b = bias.repeat_interleave(per_task, dim=0)
    logp, _ = backbone(affine(x, w, b))
    per_task_loss = per_task_ctc(logp, batch, n_tasks, twice_differentiable)
    return per_task_loss.sum() if reduce else per_task_loss


def per_task_ctc(logp: torch.Tensor, batch: Batch, n_tasks: int, twice_differentiable: bool = False) -> torch.Tensor:
    """Each task's mean CTC loss (``ctc_loss``'s per-target-length mean) of ``logp`` grouped task-major."""
    if twice_differentiable:
        nll = ctc_nll(logp, batch.targets, batch.x_lens, batch.target_lens)
    else:
        nll = ctc_loss(logp, batch, reduction="none")
    per_seq = nll / batch.target_lens.to(logp.device).clamp(min=1)
    return per_seq.view(n_tasks, -1).mean(1)


class MetaAlignment(nn.Module):
    """Meta-learned alignment: initialisation :math:`\\theta_0`, log step sizes, and the inner loop.

    Parameters
    ----------
    n_channels
        Channels C of the input.
    inner_steps
        :math:`K`, the number of calibration steps it was meta-trained for.
    init_step_size
        Initial :math:`\\alpha` for every parameter.
    form, rank
        The alignment's parameterisation (:data:`~closedloop.sdk.bci.models.ALIGNMENT_FORMS`):
        ``"full"`` learns :math:`(A_0, b_0)` and a step size per entry; ``"lowrank"``
        learns :math:`(g_0, b_0, U_0, V_0)` of :math:`A = \\operatorname{diag}(g) + UV`,
        the directions :math:`V_0` included.
    """

    def __init__(self, n_channels: int, inner_steps: int = 5, init_step_size: float = 0.1, form: str = "full",
                 rank: int = 0, seed: int = 0):
        super().__init__()
        self.n_channels, self.inner_steps = n_channels, inner_steps
        start = alignment_params(form, n_channels, rank, seed)  # checks form and rank
        self.form, self.rank = form, (rank if form == "lowrank" else 0)
        ls = float(np.log(init_step_size))
        self.init = nn.ParameterDict({k: nn.Parameter(v) for k, v in start.items()})
        self.log_step = nn.ParameterDict({k: nn.Parameter(torch.full_like(v, ls)) for k, v in start.items()})

    def step_sizes(self) -> dict[str, torch.Tensor]:
        """:math:`\\alpha = e^{s}` per parameter, by name."""
        return {k: v.exp() for k, v in self.log_step.items()}

    def start(self, n_tasks: int = 1) -> dict[str, torch.Tensor]:
        """The initialisation, with a task axis of ``n_tasks`` (differentiable, not copied)."""
        return {k: v.expand(n_tasks, *v.shape) for k, v in self.init.items()}

    def init_map(self) -> tuple[torch.Tensor, torch.Tensor]:
        """:math:`(A_0, b_0)`, the map a new session starts from."""
        return compose_alignment(dict(self.init.items()))

    def new_alignment(self) -> AffineAlignment:
        """An :class:`AffineAlignment` at the meta-learned initialisation."""
        w, b = (t.detach() for t in self.init_map())
        return AffineAlignment(self.n_channels).to(w.device).load(w, b)

    def adapt(self, backbone: GRUBackbone, x: torch.Tensor, batch: Batch, n_tasks: int = 1, steps: int | None = None,
              step_scale: float = 1.0, second_order: bool = False, start: dict[str, torch.Tensor] | None = None
              ) -> dict[str, torch.Tensor]:
        """Run the inner loop on support sequences ``x`` (task-major) and return the adapted parameters per task.

        The result stays differentiable with respect to the initialisation and the step
        sizes (first-order unless ``second_order``); :func:`~closedloop.sdk.bci.models.compose_alignment`
        turns it into :math:`(A, b)`.
        """
        steps = self.inner_steps if steps is None else steps
        alpha = self.step_sizes()
        params = self.start(n_tasks) if start is None else start
        names = list(params)
        for _ in range(steps):
            if second_order:
                with fastgru.twice_differentiable():
                    loss = task_losses(backbone, x, batch, *compose_alignment(params), n_tasks, twice_differentiable=True)
                grads = torch.autograd.grad(loss, [params[k] for k in names], create_graph=True)
            else:
                leaves = {k: params[k].detach().requires_grad_() for k in names}
                loss = task_losses(backbone, x, batch, *compose_alignment(leaves), n_tasks)
                grads = torch.autograd.grad(loss, [leaves[k] for k in names])
            params = {k: params[k] - step_scale * alpha[k] * g for k, g in zip(names, grads, strict=True)}
        return params


def _renormalize(x: torch.Tensor, lens: torch.Tensor, n_support: int, floor: float) -> torch.Tensor:
    """Re-standardise a task's sequences with the mean/std of its first ``n_support`` sequences' valid bins."""
    valid = [x[i, : int(lens[i])] for i in range(n_support)]
    cat = torch.cat(valid)
    return (x - cat.mean(0)) / cat.std(0, unbiased=False).clamp(min=floor)


class _TaskSampler:
    """Draws (support, query) tasks from held-in sessions with a fresh drift per task."""

    def __init__(self, sessions: Sequence[Session], config: MetaConfig, device: torch.device):
        self.config, self.device = config, device
        self.pools: list[list[Example]] = []
        for s in sessions:
            if s.split != "held_in":
                continue
            ex = make_examples(s, fit_indices(s), session_normalization(s, config.std_floor))
            if len(ex) >= config.n_support + 1:
                self.pools.append(ex)
        if not self.pools:
            raise ValueError(f"no held-in session has the {config.n_support + 1} training trials a meta-learning task needs")
        self.rng = np.random.default_rng(config.seed)
        self.gen = torch.Generator().manual_seed(config.seed + 7)

    def sample(self, n_tasks: int) -> tuple[torch.Tensor, Batch, torch.Tensor, Batch]:
        c = self.config
        sup_ex: list[Example] = []
        qry_ex: list[Example] = []
        for _ in range(n_tasks):
            pool = self.pools[self.rng.integers(len(self.pools))]
            n_q = min(c.n_query, len(pool) - c.n_support)
            pick = self.rng.choice(len(pool), c.n_support + n_q, replace=False)
            # query count is fixed per step so tasks stack; short sessions repeat query sentences
            pick = list(pick) + list(self.rng.choice(pick[c.n_support:], c.n_query - n_q)) if n_q < c.n_query else list(pick)
            ex = [pool[i] for i in pick]
            b = collate(ex, self.device)
            x = c.drift(b.x, self.gen, per="batch")
            if c.renormalize:
                x = _renormalize(x, b.x_lens, c.n_support, c.renormalize_std_floor)
            for i, e in enumerate(ex):
                drifted = Example(x[i, : int(b.x_lens[i])].cpu().numpy(), e.labels, e.sentence)
                (sup_ex if i < c.n_support else qry_ex).append(drifted)
        sb, qb = collate(sup_ex, self.device), collate(qry_ex, self.device)
        return sb.x, sb, qb.x, qb


def meta_summary(meta: MetaAlignment) -> dict:
    """What meta-learning changed: the initialisation's distance from identity and the learned step sizes.

    Recorded by the benchmark next to each run, so it can be read whether the two-stage
    method differs from the identity-initialised alignment by its start, its steps, or neither.
    Step-size quantiles are over the entries of :math:`A` (``full``) or of :math:`(g, U, V)`
    (``lowrank``), and over :math:`b`.
    """
    with torch.no_grad():
        w0, b0 = meta.init_map()
        dw = (w0 - torch.eye(meta.n_channels, device=w0.device)).abs()
        alpha = meta.step_sizes()
        aw = torch.cat([a.flatten() for k, a in alpha.items() if k != "bias"])
        q = [0.05, 0.5, 0.95]
        return {
            "form": meta.form, "rank": meta.rank,
            "init_weight_offset_fro": float(dw.pow(2).sum().sqrt()),
            "init_weight_offset_max": float(dw.max()),
            "init_bias_max": float(b0.abs().max()),
            "step_weight_quantiles": [float(v) for v in torch.quantile(aw.float().cpu(), torch.tensor(q))],
            "step_bias_quantiles": [float(v) for v in torch.quantile(alpha["bias"].float().cpu(), torch.tensor(q))],
            "quantiles": q,
        }


def meta_train_alignment(
    backbone: GRUBackbone, sessions: Sequence[Session], config: MetaConfig | None = None, progress: Any = None,
    deadline: float | None = None,
) -> tuple[MetaAlignment, TrainingLog]:
    """Stage 2: freeze ``backbone`` and meta-learn the alignment layer's initialisation and step sizes.

    ``progress`` (a :class:`~closedloop.sdk.bci.progress.StageProgress`) is told every meta-step, in place
    of the module's own tqdm bar. ``deadline`` (a ``time.perf_counter()`` value): stop after the meta-step
    that passes it (at least one runs); the log's ``stop_reason`` is then ``time_budget``.

    Returns
    -------
    meta, log
        The :class:`MetaAlignment` and the outer (query) loss per meta-step. The
        backbone's parameters are left exactly as they were.
    """
    config = config or MetaConfig()
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)
    backbone.to(device).eval()
    frozen = [p.requires_grad for p in backbone.parameters()]
    for p in backbone.parameters():
        p.requires_grad_(False)
    meta = MetaAlignment(backbone.n_inputs, config.inner_steps, config.init_step_size, config.form, config.rank,
                         config.seed).to(device)
    opt = torch.optim.Adam([
        {"params": list(meta.init.values()), "lr": config.outer_lr_init},
        {"params": list(meta.log_step.values()), "lr": config.outer_lr_step},
    ])
    sampler = _TaskSampler(sessions, config, device)
    log = TrainingLog(device=str(device), n_trials=sum(len(p) for p in sampler.pools), what="stage 2: meta-learning")
    t0 = time.perf_counter()
    bar = tqdm(range(config.meta_steps), desc=log.what, disable=not config.progress or progress is not None,
               leave=False)
    try:
        # cuDNN's GRU cannot backpropagate in eval mode nor twice; the native kernels can
        with torch.backends.cudnn.flags(enabled=False):
            for step in bar:
                sx, sb, qx, qb = sampler.sample(config.tasks_per_step)
                params = meta.adapt(backbone, sx, sb, config.tasks_per_step, second_order=config.second_order)
                loss = task_losses(backbone, qx, qb, *compose_alignment(params), config.tasks_per_step)
                loss = loss / config.tasks_per_step
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                log.loss.append(float(loss.detach()))
                if step % 10 == 0:
                    bar.set_postfix(query_loss=f"{np.mean(log.loss[-10:]):.3f}")
                if progress is not None:
                    progress.step(step + 1, float(np.mean(log.loss[-10:])))
                if deadline is not None and time.perf_counter() >= deadline and step + 1 < config.meta_steps:
                    log.stop_reason = "time_budget"
                    break
    finally:
        for p, r in zip(backbone.parameters(), frozen, strict=True):
            p.requires_grad_(r)
    log.wall_s = time.perf_counter() - t0
    return meta.eval(), log
