"""stable-baselines3 integration: a replay buffer that relabels shaped rewards, and the callbacks of a run.

- :class:`ShapedReplayBuffer` stores each transition's *outcome* reward and, at
  sampling time, adds the bonus of the discriminator as it is now: the reward SAC
  learns from follows the discriminator as it is refitted, instead of freezing the
  bonus a transition had when it was collected.  For on-policy algorithms (PPO) the
  wrapper's step-time reward is already current, and no buffer is needed.
- :class:`ShapedDictReplayBuffer` does the same for dict observations (panda-gym's
  goal-conditioned ones), and :class:`ShapedHerReplayBuffer` relabels goals as SB3's
  ``HerReplayBuffer`` does, with the reward of a relabelled transition the environment's
  ``compute_reward`` for the new goal *plus* the bonus of the discriminator for the new goal
  (it sees the whole flattened observation, ``desired_goal`` included).  SB3's plain
  ``HerReplayBuffer`` on a :class:`~closedloop.sdk.rl.SuccessVisitationWrapper` is refused
  (the wrapper's ``compute_reward`` raises) instead of dropping the bonus.
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

import copy
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from stable_baselines3.common.buffers import DictReplayBuffer, ReplayBuffer
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.type_aliases import DictReplayBufferSamples
from stable_baselines3.her import HerReplayBuffer

from .reward import VisitationReward
from .wrapper import flatten_batch

__all__ = ["ShapedReplayBuffer", "ShapedDictReplayBuffer", "ShapedHerReplayBuffer", "OutcomeLogger", "ActorWarmup",
           "evaluate_success"]


def _outcomes(infos, reward, model: VisitationReward, buffer: str) -> list[float]:
    """Each transition's outcome, as the SuccessVisitationWrapper put it in ``info`` (or a caller seeding the replay
    did); a transition from an environment without the wrapper, or whose wrapper trains another reward model than
    the buffer's, is refused: the bonus would come from a discriminator nothing trains."""
    for info in infos:
        if "outcome_reward" not in info:
            raise ValueError(f"{buffer}: the environment's step info has no outcome_reward: wrap the environment in "
                             "closedloop.sdk.rl.SuccessVisitationWrapper (it trains the discriminator and reports the "
                             "outcome), and pass its reward_model to the buffer")
        if info.get("reward_model_id", id(model)) != id(model):  # a wrapper's step says which model it trains
            raise ValueError(f"{buffer}: its reward_model is not the one the environment's SuccessVisitationWrapper "
                             "trains, so its bonus would come from a discriminator that never learns: pass "
                             "replay_buffer_kwargs={'reward_model': env.reward_model} with that wrapper's")
    return [info["outcome_reward"] for info in infos]


def _numpy_obs(obs) -> Any:
    if isinstance(obs, dict):
        return {k: v.cpu().numpy() for k, v in obs.items()}
    return obs.cpu().numpy()


def _shaped(samples, outcome: np.ndarray, reward_model: VisitationReward, space: spaces.Space):
    """``samples`` with rewards replaced by ``outcome`` + the current bonus of ``reward_model``."""
    obs = flatten_batch(space, _numpy_obs(samples.observations))
    nxt = flatten_batch(space, _numpy_obs(samples.next_observations))
    bonus = reward_model.bonus(obs, samples.actions.cpu().numpy(), nxt, samples.dones.cpu().numpy())
    rewards = torch.as_tensor((np.asarray(outcome, np.float64).reshape(-1) + bonus).reshape(-1, 1),
                              dtype=samples.rewards.dtype, device=samples.rewards.device)
    return samples._replace(rewards=rewards)


