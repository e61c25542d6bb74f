"""Gymnasium environments on the PyBullet Panda: one task, one headless PyBullet client per environment.

``PandaTaskEnv("push")`` (or ``gymnasium.make("closedloop/PandaPush-v0")``) wraps a
:class:`~closedloop.sim.manipulation.tasks.TabletopTask` in gymnasium's API: ``reset(seed=)``
draws the object and goal from a generator seeded by ``seed`` (the same seed gives
the same episode), ``step(action)`` commands the hand and runs ``physics_hz /
control_hz`` physics steps, the reward is 1.0 in a step that ends in the success set
and 0.0 otherwise, ``info["is_success"]`` says whether it does, and the episode is
truncated after ``episode_steps`` steps (it never terminates early: staying at the
goal is part of the task).  ``render_mode="rgb_array"`` renders with PyBullet's
software renderer.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from ..devices.panda_scene import PandaScene, task_class
from .tasks import TabletopTask

__all__ = ["PandaTaskEnv", "ENV_IDS", "register_envs"]

#: gymnasium ids of the shipped tasks.
ENV_IDS = {"reach": "closedloop/PandaReach-v0", "push": "closedloop/PandaPush-v0",
           "pick_and_place": "closedloop/PandaPickAndPlace-v0"}


class PandaTaskEnv(gym.Env):
    """A Panda tabletop task as a gymnasium environment.

    Parameters
    ----------
    task : str
        Registered task name (``reach``, ``push``, ``pick_and_place``).
    render_mode : {None, "rgb_array"}
        ``"rgb_array"``: :meth:`render` returns a ``(height, width, 3)`` uint8 image.
    render_size : tuple of int
        ``(width, height)`` of rendered images.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 25}

    def __init__(self, task: str = "push", render_mode: str | None = None,
                 render_size: tuple[int, int] = (240, 240)) -> None:
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"render_mode={render_mode!r}; this environment renders only 'rgb_array' (or None)")
        cls = task_class(task)
        if not issubclass(cls, TabletopTask):
            raise ValueError(f"task {task!r} is a {cls.__name__}, not a TabletopTask; it has no actions")
        self.task_name = task
        self.task: TabletopTask = cls()
        self.render_mode = render_mode
        self.render_size = render_size
        self.scene = PandaScene(self.task.physics_hz, ik_iterations=self.task.ik_iterations)
        self.substeps = max(1, round(self.task.physics_hz / self.task.control_hz))
        self.task.setup(self.scene, np.random.default_rng(0))
        self.metadata = {**self.metadata, "render_fps": self.task.control_hz}
        n = self.task.n_obs
        self.observation_space = spaces.Box(-np.inf, np.inf, shape=(n,), dtype=np.float32)
        self.action_space = spaces.Box(-1.0, 1.0, shape=(self.task.n_actions,), dtype=np.float32)
        self.max_episode_steps = self.task.episode_steps
        self._steps = 0

    def _obs(self) -> np.ndarray:
        return self.task.observation(self.scene).astype(np.float32)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.task.reset(self.scene, self.np_random)
        self._steps = 0
        return self._obs(), {"is_success": bool(self.task.success(self.scene))}

    def step(self, action: np.ndarray):
        action = np.asarray(action, dtype=np.float64).reshape(-1)
        if action.shape != self.action_space.shape or not np.all(np.isfinite(action)):
            raise ValueError(f"action {action.tolist()} must be {self.action_space.shape[0]} finite values in [-1, 1]")
        self.task.apply_action(self.scene, action)
        self.scene.step(self.substeps)
        self._steps += 1
        success = bool(self.task.success(self.scene))
        truncated = self._steps >= self.max_episode_steps
        return self._obs(), float(success), False, truncated, {"is_success": success}

    def render(self) -> np.ndarray | None:
        if self.render_mode != "rgb_array":
            return None
        p = self.scene.p
        w, h = self.render_size
        view = p.computeViewMatrixFromYawPitchRoll(cameraTargetPosition=[0.45, 0.0, 0.05], distance=0.9, yaw=90,
                                                   pitch=-35, roll=0, upAxisIndex=2)
        proj = p.computeProjectionMatrixFOV(fov=60, aspect=w / h, nearVal=0.05, farVal=5.0)
        _, _, rgba, _, _ = p.getCameraImage(w, h, view, proj, renderer=p.ER_TINY_RENDERER,
                                            physicsClientId=self.scene.client)
        return np.asarray(rgba, dtype=np.uint8).reshape(h, w, 4)[:, :, :3].copy()

    def close(self) -> None:
        self.scene.close()


def register_envs() -> None:
    """Register :data:`ENV_IDS` with gymnasium (idempotent)."""
    for task, env_id in ENV_IDS.items():
        if env_id not in gym.registry:
            gym.register(env_id, entry_point="closedloop.sim.manipulation.env:PandaTaskEnv", kwargs={"task": task},
                         max_episode_steps=None, disable_env_checker=False)
