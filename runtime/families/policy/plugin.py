"""The ``policy`` family: a robot policy from a task observation to a clipped end-effector command.

Per step the device sends a PLANT_MEASUREMENT whose ``y`` is the task observation (the
panda emulator with ``task=...`` does; a real cell would send its own tracker's
estimate in the same layout) and whose ``u`` carries the task's episode counters
``[episode, step, success now, episodes done, episodes succeeded]``.  The family
standardises ``y`` with the bundle's ``preprocess.mean``/``std``, runs the policy
(actions in ``[-1, 1]``), and turns the action into a hand target::

    target = clip(y[ee_index] + action_scale_m * action[:3], low, high)

sent as a JOINT_COMMAND in END_EFFECTOR mode (``[x, y, z]``).  A policy with a gripper
(``extra.policy.n_actions`` 4, pick-and-place) sends ``[x, y, z, opening]`` with
``opening = (clip(action[3], -1, 1) + 1) / 2 * gripper_max_m`` (the protocol's gripper
channel; its safe command keeps the last commanded opening).  ``low``/``high`` are
``postprocess.low``/``high`` (the task's workspace box).  The safe command holds the
hand where it was last seen (the bundle's ``extra.policy.safe_position`` before any
observation).  From the counters it reports the deployed success rate with a Wilson
95% interval.  Manifest block ``extra.policy``: ``task``, ``ee_index``,
``action_scale_m``, ``safe_position``, ``n_actions`` (written by
``closedloop.sdk.rl.deploy.export_policy``; see ``docs/rl.md``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, cast

import numpy as np

from closedloop.firmware_bridge import JointCommand, JointMode, PlantMeasurement
from closedloop.runtime.families.base import FamilyPlugin, limit_order_problems, limit_problems
from closedloop.runtime.families.registry import register_family

if TYPE_CHECKING:
    from closedloop.firmware_bridge import Hello, Message
    from closedloop.runtime.bundle import Bundle
    from closedloop.runtime.model import Model

BLOCK = "policy"
_COUNTERS = 5


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95% for ``z = 1.96``); ``(0, 1)`` when ``n == 0``."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


@register_family
class PolicyFamily(FamilyPlugin):
    """Task observation in, END_EFFECTOR hand target out, success counted per episode."""

    name = "policy"
    default_input = "plant_measurement"
    default_command = "none"  # built here: END_EFFECTOR JointCommands are not a generic command kind
    consume = "newest"

    @classmethod
    def problems(cls, bundle: Bundle) -> list[str]:
        pol = bundle.manifest.extra.get(BLOCK)
        if not isinstance(pol, dict):
            return [f"policy: manifest extra.{BLOCK} is missing (ee_index, action_scale_m, safe_position)"]
        out = []
        spec = bundle.graph()
        n_in, n_out = int(spec.data_inputs[0].shape[-1]), int(spec.data_outputs[0].shape[-1])
        idx = pol.get("ee_index", [])
        if len(idx) != 3 or any(not 0 <= int(i) < n_in for i in idx):
            out.append(f"policy: extra.policy.ee_index={idx} must be 3 indices into the {n_in}-value observation")
        if n_out < 3:
            out.append(f"policy: the graph outputs {n_out} actions; at least 3 (hand dx, dy, dz) are needed")
        pre, post = bundle.manifest.preprocess, bundle.manifest.postprocess
        for key, section, n in (("mean", pre, n_in), ("std", pre, n_in), ("low", post, 3), ("high", post, 3)):
            if key not in section or np.asarray(section[key]).shape != (n,):
                out.append(f"policy: {'preprocess' if section is pre else 'postprocess'}.{key} must hold {n} values")
        if "std" in pre and np.any(np.asarray(pre["std"], dtype=float) <= 0):
            out.append("policy: preprocess.std has values <= 0")
        if not out:
            out += [f"policy: {p}" for p in limit_order_problems(post["low"], post["high"])]
        if len(pol.get("safe_position", [])) != 3:
            out.append("policy: extra.policy.safe_position must be [x, y, z]")
        n_act = int(pol.get("n_actions", 3))
        if n_act not in (3, 4) or n_out < n_act:
            out.append(f"policy: extra.policy.n_actions={n_act} must be 3 (hand) or 4 (hand + gripper) and at most "
                       f"the graph's {n_out} outputs")
        if n_act == 4 and not float(pol.get("gripper_max_m", 0)) > 0:
            out.append("policy: a gripper policy (n_actions 4) needs extra.policy.gripper_max_m > 0")
        return out

    def __init__(self, bundle: Bundle, model: Model):
        super().__init__(bundle, model)
        pol, pre, post = bundle.manifest.extra[BLOCK], bundle.manifest.preprocess, bundle.manifest.postprocess
        self._x = model.inputs[model.spec.data_inputs[0].name]
        self._y = model.outputs[model.spec.data_outputs[0].name]
        self._mean = np.asarray(pre["mean"], dtype=np.float32)
        self._inv_std = (1.0 / np.asarray(pre["std"], dtype=np.float32)).astype(np.float32)
        self._ee_index = np.asarray(pol["ee_index"], dtype=np.int64)
        self._scale = np.float32(pol["action_scale_m"])
        self._low = np.asarray(post["low"], dtype=np.float32)
        self._high = np.asarray(post["high"], dtype=np.float32)
        self._safe_home = np.asarray(pol["safe_position"], dtype=np.float32)
        self._obs = np.zeros(self._mean.size, dtype=np.float32)
        self._ee = self._safe_home.copy()
        self._gripper = int(pol.get("n_actions", 3)) == 4
        self._gripper_max = np.float32(pol.get("gripper_max_m", 0.0))
        self._cmd = np.zeros(4 if self._gripper else 3, dtype=np.float32)
        self._hand = self._cmd[:3]
        self._safe = np.zeros_like(self._cmd)
        self._safe[3:] = self._gripper_max  # open until a command says otherwise
        if self._gripper:
            self._low = np.append(self._low, np.float32(0.0))
            self._high = np.append(self._high, self._gripper_max)
        self._counters = np.zeros(_COUNTERS)
        self._seen = False

    def reset(self) -> None:
        super().reset()
        self._ee[:] = self._safe_home
        self._seen = False

    def check_device(self, hello: Hello) -> list[str]:
        """The device's kind must stream the task observation; its rate must be the policy's; limits it states for
        the end-effector command (as many as the policy sends: x, y, z and the gripper) must hold the bundle's.
        Limits of another size (the panda emulator's 7 joints and gripper) are in another space and not compared;
        a device that states 3 (no gripper) does not take a gripper policy."""
        rate = self.bundle.manifest.rate_hz
        problems = self._kind_problems(hello)
        if hello.rate_hz and abs(hello.rate_hz - rate) > 0.01 * rate:
            problems.append(f"device streams at {hello.rate_hz:g} Hz, the policy was trained at {rate:g} Hz "
                            f"(for the emulator: sim://panda?task=...&rate={rate:g})")
        n = hello.command_low.size
        if n == 3 and self._gripper:
            problems.append("device states 3 end-effector limits (x, y, z: no gripper), the policy also sends a "
                            "gripper opening (n_actions 4)")
        elif n == self._low.size:
            problems += limit_problems(self._low, self._high, hello, ("x", "y", "z", "gripper"))
        return problems

    @property
    def frame_vector(self) -> np.ndarray:
        """The task observation as the device sent it: what observers, recordings of steps and the monitor get as
        the step's input (this family reads the observation in ``on_message``, not through the base class)."""
        return self._obs

    def on_message(self, message: Message) -> None:
        m = cast(PlantMeasurement, message)  # the session only passes the input kind
        y, u = m.y, m.u
        if y.size != self._obs.size:
            raise ValueError(f"policy: the device sent a {y.size}-value observation, the bundle's policy takes "
                             f"{self._obs.size} (task {self.bundle.manifest.extra[BLOCK].get('task')!r}); "
                             "is the device running the same task?")
        if u.size >= _COUNTERS:
            self._counters[:] = u[:_COUNTERS]
        self.preprocess(y)

    def preprocess(self, frame: np.ndarray) -> None:
        np.copyto(self._obs, frame.reshape(-1), casting="unsafe")
        ee = self._obs[self._ee_index]
        if np.isfinite(ee).all():  # the safe command holds the last finite position, never a NaN one
            self._ee[:] = ee
            self._seen = True  # the hand's position is known: a safe command can hold it
        x = self._x.reshape(-1)
        np.subtract(self._obs, self._mean, out=x)
        np.multiply(x, self._inv_std, out=x)

    def postprocess(self) -> np.ndarray:
        y = self._y.reshape(-1)
        hand = self._hand
        np.clip(y[:3], -1.0, 1.0, out=hand)
        np.multiply(hand, self._scale, out=hand)
        np.add(hand, self._ee, out=hand)
        if self._gripper:
            self._cmd[3] = (min(max(float(y[3]), -1.0), 1.0) + 1.0) * 0.5 * self._gripper_max
            self._safe[3] = self._cmd[3]
        np.clip(self._cmd, self._low, self._high, out=self._cmd)
        return self._cmd

    def safe_output(self) -> np.ndarray:
        self._safe[:3] = self._ee
        return np.clip(self._safe, self._low, self._high)

    def command_limits(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        return self._low, self._high

    def command_message(self, command: np.ndarray, step: int) -> Message | None:
        return JointCommand(JointMode.END_EFFECTOR, command)

    def safe_message(self, step: int) -> Message | None:
        """Hold the hand where it was last seen. None before this stream's first observation (the session's start,
        or a device's re-handshake, which may follow a reboot that moved the arm): a fixed position would move it."""
        if not self._seen:
            return None
        return JointCommand(JointMode.END_EFFECTOR, np.ascontiguousarray(self.safe_output()))

    def episodes(self) -> tuple[int, int]:
        """``(episodes done, episodes succeeded)`` as the device last reported them."""
        return int(self._counters[3]), int(self._counters[4])

    def live_metrics(self) -> dict[str, float | str]:
        done, won = self.episodes()
        return {"episode": int(self._counters[0]), "success": f"{won}/{done}"}

    def summary_metrics(self) -> dict[str, float | str | list[float]]:
        done, won = self.episodes()
        lo, hi = wilson_interval(won, done)
        rate = won / done if done else float("nan")
        return {"episodes": done, "successes": won, "success_rate": rate,
                "success_rate_wilson95": [round(lo, 4), round(hi, 4)]}
