"""Tabletop tasks for the Franka Panda: reach, push and pick-and-place.

Each task is a :class:`~closedloop.sim.devices.panda_scene.Task`: the same object drives the
gymnasium environment (:class:`closedloop.sim.manipulation.PandaTaskEnv`) and the emulator
(``sim://panda?task=push``), so an episode in-process and an episode over the wire run
the same scene code.  The arm is commanded in end-effector space: an action's first
three values in ``[-1, 1]`` move the hand target by up to ``action_scale_m`` along x, y
and z from where the hand is (clipped to :attr:`TabletopTask.workspace_low` /
``workspace_high``), then IK and joint position control follow; pick-and-place adds a
fourth value for the gripper opening (``-1`` closed, ``1`` open, 0..8 cm).  The reward
is sparse: 1 in a step that ends in the success set, else 0; episodes last
``episode_steps`` control steps at ``control_hz``.  Observation layouts are in
``OBS_LAYOUT`` (and ``docs/rl.md``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from ..devices.panda_scene import PandaScene, Task, register_task

__all__ = ["TabletopTask", "ReachTask", "PushTask", "PickAndPlaceTask", "GRIPPER_MAX_M"]

GRIPPER_MAX_M = 0.08
_CUBE_HALF_M = 0.02


class TabletopTask(Task):
    """What reach, push and pick-and-place share: the start pose, the action, the workspace, a goal marker."""

    control_hz = 25.0
    physics_hz = 250.0  # 10 physics steps per control step: about 0.3 ms of PyBullet per env step
    episode_steps = 50
    ik_iterations = 20  # re-solved every step from the current pose; ~8 mm short of a 5 cm move, caught up next step

    #: Hand target box (m, world frame): every end-effector target is clipped to it.
    workspace_low: ClassVar[np.ndarray] = np.array([0.25, -0.3, 0.015])
    workspace_high: ClassVar[np.ndarray] = np.array([0.7, 0.3, 0.4])
    #: Largest hand displacement per step (m), per axis.
    action_scale_m: ClassVar[float] = 0.05
    #: Where each episode starts the hand (m).
    start_ee: ClassVar[np.ndarray] = np.array([0.4, 0.0, 0.2])
    #: Gripper opening held for the whole episode (m), or None when the action controls it.
    fixed_gripper_m: ClassVar[float | None] = 0.0
    #: Success when the distance that ``distance_m`` measures is below this (m).
    tolerance_m: ClassVar[float] = 0.05
    #: Names and slices of the observation vector.
    OBS_LAYOUT: ClassVar[tuple[tuple[str, int], ...]] = ()

    @property
    def n_obs(self) -> int:
        return sum(n for _, n in self.OBS_LAYOUT)

    @property
    def n_actions(self) -> int:
        return 3 if self.fixed_gripper_m is not None else 4

    def setup(self, scene: PandaScene, rng: np.random.Generator) -> None:
        self.goal = np.zeros(3)
        p, kw = scene.p, {"physicsClientId": scene.client}
        shape = p.createVisualShape(p.GEOM_SPHERE, radius=self.tolerance_m / 2, rgbaColor=[0, 1, 0, 0.4], **kw)
        self._goal_body = p.createMultiBody(baseMass=0, baseVisualShapeIndex=shape, basePosition=[0, 0, -1], **kw)
        self.add_bodies(scene)
        # The start pose is solved once, precisely, from home; every episode teleports there.
        scene.reset_home()
        self._start_q = scene.solve_ik(self.start_ee, iterations=500)
        self.reset(scene, rng)

    def add_bodies(self, scene: PandaScene) -> None:
        """Objects beyond the goal marker (none for reach)."""

    def reset(self, scene: PandaScene, rng: np.random.Generator) -> None:
        scene.reset_arm(self._start_q, GRIPPER_MAX_M if self.fixed_gripper_m is None else self.fixed_gripper_m)
        self.place(scene, rng)
        scene.p.resetBasePositionAndOrientation(self._goal_body, self.goal.tolist(), [0, 0, 0, 1],
                                                physicsClientId=scene.client)

    def place(self, scene: PandaScene, rng: np.random.Generator) -> None:
        """Draw this episode's goal (and objects) from ``rng``."""
        raise NotImplementedError

    def ee_target(self, scene: PandaScene, action: np.ndarray) -> np.ndarray:
        """The clipped hand target an action asks for (the runtime's policy family computes the same)."""
        a = np.clip(np.asarray(action, dtype=float), -1.0, 1.0)
        return np.clip(scene.ee_pose()[:3] + self.action_scale_m * a[:3], self.workspace_low, self.workspace_high)

    def apply_action(self, scene: PandaScene, action: np.ndarray) -> None:
        """Command the arm (and gripper) for one control step; the caller steps the physics."""
        scene.command_ee(self.ee_target(scene, action))
        if self.fixed_gripper_m is None:
            scene.command_gripper((float(np.clip(action[3], -1.0, 1.0)) + 1.0) / 2.0 * GRIPPER_MAX_M)

    def distance_m(self, scene: PandaScene) -> float:
        raise NotImplementedError

    def success(self, scene: PandaScene) -> bool:
        return self.distance_m(scene) < self.tolerance_m

    def info(self, scene: PandaScene) -> dict[str, Any]:
        return {"goal": self.goal.round(4).tolist(), "distance_m": round(self.distance_m(scene), 4)}

    def _hand(self, scene: PandaScene) -> tuple[np.ndarray, np.ndarray]:
        return scene.ee_pose()[:3], scene.ee_velocity()


