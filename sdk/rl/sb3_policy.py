"""Any stable-baselines3 policy with continuous actions as a plain module, ready for ``export_bundle``.

A policy trained with SB3 on the user's own environment acts through ``model.predict(obs,
deterministic=True)``: features, the actor's network, the deterministic action (the mean, squashed by
``tanh`` where the policy squashes), then SB3 rescales a squashed action from [-1, 1] to the action space's
bounds or clips an unsquashed one to them. :class:`SB3Policy` writes that path with torch ops only (no
distribution objects, which do not trace to a fixed-size graph) for SAC, TD3, DDPG, PPO and A2C, and can
take a ``VecNormalize``'s observation statistics in front, so the bundle maps the environment's raw
observation to the environment's action exactly as ``predict`` does::

    from closedloop import export_bundle
    from closedloop.sdk.rl import SB3Policy

    policy = SB3Policy(model, vec_normalize=venv)              # venv: the VecNormalize it trained with, if any
    export_bundle(policy, "out/policy", kind="feedforward", rate_hz=50.0,
                  example_input=torch.zeros(1, *env.observation_space.shape),
                  postprocess={"low": policy.low.tolist(), "high": policy.high.tolist()})

Observation spaces: a flat ``Box``, or a ``Dict`` of ``Box`` spaces (a goal-conditioned task's ``observation``,
``achieved_goal`` and ``desired_goal`` with HER, ``MultiInputPolicy``): the module then takes the flat vector
``gymnasium.spaces.flatten`` gives (the keys in the space's order, each flattened) and splits it for the policy,
so a device streams one measurement. Action spaces: ``Box``. Anything else is refused, naming what to change.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = ["SB3Policy"]


def _copy_policy(policy: Any) -> Any:
    """A copy of an SB3 policy on the CPU, as SB3's own ``policy.save`` / ``load`` rebuilds one.

    A policy that has acted (PPO and A2C after ``learn``) keeps its last action distribution, whose tensors are
    not graph leaves, and ``copy.deepcopy`` refuses it; SB3's constructor parameters and the state dict make the
    same network without it. A custom policy that does not give its constructor parameters is deep-copied.
    """
    try:
        params = policy._get_constructor_parameters()
    except (AttributeError, NotImplementedError):
        return copy.deepcopy(policy)
    clone = type(policy)(**params)
    clone.load_state_dict({k: v.detach().cpu() for k, v in policy.state_dict().items()})
    return clone


class SB3Policy(nn.Module):
    """``model.predict(obs, deterministic=True)`` of an SB3 model as ``forward(obs) -> action`` (batch first).

    Parameters
    ----------
    model
        A stable-baselines3 SAC, TD3, DDPG, PPO or A2C model (or its ``policy``).
    vec_normalize
        The ``VecNormalize`` wrapper the policy trained behind, if any: its observation mean, variance,
        epsilon and clip go in front (``(obs - mean) / sqrt(var + eps)``, clipped), so the module takes raw
        observations.
    """

    def __init__(self, model: Any, vec_normalize: Any = None):
        super().__init__()
        from gymnasium import spaces

        policy = getattr(model, "policy", model)
        name = type(model).__name__
        if not isinstance(policy.action_space, spaces.Box):
            raise ValueError(f"{name}'s action space is {type(policy.action_space).__name__}: SB3Policy exports "
                             "continuous (Box) actions; a discrete policy's argmax is not a command a session sends")
        obs_space = policy.observation_space
        parts = obs_space.spaces if isinstance(obs_space, spaces.Dict) else {"": obs_space}
        if not all(isinstance(sp, spaces.Box) for sp in parts.values()) or (
                not isinstance(obs_space, spaces.Dict) and len(obs_space.shape) != 1):
            raise ValueError(f"{name}'s observation space is {obs_space}: SB3Policy takes a flat Box or a Dict of "
                             "Box spaces (images and nested spaces are not supported)")
        self.keys = list(parts) if isinstance(obs_space, spaces.Dict) else None
        self.shapes = [tuple(sp.shape) for sp in parts.values()]
        self.sizes = [int(np.prod(sh)) for sh in self.shapes]
        self.policy = _copy_policy(policy).cpu().eval()
        self.kind = self._kind(self.policy, name)
        self.squash = bool(getattr(self.policy, "squash_output", False))
        self.register_buffer("low", torch.as_tensor(np.asarray(policy.action_space.low), dtype=torch.float32))
        self.register_buffer("high", torch.as_tensor(np.asarray(policy.action_space.high), dtype=torch.float32))
        self.normalise = vec_normalize is not None and bool(getattr(vec_normalize, "norm_obs", True))
        n = sum(self.sizes)
        mean, scale, clip = np.zeros(n), np.ones(n), np.full(n, np.inf)
        if self.normalise:  # VecNormalize's (obs - mean) / sqrt(var + eps), clipped, per key for a Dict space
            rms = vec_normalize.obs_rms
            normed = getattr(vec_normalize, "norm_obs_keys", None) or list(parts)
            start = 0
            for key, size in zip(parts, self.sizes, strict=True):
                stats = rms.get(key) if isinstance(rms, dict) else rms
                if stats is not None and (not isinstance(rms, dict) or key in normed):
                    mean[start:start + size] = np.ravel(stats.mean)
                    scale[start:start + size] = 1.0 / np.sqrt(np.ravel(stats.var) + float(vec_normalize.epsilon))
                    clip[start:start + size] = float(vec_normalize.clip_obs)
                start += size
        self.register_buffer("obs_mean", torch.as_tensor(mean, dtype=torch.float32))
        self.register_buffer("obs_scale", torch.as_tensor(scale, dtype=torch.float32))
        self.register_buffer("obs_clip", torch.as_tensor(np.minimum(clip, np.finfo(np.float32).max), dtype=torch.float32))

    @staticmethod
    def _kind(policy: Any, name: str) -> str:
        actor = getattr(policy, "actor", None)
        if actor is not None and hasattr(actor, "latent_pi") and hasattr(actor, "mu"):
            return "sac"
        if actor is not None and hasattr(actor, "mu"):
            return "td3"
        if hasattr(policy, "mlp_extractor") and hasattr(policy, "action_net"):
            return "actor_critic"
        raise ValueError(f"{name}: SB3Policy knows SAC, TD3, DDPG, PPO and A2C policies; write this policy's "
                         "deterministic forward as a module and export that")

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """``obs``: (batch, n) raw observations, a Dict space's keys flattened in order; returns (batch, actions)."""
        if self.normalise:
            obs = (obs - self.obs_mean) * self.obs_scale
            obs = torch.minimum(torch.maximum(obs, -self.obs_clip), self.obs_clip)
        if self.keys is not None:  # the policy's Dict observation, from the flat vector
            parts = torch.split(obs, self.sizes, dim=1)
            obs = {k: part.reshape(part.shape[0], *shape)  # type: ignore[assignment]
                   for k, part, shape in zip(self.keys, parts, self.shapes, strict=True)}
        p = self.policy
        if self.kind == "sac":
            a = p.actor.mu(p.actor.latent_pi(p.actor.extract_features(obs, p.actor.features_extractor)))
            a = torch.tanh(a)  # the squashed Gaussian's mode
        elif self.kind == "td3":
            a = p.actor(obs)  # its mu ends in tanh
        else:
            a = p.action_net(p.mlp_extractor.forward_actor(p.extract_features(obs, p.pi_features_extractor)))
            if self.squash:
                a = torch.tanh(a)
        if self.squash or self.kind in ("sac", "td3"):
            return self.low + 0.5 * (a + 1.0) * (self.high - self.low)  # SB3's unscale_action
        return torch.minimum(torch.maximum(a, self.low), self.high)  # SB3 clips an unsquashed action
