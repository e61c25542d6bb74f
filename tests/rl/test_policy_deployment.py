"""An exported policy runs in the torch-free runtime with the same outputs, clips its commands, and plays
episodes against ``sim://panda?task=push`` over the wire, reporting success per episode."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from closedloop.runtime import Model, get_family, load_bundle
from closedloop.runtime.families.policy import wilson_interval
from closedloop.sdk.rl.deploy import export_policy, run_deployed
from closedloop.sim.manipulation import PandaTaskEnv, PushTask

TOL = 1e-5  # float32 graph vs float32 torch: well inside the exporter's 1e-4 parity bound


@pytest.fixture(scope="module")
def push_bundle(tmp_path_factory):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(21, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3), torch.nn.Tanh())
    env = PandaTaskEnv("push")
    obs = np.stack([env.reset(seed=s)[0] for s in range(20)])
    env.close()
    mean, std = obs.mean(0), np.maximum(obs.std(0), 0.01)
    path = export_policy(net, mean, std, "push", tmp_path_factory.mktemp("rl") / "push-policy")
    return path, net, mean, std


@pytest.mark.parametrize("backend", ["numba", "onnxruntime"])
def test_runtime_matches_torch_and_the_environment_target(push_bundle, backend):
    path, net, mean, std = push_bundle
    bundle = load_bundle(path)
    model = Model(bundle, backend=backend)
    fam = get_family("policy")(bundle, model)
    env = PandaTaskEnv("push")
    try:
        obs, _ = env.reset(seed=3)
        for _ in range(10):
            fam.preprocess(obs)
            model.run()
            cmd = fam.postprocess().copy()
            with torch.no_grad():
                a = net(torch.as_tensor((obs - mean) / std, dtype=torch.float32)[None]).numpy()[0]
            np.testing.assert_allclose(model.outputs[model.spec.data_outputs[0].name].reshape(-1), a, atol=TOL)
            np.testing.assert_allclose(cmd, env.task.ee_target(env.scene, a), atol=TOL)
            obs = env.step(a)[0]
    finally:
        env.close()
        model.close()


def test_commands_are_clipped_to_the_bundles_workspace(push_bundle):
    path = push_bundle[0]
    bundle = load_bundle(path)
    model = Model(bundle, backend="onnxruntime")
    fam = get_family("policy")(bundle, model)
    obs = np.zeros(21, np.float32)
    obs[:3] = [0.9, -0.9, -0.5]  # a hand far outside the box
    fam.preprocess(obs)
    model.run()
    cmd = fam.postprocess()
    assert np.all(cmd >= PushTask.workspace_low - 1e-6) and np.all(cmd <= PushTask.workspace_high + 1e-6)
    assert np.all(fam.safe_output() <= PushTask.workspace_high + 1e-6)
    model.close()


def test_pick_and_place_policy_sends_the_gripper_channel_and_the_emulator_follows_it(tmp_path):
    """The 4th action becomes the opening (m) of an n = 4 END_EFFECTOR command, as the environment maps it."""
    from closedloop.firmware_bridge import JointCommand, JointMode
    from closedloop.sim.manipulation.tasks import GRIPPER_MAX_M

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(22, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4), torch.nn.Tanh())
    path = export_policy(net, np.zeros(22), np.ones(22), "pick_and_place", tmp_path / "pp")
    bundle = load_bundle(path)
    model = Model(bundle, backend="onnxruntime")
    fam = get_family("policy")(bundle, model)
    env = PandaTaskEnv("pick_and_place")
    try:
        obs, _ = env.reset(seed=2)
        fam.preprocess(obs)
        model.run()
        cmd = fam.postprocess().copy()
        with torch.no_grad():
            a = net(torch.as_tensor(obs, dtype=torch.float32)[None]).numpy()[0]
        assert cmd.shape == (4,)
        np.testing.assert_allclose(cmd[:3], env.task.ee_target(env.scene, a), atol=TOL)
        np.testing.assert_allclose(cmd[3], (a[3] + 1) / 2 * GRIPPER_MAX_M, atol=TOL)
        msg = fam.command_message(cmd, 0)
        assert msg.mode is JointMode.END_EFFECTOR and msg.values.size == 4
        again = JointCommand.decode_payload(msg.encode_payload())  # the wire carries it
        np.testing.assert_allclose(again.values, cmd)
        assert fam.safe_output()[3] == pytest.approx(cmd[3])  # holding keeps the last opening: no dropped cube
        # an arm that states 3 end-effector limits takes no gripper; one whose gripper opens less is refused
        from closedloop.firmware_bridge import Hello

        low, high = fam.command_limits()
        rate = bundle.manifest.rate_hz
        (no_grip,) = fam.check_device(Hello(kind="arm", rate_hz=rate, command_low=low[:3], command_high=high[:3]))
        assert "no gripper" in no_grip
        small = high.copy()
        small[3] = GRIPPER_MAX_M / 2
        assert fam.check_device(Hello(kind="arm", rate_hz=rate, command_low=low, command_high=small)) == [
            f"command 3 (gripper): bundle high limit {high[3]:g} is above the device's {small[3]:g}"]
    finally:
        env.close()
        model.close()


def test_panda_emulator_applies_the_gripper_channel():
    from closedloop.firmware_bridge import JointCommand, JointMode
    from closedloop.sim.devices.base import device_params

    cls, params = device_params("panda", {"task": "pick_and_place"})
    dev = cls(params)
    dev.start(0.0)
    try:
        dev.on_message(JointCommand(JointMode.END_EFFECTOR, np.array([0.45, 0.0, 0.2, 0.02], np.float32)), 0.0)
        assert dev.refused == 0
        for k in range(1, 30):
            dev._advance(k * 0.04)
        assert dev.scene.state()[0][7] == pytest.approx(0.02, abs=0.004)
        dev.on_message(JointCommand(JointMode.END_EFFECTOR, np.array([0.45, 0.0, 0.2, 0.5], np.float32)), 1.3)
        assert dev.clipped == 1  # opening beyond 8 cm is clipped and reported
    finally:
        dev.close()


def test_end_effector_commands_of_other_sizes_are_refused():
    from closedloop.firmware_bridge import JointCommand, JointMode
    from closedloop.firmware_bridge.messages.base import MessageError

    for n in (2, 5, 6, 9):
        with pytest.raises(MessageError, match="gripper opening"):
            JointCommand(JointMode.END_EFFECTOR, np.zeros(n, np.float32))


def test_session_against_the_push_emulator_counts_episodes(push_bundle):
    summary = run_deployed(push_bundle[0], episodes=2, seed=1)
    fam = summary["family"]
    assert fam["episodes"] == 2 and 0 <= fam["successes"] <= 2
    assert summary["device"]["kind"] == "panda" and summary["watchdog_trips"] == 0
    # every observation the loop acted on was answered by exactly one command; on a loaded machine the physics
    # emulator falls behind and its frames land in bursts, of which the loop acts on the newest (CI once saw 63
    # commands in 105 steps, an idle machine 105), so the count has only a loose floor
    assert summary["commands_sent"] == summary["inputs_used"] >= summary["loop"]["steps"] // 2
    assert summary["loop"]["latency_p99_us"] < 20_000


def test_observers_and_the_monitor_get_the_observation_the_policy_acted_on(push_bundle, acted_inputs):
    """The per-step hooks' ``inputs`` of a policy session are the task observations it read (they were zeros)."""
    from closedloop.runtime import Session, SessionConfig

    obs = acted_inputs
    cfg = SessionConfig(device="sim://panda?task=push&seed=3", max_steps=40, watchdog_s=0.5, observers=[obs])
    with Session(load_bundle(push_bundle[0]), cfg) as s:
        s.start()
        s.run()
    rows = np.asarray(obs.rows)
    assert obs.n_in == 21 and len(rows) >= 10
    # hand position within the workspace, the goal on the floor (z = the cube's half size), and the hand moving
    assert np.all((rows[:, 0] > 0.1) & (rows[:, 0] < 0.9)) and np.allclose(rows[:, 14], 0.02, atol=1e-3)
    assert np.ptp(rows[:, 0:3], axis=0).max() > 1e-3


