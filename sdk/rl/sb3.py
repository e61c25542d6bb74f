"""stable-baselines3 integration: a replay buffer that relabels shaped rewards, and the callbacks of a run.

- :class:`ShapedReplayBuffer` stores each transition's *outcome* reward and, at
  sampling time, adds the bonus of the discriminator as it is now: the reward SAC
  learns from follows the discriminator as it is refitted, instead of freezing the
  bonus a transition had when it was collected.  For on-policy algorithms (PPO) the
  wrapper's step-time reward is already current, and no buffer is needed.
- :class:`OutcomeLogger` logs the outcome-only success rate and return next to the
  shaped return (``rollout/outcome_success_rate``, ``rollout/outcome_return``,
  ``rollout/shaped_return``, the discriminator's loss and accuracy) and evaluates the
  deterministic policy in-process every ``eval_every`` steps (``eval/success_rate``;
  the curve is kept in ``curve``).
- :class:`ActorWarmup` freezes the actor for the first steps, so the critic learns the
  pre-trained policy's values before the policy moves (a fresh critic would otherwise
  drag a good pre-trained actor down).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from stable_baselines3.common.buffers import ReplayBuffer
from stable_baselines3.common.callbacks import BaseCallback

from .reward import VisitationReward

__all__ = ["ShapedReplayBuffer", "OutcomeLogger", "ActorWarmup", "evaluate_success"]


class ShapedReplayBuffer(ReplayBuffer):
    """A :class:`~stable_baselines3.common.buffers.ReplayBuffer` whose rewards are outcome + current bonus.

    Pass ``replay_buffer_class=ShapedReplayBuffer, replay_buffer_kwargs={"reward_model": vr}``
    to SAC; the environment must be wrapped in :class:`~closedloop.sdk.rl.SuccessVisitationWrapper`
    sharing ``vr`` (it puts ``outcome_reward`` in ``info``).  One environment only.
    """

    def __init__(self, *args: Any, reward_model: VisitationReward | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.n_envs != 1:
            raise ValueError(f"ShapedReplayBuffer relabels one environment's transitions; got n_envs={self.n_envs}")
        self.reward_model = reward_model
        self.outcome_rewards = np.zeros((self.buffer_size, 1), dtype=np.float32)

    def add(self, obs, next_obs, action, reward, done, infos) -> None:
        self.outcome_rewards[self.pos] = [info.get("outcome_reward", r) for info, r in zip(infos, reward, strict=True)]
        super().add(obs, next_obs, action, reward, done, infos)

    def _get_samples(self, batch_inds: np.ndarray, env=None):
        samples = super()._get_samples(batch_inds, env)
        if self.reward_model is None:
            return samples
        outcome = self.outcome_rewards[batch_inds, 0].astype(np.float64)
        bonus = self.reward_model.bonus(samples.observations.cpu().numpy(), samples.actions.cpu().numpy(),
                                        samples.next_observations.cpu().numpy(), samples.dones.cpu().numpy())
        rewards = torch.as_tensor((outcome + bonus).reshape(-1, 1), dtype=samples.rewards.dtype,
                                  device=samples.rewards.device)
        return samples._replace(rewards=rewards)


def evaluate_success(act: Callable[[np.ndarray], np.ndarray], env, episodes: int, seed: int = 10_000) -> float:
    """Outcome-only success rate of ``act`` over ``episodes`` episodes with seeds ``seed, seed + 1, ...``
    (success: ``info["is_success"]`` at the last step)."""
    wins = 0
    for e in range(episodes):
        obs, info = env.reset(seed=seed + e)
        done = False
        while not done:
            obs, _, term, trunc, info = env.step(act(obs))
            done = term or trunc
        wins += bool(info.get("is_success", False))
    return wins / max(episodes, 1)


class OutcomeLogger(BaseCallback):
    """Outcome success rate next to the shaped return; periodic deterministic in-process evaluation.

    Parameters
    ----------
    eval_env : gymnasium.Env, optional
        Evaluated every ``eval_every`` steps (and at the start) with the deterministic policy.
    eval_every, eval_episodes : int
        Evaluation period in environment steps, and episodes per evaluation.
    window : int
        Training episodes in the moving success rate.
    """

    def __init__(self, eval_env=None, eval_every: int = 2000, eval_episodes: int = 20, window: int = 20,
                 reward_model: VisitationReward | None = None, verbose: int = 0) -> None:
        super().__init__(verbose)
        self.eval_env, self.eval_every, self.eval_episodes = eval_env, eval_every, eval_episodes
        self.reward_model = reward_model
        self.successes: deque[float] = deque(maxlen=window)
        self.outcome_returns: deque[float] = deque(maxlen=window)
        self.shaped_returns: deque[float] = deque(maxlen=window)
        self.curve: list[tuple[int, float]] = []
        self.episodes: list[dict[str, float]] = []
        self._next_eval = 0

    def evaluate(self) -> float:
        rate = evaluate_success(lambda o: self.model.predict(o, deterministic=True)[0], self.eval_env,
                                self.eval_episodes)
        self.curve.append((int(self.num_timesteps), rate))
        self.logger.record("eval/success_rate", rate)
        if self.verbose:
            print(f"step {self.num_timesteps}: eval success {rate:.2f}, train success "
                  f"{np.mean(self.successes) if self.successes else float('nan'):.2f}", flush=True)
        return rate

    def _on_training_start(self) -> None:
        if self.eval_env is not None and self.num_timesteps >= self._next_eval:
            self.evaluate()
            self._next_eval = self.num_timesteps + self.eval_every

    def _on_step(self) -> bool:
        for info in self.locals.get("infos", []):
            if "episode_success" in info:
                self.successes.append(float(info["episode_success"]))
                self.outcome_returns.append(info["episode_outcome_return"])
                self.shaped_returns.append(info["episode_shaped_return"])
                self.episodes.append({"step": int(self.num_timesteps), "success": float(info["episode_success"]),
                                      "outcome_return": info["episode_outcome_return"],
                                      "shaped_return": info["episode_shaped_return"]})
                self.logger.record("rollout/outcome_success_rate", float(np.mean(self.successes)))
                self.logger.record("rollout/outcome_return", float(np.mean(self.outcome_returns)))
                self.logger.record("rollout/shaped_return", float(np.mean(self.shaped_returns)))
                if self.reward_model is not None:
                    for k, v in self.reward_model.stats().items():
                        self.logger.record(f"shaping/{k}", v)
        if self.eval_env is not None and self.num_timesteps >= self._next_eval:
            self.evaluate()
            self._next_eval += self.eval_every
        return True


class ActorWarmup(BaseCallback):
    """Freeze the actor's parameters until ``steps`` environment steps have passed."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps
        self.frozen = False

    def _set(self, trainable: bool) -> None:
        for p in self.model.actor.parameters():
            p.requires_grad_(trainable)
        self.frozen = not trainable

    def _on_training_start(self) -> None:
        if self.steps > 0:
            self._set(False)

    def _on_step(self) -> bool:
        if self.frozen and self.num_timesteps >= self.steps:
            self._set(True)
        return True
