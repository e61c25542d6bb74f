"""Robot-arm emulator: a PyBullet Franka Panda that streams JOINT_STATE and follows JOINT_COMMAND.

``sim://panda?rate=50&physics_hz=240&hold_s=0.2&task=push``.  Each tick the physics
is stepped up to device time and a JOINT_STATE is sent: 8 positions and velocities
(7 arm joints in rad, gripper opening in m) and the end-effector pose.  A
JOINT_COMMAND is applied as it arrives: POSITION (7 or 8 targets, clipped to the
URDF joint limits), VELOCITY (7 or 8 rates, clipped to the URDF velocity limits),
END_EFFECTOR (``[x, y, z]`` or with a quaternion; solved by PyBullet IK, then as
POSITION; a 4th / 8th value is the gripper opening in m, clipped to 0..0.08).  Clipping and refused commands are reported by STATUS.  With no command
for ``hold_s`` the arm holds where it is (position control at the current angles).

With a ``task`` the emulator runs the task's episodes: ``rate`` and ``physics_hz``
default to the task's control and physics rates, every ``episode_steps`` ticks the
episode's outcome (success at its last tick) is counted and a new episode starts
(arm back to the start pose, object and goal drawn again), and each tick also sends
a PLANT_MEASUREMENT whose ``y`` is the task's observation vector (the layout of
``closedloop.sim.manipulation.tasks``) and whose ``u`` is ``[episode, step, success now,
episodes done, episodes succeeded]``; a host reads the deployed success rate there.
The first episode's clock starts with the first JOINT_COMMAND (the arm waits at the
start pose until the host acts), so a slow host start does not cost it steps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from closedloop.firmware_bridge import (
    Hello,
    JointCommand,
    JointMode,
    JointState,
    Message,
    PlantMeasurement,
    Severity,
)

from ..params import Param
from .base import Device, StatusCode, register_device
from .panda_scene import TASKS, PandaScene, Task, task_class

__all__ = ["PandaDevice", "WORKSPACE_LOW", "WORKSPACE_HIGH"]

#: End-effector targets are clipped to this box (metres, world frame): the Panda's reach.
WORKSPACE_LOW = np.array([-0.85, -0.85, 0.0])
WORKSPACE_HIGH = np.array([0.85, 0.85, 1.2])


@register_device("panda")
class PandaDevice(Device):
    """A Franka Panda arm on a serial line."""

    KIND = "panda"
    PARAMS = (
        Param("rate", float, None, "JOINT_STATE frames per second (default 50, or the task's control rate)",
              low=0.1, high=1000.0),
        Param("physics_hz", float, None, "PyBullet step rate in Hz (default 240, or the task's)", low=10.0,
              high=10_000.0),
        Param("hold_s", float, 0.2, "hold the current pose after this long without a command", low=0.0),
        Param("task", str, "", "task plugged into the scene (sim.devices.panda_scene.TASKS); empty: none",
              choices=lambda: ["", *TASKS]),
        Param("episode_steps", int, 0, "ticks per task episode (0: the task's own length)", low=0),
    )

    def __init__(self, params: Mapping[str, Any], log: Callable[[str], None] | None = None) -> None:
        super().__init__(params, log)
        cls = task_class(self.params["task"]) if self.params["task"] else None
        if self.params["rate"] is None:
            self.params["rate"] = cls.control_hz if cls is not None else 50.0
        if self.params["physics_hz"] is None:
            self.params["physics_hz"] = cls.physics_hz if cls is not None else 240.0
        self.scene = PandaScene(self.params["physics_hz"], ik_iterations=cls.ik_iterations if cls else 200)
        self.task: Task | None = None
        self.rng = np.random.default_rng(np.random.SeedSequence([self.params["seed"], 7]))
        if cls is not None:
            self.task = cls()
            self.task.setup(self.scene, self.rng)
        self.episode_steps = self.params["episode_steps"] or (cls.episode_steps if cls is not None else 0)
        self.episode = self.episode_step = self.episodes_done = self.episodes_succeeded = 0
        self.commanded = False
        self.t_start_s = 0.0
        self.mode: JointMode | None = None
        self.last_command_s: float | None = None
        self.solved = False
        self.commands = 0
        self.clipped = 0
        self.refused = 0

    def hello(self) -> Hello:
        return Hello(kind=self.KIND, name="franka-panda", n_channels=self.scene.n_dims, rate_hz=self.rate_hz,
                     command_low=self.scene.lower, command_high=self.scene.upper)

    def start(self, t_s: float) -> None:
        self.t_start_s = t_s
        if self.task is not None:  # the first episode starts with the stream
            self.task.reset(self.scene, self.rng)
            self.episode = self.episode_step = self.episodes_done = self.episodes_succeeded = 0
            self.solved = False
            self.commanded = False
        self._physics_base = self.scene.steps

    def _advance(self, t_s: float) -> None:
        target = self._physics_base + int((t_s - self.t_start_s) * self.scene.physics_hz + 1e-9)
        if target > self.scene.steps:
            self.scene.step(target - self.scene.steps)

    def _hold_here(self) -> None:
        q, _ = self.scene.state()
        self.scene.command_positions(np.clip(q, self.scene.lower, self.scene.upper))

    def tick(self, index: int, t_s: float) -> Sequence[Message]:
        self._advance(t_s)
        if (not self.safe_action_applied and self.last_command_s is not None
                and t_s - self.last_command_s > self.params["hold_s"]):
            self._hold_here()
            self.safe_action_applied = True
            self.notify(StatusCode.HOLD, Severity.WARNING,
                        f"no JOINT_COMMAND for {self.params['hold_s']:g} s: holding the current pose", t_s,
                        min_interval_s=0.0)
        if self.task is None:
            q, dq = self.scene.state()
            return [JointState(q, dq, self.scene.ee_pose())]
        success = self.task.success(self.scene)
        if success and not self.solved:
            self.solved = True
            self.notify(StatusCode.TASK_SUCCESS, Severity.INFO, f"task {self.task.NAME!r} solved in episode "
                        f"{self.episode}: {self.task.info(self.scene)}", t_s, min_interval_s=0.0)
        if index > 0 and self.commanded:
            self.episode_step += 1
        if self.episode_steps and self.episode_step >= self.episode_steps:
            # The episode's outcome is its state after its last control step; then a new one starts.
            self.episodes_done += 1
            self.episodes_succeeded += bool(success)
            self.episode += 1
            self.episode_step = 0
            self.solved = False
            self.task.reset(self.scene, self.rng)
            success = self.task.success(self.scene)
        q, dq = self.scene.state()
        counters = [self.episode, self.episode_step, float(success), self.episodes_done, self.episodes_succeeded]
        return [JointState(q, dq, self.scene.ee_pose()), PlantMeasurement(self.task.observation(self.scene), counters)]

    def on_message(self, message: Message, t_s: float) -> None:
        if not isinstance(message, JointCommand):
            super().on_message(message, t_s)
            return
        values = np.asarray(message.values, dtype=float)
        sizes = (3, 4, 7, 8) if message.mode is JointMode.END_EFFECTOR else (7, 8)
        if values.size not in sizes or not np.all(np.isfinite(values)):
            self.refused += 1
            self.notify(StatusCode.BAD_COMMAND, Severity.ERROR,
                        f"refused {message.mode.name} JOINT_COMMAND with {values.size} value(s) "
                        f"{values.tolist()[:8]}: expected {' or '.join(map(str, sizes))} finite values", t_s)
            return
        self._advance(t_s)
        if not self.commanded:  # the first episode's clock starts now
            self.commanded = True
            self.episode_step = 0
        scene, n = self.scene, values.size
        if message.mode is JointMode.POSITION:
            applied = np.clip(values, scene.lower[:n], scene.upper[:n])
            what = "joint limits"
            scene.command_positions(applied)
        elif message.mode is JointMode.VELOCITY:
            applied = np.clip(values, -scene.max_velocity[:n], scene.max_velocity[:n])
            what = "velocity limits"
            scene.command_velocities(applied)
        else:
            pos = np.clip(values[:3], WORKSPACE_LOW, WORKSPACE_HIGH)
            quat = values[3:7] if n >= 7 else values[3:3]
            orn = quat / np.linalg.norm(quat) if quat.size and np.linalg.norm(quat) > 0 else None
            gripper = np.clip(values[-1:], 0.0, scene.upper[7]) if n in (4, 8) else values[:0]
            applied = np.concatenate([pos, quat, gripper])
            what = "the workspace box" + (f" and the gripper's 0..{scene.upper[7]:g} m" if gripper.size else "")
            scene.command_ee(pos, orn)
            if gripper.size:  # the gripper channel: opening in metres, last value of n = 4 or 8
                scene.command_gripper(float(gripper[0]))
        if np.any(applied != values):
            self.clipped += 1
            self.notify(StatusCode.COMMAND_CLIPPED, Severity.WARNING,
                        f"{message.mode.name} command clipped to {what}: {np.round(values, 4).tolist()} -> "
                        f"{np.round(applied, 4).tolist()}", t_s)
        self.mode = message.mode
        self.commands += 1
        self.last_command_s = t_s
        self.safe_action_applied = False

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mode": None if self.mode is None else self.mode.name, "commands": self.commands,
            "clipped": self.clipped, "refused": self.refused, "holding": self.safe_action_applied,
            "velocity_limits": np.round(self.scene.max_velocity, 4).tolist(),
            "ee_pose": np.round(self.scene.ee_pose(), 4).tolist(),
        }
        if self.task is not None:
            out["task"] = {"name": self.task.NAME, "solved": self.solved, "episode": self.episode,
                           "episode_step": self.episode_step, "episodes_done": self.episodes_done,
                           "episodes_succeeded": self.episodes_succeeded, **self.task.info(self.scene)}
        return out

    def close(self) -> None:
        self.scene.close()
