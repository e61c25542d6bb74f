"""A headless PyBullet scene with a Franka Panda, and the :class:`Task` hook that extends it.

:class:`PandaScene` owns one PyBullet client in DIRECT mode: a ground plane and the
Panda from ``pybullet_data`` (``franka_panda/panda.urdf``, fixed base), with joint
limits, efforts and velocity limits read from the URDF.  Its state has 8 dimensions:
the 7 arm joints and the gripper opening (the sum of the two finger joints, 0..0.08 m).
A :class:`Task` adds bodies to the scene and says when it is solved; tasks are
registered by name (``sim://panda?task=NAME``), so manipulation tasks (push, reach,
pick-and-place) plug in without touching the emulator.  PyBullet is imported when a
scene is built, so importing this module is cheap.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import numpy as np

from ..registry import registrar

__all__ = ["PandaScene", "Task", "TASKS", "register_task", "task_class", "ReachTask"]

T = TypeVar("T", bound=type["Task"])

HOME_Q = (0.0, -0.785, 0.0, -2.356, 0.0, 1.571, 0.785)
_GRIPPER_MAX_M = 0.08


class PandaScene:
    """PyBullet world with one Panda arm.

    Parameters
    ----------
    physics_hz : float
        Physics step rate (PyBullet's default is 240 Hz).
    """

    def __init__(self, physics_hz: float = 240.0) -> None:
        import pybullet as p
        import pybullet_data

        self.p = p
        self.client = p.connect(p.DIRECT)
        self.physics_hz = physics_hz
        kw = {"physicsClientId": self.client}
        p.setAdditionalSearchPath(pybullet_data.getDataPath(), **kw)
        p.setGravity(0.0, 0.0, -9.81, **kw)
        p.setTimeStep(1.0 / physics_hz, **kw)
        self.plane = p.loadURDF("plane.urdf", **kw)
        self.robot = p.loadURDF("franka_panda/panda.urdf", useFixedBase=True, **kw)
        arm, fingers, ee_link = [], [], None
        info = [p.getJointInfo(self.robot, j, **kw) for j in range(p.getNumJoints(self.robot, **kw))]
        for row in info:
            if row[2] == p.JOINT_REVOLUTE:
                arm.append(row)
            elif row[2] == p.JOINT_PRISMATIC:
                fingers.append(row)
            if row[12].decode() == "panda_grasptarget":
                ee_link = row[0]
        if len(arm) != 7 or len(fingers) != 2 or ee_link is None:
            raise RuntimeError(f"franka_panda/panda.urdf has {len(arm)} revolute and {len(fingers)} prismatic "
                               "joints (expected 7 and 2) or no panda_grasptarget link; is pybullet_data intact?")
        self.arm_joints = [row[0] for row in arm]
        self.finger_joints = [row[0] for row in fingers]
        self.ee_link = ee_link
        # 8 dims: 7 arm joints + gripper opening (both fingers move together).
        self.lower = np.array([row[8] for row in arm] + [0.0])
        self.upper = np.array([row[9] for row in arm] + [_GRIPPER_MAX_M])
        self.max_force = np.array([row[10] for row in arm] + [fingers[0][10]])
        self.max_velocity = np.array([row[11] for row in arm] + [2.0 * fingers[0][11]])
        self.steps = 0
        self.reset_home()
        self.home_ee_orientation = self.ee_pose()[3:].copy()

    @property
    def n_dims(self) -> int:
        return 8

    def reset_home(self) -> None:
        """Put the arm in its home pose, gripper open, and hold it there."""
        p, kw = self.p, {"physicsClientId": self.client}
        for j, q in zip(self.arm_joints, HOME_Q, strict=True):
            p.resetJointState(self.robot, j, q, 0.0, **kw)
        for j in self.finger_joints:
            p.resetJointState(self.robot, j, _GRIPPER_MAX_M / 2, 0.0, **kw)
        self.command_positions(np.array([*HOME_Q, _GRIPPER_MAX_M]))

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.p.stepSimulation(physicsClientId=self.client)
        self.steps += n

    def state(self) -> tuple[np.ndarray, np.ndarray]:
        """``(q, dq)``: 7 joint angles (rad) + gripper opening (m), and their rates."""
        rows = self.p.getJointStates(self.robot, self.arm_joints + self.finger_joints, physicsClientId=self.client)
        q = np.array([r[0] for r in rows])
        dq = np.array([r[1] for r in rows])
        return (np.append(q[:7], q[7] + q[8]), np.append(dq[:7], dq[7] + dq[8]))

    def ee_pose(self) -> np.ndarray:
        """End-effector (grasp target) pose ``[x, y, z, qx, qy, qz, qw]`` in the world frame."""
        s = self.p.getLinkState(self.robot, self.ee_link, computeForwardKinematics=True,
                                physicsClientId=self.client)
        return np.array([*s[4], *s[5]])

    def command_positions(self, q: np.ndarray) -> None:
        """Position-control targets for the 8 dims (7 given: the gripper keeps its target)."""
        p, kw = self.p, {"physicsClientId": self.client}
        for i, j in enumerate(self.arm_joints):
            p.setJointMotorControl2(self.robot, j, p.POSITION_CONTROL, targetPosition=float(q[i]),
                                    force=float(self.max_force[i]), maxVelocity=float(self.max_velocity[i]), **kw)
        if q.size > 7:
            for j in self.finger_joints:
                p.setJointMotorControl2(self.robot, j, p.POSITION_CONTROL, targetPosition=float(q[7]) / 2,
                                        force=float(self.max_force[7]), maxVelocity=float(self.max_velocity[7]) / 2,
                                        **kw)

    def command_velocities(self, dq: np.ndarray) -> None:
        """Velocity-control targets for the 8 dims (7 given: the gripper keeps its target)."""
        p, kw = self.p, {"physicsClientId": self.client}
        for i, j in enumerate(self.arm_joints):
            p.setJointMotorControl2(self.robot, j, p.VELOCITY_CONTROL, targetVelocity=float(dq[i]),
                                    force=float(self.max_force[i]), **kw)
        if dq.size > 7:
            for j in self.finger_joints:
                p.setJointMotorControl2(self.robot, j, p.VELOCITY_CONTROL, targetVelocity=float(dq[7]) / 2,
                                        force=float(self.max_force[7]), **kw)

    def solve_ik(self, position: np.ndarray, orientation: np.ndarray | None = None) -> np.ndarray:
        """The 7 arm joint angles that put the end effector at ``position`` (and ``orientation``)."""
        orn = self.home_ee_orientation if orientation is None else orientation
        ranges = (self.upper - self.lower)[:7]
        rest = list(HOME_Q) + [_GRIPPER_MAX_M / 2] * 2
        lower = list(self.lower[:7]) + [0.0, 0.0]
        upper = list(self.upper[:7]) + [_GRIPPER_MAX_M / 2] * 2
        sol = self.p.calculateInverseKinematics(
            self.robot, self.ee_link, [float(v) for v in position], [float(v) for v in orn],
            lowerLimits=lower, upperLimits=upper, jointRanges=list(ranges) + [0.04, 0.04], restPoses=rest,
            maxNumIterations=200, residualThreshold=1e-5, physicsClientId=self.client)
        return np.asarray(sol[:7], dtype=float)

    def close(self) -> None:
        try:
            self.p.disconnect(physicsClientId=self.client)
        except Exception:  # noqa: BLE001 - already disconnected
            pass


class Task(ABC):
    """Something to do in a :class:`PandaScene`: adds its bodies, and says when it is solved.

    ``setup`` runs once after the scene is built; ``success`` after every tick (the
    emulator sends a TASK_SUCCESS status when it turns true); ``info`` goes into the
    device's REPORT (targets, object poses) so a host can read them.
    """

    NAME: ClassVar[str] = ""

    @abstractmethod
    def setup(self, scene: PandaScene, rng: np.random.Generator) -> None: ...

    @abstractmethod
    def success(self, scene: PandaScene) -> bool: ...

    def info(self, scene: PandaScene) -> dict[str, Any]:
        return {}


#: Task classes by name.
TASKS: dict[str, type[Task]] = {}


def register_task(name: str, *, replace: bool = False) -> Callable[[T], T]:
    """Class decorator: make ``sim://panda?task=NAME`` plug this task into the scene."""
    return registrar(TASKS, "task", name, replace)


def task_class(name: str) -> type[Task]:
    try:
        return TASKS[name]
    except KeyError:
        raise KeyError(f"no panda task named {name!r}; registered: {', '.join(sorted(TASKS))}") from None


@register_task("reach")
class ReachTask(Task):
    """Bring the end effector within 3 cm of a (seeded) target point, shown as a sphere."""

    tolerance_m = 0.03

    def setup(self, scene: PandaScene, rng: np.random.Generator) -> None:
        self.target = np.array([0.5, 0.0, 0.35]) + rng.uniform([-0.1, -0.2, -0.1], [0.1, 0.2, 0.1])
        p, kw = scene.p, {"physicsClientId": scene.client}
        shape = p.createVisualShape(p.GEOM_SPHERE, radius=self.tolerance_m, rgbaColor=[0, 1, 0, 0.5], **kw)
        p.createMultiBody(baseMass=0, baseVisualShapeIndex=shape, basePosition=self.target.tolist(), **kw)

    def distance_m(self, scene: PandaScene) -> float:
        return float(np.linalg.norm(scene.ee_pose()[:3] - self.target))

    def success(self, scene: PandaScene) -> bool:
        return self.distance_m(scene) < self.tolerance_m

    def info(self, scene: PandaScene) -> dict[str, Any]:
        return {"target": self.target.round(4).tolist(), "distance_m": round(self.distance_m(scene), 4)}
