"""Models with several named inputs: export, the manifest's roles, Model.step by position or name, and
sessions that hold the inputs a device does not stream (a goal) from their config or a second message."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from torch import nn

from closedloop.export import ExportError, export_bundle
from closedloop.runtime import BundleError, Model, SessionConfig, SessionError, load_bundle, run_session
from closedloop.runtime.integrity import seal_manifest
from closedloop.runtime.manifest import MANIFEST_NAME


class GoalPolicy(nn.Module):
    """A goal-conditioned policy: forward(obs, goal) -> action."""

    def __init__(self, n_obs=1, n_goal=1, n_act=1):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_obs + n_goal, 16), nn.Tanh(), nn.Linear(16, n_act))

    def forward(self, obs, goal):
        return self.net(torch.cat([obs, goal], dim=-1))


class GoalGRU(nn.Module):
    """A recurrent model with two inputs: step(x, goal, h) -> (y, h)."""

    def __init__(self):
        super().__init__()
        self.cell = nn.GRUCell(4 + 2, 8)
        self.out = nn.Linear(8, 3)

    def init_state(self, batch):
        return (torch.zeros(batch, 8),)

    def step(self, x, goal, h):
        h = self.cell(torch.cat([x, goal], dim=-1), h)
        return self.out(h), h


@pytest.fixture(scope="module")
def goal_bundle(tmp_path_factory):
    torch.manual_seed(0)
    return export_bundle(GoalPolicy().eval(), tmp_path_factory.mktemp("n") / "goal", kind="feedforward",
                         example_input={"obs": torch.zeros(1, 1), "goal": torch.zeros(1, 1)},
                         input_roles={"goal": "goal"}, rate_hz=200.0, postprocess={"low": [-2.0], "high": [2.0]},
                         extra={"session": {"input": "plant_measurement", "command": "actuator_command"}},
                         variants=(), tensorrt=False, report=lambda s: None)


def test_the_manifest_lists_every_input_with_its_role(goal_bundle):
    spec = load_bundle(goal_bundle).graph()
    assert [(t.name, t.shape, spec.role_of(t)) for t in spec.inputs] == [
        ("obs", ["batch", 1], "measurement"), ("goal", ["batch", 1], "goal")]
    raw = json.loads((goal_bundle / MANIFEST_NAME).read_text())
    assert raw["schema_version"] == 2 and raw["graphs"]["main"]["inputs"][1]["role"] == "goal"


def test_step_takes_inputs_by_position_or_by_name_and_holds_the_rest(goal_bundle):
    torch_model = GoalPolicy()
    torch.manual_seed(0)
    torch_model = GoalPolicy().eval()
    obs, goal = np.array([[0.3]], np.float32), np.array([[-1.2]], np.float32)
    want = torch_model(torch.from_numpy(obs), torch.from_numpy(goal)).detach().numpy()
    m = Model(goal_bundle, backend="onnxruntime")
    assert m.input_names == ["obs", "goal"]
    np.testing.assert_allclose(m.step(obs, goal), want, atol=1e-6)
    np.testing.assert_allclose(m.step(goal=goal, obs=obs), want, atol=1e-6)
    m.set_input("goal", goal)
    np.testing.assert_allclose(m.step(obs), want, atol=1e-6)  # the goal is held


@pytest.mark.parametrize(("call", "message"), [
    (lambda m: m.step(np.zeros((1, 1), np.float32)), r"input\(s\) \['goal'\] have no value yet"),
    (lambda m: m.step(obs=np.zeros((1, 2), np.float32), goal=np.zeros((1, 1), np.float32)),
     r"input 'obs' takes shape \(1, 1\) \(1 value; manifest \['batch', 1\]\), got shape \(1, 2\)"),
    (lambda m: m.step(gaol=np.zeros((1, 1), np.float32)), r"no data input 'gaol'; its inputs: \['obs', 'goal'\]"),
    (lambda m: m.step(obs=np.zeros((4, 1), np.float32), goal=np.zeros((4, 1), np.float32)),  # another batch size
     r"got shape \(4, 1\).*runs 1 at a time: for batches of 4, load it with Model\(bundle, "
     r"options=BackendOptions\(batch=4\)\)"),
    (lambda m: m.step(*[np.zeros((1, 1), np.float32)] * 3), r"takes 2 input\(s\) \['obs', 'goal'\], got 3"),
])
def test_bad_inputs_are_named(goal_bundle, call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call(Model(goal_bundle, backend="onnxruntime"))


def test_a_recurrent_model_with_two_inputs_exports_and_streams(tmp_path):
    torch.manual_seed(1)
    module = GoalGRU().eval()
    path = export_bundle(module, tmp_path / "gg", kind="recurrent", input_name=["x", "goal"],
                         example_input=(torch.zeros(1, 4), torch.zeros(1, 2)), input_roles={"goal": "goal"},
                         rate_hz=50.0, variants=(), tensorrt=False, report=lambda s: None)
    m = Model(path, backend="onnxruntime")
    with pytest.raises(ValueError, match=r"input 'goal' takes shape \(1, 2\) \(2 values; .*got shape \(\)"):
        m.set_input("goal", 0.5)  # one value for a goal of two: a typo, never broadcast
    xs = np.random.default_rng(0).normal(size=(20, 1, 4)).astype(np.float32)
    goal = np.array([[0.5, -0.5]], np.float32)
    m.set_input("goal", goal)
    h = module.init_state(1)[0]
    for x in xs:
        y = m.step(x)
        want, h = module.step(torch.from_numpy(x), torch.from_numpy(goal), h)
        np.testing.assert_allclose(y, want.detach().numpy(), atol=1e-5)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"windows": {"obz": {"length": 4}}}, "windows names 'obz', which is not a graph input"),
    ({"input_roles": {"goal": "measurement"}}, "exactly one data input must have role 'measurement'"),
    ({"input_roles": {"goal": "target"}}, "has role 'target'; known roles"),
    ({"input_name": ["a", "b", "c"]}, "example_input is a dict"),
])
def test_export_refuses_roles_and_windows_that_do_not_fit(tmp_path, kwargs, message):
    with pytest.raises(ExportError, match=message):
        export_bundle(GoalPolicy().eval(), tmp_path / "x", kind="feedforward",
                      example_input={"obs": torch.zeros(1, 1), "goal": torch.zeros(1, 1)}, rate_hz=50.0,
                      variants=(), tensorrt=False, report=lambda s: None, **kwargs)


def test_a_session_holds_the_goal_from_its_config(goal_bundle, tmp_path):
    summary = run_session(goal_bundle, SessionConfig(device="sim://plant?model=msd&rate=200", duration_s=1.0, status=False,
                                                     backend="onnxruntime", inputs={"goal": [0.7]}))
    assert summary.commands_sent > 50 and summary.safe_commands_sent <= 1


def test_a_session_without_the_goal_says_how_to_give_it(goal_bundle):
    with pytest.raises(SessionError, match=r"input 'goal' \(role goal, shape \['batch', 1\]\) is not streamed.*"
                                           r"SessionConfig\(inputs=.*--input NAME=") as err:
        run_session(goal_bundle, SessionConfig(device="sim://plant?model=msd&rate=200", duration_s=0.5, status=False))
    # the goal has the action's shape, but its role says what it is: no hint that it may be a recurrent state
    assert "recurrent state" not in str(err.value) and "import-onnx" not in str(err.value)


def test_a_session_refuses_a_value_for_an_input_the_bundle_does_not_hold(goal_bundle):
    with pytest.raises(SessionError, match=r"\['obs'\] are not inputs this bundle holds.*comes from the device"):
        run_session(goal_bundle, SessionConfig(device="sim://plant?model=msd&rate=200", duration_s=0.5, status=False,
                                               inputs={"goal": [0.0], "obs": [1.0]}))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e40])
def test_a_held_value_that_is_not_a_finite_float32_is_refused_before_the_session(goal_bundle, value, capsys):
    """Held for the whole session, a NaN goal made every step refused (the safe command only) with no word why."""
    with pytest.raises(SessionError, match=r"session input 'goal' = .*must be a finite number a float32 holds"):
        run_session(goal_bundle, SessionConfig(device="sim://plant?model=msd&rate=200", duration_s=0.5, status=False,
                                               inputs={"goal": [value]}))
    from closedloop.sdk.cli import main

    assert main(["run", str(goal_bundle), "--device", "sim://plant?model=msd&rate=200", "--duration", "0.3",
                 "--input", f"goal={value}"]) == 2
    assert "must be a finite number" in capsys.readouterr().err
    assert main(["run", str(goal_bundle), "--input", "goal=abc"]) == 2  # a malformed one: bad input too
    assert "closedloop run: error: --input 'goal=abc': expected NAME=V1,V2" in capsys.readouterr().err


def test_a_version_1_manifest_still_loads_with_default_roles(tmp_path, mlp_bundle):
    copy = shutil.copytree(mlp_bundle, tmp_path / "v1")
    raw = json.loads((copy / MANIFEST_NAME).read_text())
    raw["schema_version"] = 1
    raw.pop("integrity")  # a version-1 manifest predates the digest: nothing to check, it loads
    for t in raw["graphs"]["main"]["inputs"] + raw["graphs"]["main"]["outputs"]:
        t.pop("role", None)
        t.pop("window", None)
    (copy / MANIFEST_NAME).write_text(json.dumps(raw))
    bundle = load_bundle(copy)
    spec = bundle.graph()
    assert bundle.manifest.schema_version == 1
    assert spec.role_of(spec.inputs[0]) == "measurement" and spec.role_of(spec.outputs[0]) == "command"
    y = Model(bundle, backend="onnxruntime").step(np.zeros((1, 6), np.float32))
    assert y.shape == (1, 3)


def test_a_role_that_contradicts_the_state_flag_is_refused(tmp_path, gru_bundle):
    copy = shutil.copytree(gru_bundle, tmp_path / "bad")
    raw = json.loads((copy / MANIFEST_NAME).read_text())
    raw["graphs"]["main"]["inputs"][0]["role"] = "state"
    (copy / MANIFEST_NAME).write_text(json.dumps(seal_manifest(raw)))
    with pytest.raises(BundleError, match="has role 'state' but state=False"):
        load_bundle(copy)


def test_a_recorded_session_with_a_held_goal_replays_with_it(goal_bundle, tmp_path):
    from closedloop.runtime import replay_recording

    record = tmp_path / "g.clrec"
    run_session(goal_bundle, SessionConfig(device="sim://plant?model=msd&rate=200", duration_s=0.5, status=False,
                                           backend="onnxruntime", inputs={"goal": [0.7]}, record=str(record)))
    report = replay_recording(record, goal_bundle, backend="onnxruntime")
    assert report.outputs_compared > 20 and report.max_abs_diff == 0.0


def test_a_second_message_type_sets_the_held_goal(tmp_path):
    """extra.session.inputs maps the goal to another message the board sends: the session writes it into the
    goal input whenever one arrives, and the commands follow the goal the board set."""
    import threading
    import time

    from closedloop.firmware_bridge import (
        ActuatorCommand,
        Hello,
        Link,
        NeuralFrame,
        PlantMeasurement,
        open_pty_pair,
    )
    from closedloop.runtime import replay_recording

    torch.manual_seed(2)
    module = GoalPolicy().eval()
    bundle = export_bundle(module, tmp_path / "side", kind="feedforward",
                           example_input={"obs": torch.zeros(1, 1), "goal": torch.zeros(1, 1)},
                           input_roles={"goal": "goal"}, rate_hz=200.0, postprocess={"low": [-9.0], "high": [9.0]},
                           extra={"session": {"input": "plant_measurement", "command": "actuator_command",
                                              "inputs": {"goal": "neural_frame"}}},
                           variants=(), tensorrt=False, report=lambda s: None)
    board_end, port_end = open_pty_pair()
    stop = threading.Event()

    def board():
        link = Link(board_end, role="device")
        hello = Hello(kind="acme-arm", n_channels=1, rate_hz=200.0)
        k, first_goal = 0, None
        while not stop.is_set():
            for f in link.poll():
                if isinstance(f.message, Hello):
                    link.send(hello)
                elif isinstance(f.message, ActuatorCommand) and first_goal is None:
                    first_goal = k  # the session has acted before any goal: the goal comes only now
            if first_goal is not None and (k - first_goal) % 20 == 0:  # the goal, as a one-channel count: 3
                link.send(NeuralFrame(bin_index=k, counts=np.array([3], dtype=np.uint16)))
            link.send(PlantMeasurement(y=np.array([0.25], np.float32), u=np.zeros(1, np.float32)))
            k += 1
            time.sleep(0.005)

    t = threading.Thread(target=board, daemon=True)
    t.start()
    try:
        s = run_session(bundle, SessionConfig(device=port_end.path, duration_s=1.0, status=False,
                                              backend="onnxruntime", record=str(tmp_path / "side.clrec")))
    finally:
        stop.set()
        t.join(2)
        board_end.close()
        port_end.close()
    # until the first goal message (sent once the board has seen a command) the session sends the safe command:
    # nothing to act on yet; from then on it follows the goal
    assert s.commands_sent > 50 and 1 <= s.safe_commands_sent < s.commands_sent // 2
    from closedloop.firmware_bridge import FrameParser
    from closedloop.runtime import RecordingReader, RecordType

    parser = FrameParser()
    sent = [f.message.u[0] for rec in RecordingReader(tmp_path / "side.clrec").of_type(RecordType.TX)
            for f in parser.feed(rec.payload) if isinstance(f.message, ActuatorCommand)]
    with torch.no_grad():
        want = float(module(torch.tensor([[0.25]]), torch.tensor([[3.0]]))[0, 0])
    assert abs(sent[-2] - want) < 1e-5  # the last is the closing safe command
    assert replay_recording(tmp_path / "side.clrec", bundle, backend="onnxruntime").max_abs_diff < 1e-6


def test_one_positional_input_is_refused_where_the_first_input_is_not_the_measurement(tmp_path):
    """forward(goal, obs): step(obs) would write the observation into the goal and leave obs as it was (a held-goal
    loop silently wrong); it is refused, naming the measurement to pass by name."""

    class GoalFirst(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)

        def forward(self, goal, obs):
            return self.lin(torch.cat([goal, obs], dim=-1))

    module = GoalFirst().eval()
    bundle = export_bundle(module, tmp_path / "gf", kind="feedforward",
                           example_input={"goal": torch.zeros(1, 1), "obs": torch.zeros(1, 1)},
                           input_roles={"goal": "goal", "obs": "measurement"}, rate_hz=50.0, variants=(), tensorrt=False,
                           report=lambda s: None)
    m = Model(bundle, backend="onnxruntime")
    goal, obs = np.array([[0.5]], np.float32), np.array([[-1.0]], np.float32)
    m.set_input("goal", goal)
    with pytest.raises(TypeError, match=r"would set 'goal' \(role 'goal'\).* measurement 'obs'.* step\(obs=x\)"):
        m.step(obs)
    want = module(torch.from_numpy(goal), torch.from_numpy(obs)).detach().numpy()
    np.testing.assert_allclose(m.step(obs=obs), want, atol=1e-6)  # by name: the goal held
