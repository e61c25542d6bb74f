"""Pre-train a Panda policy by behaviour cloning, then fine-tune it with SAC on a (shaped) success reward.

The method's setting: fine-tuning starts from a policy of modest success.
:func:`collect_demonstrations` runs the task's scripted controller (with action
noise); :func:`behaviour_clone` fits SAC's actor mean to the successful
demonstrations (mean squared error on the squashed action) and sets its log standard
deviation; :func:`fine_tune` then

1. standardises observations with statistics of the demonstrations (frozen:
   :class:`~closedloop.sdk.rl.wrapper.FixedNormalization`, repeated in the exported bundle),
2. wraps the environment in :class:`~closedloop.sdk.rl.wrapper.SuccessVisitationWrapper` (the
   reward of ``config.shaping``) and gives SAC a :class:`~closedloop.sdk.rl.sb3.ShapedReplayBuffer`
   sharing the discriminator,
3. seeds the SAC replay and the discriminator's labelled replay with the
   demonstrations and ``prior_episodes`` episodes of the pre-trained policy,
4. fits the critic on that replay (``critic_pretrain_steps``, actor frozen),
5. learns for ``total_steps`` environment steps with
   :class:`~closedloop.sdk.rl.regularised_sac.PriorRegularisedSAC` (actor frozen for the first
   ``actor_warmup_steps``, then pulled towards the frozen cloned policy: plain SAC
   collapses it), evaluating the deterministic policy in-process on the outcome only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from .config import FineTuneConfig
from .regularised_sac import PriorRegularisedSAC, silent_logger
from .sb3 import ActorWarmup, OutcomeLogger, ShapedReplayBuffer, evaluate_success
from .wrapper import FixedNormalization, SuccessVisitationWrapper

__all__ = ["collect_demonstrations", "observation_stats", "behaviour_clone", "fine_tune", "FineTuneResult",
           "make_task_env"]


def make_task_env(task: str, mean: np.ndarray | None = None, std: np.ndarray | None = None):
    """A :class:`closedloop.sim.manipulation.PandaTaskEnv`, standardised when ``mean``/``std`` are given."""
    from closedloop.sim.manipulation import PandaTaskEnv

    env = PandaTaskEnv(task)
    return env if mean is None else FixedNormalization(env, mean, std)


def collect_demonstrations(task: str, episodes: int, noise: float = 0.1, seed: int = 0) -> list[dict[str, Any]]:
    """Scripted-controller episodes on seeds ``seed * 1000 + e``: dicts of ``obs``, ``actions``,
    ``next_obs``, ``rewards``, ``success`` (raw, unnormalised observations)."""
    from closedloop.sim.manipulation import scripted_controller

    env = make_task_env(task)
    controller = scripted_controller(task, noise=noise, seed=seed)
    out = []
    try:
        for e in range(episodes):
            obs, info = env.reset(seed=seed * 1000 + e)
            controller.reset()
            rows: dict[str, list] = {"obs": [], "actions": [], "next_obs": [], "rewards": []}
            done = False
            while not done:
                a = controller.act(obs)
                nxt, r, term, trunc, info = env.step(a)
                for k, v in zip(rows, (obs, a, nxt, r), strict=True):
                    rows[k].append(v)
                obs, done = nxt, term or trunc
            out.append({k: np.asarray(v, np.float32) for k, v in rows.items()} | {"success": bool(info["is_success"])})
    finally:
        env.close()
    return out


def observation_stats(episodes: list[dict[str, Any]], floor: float = 0.01) -> tuple[np.ndarray, np.ndarray]:
    """Mean and standard deviation (at least ``floor``) of the observations in ``episodes``."""
    x = np.concatenate([e["obs"] for e in episodes])
    return x.mean(0).astype(np.float32), np.maximum(x.std(0), floor).astype(np.float32)


def fit_actions(forward, params: list, obs, actions: np.ndarray, *, epochs: int, lr: float,
                batch_size: int, seed: int, lr_final_fraction: float | None = None,
                device: str | torch.device = "cpu", on_epoch: Callable[[int], bool] | None = None) -> float:
    """Minibatch Adam on the mean squared error of ``forward(obs)`` to ``actions`` (clipped to +-0.95).

    The one behaviour-cloning loop of the package (SAC actors, the demo's MLP, the bit-flip
    benchmark's policy). ``obs`` is an array, or a dict of arrays (dict observations: each
    batch is a dict of the same keys). ``lr_final_fraction``: cosine decay per batch to ``lr``
    times it (None: constant rate). ``on_epoch(epoch)``, called after each epoch (from 1),
    stops the loop when it returns True. Returns the last batch's loss.
    """
    gen = torch.Generator().manual_seed(seed)

    def tensor(a):
        return torch.as_tensor(np.asarray(a), dtype=torch.float32, device=device)

    x = {k: tensor(v) for k, v in obs.items()} if isinstance(obs, dict) else tensor(obs)
    y = torch.as_tensor(np.clip(actions, -0.95, 0.95), dtype=torch.float32, device=device)
    opt = torch.optim.Adam(params, lr=lr)
    sched = None
    if lr_final_fraction is not None:
        n_batches = -(-len(y) // batch_size)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs * n_batches, eta_min=lr * lr_final_fraction)
    loss = torch.tensor(float("nan"))
    for epoch in range(1, epochs + 1):
        for idx in torch.randperm(len(y), generator=gen).split(batch_size):
            batch = {k: v[idx] for k, v in x.items()} if isinstance(x, dict) else x[idx]
            loss = ((forward(batch) - y[idx]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if sched is not None:
                sched.step()
        if on_epoch is not None and on_epoch(epoch):
            break
    return float(loss.detach())


def behaviour_clone(actor: nn.Module, obs: np.ndarray, actions: np.ndarray, epochs: int = 200,
                    lr: float = 1e-3, batch_size: int = 256, init_log_std: float = -1.5, seed: int = 0) -> float:
    """Fit a stable-baselines3 SAC actor's mean action ``tanh(mu(latent_pi(obs)))`` to ``actions``.

    ``obs`` are already standardised.  The log-std head is reset to output ``init_log_std``.
    Returns the final mean squared error.
    """
    params = list(actor.latent_pi.parameters()) + list(actor.mu.parameters())
    loss = fit_actions(lambda b: torch.tanh(actor.mu(actor.latent_pi(b))), params, obs, actions, epochs=epochs, lr=lr,
                       batch_size=batch_size, seed=seed, device=actor.device)
    with torch.no_grad():
        actor.log_std.weight.zero_()
        actor.log_std.bias.fill_(init_log_std)
    return loss


@dataclass
class FineTuneResult:
    """What :func:`fine_tune` returns: the model, its normalisation, the curve and the record."""

    model: Any
    mean: np.ndarray
    std: np.ndarray
    config: FineTuneConfig
    curve: list[tuple[int, float]]
    record: dict[str, Any] = field(default_factory=dict)

    def act(self, raw_obs: np.ndarray) -> np.ndarray:
        """The deterministic action for a raw (unnormalised) observation."""
        return self.model.predict((np.asarray(raw_obs, np.float32) - self.mean) / self.std, deterministic=True)[0]


def _add(model, obs, nxt, action, reward, success) -> None:
    model.replay_buffer.add(obs[None], nxt[None], action[None], np.array([reward], np.float32), np.array([False]),
                            [{"outcome_reward": float(reward), "is_success": success}])


def fine_tune(config: FineTuneConfig, verbose: int = 0, env_factory=None) -> FineTuneResult:
    """Pre-train by behaviour cloning, then fine-tune with SAC on ``config.shaping``'s reward (see module doc)."""
    t0 = time.perf_counter()
    cfg = config
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    demos = collect_demonstrations(cfg.task, cfg.demos, cfg.demo_noise, seed=cfg.seed)
    mean, std = observation_stats(demos)
    factory = env_factory or make_task_env
    train_env = SuccessVisitationWrapper(factory(cfg.task, mean, std), cfg.shaping, seed=cfg.seed)
    eval_env = factory(cfg.task, mean, std)
    vr = train_env.reward_model
    vr.bind_gamma(cfg.gamma)  # the potential form's discount is SAC's
    model = PriorRegularisedSAC(
                "MlpPolicy", train_env, learning_rate=cfg.learning_rate, buffer_size=max(cfg.total_steps * 2, 10_000),
                learning_starts=0, batch_size=cfg.batch_size, gamma=cfg.gamma, train_freq=cfg.train_freq,
                gradient_steps=cfg.gradient_steps, ent_coef=cfg.ent_coef, policy_kwargs={"net_arch": list(cfg.net)},
                replay_buffer_class=ShapedReplayBuffer, replay_buffer_kwargs={"reward_model": vr},
                seed=cfg.seed, device=cfg.device, verbose=0)
    model.set_logger(silent_logger())  # progress is OutcomeLogger's; SB3's own would leave an empty temp folder
    model.actor_lr_scale = cfg.actor_lr_scale
    # Behaviour cloning on the successful demonstrations.
    prior_record = None
    if cfg.prior_band is None:
        good = [d for d in demos if d["success"]] or demos
        x = (np.concatenate([d["obs"] for d in good]) - mean) / std
        bc_mse = behaviour_clone(model.actor, x, np.concatenate([d["actions"] for d in good]), epochs=cfg.bc_epochs,
                                 init_log_std=cfg.init_log_std, seed=cfg.seed)
    else:  # a weak prior: stop cloning inside the band (checks on seeds apart from the evaluation's)
        from .panda_gym import clone_weak_prior

        normalised = [{**d, "obs": (d["obs"] - mean) / std} for d in demos]
        # every epoch checked (the push demonstrations are about 4 batches), and 5 checks in a row above the band
        # end it: a scripted task's prior is learned in a few epochs, so the band is passed early or not at all
        prior_record = clone_weak_prior(model, normalised, eval_env, band=tuple(cfg.prior_band),
                                        check_gradient_steps=1, above_limit=5, init_log_std=cfg.init_log_std,
                                        seed=cfg.seed)
        bc_mse = float("nan")
    # Seed both replays: demonstrations, then episodes of the pre-trained (stochastic) policy.
    for d in demos:
        o, n = (d["obs"] - mean) / std, (d["next_obs"] - mean) / std
        for t in range(len(o)):
            _add(model, o[t], n[t], d["actions"][t], d["rewards"][t], False)
        vr.add_episode(o, d["actions"], n, d["success"])
    prior_success = 0
    for e in range(cfg.prior_episodes):
        obs, _ = train_env.reset(seed=cfg.seed * 1000 + 500 + e)
        done = False
        while not done:
            a = model.predict(obs, deterministic=False)[0]
            nxt, _, term, trunc, info = train_env.step(a)
            _add(model, obs, nxt, a, info["outcome_reward"], info["is_success"])
            obs, done = nxt, term or trunc
        prior_success += info["episode_success"]
    vr.fit(200)
    model.set_prior(cfg.prior_weight)
    model.pretrain_critic(cfg.critic_pretrain_steps)
    logger = OutcomeLogger(eval_env, cfg.eval_every, cfg.eval_episodes, reward_model=vr, verbose=verbose)
    t_pre = time.perf_counter() - t0
    model.learn(cfg.total_steps, callback=[logger, ActorWarmup(cfg.actor_warmup_steps)], reset_num_timesteps=True)
    if not logger.curve or logger.curve[-1][0] != model.num_timesteps:
        logger.evaluate()
    record = {
        "config": cfg.to_dict(),
        "demo_success_rate": float(np.mean([d["success"] for d in demos])),
        "bc_mse": bc_mse,
        "prior_success_rate": prior_success / max(cfg.prior_episodes, 1),
        **({"prior": prior_record} if prior_record is not None else {}),
        "curve": logger.curve,
        "train_episodes": logger.episodes,
        "discriminator": vr.stats(),
        "pretrain_s": t_pre,
        "wall_s": time.perf_counter() - t0,
    }
    train_env.close()
    eval_env.close()
    return FineTuneResult(model, mean, std, cfg, logger.curve, record)


def evaluate_result(result: FineTuneResult, episodes: int, seed: int = 20_000) -> float:
    """In-process outcome success rate of a fine-tuned policy (deterministic) on fresh seeds."""
    env = make_task_env(result.config.task)
    try:
        return evaluate_success(result.act, env, episodes, seed)
    finally:
        env.close()