def test_wilson_interval():
    lo, hi = wilson_interval(8, 10)
    assert 0.49 < lo < 0.5 and 0.94 < hi < 0.95
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_the_safe_command_observers_see_is_the_one_sent_holding_the_hand_where_it_is(push_bundle, lockstep):
    """A policy's safe command holds the hand at its last finite position: the step hooks (the monitor, LSL's
    commands outlet) get that command as sent, not the one computed when the session opened."""
    from closedloop.runtime import Session, SessionConfig
    from closedloop.runtime.observe import FLAG_SAFE, SessionObserver

    class SafeSteps(SessionObserver):
        def __init__(self):
            self.commands = []

        def on_steps(self, batch):
            self.commands.extend(batch.command[(batch.flags & FLAG_SAFE) != 0].copy())

    b = load_bundle(push_bundle[0])
    ee = np.asarray(b.manifest.extra["policy"]["ee_index"])
    env = PandaTaskEnv("push")
    first = env.reset(seed=0)[0].astype(np.float32)
    env.close()
    moved = first.copy()
    moved[ee] += np.float32([0.05, -0.04, 0.03])  # the hand elsewhere, and a non-finite goal: refused
    moved[14] = np.nan
    url, dev = lockstep(first.size, [first, moved], kind="panda", rate_hz=b.manifest.rate_hz)
    obs = SafeSteps()
    cfg = SessionConfig(device=url, duration_s=10.0, status=False, watchdog_s=30.0, overrun="skip", observers=[obs])
    with Session(b, cfg) as s:
        s.start()
        threading.Thread(target=lambda: (dev.thread.join(10.0), s.stop()), daemon=True).start()
        summary = s.run()
    low, high = get_family("policy")(b, Model(b, backend="onnxruntime")).command_limits()
    held = np.clip(moved[ee], low, high)
    assert summary.nonfinite_inputs == 1 and summary.safe_commands_sent == 1
    np.testing.assert_allclose(dev.replies[1], held, atol=1e-6)  # what the arm got
    assert len(obs.commands) == 1
    np.testing.assert_allclose(obs.commands[0], held, atol=1e-6)  # what the observers got


