"""Scripted controllers for the Panda tasks: demonstrations for behaviour cloning, and a reference success rate.

A controller reads only the task's observation vector (the layouts of
:mod:`closedloop.sim.manipulation.tasks`), so it runs the same in-process or on the far side of
the wire.  Each is a small phase machine: ``reset()`` at the start of an episode, then
``act(obs)`` once per step returns an action in ``[-1, 1]``.  ``noise`` adds Gaussian
action noise (diverse demonstrations); :func:`rollout_controller` runs episodes and
reports the success rate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import numpy as np

__all__ = ["ScriptedController", "ReachController", "PushController", "PickAndPlaceController",
           "SCRIPTED_CONTROLLERS", "scripted_controller", "rollout_controller"]

_SCALE_M = 0.05  # TabletopTask.action_scale_m: one action unit moves the hand 5 cm


def _towards(ee: np.ndarray, target: np.ndarray, gain: float = 1.0) -> np.ndarray:
    return np.clip(gain * (target - ee) / _SCALE_M, -1.0, 1.0)


class ScriptedController:
    """Base class: a phase machine over observations."""

    n_actions: ClassVar[int] = 3

    def __init__(self, noise: float = 0.0, seed: int | None = None) -> None:
        self.noise = noise
        self.rng = np.random.default_rng(seed)
        self.reset()

    def reset(self) -> None:
        self.phase = 0
        self.t = 0

    def plan(self, obs: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def act(self, obs: np.ndarray) -> np.ndarray:
        a = self.plan(np.asarray(obs, dtype=float))
        self.t += 1
        if self.noise > 0:
            a = a + self.noise * self.rng.standard_normal(a.shape)
        return np.clip(a, -1.0, 1.0).astype(np.float32)


class ReachController(ScriptedController):
    """Straight at the goal."""

    def plan(self, obs: np.ndarray) -> np.ndarray:
        return _towards(obs[0:3], obs[6:9])


class PushController(ScriptedController):
    """Above the point behind the cube, down, then push it along the cube-to-goal line."""

    push_height_m = 0.025
    clearance_m = 0.05  # hand centre behind the cube centre while pushing
    travel_height_m = 0.08

    def plan(self, obs: np.ndarray) -> np.ndarray:
        ee, obj, goal = obs[0:3], obs[6:9], obs[12:15]
        d = goal[:2] - obj[:2]
        dist = float(np.linalg.norm(d))
        u = d / dist if dist > 1e-6 else np.array([1.0, 0.0])
        behind = obj[:2] - u * self.clearance_m
        rel = ee[:2] - obj[:2]
        lateral = abs(rel[0] * u[1] - rel[1] * u[0])
        along = float(rel @ u)
        if self.phase == 2 and (lateral > 0.03 or along > -0.02):
            self.phase = 0  # lost the cube: go round again
        if self.phase == 0:
            target = np.array([*behind, self.travel_height_m])
            if np.linalg.norm(ee[:2] - behind) < 0.015:
                self.phase = 1
        if self.phase == 1:
            target = np.array([*behind, self.push_height_m])
            if ee[2] < self.push_height_m + 0.01:
                self.phase = 2
        if self.phase == 2:
            # Keep the hand on the line behind the cube and advance along it.
            step = min(dist, 0.05)
            target = np.array([*(behind + u * step), self.push_height_m])
        return _towards(ee, target)


class PickAndPlaceController(ScriptedController):
    """Above the cube with the gripper open, down, close, carry to the goal."""

    n_actions = 4
    travel_height_m = 0.1

    def plan(self, obs: np.ndarray) -> np.ndarray:
        ee, obj, goal = obs[0:3], obs[7:10], obs[13:16]
        grip = 1.0
        if self.phase == 0:
            target = np.array([*obj[:2], self.travel_height_m])
            if np.linalg.norm(ee[:2] - obj[:2]) < 0.01:
                self.phase = 1
        if self.phase == 1:
            target = np.array([*obj[:2], obj[2]])
            if abs(ee[2] - obj[2]) < 0.008 and np.linalg.norm(ee[:2] - obj[:2]) < 0.01:
                self.phase, self._closing = 2, 0
        if self.phase == 2:
            target, grip = ee.copy(), -1.0
            self._closing += 1
            if self._closing >= 4:
                self.phase = 3
        if self.phase == 3:
            grip = -1.0
            if np.linalg.norm(obj - ee) > 0.04:  # dropped it
                self.phase = 0
            target = goal
        return np.append(_towards(ee, target), grip)


SCRIPTED_CONTROLLERS: dict[str, type[ScriptedController]] = {
    "reach": ReachController, "push": PushController, "pick_and_place": PickAndPlaceController,
}


def scripted_controller(task: str, noise: float = 0.0, seed: int | None = None) -> ScriptedController:
    """The scripted controller for ``task``."""
    try:
        return SCRIPTED_CONTROLLERS[task](noise=noise, seed=seed)
    except KeyError:
        raise KeyError(f"no scripted controller for task {task!r}; known: {sorted(SCRIPTED_CONTROLLERS)}") from None


def rollout_controller(env, act: Callable[[np.ndarray], np.ndarray] | ScriptedController, episodes: int,
                       seed: int = 0, keep: bool = False) -> tuple[float, list[dict[str, np.ndarray]]]:
    """Run ``episodes`` episodes (seeds ``seed``, ``seed + 1``, ...); return the success rate and, with
    ``keep``, the episodes as dicts of ``obs``, ``actions``, ``next_obs``, ``success`` (final step)."""
    controller = act if isinstance(act, ScriptedController) else None
    wins, kept = 0, []
    for e in range(episodes):
        obs, info = env.reset(seed=seed + e)
        if controller is not None:
            controller.reset()
        rows: dict[str, list] = {"obs": [], "actions": [], "next_obs": []}
        done = False
        while not done:
            a = controller.act(obs) if controller is not None else act(obs)
            nxt, _, term, trunc, info = env.step(a)
            if keep:
                rows["obs"].append(obs)
                rows["actions"].append(a)
                rows["next_obs"].append(nxt)
            obs, done = nxt, term or trunc
        ok = bool(info.get("is_success", False))
        wins += ok
        if keep:
            kept.append({k: np.asarray(v, dtype=np.float32) for k, v in rows.items()} | {"success": ok})
    return wins / max(episodes, 1), kept
