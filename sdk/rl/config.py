"""Configuration of success-visitation fine-tuning, as dataclasses that round-trip through JSON.

:class:`ShapingConfig` is the reward (which form, lambda, beta, the discriminator and
its training); :class:`FineTuneConfig` is one fine-tuning run (task, pre-training,
SAC settings, budget, evaluation).  ``to_dict``/``from_dict`` make every run
reproducible from its record (``bench/results/rl/rl.json`` stores them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from closedloop.common.config import JsonConfig

__all__ = ["ShapingConfig", "FineTuneConfig", "SHAPING_KINDS"]

#: ``sparse``: outcome reward only.  ``svm``: success visitation matching,
#: r + lambda clip_beta(logit f(s, a)), f from successful vs failed trajectories.
#: ``potential``: r + lambda (gamma Phi(s') - Phi(s)), Phi = clip_beta(logit g(s)), g state-only.
#: ``gail``: like ``svm`` but f from successful trajectories vs the policy's own recent data (no failure labels).
SHAPING_KINDS = ("sparse", "svm", "potential", "gail")
#: the Panda tasks a fine-tuning run takes
TASKS = ("reach", "push", "pick_and_place")


def _at_least(where: str, floors: dict[str, int], cfg: object) -> None:
    """Each named setting of ``cfg`` must be a whole number at or above its floor."""
    for name, floor in floors.items():
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < floor:
            raise ValueError(f"{where}.{name}={v!r}: give a whole number, {floor} or more")


@dataclass
class ShapingConfig(JsonConfig):
    """The dense process reward and its discriminator.

    Attributes
    ----------
    kind : str
        One of :data:`SHAPING_KINDS`.
    lam : float
        lambda, the weight of the discriminator term.
    beta : float
        Logits are clipped to ``[-beta, beta]`` (bounds the bonus at ``lam * beta`` per step).
    gamma : float or None
        Discount in the potential-based form.  None (default): the RL algorithm's, bound by
        :meth:`VisitationReward.bind_gamma` at training start; a set value that differs from
        the algorithm's is an error for ``potential`` (exact invariance needs the same discount) where the
        algorithm is known (``OutcomeLogger`` at training start, ``fine_tune``, ``rl-train``).
    hidden : tuple of int
        Discriminator hidden widths (ReLU MLP).
    lr, weight_decay : float
        AdamW settings of the discriminator.
    batch_size : int
        Per class (positives and negatives are sampled in equal numbers).
    updates_per_episode : int
        Gradient steps after every finished episode ("refit as episodes arrive").
    capacity : int
        Transitions kept per label (oldest dropped first).
    policy_window : int
        ``gail``: negatives are the policy's most recent transitions, this many.
    success_when : {"final", "any"}
        A trajectory is successful if ``info["is_success"]`` holds at its last step, or at any step.
    device : str
        Torch device of the discriminator.
    """

    kind: str = "svm"
    lam: float = 0.05
    beta: float = 5.0
    gamma: float | None = None
    hidden: tuple[int, ...] = (64, 64)
    lr: float = 1e-3
    weight_decay: float = 1e-4
    batch_size: int = 128
    updates_per_episode: int = 10
    capacity: int = 50_000
    policy_window: int = 5_000
    success_when: str = "final"
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.kind not in SHAPING_KINDS:
            raise ValueError(f"ShapingConfig.kind={self.kind!r}; expected one of {SHAPING_KINDS}")
        if self.success_when not in ("final", "any"):
            raise ValueError(f"ShapingConfig.success_when={self.success_when!r}; expected 'final' or 'any'")
        if not (math.isfinite(self.beta) and self.beta > 0 and math.isfinite(self.lam) and self.lam >= 0) or (
                self.gamma is not None and not 0 < self.gamma <= 1):
            raise ValueError(f"ShapingConfig needs beta > 0, lam >= 0, 0 < gamma <= 1; got beta={self.beta}, "
                             f"lam={self.lam}, gamma={self.gamma}")
        # each would leave the discriminator untrained (no data kept, no batch, no update): a bonus that never moves
        _at_least("ShapingConfig", {"batch_size": 1, "capacity": 1, "policy_window": 1, "updates_per_episode": 0},
                  self)
        if not (self.lr > 0 and self.weight_decay >= 0):
            raise ValueError(f"ShapingConfig needs lr > 0 and weight_decay >= 0; got lr={self.lr}, "
                             f"weight_decay={self.weight_decay}")
        self.hidden = tuple(int(h) for h in self.hidden)
        if not self.hidden or min(self.hidden) < 1:
            raise ValueError(f"ShapingConfig.hidden={self.hidden}: give one or more layer widths, each 1 or more")


@dataclass
class FineTuneConfig(JsonConfig):
    """One pre-train + fine-tune run on a Panda task (see :func:`closedloop.sdk.rl.fine_tune`).

    Attributes
    ----------
    task : str
        ``reach``, ``push`` or ``pick_and_place``.
    seed : int
        Seeds torch, the environments and the demonstrations.
    shaping : ShapingConfig
        The reward.
    demos : int
        Scripted demonstrations for behaviour cloning (their successful episodes are cloned).
    demo_noise : float
        Gaussian action noise on the scripted controller (diverse demonstrations).
    bc_epochs : int
        Behaviour-cloning epochs over the demonstrations.
    prior_episodes : int
        Episodes of the pre-trained policy that seed the discriminator's labelled replay.
    total_steps : int
        Environment steps of fine-tuning.
    net : tuple of int
        Actor and critic hidden widths.
    batch_size, gradient_steps, train_freq : int
        SAC settings (no random warm-up steps: the replay starts with demonstrations and prior episodes).
    critic_pretrain_steps : int
        Critic gradient steps (actor frozen) on the seeded replay before the first environment step.
    actor_warmup_steps : int
        The actor is frozen for this many steps while the critic learns the pre-trained policy's values.
    actor_lr_scale : float
        The actor's learning rate is ``learning_rate * actor_lr_scale``.
    prior_weight : float
        Weight of the pull towards the frozen pre-trained policy in the actor's loss
        (:class:`~closedloop.sdk.rl.regularised_sac.PriorRegularisedSAC`, TD3+BC-style: the Q term is divided by
        the batch's mean |Q|).  0: plain SAC, which collapses the cloned push policy.
    init_log_std : float
        Log standard deviation of the pre-trained actor's (pre-tanh) Gaussian.
    prior_band : (low, high), optional
        A weak prior: clone until the deterministic success, checked on 50 episodes, is inside this band
        (:func:`closedloop.sdk.rl.panda_gym.clone_weak_prior`, at most 1000 epochs) instead of ``bc_epochs``
        epochs.  None (default): ``bc_epochs``.
    ent_coef : str
        SAC's entropy coefficient: a number, or ``"auto_0.01"`` (tuned from 0.01; its target entropy
        drags a pre-trained policy whose actions saturate the tanh towards noise, so the default is fixed).
    eval_every, eval_episodes : int
        In-process evaluation (deterministic policy, outcome only) every so many steps.
    """

    task: str = "push"
    seed: int = 0
    shaping: ShapingConfig = field(default_factory=ShapingConfig)
    demos: int = 30
    demo_noise: float = 0.1
    bc_epochs: int = 200
    prior_episodes: int = 20
    total_steps: int = 20_000
    net: tuple[int, ...] = (256, 256)
    learning_rate: float = 3e-4
    gamma: float = 0.95
    batch_size: int = 256
    gradient_steps: int = 1
    train_freq: int = 1
    critic_pretrain_steps: int = 2_000
    actor_warmup_steps: int = 500
    actor_lr_scale: float = 0.3
    prior_weight: float = 1.0
    init_log_std: float = -1.5
    prior_band: tuple[float, float] | None = None
    ent_coef: str = "0.002"
    eval_every: int = 2_000
    eval_episodes: int = 30
    device: str = "cpu"

    def __post_init__(self) -> None:
        self.net = tuple(int(h) for h in self.net)
        if isinstance(self.shaping, dict):
            self.shaping = ShapingConfig.from_dict(self.shaping)
        if self.task not in TASKS:
            raise ValueError(f"FineTuneConfig.task={self.task!r}: one of {', '.join(TASKS)}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            raise ValueError(f"FineTuneConfig.seed={self.seed!r}: a whole number from 0 to 2**32 - 1")
        _at_least("FineTuneConfig", {"total_steps": 1, "demos": 1, "bc_epochs": 0, "prior_episodes": 0,
                                     "batch_size": 1, "gradient_steps": 1, "train_freq": 1, "critic_pretrain_steps": 0,
                                     "actor_warmup_steps": 0, "eval_every": 1, "eval_episodes": 1}, self)
        if not (self.learning_rate > 0 and 0 < self.gamma <= 1 and self.demo_noise >= 0 and self.actor_lr_scale >= 0
                and self.prior_weight >= 0):
            raise ValueError(f"FineTuneConfig needs learning_rate > 0, 0 < gamma <= 1, demo_noise, actor_lr_scale and "
                             f"prior_weight >= 0; got {self.learning_rate}, {self.gamma}, {self.demo_noise}, "
                             f"{self.actor_lr_scale}, {self.prior_weight}")
