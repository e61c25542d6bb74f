"""The PyBullet Panda follows joint, velocity and end-effector commands, clips them, and holds on silence."""

from __future__ import annotations

import time

import numpy as np
import pytest

from closedloop.firmware_bridge import JointCommand, JointMode, JointState
from closedloop.sim import StatusCode

pytest.importorskip("pybullet")


def _state(h) -> JointState:
    return h.wait_for(lambda f: isinstance(f.message, JointState), 2.0).message


def _command_for(h, mode, values, seconds) -> JointState:
    """Send the command once per received JOINT_STATE (50 Hz) for ``seconds``; return the last state."""
    end = time.monotonic() + seconds
    state = _state(h)
    while time.monotonic() < end:
        h.send(JointCommand(mode, values))
        state = _state(h)
    return state


def test_position_command_is_followed(host):
    h = host("sim://panda")
    h.handshake(timeout=10.0)
    start = _state(h)
    assert start.q.shape == (8,) and start.dq.shape == (8,) and start.ee_pose.shape == (7,)
    target = start.q.copy()
    target[:4] += [0.3, 0.2, -0.2, 0.3]
    target[7] = 0.02  # close the gripper to 2 cm
    error0 = np.abs(start.q - target).max()
    end = _command_for(h, JointMode.POSITION, target, 1.0)
    assert error0 > 0.25 and np.abs(end.q - target).max() < 0.02
    assert h.report()["mode"] == "POSITION"


def test_end_effector_command_moves_the_hand_to_the_target(host):
    h = host("sim://panda")
    h.handshake(timeout=10.0)
    ee0 = _state(h).ee_pose[:3]
    goal = ee0 + [0.1, 0.1, -0.1]
    end = _command_for(h, JointMode.END_EFFECTOR, goal, 1.5)
    assert np.linalg.norm(ee0 - goal) > 0.15
    assert np.linalg.norm(end.ee_pose[:3] - goal) < 0.02


def test_velocity_clipped_to_urdf_limits_then_hold_when_commands_stop(host):
    h = host("sim://panda?hold_s=0.2")
    h.handshake(timeout=10.0)
    dq = np.zeros(7)
    dq[0] = 10.0  # joint 1 limit is 2.175 rad/s
    moving = _command_for(h, JointMode.VELOCITY, dq, 0.3)
    assert 1.5 < moving.dq[0] <= 2.2
    assert "velocity limits" in h.wait_status(StatusCode.COMMAND_CLIPPED).text
    h.wait_status(StatusCode.HOLD, timeout=2.0)
    h.collect(0.3)
    held = _state(h)
    assert abs(held.dq[0]) < 0.05
    assert h.report()["holding"] is True


def test_bad_joint_command_is_refused(host):
    h = host("sim://panda")
    h.handshake(timeout=10.0)
    h.send(JointCommand(JointMode.POSITION, np.zeros(5)))
    assert "expected 7 or 8" in h.wait_status(StatusCode.BAD_COMMAND).text


def test_reach_task_reports_success(host):
    h = host("sim://panda?task=reach&seed=3")
    h.handshake(timeout=10.0)
    task = h.report()["task"]
    assert task["name"] == "reach" and task["solved"] is False
    _command_for(h, JointMode.END_EFFECTOR, np.array(task["target"]), 1.5)
    assert "reach" in h.wait_status(StatusCode.TASK_SUCCESS).text
    assert h.report()["task"]["solved"] is True
