"""panda-gym's goal-conditioned tasks: scripted demonstrations, weak cloned priors, and fine-tuning from them.

panda-gym (Gallouedec et al. 2021) is what robot-learning users compare on, so the RL benchmark runs
its ``PandaReach-v3``, ``PandaPush-v3`` and ``PandaPickAndPlace-v3`` next to the project's own tasks:

- :class:`GymScriptedController` drives a panda-gym task with the project's scripted controller
  (:mod:`closedloop.sim.manipulation.scripted`): the dict observation is laid out as the project's
  task vector (hand position, object position, goal), and panda-gym's action scale is the project's
  (one unit moves the hand 5 cm).  :func:`collect_gym_demonstrations` runs it with action noise.
- :func:`clone_weak_prior` behaviour-clones stable-baselines3 SAC's actor (``MultiInputPolicy``) on
  the successful demonstrations, checking the deterministic policy's success after every epoch on
  episodes of their own seeds, and stops at the first check inside a band (default 10-30%): the
  "weak prior" fine-tuning starts from.  The rule fixes the prior's *strength*, not an epoch count
  that suited one seed; when no check lands in the band the checkpoint nearest its middle is kept
  and the record says so.
- :func:`seed_replay` puts the demonstrations and episodes of the cloned policy into SAC's replay
  (plain, dict or HER: whole episodes, timeouts marked) and the discriminator's labelled replay.
- :func:`fine_tune_gym` is :func:`closedloop.sdk.rl.finetune.fine_tune`'s recipe on a panda-gym task:
  clone, seed both replays, fit the critic with the actor frozen, then
  :class:`~closedloop.sdk.rl.regularised_sac.PriorRegularisedSAC` (actor warm-up, a pull towards the
  frozen prior) with HER (SB3's ``HerReplayBuffer`` for the sparse reward, the shaped
  :class:`~closedloop.sdk.rl.sb3.ShapedHerReplayBuffer` otherwise) or without it.  Every reward gets
  the same recipe, so a comparison differs only in the reward.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .sb3 import evaluate_success

__all__ = ["GYM_TASKS", "GymScriptedController", "collect_gym_demonstrations", "clone_weak_prior", "seed_replay",
           "fine_tune_gym", "WEAK_PRIOR_BAND"]

#: panda-gym task -> (the project's scripted controller, index of the object's position, index of the goal) in
#: the project's observation layout (:mod:`closedloop.sim.manipulation.tasks`); ``None``: no object.
GYM_TASKS: dict[str, tuple[str, int | None, int]] = {
    "PandaReach-v3": ("reach", None, 6),
    "PandaPush-v3": ("push", 6, 12),
    "PandaPickAndPlace-v3": ("pick_and_place", 7, 13),
}


def _task(env_id: str) -> tuple[str, int | None, int]:
    try:
        return GYM_TASKS[env_id]
    except KeyError:
        raise ValueError(f"no scripted controller for panda-gym task {env_id!r}; known: {sorted(GYM_TASKS)}") from None


class GymScriptedController:
    """The project's scripted controller for a panda-gym task, reading panda-gym's dict observation.

    ``act(obs)`` lays ``obs`` out as the project's task vector: the hand position
    (``observation[0:3]``, panda-gym's robot state starts with it), the finger width for
    pick-and-place (``observation[6]``), the object's position (``achieved_goal``) and the goal
    (``desired_goal``).
    """

    def __init__(self, env_id: str, noise: float = 0.0, seed: int | None = None) -> None:
        from closedloop.sim.manipulation import scripted_controller

        self.env_id = env_id
        name, self._obj, self._goal = _task(env_id)
        self.controller = scripted_controller(name, noise=noise, seed=seed)

    def reset(self) -> None:
        self.controller.reset()

    def layout(self, obs: dict[str, np.ndarray]) -> np.ndarray:
        v = np.zeros(self._goal + 3)
        robot = np.asarray(obs["observation"], float)
        v[0:3] = robot[0:3]
        if self._obj is not None:
            v[self._obj:self._obj + 3] = obs["achieved_goal"]
            if self._obj == 7:
                v[6] = robot[6]
        v[self._goal:self._goal + 3] = obs["desired_goal"]
        return v

    def act(self, obs: dict[str, np.ndarray]) -> np.ndarray:
        return self.controller.act(self.layout(obs))


def _stack(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.stack([r[k] for r in rows]).astype(np.float32) for k in rows[0]}


def run_episode(env, act: Callable[[dict], np.ndarray], seed: int) -> dict[str, Any]:
    """One episode of ``act`` on ``env`` from ``reset(seed=seed)``: dict observations stacked per key, actions,
    rewards, whether each step was a time-out, and ``success`` (``info["is_success"]`` at the last step)."""
    obs, info = env.reset(seed=seed)
    rows: dict[str, list] = {"obs": [], "next_obs": [], "actions": [], "rewards": [], "timeouts": []}
    done = False
    while not done:
        a = np.asarray(act(obs), np.float32)
        nxt, r, term, trunc, info = env.step(a)
        for k, v in zip(rows, (obs, nxt, a, float(r), bool(trunc and not term)), strict=True):
            rows[k].append(v)
        obs, done = nxt, term or trunc
    return {"obs": _stack(rows["obs"]), "next_obs": _stack(rows["next_obs"]),
            "actions": np.asarray(rows["actions"], np.float32), "rewards": np.asarray(rows["rewards"], np.float32),
            "timeouts": np.asarray(rows["timeouts"]), "success": bool(info.get("is_success", False))}


def collect_gym_demonstrations(env_id: str, episodes: int, noise: float = 0.1, seed: int = 0) -> list[dict[str, Any]]:
    """``episodes`` scripted episodes (action noise ``noise``) on seeds ``seed * 1000 + e``."""
    import gymnasium as gym
    import panda_gym  # noqa: F401  (registers the environments)

    env = gym.make(env_id)
    controller = GymScriptedController(env_id, noise=noise, seed=seed)
    out = []
    try:
        for e in range(episodes):
            controller.reset()
            out.append(run_episode(env, controller.act, seed * 1000 + e))
    finally:
        env.close()
    return out


def _actor_forward(actor) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    """SB3 SAC actor's deterministic (tanh-squashed) action for a batch of (dict or array) observations."""
    return lambda obs: torch.tanh(actor.mu(actor.latent_pi(actor.extract_features(obs, actor.features_extractor))))


#: the success band of a weak prior (the benchmark's cloned priors, panda-gym's and the project's tasks alike)
WEAK_PRIOR_BAND = (0.1, 0.3)


def clone_weak_prior(model, demos: list[dict[str, Any]], check_env,
                     band: tuple[float, float] = WEAK_PRIOR_BAND,
                     max_epochs: int = 1000, check_episodes: int = 50, check_gradient_steps: int = 25,
                     check_seed: int = 50_000, lr: float = 1e-3,
                     batch_size: int = 256, init_log_std: float = -1.5, seed: int = 0,
                     above_limit: int | None = None) -> dict[str, Any]:
    """Behaviour-clone ``model``'s actor (SB3 SAC, dict or array observations) until its success is inside
    ``band``.

    The actor's mean action is fitted to the successful demonstrations' actions (mean squared
    error, :func:`closedloop.sdk.rl.finetune.fit_actions`); after every epoch its deterministic
    success is measured every ``check_gradient_steps`` gradient steps (rounded up to whole epochs)
    on ``check_episodes`` episodes of ``check_env`` (seeds from ``check_seed``, kept apart from any
    evaluation's).  The first check inside ``band`` stops it, the band's low end raised to the
    untrained actor's own rate plus two standard errors of a check (an idle hand "succeeds" when
    the object starts on the goal: about 7% on ``PandaPush-v3``); otherwise, after ``max_epochs``,
    the check nearest the band's middle is restored (``above_limit``: after that many checks in a row
    above the band, the cloning stops there too: a task whose demonstrations are learned within a few
    epochs overshoots the band at once).  The log-std head is then set
    to ``init_log_std``.  Returns the record: ``epochs``, ``check_success``, ``in_band``, ``history``.
    """
    from .finetune import fit_actions

    lo, hi = band
    if not 0 <= lo <= hi <= 1:
        raise ValueError(f"prior band {band}: expected 0 <= low <= high <= 1")
    good = [d for d in demos if d["success"]]
    if not good:
        raise ValueError("clone_weak_prior: none of the demonstrations succeeded; a prior cannot be cloned from them")
    actor = model.actor
    if isinstance(good[0]["obs"], dict):
        obs = {k: np.concatenate([d["obs"][k] for d in good]) for k in good[0]["obs"]}
    else:
        obs = np.concatenate([d["obs"] for d in good])
    actions = np.concatenate([d["actions"] for d in good])
    params = list(actor.features_extractor.parameters()) + list(actor.latent_pi.parameters()) + \
        list(actor.mu.parameters())
    forward = _actor_forward(actor)
    history: list[tuple[int, float]] = []
    best: dict[str, Any] = {"distance": float("inf")}
    middle = (lo + hi) / 2

    def check(epoch: int) -> bool:
        rate = evaluate_success(lambda o: model.predict(o, deterministic=True)[0], check_env, check_episodes, check_seed)
        history.append((epoch, rate))
        if abs(rate - middle) < best["distance"]:
            best.update(distance=abs(rate - middle), epoch=epoch, rate=rate, state=copy.deepcopy(actor.state_dict()))
        return rate <= hi

    check(0)
    untrained = history[0][1]
    # a prior must beat the untrained actor by two standard errors of the check, whatever the band says
    floor = max(lo, untrained + 2 * float(np.sqrt(max(untrained * (1 - untrained), 1e-4) / check_episodes)))
    best["distance"] = float("inf")  # the untrained actor is not a prior, whatever its rate
    every = max(1, -(-check_gradient_steps * batch_size // len(actions)))  # epochs between checks

    def on_epoch(epoch: int) -> bool:
        if not (epoch % every == 0 or epoch == max_epochs):
            return False
        if check(epoch):
            return history[-1][1] >= floor
        if above_limit is None:
            return False
        recent = [r for _, r in history[1:]][-above_limit:]
        return len(recent) == above_limit and all(r > hi for r in recent)

    fit_actions(forward, params, obs, actions, epochs=max_epochs, lr=lr, batch_size=batch_size, seed=seed,
                device=actor.device, on_epoch=on_epoch)
    in_band = floor <= history[-1][1] <= hi
    if not in_band:
        actor.load_state_dict(best["state"])
    epoch, rate = (history[-1] if in_band else (best["epoch"], best["rate"]))
    with torch.no_grad():
        actor.log_std.weight.zero_()
        actor.log_std.bias.fill_(init_log_std)
    return {"epochs": int(epoch), "check_success": float(rate), "untrained_success": float(untrained),
            "band_floor": floor, "check_every_epochs": every,
            "check_episodes": check_episodes, "band": [lo, hi],
            "in_band": bool(in_band), "demos": len(demos), "successful_demos": len(good),
            "history": [[int(e), float(r)] for e, r in history]}


def seed_replay(model, episodes: list[dict[str, Any]], reward_model=None) -> None:
    """Add whole ``episodes`` (from :func:`run_episode`) to SAC's replay buffer, step by step as the environment
    would (a time-out marked as one, so it is not taken for a terminal state; HER sees episode ends), and, with
    ``reward_model``, to the discriminator's labelled replay (flattened observations, labelled by success)."""
    from gymnasium import spaces

    from .wrapper import flatten_batch

    buf = model.replay_buffer
    space = model.observation_space
    if reward_model is not None and not isinstance(space, spaces.Dict):
        raise TypeError("seed_replay: dict-observation episodes need a Dict observation space")
    for ep in episodes:
        n = len(ep["actions"])
        for t in range(n):
            last = t == n - 1
            info = {"outcome_reward": float(ep["rewards"][t]), "is_success": bool(last and ep["success"]),
                    "TimeLimit.truncated": bool(ep["timeouts"][t])}
            o = {k: v[t][None] for k, v in ep["obs"].items()}
            nx = {k: v[t][None] for k, v in ep["next_obs"].items()}
            buf.add(o, nx, ep["actions"][t][None], np.array([ep["rewards"][t]], np.float32), np.array([last]), [info])
        if reward_model is not None:
            reward_model.add_episode(flatten_batch(space, ep["obs"]), ep["actions"], flatten_batch(space, ep["next_obs"]),
                                     ep["success"])


def fine_tune_gym(env_id: str, reward: str, seed: int, *, prior: str = "bc", her: bool = True, steps: int = 20_000,
                  eval_every: int = 2_000, eval_episodes: int = 100, eval_seed: int = 10_000, lam: float = 0.05,
                  beta: float = 5.0, gamma: float = 0.95, net: tuple[int, ...] = (256, 256), batch_size: int = 256,
                  learning_starts: int = 1_000, demos: int = 30, demo_noise: float = 0.1,
                  band: tuple[float, float] = WEAK_PRIOR_BAND, prior_episodes: int = 20,
                  critic_pretrain_steps: int = 2_000,
                  actor_warmup_steps: int = 500, actor_lr_scale: float = 0.3, prior_weight: float = 1.0,
                  refit: int = 10, ent_coef: str = "0.002", buffer_size: int | None = None,
                  prior_options: dict[str, Any] | None = None,
                  log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """SAC (+ HER) on a panda-gym task with ``reward`` (``sparse``, ``svm``, ``potential``, ``gail``).

    ``prior="scratch"``: SB3's SAC from random weights (``learning_starts`` random steps, SAC's
    defaults otherwise).  ``prior="bc"``: the recipe in the module docstring, from a weak cloned
    prior (``band``); the prior's own success is the curve's first point.  The deterministic
    policy is evaluated on ``eval_episodes`` episodes (seeds from ``eval_seed``) every
    ``eval_every`` steps.  Returns ``curve`` ([step, success] pairs), ``prior`` (the cloning record,
    for ``bc``) and ``wall_s``.  ``prior_options``: more keyword arguments of :func:`clone_weak_prior`;
    ``prior_weight``: the pull towards the frozen cloned prior (0: none after the warm-up); ``refit``: the
    discriminator's gradient steps after each finished episode (``ShapingConfig.updates_per_episode``).
    ``log``: called with a line for the prior and each evaluation (progress).
    """
    import gymnasium as gym
    import panda_gym  # noqa: F401
    from stable_baselines3 import SAC
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.her import HerReplayBuffer

    from .config import ShapingConfig
    from .regularised_sac import PriorRegularisedSAC, silent_logger
    from .sb3 import ActorWarmup, OutcomeLogger, ShapedDictReplayBuffer, ShapedHerReplayBuffer
    from .wrapper import SuccessVisitationWrapper

    if prior not in ("scratch", "bc"):
        raise ValueError(f"prior {prior!r}: expected 'scratch' or 'bc'")
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    np.random.seed(seed)
    env = gym.make(env_id)
    vr = None
    callbacks: list = []
    if reward == "sparse":
        kwargs: dict = ({"replay_buffer_class": HerReplayBuffer,
                         "replay_buffer_kwargs": {"n_sampled_goal": 4, "goal_selection_strategy": "future"}}
                        if her else {})
    else:
        env = SuccessVisitationWrapper(env, ShapingConfig(kind=reward, lam=lam, beta=beta, updates_per_episode=refit),
                                        seed=seed)
        vr = env.reward_model
        vr.bind_gamma(gamma)
        callbacks.append(OutcomeLogger(reward_model=vr))
        kwargs = ({"replay_buffer_class": ShapedHerReplayBuffer,
                   "replay_buffer_kwargs": {"reward_model": vr, "n_sampled_goal": 4, "goal_selection_strategy": "future"}}
                  if her else {"replay_buffer_class": ShapedDictReplayBuffer, "replay_buffer_kwargs": {"reward_model": vr}})
    eval_env = gym.make(env_id)
    common = {"buffer_size": buffer_size or max(steps + 10_000, 20_000), "batch_size": batch_size, "gamma": gamma,
              "policy_kwargs": {"net_arch": list(net)}, "seed": seed, "device": "cpu", **kwargs}
    record: dict[str, Any] = {}
    if prior == "scratch":
        model = SAC("MultiInputPolicy", env, learning_starts=learning_starts, **common)
    else:
        model = PriorRegularisedSAC("MultiInputPolicy", env, learning_starts=0, ent_coef=ent_coef, **common)
        model.actor_lr_scale = actor_lr_scale
        demo_eps = collect_gym_demonstrations(env_id, demos, demo_noise, seed=seed)
        record["prior"] = clone_weak_prior(model, demo_eps, eval_env, band=band, seed=seed, **(prior_options or {}))
        record["prior"]["demo_success"] = float(np.mean([d["success"] for d in demo_eps]))
        if log:
            p = record["prior"]
            log(f"{env_id}: prior cloned for {p['epochs']} epochs, check success {p['check_success']:.2f} "
                f"({'inside' if p['in_band'] else 'NOT inside'} the band {p['band_floor']:.2f}-{band[1]:.2f}; "
                f"untrained {p['untrained_success']:.2f}), {time.perf_counter() - t0:.0f} s")
        act = lambda o: model.predict(o, deterministic=False)[0]  # noqa: E731  (the stochastic prior explores)
        prior_eps = [run_episode(eval_env, act, seed * 1000 + 500 + e) for e in range(prior_episodes)]
        seed_replay(model, demo_eps + prior_eps, vr)
        if vr is not None:
            vr.fit(200)
        model.set_prior(prior_weight)
        model.pretrain_critic(critic_pretrain_steps)
        callbacks.append(ActorWarmup(actor_warmup_steps))
    if model.verbose == 0:  # progress is ``log``'s; SB3's silent default would leave an empty temp folder
        model.set_logger(silent_logger())
    curve: list[tuple[int, float]] = []

    def evaluate() -> None:
        curve.append((int(model.num_timesteps),
                      evaluate_success(lambda o: model.predict(o, deterministic=True)[0], eval_env, eval_episodes,
                                  eval_seed)))
        if log:
            log(f"{env_id} {reward}{'+HER' if her else ''} from {prior}, seed {seed}: step {curve[-1][0]:,}/{steps:,} "
                f"success {curve[-1][1]:.2f} ({eval_episodes} episodes), {time.perf_counter() - t0:.0f} s")

    class Evaluate(BaseCallback):
        def _on_step(self) -> bool:
            if self.num_timesteps % eval_every == 0:
                evaluate()
            return True

    evaluate()
    model.learn(steps, callback=[*callbacks, Evaluate()])
    env.close()
    eval_env.close()
    return record | {"curve": [[int(a), float(b)] for a, b in curve], "wall_s": time.perf_counter() - t0}
