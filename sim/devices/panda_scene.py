"""A headless PyBullet scene with a Franka Panda, and the :class:`Task` hook that extends it.

:class:`PandaScene` owns one PyBullet client in DIRECT mode: a ground plane and the
Panda from ``pybullet_data`` (``franka_panda/panda.urdf``, fixed base), with joint
limits, efforts and velocity limits read from the URDF.  Its state has 8 dimensions:
the 7 arm joints and the gripper opening (the sum of the two finger joints, 0..0.08 m).
A :class:`Task` adds bodies to the scene, starts episodes, turns the scene into an
observation vector and says when it is solved; tasks are registered by name
(``sim://panda?task=NAME``).  The same task objects drive the gymnasium environments
of :mod:`closedloop.sim.manipulation` (reach, push, pick-and-place live there), so an emulated
episode and an in-process episode run the same code.  PyBullet is imported when a
scene is built, so importing this module is cheap.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import numpy as np

from ..registry import registrar

__all__ = ["PandaScene", "Task", "TASKS", "register_task", "task_class", "ReachTask", "HOME_Q"]

T = TypeVar("T", bound=type["Task"])

HOME_Q = (0.0, -0.785, 0.0, -2.356, 0.0, 1.571, 0.785)
_GRIPPER_MAX_M = 0.08


class PandaScene:
    """PyBullet world with one Panda arm.

    Parameters
    ----------
    physics_hz : float
        Physics step rate (PyBullet's default is 240 Hz).
    ik_iterations : int
        Iterations of PyBullet's IK per end-effector command (each ~5 us).  Many give a
        precise one-shot solve; a closed loop that re-solves every step needs few.
    """

    def __init__(self, physics_hz: float = 240.0, ik_iterations: int = 200) -> None:
        import pybullet as p
        import pybullet_data

        self.p = p
        self.client = p.connect(p.DIRECT)
        self.physics_hz = physics_hz
        self.ik_iterations = int(ik_iterations)
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
        self.reset_arm(np.array(HOME_Q), _GRIPPER_MAX_M)

    def reset_arm(self, q: np.ndarray, gripper_m: float) -> None:
        """Teleport the arm to joint angles ``q`` (7) at rest, gripper opening ``gripper_m``, and hold there."""
        p, kw = self.p, {"physicsClientId": self.client}
        for j, v in zip(self.arm_joints, q, strict=True):
            p.resetJointState(self.robot, j, float(v), 0.0, **kw)
        for j in self.finger_joints:
            p.resetJointState(self.robot, j, gripper_m / 2, 0.0, **kw)
        self.command_positions(np.array([*q, gripper_m]))

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

    def ee_velocity(self) -> np.ndarray:
        """End-effector linear velocity ``[vx, vy, vz]`` (m/s, world frame)."""
        s = self.p.getLinkState(self.robot, self.ee_link, computeLinkVelocity=True, physicsClientId=self.client)
        return np.array(s[6])

    def command_ee(self, position: np.ndarray, orientation: np.ndarray | None = None) -> np.ndarray:
        """Move the hand towards ``position``: IK, clipped to the joint limits, as position targets.

        Returns the 7 joint targets sent.  The emulator's END_EFFECTOR command and the
        manipulation environments' actions both come here, so they move the arm alike.
        """
        q = np.clip(self.solve_ik(position, orientation), self.lower[:7], self.upper[:7])
        self.command_positions(q)
        return q

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

    def command_gripper(self, opening_m: float) -> None:
        """Position-control target for the gripper opening (0..0.08 m; both fingers move together)."""
        p, kw = self.p, {"physicsClientId": self.client}
        width = float(np.clip(opening_m, 0.0, _GRIPPER_MAX_M))
        for j in self.finger_joints:
            p.setJointMotorControl2(self.robot, j, p.POSITION_CONTROL, targetPosition=width / 2,
                                    force=float(self.max_force[7]), maxVelocity=float(self.max_velocity[7]) / 2, **kw)

    def solve_ik(self, position: np.ndarray, orientation: np.ndarray | None = None,
                 iterations: int | None = None) -> np.ndarray:
        """The 7 arm joint angles that put the end effector at ``position`` (and ``orientation``).

        PyBullet's IK starts from the current joint angles; ``iterations`` overrides
        :attr:`ik_iterations` for this call.
        """
        orn = self.home_ee_orientation if orientation is None else orientation
        ranges = (self.upper - self.lower)[:7]
        rest = list(HOME_Q) + [_GRIPPER_MAX_M / 2] * 2
        lower = list(self.lower[:7]) + [0.0, 0.0]
        upper = list(self.upper[:7]) + [_GRIPPER_MAX_M / 2] * 2
        sol = self.p.calculateInverseKinematics(
            self.robot, self.ee_link, [float(v) for v in position], [float(v) for v in orn],
            lowerLimits=lower, upperLimits=upper, jointRanges=list(ranges) + [0.04, 0.04], restPoses=rest,
            maxNumIterations=iterations or self.ik_iterations, residualThreshold=1e-5, physicsClientId=self.client)
        return np.asarray(sol[:7], dtype=float)

    def close(self) -> None:
        try:
            self.p.disconnect(physicsClientId=self.client)
        except Exception:  # noqa: BLE001 - already disconnected
            pass


class Task(ABC):
    """Something to do in a :class:`PandaScene`: adds its bodies, starts episodes, says when it is solved.

    ``setup`` runs once after the scene is built (add bodies, then start the first
    episode); ``reset`` starts a new episode (arm to the start pose, object and goal
    drawn from ``rng``); ``observation`` is the task's state as one float vector (the
    policy's input: its layout is the task's, see ``docs/rl.md``); ``success`` is
    checked after every control step; ``info`` goes into the device's REPORT.  The
    class attributes are the control settings a task is designed for: an environment
    and the emulator both run it at ``control_hz`` with ``physics_hz`` physics.
    """

    NAME: ClassVar[str] = ""
    #: Control steps per second, physics steps per second, control steps per episode.
    control_hz: ClassVar[float] = 25.0
    physics_hz: ClassVar[float] = 250.0
    episode_steps: ClassVar[int] = 50
    #: IK iterations per end-effector command (see :class:`PandaScene`).
    ik_iterations: ClassVar[int] = 200

    @abstractmethod
    def setup(self, scene: PandaScene, rng: np.random.Generator) -> None: ...

    @abstractmethod
    def success(self, scene: PandaScene) -> bool: ...

    def reset(self, scene: PandaScene, rng: np.random.Generator) -> None:
        """Start a new episode (default: arm home)."""
        scene.reset_home()

    def observation(self, scene: PandaScene) -> np.ndarray:
        """The task's observation vector (default: none)."""
        return np.zeros(0)

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


# The manipulation tasks (reach, push, pick_and_place) live with their environments and
# register themselves here; imported last so that they find Task and register_task defined.
from ..manipulation.tasks import ReachTask  # noqa: E402
