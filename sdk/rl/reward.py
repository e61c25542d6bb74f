"""Success-visitation rewards: a discriminator between successful and other trajectories, turned into a dense reward.

Three forms (Tsao, Wagenmaker and Levine, "Learning Process Rewards via Success
Visitation Matching for Efficient RL", arXiv 2606.23640; Ng, Harada and Russell 1999):

- success visitation matching (``svm``): ``r'(s, a, s') = r(s, a, s') + lam * clip_beta(logit f(s, a))``
  with ``f`` trained by binary cross-entropy on ``D+`` (state-action pairs of successful
  trajectories, label 1) against ``D-`` (those of the other trajectories, label 0);
- potential-based (``potential``): ``r' = r + lam * (gamma * Phi(s') - Phi(s))`` with
  ``Phi(s) = clip_beta(logit g(s))``, ``g`` a state-only discriminator on the same labels
  (``Phi`` of a terminal state is 0).  For a fixed ``Phi`` this leaves the optimal
  policies of any MDP unchanged;
- success-only (``gail``): ``f`` trained on ``D+`` against the policy's own recent
  transitions, with no failure labels (GAIL-like, Ho and Ermon 2016).

Classes are sampled in equal numbers, so ``logit f = log p+(x) / p-(x)``, the log
density ratio of the two visitation distributions.  :class:`VisitationReward` keeps the
labelled replay of trajectories, refits its discriminator after every episode
(``updates_per_episode`` gradient steps), and computes the bonus for a batch of
transitions; it is framework-free (numpy in, numpy out).
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch
from torch import nn

from .config import ShapingConfig

__all__ = ["Discriminator", "LabelledReplay", "VisitationReward", "clipped_logit"]


def clipped_logit(logit: np.ndarray, beta: float) -> np.ndarray:
    """``clip_beta(logit) = min(max(logit, -beta), beta)``."""
    return np.clip(logit, -beta, beta)


class Discriminator(nn.Module):
    """``x -> logit f(x)``: an MLP with input standardisation fitted to the replay at each refit."""

    def __init__(self, n_in: int, hidden: tuple[int, ...] = (64, 64)) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = n_in
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 1))
        self.net = nn.Sequential(*layers)
        self.register_buffer("mean", torch.zeros(n_in))
        self.register_buffer("inv_std", torch.ones(n_in))

    def set_normaliser(self, x: np.ndarray) -> None:
        self.mean.copy_(torch.as_tensor(x.mean(0), dtype=torch.float32))
        self.inv_std.copy_(torch.as_tensor(1.0 / np.maximum(x.std(0), 1e-3), dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net((x - self.mean) * self.inv_std).squeeze(-1)


class LabelledReplay:
    """Transitions by label: ``positive`` (successful trajectories), ``negative`` (the others), ``recent`` (all)."""

    def __init__(self, capacity: int, recent: int) -> None:
        self.positive: deque[np.ndarray] = deque(maxlen=capacity)
        self.negative: deque[np.ndarray] = deque(maxlen=capacity)
        self.recent: deque[np.ndarray] = deque(maxlen=recent)
        self.episodes = {"positive": 0, "negative": 0}

    def add(self, rows: np.ndarray, success: bool) -> None:
        (self.positive if success else self.negative).extend(rows)
        self.recent.extend(rows)
        self.episodes["positive" if success else "negative"] += 1

    @staticmethod
    def sample(rows: deque[np.ndarray], n: int, rng: np.random.Generator) -> np.ndarray:
        idx = rng.integers(0, len(rows), size=n)
        return np.stack([rows[i] for i in idx])


class VisitationReward:
    """The dense reward of one :class:`ShapingConfig`: labelled replay, discriminator, bonus.

    Parameters
    ----------
    config : ShapingConfig
        The form (``kind``), ``lam``, ``beta``, ``gamma`` and discriminator settings.
    obs_dim, act_dim : int
        Sizes of the flat observation and action vectors.
    seed : int
        Seeds the discriminator's initial weights and its minibatches.

    Notes
    -----
    A replay row is ``[s, a, s']`` flattened.  ``svm`` and ``gail`` discriminate ``[s, a]``,
    ``potential`` discriminates ``s`` (and evaluates it at ``s`` and ``s'``).  Until the
    replay has both classes the bonus is 0 (``ready`` is False).

    Examples
    --------
    >>> import numpy as np
    >>> from closedloop.sdk.rl import ShapingConfig, VisitationReward
    >>> vr = VisitationReward(ShapingConfig(kind="svm", lam=0.1, beta=2.0), obs_dim=1, act_dim=1)
    >>> vr.add_episode(np.ones((5, 1)), np.ones((5, 1)), np.ones((5, 1)), success=True)
    >>> vr.add_episode(-np.ones((5, 1)), -np.ones((5, 1)), -np.ones((5, 1)), success=False)
    >>> vr.fit(200)
    >>> b = vr.bonus(np.array([[1.0], [-1.0]]), np.array([[1.0], [-1.0]]), np.array([[1.0], [-1.0]]))
    >>> bool(b[0] > 0.15 and b[1] < -0.15)
    True
    """

    def __init__(self, config: ShapingConfig, obs_dim: int, act_dim: int, seed: int = 0) -> None:
        self.config = config
        self.obs_dim, self.act_dim = int(obs_dim), int(act_dim)
        self.rng = np.random.default_rng(seed)
        self.replay = LabelledReplay(config.capacity, config.policy_window)
        self.device = torch.device(config.device)
        n_in = self.obs_dim if config.kind == "potential" else self.obs_dim + self.act_dim
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.net = Discriminator(n_in, config.hidden).to(self.device)
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.gamma: float | None = config.gamma
        self.updates = 0
        self.last_loss = float("nan")
        self.last_accuracy = float("nan")

    def bind_gamma(self, gamma: float) -> None:
        """Take the RL algorithm's discount when ``config.gamma`` is None; refuse a different one for ``potential``.

        The potential form keeps the optimal policy exactly only with the algorithm's own
        discount, so a ``ShapingConfig.gamma`` set to another value is an error there
        (``svm``/``gail``/``sparse`` do not use gamma).
        """
        gamma = float(gamma)
        if self.config.gamma is None:
            self.gamma = gamma
        elif self.config.kind == "potential" and abs(self.config.gamma - gamma) > 1e-12:
            raise ValueError(f"ShapingConfig.gamma={self.config.gamma} but the algorithm's gamma is {gamma}: the "
                             "potential form keeps the optimal policy only with the algorithm's discount; set "
                             "ShapingConfig.gamma=None (take the algorithm's) or to the same value")

    # --- data -------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Whether the discriminator has been trained on both classes (before that the bonus is 0)."""
        return self.config.kind != "sparse" and self.updates > 0

    def _has_classes(self) -> bool:
        r = self.replay
        if self.config.kind == "gail":
            return len(r.positive) > 0 and len(r.recent) > 0
        return len(r.positive) > 0 and len(r.negative) > 0

    def add_episode(self, obs: np.ndarray, actions: np.ndarray, next_obs: np.ndarray, success: bool) -> None:
        """Store one finished trajectory under its label (flat arrays, one row per step)."""
        rows = np.concatenate([np.asarray(obs, np.float32).reshape(len(obs), -1),
                               np.asarray(actions, np.float32).reshape(len(obs), -1),
                               np.asarray(next_obs, np.float32).reshape(len(obs), -1)], axis=1)
        self.replay.add(rows, bool(success))

    def _features(self, rows: np.ndarray) -> np.ndarray:
        if self.config.kind == "potential":
            return rows[:, : self.obs_dim]
        return rows[:, : self.obs_dim + self.act_dim]

    # --- training ---------------------------------------------------------------------

    def fit(self, steps: int | None = None) -> None:
        """``steps`` (default ``updates_per_episode``) BCE gradient steps on balanced minibatches."""
        if self.config.kind == "sparse" or not self._has_classes():
            return
        cfg, r = self.config, self.replay
        negatives = r.recent if cfg.kind == "gail" else r.negative
        if self.updates == 0 or self.updates % 200 == 0:
            both = np.concatenate([self._features(np.stack(list(r.positive)[-5000:])),
                                   self._features(np.stack(list(negatives)[-5000:]))])
            self.net.set_normaliser(both)
        n = cfg.batch_size
        labels = torch.cat([torch.ones(n), torch.zeros(n)]).to(self.device)
        loss_fn = nn.BCEWithLogitsLoss()
        for _ in range(cfg.updates_per_episode if steps is None else steps):
            x = np.concatenate([self._features(r.sample(r.positive, n, self.rng)),
                                self._features(r.sample(negatives, n, self.rng))])
            logits = self.net(torch.as_tensor(x, device=self.device))
            loss = loss_fn(logits, labels)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            self.updates += 1
        self.last_loss = float(loss.detach())
        self.last_accuracy = float(((logits > 0).float() == labels).float().mean())

    # --- the reward -------------------------------------------------------------------

    @torch.no_grad()
    def logit(self, x: np.ndarray) -> np.ndarray:
        """The discriminator's logit for rows of features (``[s, a]``, or ``s`` for ``potential``)."""
        t = torch.as_tensor(np.asarray(x, np.float32), device=self.device)
        return self.net(t).cpu().numpy().astype(np.float64)

    def potential(self, obs: np.ndarray) -> np.ndarray:
        """``Phi(s) = clip_beta(logit g(s))`` (``potential`` only)."""
        return clipped_logit(self.logit(obs), self.config.beta)

    def bonus(self, obs: np.ndarray, actions: np.ndarray, next_obs: np.ndarray,
              terminated: np.ndarray | None = None) -> np.ndarray:
        """The shaping term for a batch of transitions (add it to the outcome reward).

        ``svm``/``gail``: ``lam * clip_beta(logit f(s, a))``; ``potential``:
        ``lam * (gamma * Phi(s') * (1 - terminated) - Phi(s))``; ``sparse`` or not ready: 0.
        """
        obs = np.asarray(obs, np.float32).reshape(len(obs), -1)
        if not self.ready:
            return np.zeros(len(obs))
        cfg = self.config
        if cfg.kind == "potential":
            if self.gamma is None:
                raise RuntimeError("ShapingConfig.gamma is None (take it from the algorithm) and no algorithm's gamma "
                                   "was given: call reward_model.bind_gamma(model.gamma) (closedloop.sdk.rl.sb3.OutcomeLogger "
                                   "does it at training start), or set ShapingConfig.gamma")
            nxt = np.asarray(next_obs, np.float32).reshape(len(obs), -1)
            done = np.zeros(len(obs)) if terminated is None else np.asarray(terminated, np.float64).reshape(-1)
            return cfg.lam * (self.gamma * self.potential(nxt) * (1.0 - done) - self.potential(obs))
        x = np.concatenate([obs, np.asarray(actions, np.float32).reshape(len(obs), -1)], axis=1)
        return cfg.lam * clipped_logit(self.logit(x), cfg.beta)

    def stats(self) -> dict[str, float]:
        r = self.replay
        return {"disc_loss": self.last_loss, "disc_accuracy": self.last_accuracy, "disc_updates": self.updates,
                "positive_episodes": r.episodes["positive"], "negative_episodes": r.episodes["negative"]}