class _ShapedSamples:
    """What the flat and dict buffers share: each transition's outcome stored beside it, and samples whose
    rewards are that outcome + the reward model's current bonus (one environment)."""

    def _init_shaping(self, reward_model: VisitationReward | None) -> None:
        name = type(self).__name__
        if self.n_envs != 1:
            raise ValueError(f"{name} relabels one environment's transitions; got n_envs={self.n_envs}")
        if not isinstance(reward_model, VisitationReward):
            raise ValueError(f"{name} needs reward_model= (the SuccessVisitationWrapper's: replay_buffer_kwargs="
                             "{'reward_model': env.reward_model}); without one it would be a plain buffer, so use "
                             "stable-baselines3's own")
        self.reward_model = reward_model
        self.outcome_rewards = np.zeros((self.buffer_size, 1), dtype=np.float32)

    def add(self, obs, next_obs, action, reward, done, infos) -> None:
        self.outcome_rewards[self.pos] = _outcomes(infos, reward, self.reward_model, type(self).__name__)
        super().add(obs, next_obs, action, reward, done, infos)

    def _get_samples(self, batch_inds: np.ndarray, env=None):
        samples = super()._get_samples(batch_inds, env)
        _refuse_normaliser(env)
        return _shaped(samples, self.outcome_rewards[batch_inds, 0], self.reward_model, self.observation_space)


def _refuse_normaliser(env) -> None:
    if env is not None:
        raise ValueError("the shaped replay buffers do not support VecNormalize (the bonus would be added to a "
                         "normalised outcome); normalise observations in the environment instead (FixedNormalization)")


class ShapedReplayBuffer(_ShapedSamples, ReplayBuffer):
    """A :class:`~stable_baselines3.common.buffers.ReplayBuffer` whose rewards are outcome + current bonus.

    Pass ``replay_buffer_class=ShapedReplayBuffer, replay_buffer_kwargs={"reward_model": vr}``
    to SAC; the environment must be wrapped in :class:`~closedloop.sdk.rl.SuccessVisitationWrapper`
    sharing ``vr`` (it puts ``outcome_reward`` in ``info``).  One environment only.
    """

    def __init__(self, buffer_size: int, observation_space: spaces.Space, *args: Any,
                 reward_model: VisitationReward | None = None, **kwargs: Any) -> None:
        if isinstance(observation_space, spaces.Dict):
            raise TypeError("ShapedReplayBuffer takes flat (Box) observations; for dict observations use "
                            "ShapedDictReplayBuffer, or ShapedHerReplayBuffer to relabel goals")
        super().__init__(buffer_size, observation_space, *args, **kwargs)
        self._init_shaping(reward_model)