def _uniform_xy(rng: np.random.Generator, centre: tuple[float, float], half: float) -> np.ndarray:
    return np.asarray(centre) + rng.uniform(-half, half, size=2)


@register_task("reach")
class ReachTask(TabletopTask):
    """Bring the hand within 5 cm of a goal point drawn in a 30 x 30 x 20 cm box.

    Observation (9): hand position, hand velocity, goal position.
    """

    OBS_LAYOUT = (("ee_pos", 3), ("ee_vel", 3), ("goal", 3))

    def place(self, scene: PandaScene, rng: np.random.Generator) -> None:
        self.goal = np.array([0.45, 0.0, 0.15]) + rng.uniform([-0.15, -0.15, -0.1], [0.15, 0.15, 0.1])

    def distance_m(self, scene: PandaScene) -> float:
        return float(np.linalg.norm(scene.ee_pose()[:3] - self.goal))

    def observation(self, scene: PandaScene) -> np.ndarray:
        ee, v = self._hand(scene)
        return np.concatenate([ee, v, self.goal])

    def info(self, scene: PandaScene) -> dict[str, Any]:
        return {"target": self.goal.round(4).tolist(), **super().info(scene)}


class _CubeTask(TabletopTask):
    """A 4 cm cube on the floor, drawn with its goal in 20 x 20 cm squares."""

    cube_mass_kg: ClassVar[float] = 0.5
    object_centre: ClassVar[tuple[float, float]] = (0.45, 0.0)
    object_half_range_m: ClassVar[float] = 0.1
    goal_half_range_m: ClassVar[float] = 0.1
    #: Goals are redrawn until at least this far from the cube: no episode starts solved.
    min_goal_distance_m: ClassVar[float] = 0.1

    def add_bodies(self, scene: PandaScene) -> None:
        p, kw = scene.p, {"physicsClientId": scene.client}
        half = [_CUBE_HALF_M] * 3
        col = p.createCollisionShape(p.GEOM_BOX, halfExtents=half, **kw)
        vis = p.createVisualShape(p.GEOM_BOX, halfExtents=half, rgbaColor=[0.1, 0.3, 0.9, 1], **kw)
        self.cube = p.createMultiBody(baseMass=self.cube_mass_kg, baseCollisionShapeIndex=col,
                                      baseVisualShapeIndex=vis, basePosition=[0.45, 0, _CUBE_HALF_M], **kw)
        p.changeDynamics(self.cube, -1, lateralFriction=0.5, **kw)

    def draw_goal(self, rng: np.random.Generator, cube_xy: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def place(self, scene: PandaScene, rng: np.random.Generator) -> None:
        xy = _uniform_xy(rng, self.object_centre, self.object_half_range_m)
        for _ in range(100):
            self.goal = self.draw_goal(rng, xy)
            if np.linalg.norm(self.goal[:2] - xy) >= self.min_goal_distance_m:
                break
        p, kw = scene.p, {"physicsClientId": scene.client}
        p.resetBasePositionAndOrientation(self.cube, [xy[0], xy[1], _CUBE_HALF_M], [0, 0, 0, 1], **kw)
        p.resetBaseVelocity(self.cube, [0, 0, 0], [0, 0, 0], **kw)

    def cube_state(self, scene: PandaScene) -> tuple[np.ndarray, np.ndarray]:
        p, kw = scene.p, {"physicsClientId": scene.client}
        pos, _ = p.getBasePositionAndOrientation(self.cube, **kw)
        vel, _ = p.getBaseVelocity(self.cube, **kw)
        return np.array(pos), np.array(vel)

    def distance_m(self, scene: PandaScene) -> float:
        return float(np.linalg.norm(self.cube_state(scene)[0] - self.goal))

    def info(self, scene: PandaScene) -> dict[str, Any]:
        return {"object": self.cube_state(scene)[0].round(4).tolist(), **super().info(scene)}


@register_task("push")
class PushTask(_CubeTask):
    """Push the cube (gripper closed) until its centre is within 5 cm of a goal on the floor.

    Observation (21): hand position, hand velocity, cube position, cube velocity, goal
    position, cube - hand, goal - cube.
    """

    OBS_LAYOUT = (("ee_pos", 3), ("ee_vel", 3), ("object_pos", 3), ("object_vel", 3), ("goal", 3),
                  ("object_rel_ee", 3), ("goal_rel_object", 3))

    def draw_goal(self, rng: np.random.Generator, cube_xy: np.ndarray) -> np.ndarray:
        return np.array([*_uniform_xy(rng, self.object_centre, self.goal_half_range_m), _CUBE_HALF_M])

    def observation(self, scene: PandaScene) -> np.ndarray:
        ee, v = self._hand(scene)
        obj, obj_v = self.cube_state(scene)
        return np.concatenate([ee, v, obj, obj_v, self.goal, obj - ee, self.goal - obj])


@register_task("pick_and_place")
class PickAndPlaceTask(_CubeTask):
    """Pick the cube up and hold its centre within 5 cm of a goal up to 15 cm above the floor.

    Observation (22): hand position, hand velocity, gripper opening, cube position,
    cube velocity, goal position, cube - hand, goal - cube.  Action: 4 values, the last
    the gripper opening (-1 closed .. 1 open).
    """

    OBS_LAYOUT = (("ee_pos", 3), ("ee_vel", 3), ("gripper_m", 1), ("object_pos", 3), ("object_vel", 3),
                  ("goal", 3), ("object_rel_ee", 3), ("goal_rel_object", 3))
    fixed_gripper_m = None
    cube_mass_kg = 0.2

    def add_bodies(self, scene: PandaScene) -> None:
        super().add_bodies(scene)
        p, kw = scene.p, {"physicsClientId": scene.client}
        for j in scene.finger_joints:  # grip, don't slide
            p.changeDynamics(scene.robot, j, lateralFriction=2.0, **kw)

    def draw_goal(self, rng: np.random.Generator, cube_xy: np.ndarray) -> np.ndarray:
        xy = _uniform_xy(rng, self.object_centre, self.goal_half_range_m)
        return np.array([*xy, _CUBE_HALF_M + rng.uniform(0.03, 0.15)])

    def observation(self, scene: PandaScene) -> np.ndarray:
        ee, v = self._hand(scene)
        obj, obj_v = self.cube_state(scene)
        width = scene.state()[0][7]
        return np.concatenate([ee, v, [width], obj, obj_v, self.goal, obj - ee, self.goal - obj])