def test_no_safe_command_before_the_hand_is_seen_and_none_after_a_re_handshake(push_bundle):
    """The safe command holds the hand where it was last seen; before this stream's first observation (the start,
    or a device's re-handshake after a reboot) there is none to hold, and the bundle's fixed safe_position would
    make the arm jump: no safe command then."""
    from closedloop.firmware_bridge import PlantMeasurement

    b = load_bundle(push_bundle[0])
    fam = get_family("policy")(b, Model(b, backend="onnxruntime"))
    assert fam.safe_message(0) is None
    env = PandaTaskEnv("push")
    obs = env.reset(seed=0)[0].astype(np.float32)
    env.close()
    ee = np.asarray(b.manifest.extra["policy"]["ee_index"])
    fam.on_message(PlantMeasurement(obs, np.zeros(5, np.float32)))
    low, high = fam.command_limits()
    np.testing.assert_allclose(fam.safe_message(1).values, np.clip(obs[ee], low, high), atol=1e-6)
    fam.reset()  # what a re-handshake does
    assert fam.safe_message(2) is None
    blind = obs.copy()
    blind[ee[0]] = np.nan  # an observation without a finite hand position does not make it known either
    fam.on_message(PlantMeasurement(blind, np.zeros(5, np.float32)))
    assert fam.safe_message(3) is None


def test_the_policy_checks_the_devices_kind_and_the_end_effector_limits_it_states(push_bundle):
    from closedloop.firmware_bridge import Hello

    b = load_bundle(push_bundle[0])
    fam = get_family("policy")(b, Model(b, backend="onnxruntime"))
    rate = b.manifest.rate_hz
    low, high = fam.command_limits()
    assert fam.check_device(Hello(kind="panda", n_channels=8, rate_hz=rate)) == []
    # the panda emulator's 8 joint-space limits are not end-effector limits: not compared
    assert fam.check_device(Hello(kind="panda", n_channels=8, rate_hz=rate, command_low=np.full(8, -0.1),
                                  command_high=np.full(8, 0.1))) == []
    (kind,) = fam.check_device(Hello(kind="headstage", n_channels=21, rate_hz=rate))
    assert "streams neural_frame" in kind
    narrow = fam.check_device(Hello(kind="arm", rate_hz=rate, command_low=low, command_high=high - 0.1))
    assert narrow == [f"command {i} ({n}): bundle high limit {high[i]:g} is above the device's {high[i] - 0.1:g}"
                      for i, n in enumerate("xyz")]
    assert fam.check_device(Hello(kind="arm", rate_hz=rate, command_low=low - 1, command_high=high + 1)) == []


def test_a_device_running_another_task_is_said_and_gets_no_command(push_bundle):
    """A push policy against a reach emulator: every observation has another size, the warning says it (both sizes,
    the task) and that no command went out, since the policy has no hand position to hold yet; none is sent."""
    import io

    from closedloop.runtime import Session, SessionConfig

    out = io.StringIO()
    with Session(push_bundle[0], SessionConfig(device="sim://panda?task=reach&seed=1", duration_s=1.0, status=False,
                                               backend="onnxruntime"), out=out) as s:
        s.start()
        summary = s.run()
    said = out.getvalue()
    assert summary.inputs_refused > 5 and summary.inputs_used == 0 and summary.commands_sent == 0
    assert summary.safe_commands_sent == 0 and "is the device running the same task?" in said
    assert "no command went out" in said and "the safe command went out instead" not in said