class ShapedDictReplayBuffer(_ShapedSamples, DictReplayBuffer):
    """:class:`ShapedReplayBuffer` for dict observations: rewards are the stored outcome + the current bonus.

    The discriminator sees the observation flattened in ``gymnasium.spaces.flatten``'s order
    (as :class:`~closedloop.sdk.rl.SuccessVisitationWrapper` feeds it).  One environment only.
    """

    def __init__(self, *args: Any, reward_model: VisitationReward | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_shaping(reward_model)


class ShapedHerReplayBuffer(HerReplayBuffer):
    """SB3's ``HerReplayBuffer`` whose rewards keep the bonus, for real and for relabelled goals.

    A real transition's reward is its stored outcome + the current bonus; a relabelled one's is
    ``compute_outcome_reward(next achieved goal, new goal)`` (the goal-conditioned environment's
    own ``compute_reward``) + ``bonus(s with the new goal, a, s' with the new goal)``.  The
    environment must be a :class:`~closedloop.sdk.rl.SuccessVisitationWrapper` (pass
    ``replay_buffer_kwargs={"reward_model": env.reward_model}`` and HER's own settings).
    """

    def __init__(self, *args: Any, reward_model: VisitationReward | None = None, **kwargs: Any) -> None:
        if reward_model is None:
            raise ValueError("ShapedHerReplayBuffer needs reward_model= (the SuccessVisitationWrapper's); without "
                             "one use stable-baselines3's HerReplayBuffer on the unwrapped environment")
        space = kwargs.get("observation_space", args[1] if len(args) > 1 else None)
        if space is not None and not isinstance(space, spaces.Dict):
            raise ValueError(f"ShapedHerReplayBuffer relabels goals, so it needs a goal-conditioned Dict observation "
                             f"space (observation, achieved_goal, desired_goal); this one is {space}: use "
                             "ShapedReplayBuffer (no relabelling) for a flat observation")
        super().__init__(*args, **kwargs)
        if self.n_envs != 1:
            raise ValueError(f"ShapedHerReplayBuffer relabels one environment's transitions; got n_envs={self.n_envs}")
        self.reward_model = reward_model
        self.outcome_rewards = np.zeros((self.buffer_size, self.n_envs), dtype=np.float32)

    def add(self, obs, next_obs, action, reward, done, infos) -> None:  # type: ignore[override]
        self.outcome_rewards[self.pos] = _outcomes(infos, reward, self.reward_model, "ShapedHerReplayBuffer")
        super().add(obs, next_obs, action, reward, done, infos)

    def _get_real_samples(self, batch_indices, env_indices, env=None):
        _refuse_normaliser(env)
        samples = super()._get_real_samples(batch_indices, env_indices, env)
        return _shaped(samples, self.outcome_rewards[batch_indices, env_indices], self.reward_model,
                       self.observation_space)

    def _get_virtual_samples(self, batch_indices, env_indices, env=None):
        _refuse_normaliser(env)
        obs = {key: o[batch_indices, env_indices, :] for key, o in self.observations.items()}
        next_obs = {key: o[batch_indices, env_indices, :] for key, o in self.next_observations.items()}
        infos = (copy.deepcopy(self.infos[batch_indices, env_indices]) if self.copy_info_dict
                 else [{} for _ in range(len(batch_indices))])
        new_goals = self._sample_goals(batch_indices, env_indices)
        obs["desired_goal"] = new_goals
        next_obs["desired_goal"] = new_goals
        if self.env is None:
            raise ValueError("ShapedHerReplayBuffer needs its VecEnv (SB3 passes it) to compute relabelled outcomes")
        outcome = self.env.env_method("compute_outcome_reward", next_obs["achieved_goal"], new_goals, infos,
                                      indices=[0])[0]
        dones = self.dones[batch_indices, env_indices] * (1 - self.timeouts[batch_indices, env_indices])
        bonus = self.reward_model.bonus(flatten_batch(self.observation_space, obs),
                                        self.actions[batch_indices, env_indices],
                                        flatten_batch(self.observation_space, next_obs), dones)
        self.last_virtual = {"outcome": np.asarray(outcome, np.float64).reshape(-1), "bonus": bonus}
        return DictReplayBufferSamples(
            observations={k: self.to_torch(v) for k, v in obs.items()},
            actions=self.to_torch(self.actions[batch_indices, env_indices]),
            next_observations={k: self.to_torch(v) for k, v in next_obs.items()},
            dones=self.to_torch(dones).reshape(-1, 1),
            rewards=self.to_torch((self.last_virtual["outcome"] + bonus).astype(np.float32).reshape(-1, 1)),
        )


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
        # every reward model this training uses gets the algorithm's gamma: the one given, the replay buffer's and
        # the training env's wrapper's (so the documented call binds it without reward_model=)
        found = [self.reward_model, getattr(getattr(self.model, "replay_buffer", None), "reward_model", None)]
        try:
            found += list(self.training_env.get_attr("reward_model"))
        except (AttributeError, TypeError):  # an env without the wrapper
            pass
        models = list({id(m): m for m in found if isinstance(m, VisitationReward)}.values())
        for m in models:
            m.bind_gamma(self.model.gamma)
        if self.reward_model is None and len(models) == 1:
            self.reward_model = models[0]  # and its discriminator's loss and accuracy are logged
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
