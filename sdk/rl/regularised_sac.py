"""SAC that fine-tunes a pre-trained policy without forgetting it: a prior-regularised actor loss.

Plain SAC collapses a behaviour-cloned push policy (success 0.5 -> 0-0.1) as soon as its
actor moves: the actor climbs the young critic's action gradient, which off the data is
arbitrary (the extrapolation error of offline RL), and the cloned push policy is so
fragile that a change of its actions in the 8th digit flips a tenth of the episodes.
:class:`PriorRegularisedSAC` adds the TD3+BC remedy (Fujimoto and Gu 2021) with the
frozen pre-trained policy as the reference, on every replayed state:

    L_actor = E[ alpha log pi(a|s) - Q(s, a) / mean|Q| ] + w * E[ mean_j (mu(s)_j - mu_0(s)_j)^2 ]

``mu`` is the actor's deterministic (tanh-squashed) action, ``mu_0`` the frozen prior's,
``mean|Q|`` the batch mean of the critic's values (detached: the scale of Q does not set
the step size, so sparse and shaped rewards get the same trust region), ``w`` is
``prior_weight``.  The actor learns ``actor_lr_scale`` times slower than the critic, and
while its parameters are frozen (:class:`~closedloop.sdk.rl.sb3.ActorWarmup`, or
:meth:`pretrain_critic`) its loss is not even computed.
"""

from __future__ import annotations

import copy

import numpy as np
import torch as th
from stable_baselines3 import SAC
from stable_baselines3.common.logger import Logger
from stable_baselines3.common.utils import polyak_update
from torch import nn
from torch.nn import functional as F

__all__ = ["PriorRegularisedSAC"]


def silent_logger() -> Logger:
    """An SB3 logger that writes nothing and makes no folder. ``learn()`` with ``verbose=0`` and no TensorBoard
    log otherwise configures one that creates an empty ``$TMPDIR/SB3-<date>`` folder on every call."""
    return Logger(folder=None, output_formats=[])


class PriorRegularisedSAC(SAC):
    """:class:`stable_baselines3.SAC` with a slower actor and a pull towards a frozen prior policy.

    Call :meth:`set_prior` after loading the pre-trained actor; without a prior (or with
    ``prior_weight = 0``) and ``actor_lr_scale = 1`` this is SAC.
    """

    actor_lr_scale: float = 1.0
    prior_weight: float = 0.0
    prior: nn.Module | None = None

    def set_prior(self, weight: float) -> None:
        """Freeze a copy of the current actor's deterministic policy as the prior, pulled towards with ``weight``."""
        prior = nn.Sequential(copy.deepcopy(self.actor.features_extractor), copy.deepcopy(self.actor.latent_pi),
                              copy.deepcopy(self.actor.mu), nn.Tanh()).eval()
        for p in prior.parameters():
            p.requires_grad_(False)
        self.prior, self.prior_weight = prior, float(weight)

    def _update_learning_rate(self, optimizers) -> None:
        super()._update_learning_rate(optimizers)
        for group in self.actor.optimizer.param_groups:
            group["lr"] *= self.actor_lr_scale

    def _actor_trainable(self) -> bool:
        return any(p.requires_grad for p in self.actor.parameters())

    def pretrain_critic(self, gradient_steps: int, batch_size: int | None = None) -> None:
        """Fit the critic (TD, actor frozen) on what the replay holds before any environment step."""
        if not hasattr(self, "_logger"):  # before learn(): a silent logger (learn() keeps it)
            self.set_logger(silent_logger())
        params = list(self.actor.parameters())
        was = [p.requires_grad for p in params]
        for p in params:
            p.requires_grad_(False)
        try:
            self.train(gradient_steps, batch_size or self.batch_size)
        finally:
            for p, w in zip(params, was, strict=True):
                p.requires_grad_(w)

    def train(self, gradient_steps: int, batch_size: int = 64) -> None:  # noqa: C901 - SAC's loop, one change
        self.policy.set_training_mode(True)
        optimizers = [self.actor.optimizer, self.critic.optimizer]
        if self.ent_coef_optimizer is not None:
            optimizers += [self.ent_coef_optimizer]
        self._update_learning_rate(optimizers)
        train_actor = self._actor_trainable()
        actor_losses, critic_losses, prior_losses, ent_coefs = [], [], [], []
        for gradient_step in range(gradient_steps):
            data = self.replay_buffer.sample(batch_size, env=self._vec_normalize_env)  # type: ignore[union-attr]
            discounts = data.discounts if data.discounts is not None else self.gamma
            if self.use_sde:
                self.actor.reset_noise()
            if self.ent_coef_optimizer is not None and self.log_ent_coef is not None:
                ent_coef = th.exp(self.log_ent_coef.detach())
            else:
                ent_coef = self.ent_coef_tensor
            if train_actor:
                mean_actions, log_std, kwargs = self.actor.get_action_dist_params(data.observations)
                actions_pi, log_prob = self.actor.action_dist.log_prob_from_params(mean_actions, log_std, **kwargs)
                log_prob = log_prob.reshape(-1, 1)
                if self.ent_coef_optimizer is not None and self.log_ent_coef is not None:
                    ent_loss = -(self.log_ent_coef * (log_prob + self.target_entropy).detach()).mean()
                    self.ent_coef_optimizer.zero_grad()
                    ent_loss.backward()
                    self.ent_coef_optimizer.step()
            ent_coefs.append(ent_coef.item())

            with th.no_grad():
                next_actions, next_log_prob = self.actor.action_log_prob(data.next_observations)
                next_q = th.cat(self.critic_target(data.next_observations, next_actions), dim=1)
                next_q = th.min(next_q, dim=1, keepdim=True)[0] - ent_coef * next_log_prob.reshape(-1, 1)
                target_q = data.rewards + (1 - data.dones) * discounts * next_q
            current_q = self.critic(data.observations, data.actions)
            critic_loss = 0.5 * sum(F.mse_loss(q, target_q) for q in current_q)
            critic_losses.append(critic_loss.item())  # type: ignore[union-attr]
            self.critic.optimizer.zero_grad()
            critic_loss.backward()  # type: ignore[union-attr]
            self.critic.optimizer.step()

            if train_actor:
                q_pi = th.min(th.cat(self.critic(data.observations, actions_pi), dim=1), dim=1, keepdim=True)[0]
                if self.prior is not None and self.prior_weight > 0:
                    scale = q_pi.abs().mean().detach().clamp_min(1e-3)
                    with th.no_grad():
                        prior_action = self.prior(data.observations)
                    prior_loss = F.mse_loss(th.tanh(mean_actions), prior_action)
                    actor_loss = (ent_coef * log_prob - q_pi / scale).mean() + self.prior_weight * prior_loss
                    prior_losses.append(prior_loss.item())
                else:
                    actor_loss = (ent_coef * log_prob - q_pi).mean()
                actor_losses.append(actor_loss.item())
                self.actor.optimizer.zero_grad()
                actor_loss.backward()
                self.actor.optimizer.step()

            if gradient_step % self.target_update_interval == 0:
                polyak_update(self.critic.parameters(), self.critic_target.parameters(), self.tau)
                polyak_update(self.batch_norm_stats, self.batch_norm_stats_target, 1.0)

        self._n_updates += gradient_steps
        self.logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
        self.logger.record("train/ent_coef", float(np.mean(ent_coefs)))
        self.logger.record("train/critic_loss", float(np.mean(critic_losses)))
        if actor_losses:
            self.logger.record("train/actor_loss", float(np.mean(actor_losses)))
        if prior_losses:
            self.logger.record("train/prior_mse", float(np.mean(prior_losses)))
