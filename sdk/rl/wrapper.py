"""The success-visitation reward as a gymnasium wrapper, for any environment that reports ``is_success``.

:class:`SuccessVisitationWrapper` records every transition of the episode in progress;
when the episode ends it labels the trajectory by ``info["is_success"]`` (at the last
step, or at any step), adds it to the :class:`~closedloop.sdk.rl.reward.VisitationReward`'s
labelled replay and refits the discriminator.  Each step's reward is the outcome
reward plus the bonus of the current discriminator; ``info`` carries both parts
(``outcome_reward``, ``shaping_bonus``) and, at an episode's end, the outcome-only
``episode_success`` and returns, so a logger never confuses the shaped return with
success.  Dict observations (panda-gym's goal-conditioned ones) are flattened for the
discriminator; the agent still sees them unchanged.  :class:`FixedNormalization`
standardises observations with frozen statistics (the exported bundle repeats it).
"""

from __future__ import annotations

import warnings
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from .config import ShapingConfig
from .reward import VisitationReward

__all__ = ["SuccessVisitationWrapper", "FixedNormalization", "flat_dim", "flatten_batch"]


def flat_dim(space: spaces.Space) -> int:
    return int(spaces.flatdim(space))


def flatten_batch(space: spaces.Space, obs: Any) -> np.ndarray:
    """A batch of observations (a dict of ``(n, ...)`` arrays for a Dict space) as ``(n, flatdim)`` float32 rows,
    in the order of ``gymnasium.spaces.flatten`` (the discriminator's input: the goal is part of it)."""
    if isinstance(space, spaces.Dict):
        parts = []
        for key, sub in space.spaces.items():
            if not isinstance(sub, spaces.Box):
                raise TypeError(f"flatten_batch: Dict observation key {key!r} is {type(sub).__name__}; only Box "
                                "sub-spaces are supported (flatten the observation with a wrapper first)")
            x = np.asarray(obs[key], np.float32)
            parts.append(x.reshape(x.shape[0], -1))
        return np.concatenate(parts, axis=1)
    x = np.asarray(obs, np.float32)
    return x.reshape(x.shape[0], -1)


class SuccessVisitationWrapper(gym.Wrapper):
    """Outcome reward + ``lam`` x discriminator bonus; labels and refits after each episode.

    Parameters
    ----------
    env : gymnasium.Env
        Must put ``is_success`` in ``info`` (at least at the end of an episode).
    config : ShapingConfig
        The reward form and discriminator settings.
    reward : VisitationReward, optional
        Share one discriminator between several wrappers or with a relabelling replay
        buffer (:class:`closedloop.sdk.rl.sb3.ShapedReplayBuffer`); built from ``config`` if None.
    seed : int
        Seeds the discriminator.
    """

    def __init__(self, env: gym.Env, config: ShapingConfig, reward: VisitationReward | None = None,
                 seed: int = 0) -> None:
        super().__init__(env)
        self.config = config
        space = env.observation_space
        parts = list(space.spaces.values()) if isinstance(space, spaces.Dict) else [space]
        if not all(isinstance(p, spaces.Box) for p in parts):
            raise ValueError(f"SuccessVisitationWrapper: the observation space is {space}; the discriminator reads Box "
                             "observations (any dtype) or a Dict of them: give a discrete state as a one-hot Box "
                             "(gymnasium.wrappers.FlattenObservation does it)")
        self.obs_dim = flat_dim(env.observation_space)
        self.act_dim = flat_dim(env.action_space)
        self.reward_model = reward or VisitationReward(config, self.obs_dim, self.act_dim, seed=seed)
        self._saw_success_key = False  # whether any step's info carried 'is_success' (warned once otherwise)
        self._warned_no_success_key = False
        self._rows: dict[str, list[np.ndarray]] = {"obs": [], "actions": [], "next_obs": []}
        self._any_success = False
        self._returns = [0.0, 0.0]
        self._obs: np.ndarray | None = None
        self.episodes = 0

    def _flat(self, obs: Any) -> np.ndarray:
        return np.asarray(spaces.flatten(self.env.observation_space, obs), dtype=np.float32)

    def compute_reward(self, achieved_goal, desired_goal, info):
        """Refused: the outcome alone would drop the bonus of relabelled transitions without a word.

        SB3's ``HerReplayBuffer`` calls this for relabelled goals; use
        :class:`closedloop.sdk.rl.sb3.ShapedHerReplayBuffer` (outcome for the new goal + the bonus
        for it), or :meth:`compute_outcome_reward` where the outcome alone is meant.
        """
        raise TypeError("SuccessVisitationWrapper.compute_reward would give the outcome without the shaping bonus "
                        "(a relabelled goal's transitions would lose it silently): with stable-baselines3's HER use "
                        "replay_buffer_class=closedloop.sdk.rl.sb3.ShapedHerReplayBuffer, or call "
                        "compute_outcome_reward for the outcome alone")

    def compute_outcome_reward(self, achieved_goal, desired_goal, info):
        """The wrapped goal-conditioned environment's own ``compute_reward`` (the outcome, no bonus)."""
        return self.env.get_wrapper_attr("compute_reward")(achieved_goal, desired_goal, info)

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        self._obs = self._flat(obs)
        for rows in self._rows.values():
            rows.clear()
        self._any_success = bool(info.get("is_success", False))
        self._returns = [0.0, 0.0]
        return obs, info

    def step(self, action):
        if self._obs is None:
            raise RuntimeError("SuccessVisitationWrapper.step called before reset()")
        if self.config.kind == "potential" and self.reward_model.gamma is None:
            # at the first step, not at the first discriminator fit thousands of steps into training
            raise RuntimeError("ShapingConfig.gamma is None (take it from the algorithm) and no algorithm's gamma was "
                               "bound: train with closedloop.sdk.rl.sb3.OutcomeLogger as a callback (it binds the "
                               "algorithm's gamma at training start), call env.reward_model.bind_gamma(model.gamma), "
                               "or set ShapingConfig.gamma (docs/rl.md, Settings)")
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._saw_success_key |= "is_success" in info
        flat_next = self._flat(obs)
        flat_action = np.asarray(spaces.flatten(self.env.action_space, action), dtype=np.float32)
        bonus = float(self.reward_model.bonus(self._obs[None], flat_action[None], flat_next[None],
                                              np.array([terminated]))[0])
        self._rows["obs"].append(self._obs)
        self._rows["actions"].append(flat_action)
        self._rows["next_obs"].append(flat_next)
        self._any_success |= bool(info.get("is_success", False))
        self._returns[0] += float(reward)
        self._returns[1] += float(reward) + bonus
        info = dict(info)
        info["outcome_reward"] = float(reward)
        info["shaping_bonus"] = bonus
        info["reward_model_id"] = id(self.reward_model)  # a shaped buffer checks it relabels with this model
        if terminated or truncated:
            if not self._saw_success_key and not self._warned_no_success_key:
                self._warned_no_success_key = True
                warnings.warn("SuccessVisitationWrapper: the environment's info never has 'is_success', so every "
                              "episode counts as a failure: the discriminator never sees a success and the bonus "
                              "stays 0 (the reward is the sparse outcome alone); report info['is_success']",
                              stacklevel=2)
            final = bool(info.get("is_success", False))
            success = final if self.config.success_when == "final" else self._any_success
            self.reward_model.add_episode(np.stack(self._rows["obs"]), np.stack(self._rows["actions"]),
                                          np.stack(self._rows["next_obs"]), success)
            self.reward_model.fit()
            self.episodes += 1
            info["episode_success"] = success
            info["episode_outcome_return"], info["episode_shaped_return"] = self._returns
        self._obs = flat_next
        return obs, float(reward) + bonus, terminated, truncated, info


class FixedNormalization(gym.ObservationWrapper):
    """``(obs - mean) / std`` with frozen statistics (float32 Box observations)."""

    def __init__(self, env: gym.Env, mean: np.ndarray, std: np.ndarray) -> None:
        super().__init__(env)
        self.mean = np.asarray(mean, np.float32)
        self.std = np.asarray(std, np.float32)
        if self.mean.shape != env.observation_space.shape or np.any(self.std <= 0):
            raise ValueError(f"FixedNormalization: mean/std of shape {self.mean.shape} (std > 0) must match the "
                             f"observation shape {env.observation_space.shape}")
        self.observation_space = spaces.Box(-np.inf, np.inf, shape=self.mean.shape, dtype=np.float32)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return ((np.asarray(observation, np.float32) - self.mean) / self.std).astype(np.float32)
