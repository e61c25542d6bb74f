"""import_onnx / `closedloop import-onnx`: an ONNX file made elsewhere becomes a bundle that runs like the model.

The files here come from torch.onnx.export as a user runs it (their own names, a dynamic batch or none, a GRU cell
with its state as an input and an output); the bundle's outputs are compared with the torch module that made the
file, on both backends, and what cannot be a bundle is refused with what to do.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from closedloop import Model, SessionConfig, import_onnx, load_bundle, run_session
from closedloop.export import ExportError, ParityError
from closedloop.sdk.cli import main

ROOT = Path(__file__).resolve().parents[2]
QUIET = {"report": lambda s: None, "tensorrt": False}


def _export(module: nn.Module, args: tuple, path: Path, names_in: list[str], names_out: list[str],
            dynamic: dict | None = None) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), args, str(path), input_names=names_in, output_names=names_out,
                          dynamic_axes=dynamic, dynamo=False)
    return path


class Policy(nn.Module):
    def __init__(self, n_in: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_in, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, obs):
        return self.net(obs)


class CellDecoder(nn.Module):
    """A step function written by hand (a GRU cell and a head), its state an input and an output of the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.cell, self.head = nn.GRUCell(12, 16), nn.Linear(16, 5)

    def forward(self, x, h):
        h = self.cell(x, h)
        return self.head(h), h


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("onnx")
    policy, decoder = Policy(), CellDecoder()
    out = {
        "policy": policy, "decoder": decoder,
        "dynamic": _export(policy, (torch.zeros(1, 4),), d / "policy.onnx", ["obs"], ["u"],
                           {"obs": {0: "N"}, "u": {0: "N"}}),
        "fixed": _export(policy, (torch.zeros(1, 4),), d / "policy_b1.onnx", ["obs"], ["u"]),
        "controller": _export(Policy(n_in=1), (torch.zeros(1, 1),), d / "controller.onnx", ["y"], ["u"],
                              {"y": {0: "N"}, "u": {0: "N"}}),  # a plant's one measurement in, one command out
        "recurrent": _export(decoder, (torch.zeros(1, 12), torch.zeros(1, 16)), d / "decoder.onnx", ["spikes", "h"],
                             ["logits", "h_next"], {n: {0: "b"} for n in ("spikes", "h", "logits", "h_next")}),
    }
    return out


@pytest.mark.parametrize("which", ["dynamic", "fixed"])
def test_a_feedforward_file_becomes_a_bundle_that_computes_what_the_model_does(files, tmp_path, which):
    src = files[which]
    bundle = import_onnx(src, tmp_path / "b", rate_hz=100.0, **QUIET)
    b = load_bundle(bundle)
    assert (bundle / "main.onnx").read_bytes() == src.read_bytes()  # the file as given
    spec = b.graph()
    assert [t.name for t in spec.inputs] == ["obs"] and [t.name for t in spec.outputs] == ["u"]
    assert spec.inputs[0].shape == (["batch", 4] if which == "dynamic" else [1, 4])
    assert spec.parity["reference"] == "onnxruntime (the imported file)" and spec.parity["within_tolerance"]
    assert spec.parity["candidates"]["numba"] == "checked"
    assert any(k.startswith("numba/") for k in spec.parity["checks"])
    assert any(k.startswith("onnxruntime_row_by_row/") for k in spec.parity["checks"]) == (which == "dynamic")
    export = b.manifest.provenance["export"]["settings"]
    assert export["source"] == "import_onnx" and export["batch"] == ("free" if which == "dynamic" else "fixed at 1")
    assert export["sha256"] == __import__("hashlib").sha256(src.read_bytes()).hexdigest()
    assert b.manifest.provenance["export"]["exporter"] == "none: the ONNX file as given"
    assert set(spec.variants) == {"fp16", "int8"}
    obs = np.random.default_rng(1).standard_normal((20, 4)).astype(np.float32)
    with torch.no_grad():
        want = files["policy"](torch.from_numpy(obs)).numpy()
    for backend in ("onnxruntime", "numba"):
        m = Model(bundle, backend=backend)
        got = np.stack([m.step(o[None]).copy()[0] for o in obs])
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=backend)


def test_a_recurrent_file_carries_its_named_state_step_to_step(files, tmp_path):
    bundle = import_onnx(files["recurrent"], tmp_path / "b", rate_hz=50.0, state={"h": "h_next"}, **QUIET)
    spec = load_bundle(bundle).graph()
    assert spec.kind == "recurrent" and [t.name for t in spec.state_inputs] == ["h"]
    assert "numba/sequence_step_by_step" in spec.parity["checks"]
    xs = np.random.default_rng(2).poisson(2.0, (40, 12)).astype(np.float32)
    h = torch.zeros(1, 16)
    want = []
    with torch.no_grad():
        for x in xs:
            y, h = files["decoder"](torch.from_numpy(x[None]), h)
            want.append(y.numpy()[0])
    for backend in ("onnxruntime", "numba"):
        m = Model(bundle, backend=backend)
        got = [m.step(x[None]).copy()[0] for x in xs]
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=backend)
        m.reset()  # the state starts from zeros again, as a session's reset
        np.testing.assert_allclose(m.step(xs[:1]), [want[0]], atol=1e-5)


def test_a_state_left_undeclared_is_pointed_out_at_import_and_when_a_session_asks_for_it(files, tmp_path):
    """A step file imported without --state becomes a feed-forward graph with two inputs; the import notes that
    'h' has the shape of output 'h_next', and a session that then asks for 'h' as a held input says how to declare
    it instead."""
    from closedloop.runtime import Session, SessionError

    said: list[str] = []
    bundle = import_onnx(files["recurrent"], tmp_path / "b", rate_hz=50.0, tensorrt=False, report=said.append)
    assert any("input 'h' has the shape of output 'h_next'" in s and "--state h=h_next" in s for s in said), said
    with pytest.raises(SessionError, match=r"closedloop import-onnx FILE OUT --state h=h_next"):
        Session(bundle, SessionConfig(device="sim://headstage?channels=12", status=False))
    said.clear()  # a declared state, or a graph with one input, gets no such note
    import_onnx(files["recurrent"], tmp_path / "c", rate_hz=50.0, state={"h": "h_next"}, tensorrt=False,
                report=said.append)
    import_onnx(files["dynamic"], tmp_path / "d", rate_hz=50.0, tensorrt=False, report=said.append)
    assert not [s for s in said if s.startswith("note: input")], said


class LayeredGRU(nn.Module):
    """A 2-layer nn.GRU step as a user exports it at batch 1: its state (layers, batch, hidden) has the layers first."""

    def __init__(self) -> None:
        super().__init__()
        self.gru, self.head = nn.GRU(6, 8, num_layers=2, batch_first=True), nn.Linear(8, 3)

    def forward(self, x, h):
        y, h = self.gru(x[:, None], h)
        return self.head(y[:, 0]), h


def test_a_fixed_batch_file_whose_state_has_layers_first_imports(tmp_path):
    """Batch fixed at 1 and a state of shape (2, 1, 8): the parity checks must not read the layers as rows."""
    torch.manual_seed(0)
    module = LayeredGRU().eval()
    src = _export(module, (torch.zeros(1, 6), torch.zeros(2, 1, 8)), tmp_path / "gru.onnx", ["x", "h"], ["y", "h_next"])
    bundle = import_onnx(src, tmp_path / "b", rate_hz=50.0, state={"h": "h_next"}, **QUIET)
    spec = load_bundle(bundle).graph()
    assert spec.input("h").shape == [2, 1, 8] and spec.parity["within_tolerance"]
    xs = np.random.default_rng(3).standard_normal((20, 6)).astype(np.float32)
    with torch.no_grad():
        want, _ = module.gru(torch.from_numpy(xs)[None], torch.zeros(2, 1, 8))
        want = module.head(want[0]).numpy()
    for backend in ("onnxruntime", "numba"):
        m = Model(bundle, backend=backend)
        np.testing.assert_allclose([m.step(x[None]).copy()[0] for x in xs], want, atol=1e-5, err_msg=backend)


def test_an_imported_bundle_runs_a_session_through_the_cli(files, tmp_path, capsys):
    out = tmp_path / "policy_bundle"
    assert main(["import-onnx", str(files["controller"]), str(out), "--rate", "200", "--no-tensorrt", "--variants", "none",
                 "--postprocess", '{"low": [-2], "high": [2]}',
                 "--extra", '{"session": {"input": "plant_measurement", "command": "actuator_command"}}',
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bundle"] == str(out) and report["parity"]["within_tolerance"] and report["variants"] == {}
    assert main(["inspect", str(out)]) == 0
    assert "imported from controller.onnx (sha256 " in capsys.readouterr().out  # which file, before anything else
    s = run_session(out, SessionConfig(device="sim://plant?model=msd&rate=200&seed=1", duration_s=0.5, status=False,
                                       backend="numba"))
    assert s.commands_sent > 20 and s.nonfinite_outputs == 0
    assert main(["import-onnx", str(files["controller"]), str(out), "--rate", "200"]) == 2  # exists: no --overwrite
    assert "exists" in capsys.readouterr().err


class MixesRows(nn.Module):
    def forward(self, x):
        return x - x.mean(dim=0, keepdim=True)  # each row depends on the others: axis 0 is no batch


class SumsOverTime(nn.Module):
    def forward(self, x):
        return x.sum(dim=1)


def _bad_file(tmp_path: Path, kind: str) -> tuple[Path, dict]:
    p = tmp_path / f"{kind}.onnx"
    if kind == "mixes_rows":
        _export(MixesRows(), (torch.zeros(2, 3),), p, ["x"], ["y"], {"x": {0: "b"}, "y": {0: "b"}})
    elif kind == "two_free_axes":
        _export(SumsOverTime(), (torch.zeros(1, 5, 3),), p, ["x"], ["y"], {"x": {0: "b", 1: "t"}, "y": {0: "b"}})
    elif kind == "float64":
        _export(nn.Linear(3, 2).double(), (torch.zeros(1, 3, dtype=torch.float64),), p, ["x"], ["y"])
    elif kind == "batch_of_four":
        _export(nn.Linear(3, 2), (torch.zeros(4, 3),), p, ["x"], ["y"])
    elif kind == "not_onnx":
        p.write_bytes(b"\x00\x01 this is not a protobuf \xff" * 10)
    elif kind == "external_data":
        _export(nn.Linear(64, 64), (torch.zeros(1, 64),), tmp_path / "whole.onnx", ["x"], ["y"])
        onnx.save_model(onnx.load(str(tmp_path / "whole.onnx")), str(p), save_as_external_data=True,
                        all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
    elif kind == "unknown_state":
        _export(CellDecoder(), (torch.zeros(1, 12), torch.zeros(1, 16)), p, ["x", "h"], ["y", "h_out"])
        return p, {"state": {"h": "h_next"}}
    return p, {}


@pytest.mark.parametrize(("kind", "message"), [
    ("mixes_rows", "the free first axis is not a batch axis: the rows of a batch change each other's outputs"),
    ("two_free_axes", r"2 free axes \(\['b', 't'\]\); a bundle allows one, the batch: fix the others"),
    ("float64", "input 'x' is float64: a bundle computes in float32"),
    ("batch_of_four", r"fixed shape \[4, 3\].*a batch of 1 or free"),
    ("not_onnx", "is not an ONNX model"),
    ("external_data", "external data files.*save_as_external_data=False"),
    ("unknown_state", r"state pairs 'h' with output 'h_next', which the graph does not have; its outputs are \['y', 'h_out'\]"),
])
def test_what_cannot_be_a_bundle_is_refused_with_what_to_do(tmp_path, kind, message):
    path, kw = _bad_file(tmp_path, kind)
    with pytest.raises(ExportError, match=message):
        import_onnx(path, tmp_path / "b", rate_hz=50.0, **kw, **QUIET)
    assert not (tmp_path / "b").exists()


def test_a_numba_backend_that_disagrees_with_onnx_runtime_writes_nothing(files, tmp_path, monkeypatch):
    import closedloop.export.onnx_import as imp

    real = imp._numba_runner

    def off_by_a_little(data, spec):
        run, why = real(data, spec)
        return (lambda feeds: {k: v + 1e-2 for k, v in run(feeds).items()}), why

    monkeypatch.setattr(imp, "_numba_runner", off_by_a_little)
    with pytest.raises(ParityError, match="the Numba backend computes this graph differently from ONNX Runtime"):
        import_onnx(files["dynamic"], tmp_path / "b", rate_hz=50.0, **QUIET)
    assert not (tmp_path / "b").exists()


def test_importing_needs_no_torch(files, tmp_path):
    # a TensorFlow or JAX user has onnx and ONNX Runtime, not torch: the import and the bundle's use never load it
    code = textwrap.dedent(f"""
        import sys
        class _Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "torch":
                    raise ImportError("blocked for this test: " + name)
        sys.meta_path.insert(0, _Block())
        import numpy as np
        from closedloop import Model, import_onnx
        b = import_onnx({str(files["recurrent"])!r}, {str(tmp_path / "b")!r}, rate_hz=50.0, state={{"h": "h_next"}},
                        report=lambda s: None)
        print(Model(b, backend="numba").step(np.ones((1, 12), np.float32)).shape, "torch" in sys.modules)
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["(1,", "5)", "False"]


class LabelAndScores(nn.Module):
    """A classifier as often exported: the predicted label (int64) first, then the class probabilities."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        p = torch.softmax(self.lin(x), -1)
        return p.argmax(-1), p


def test_outputs_keeps_the_float_outputs_in_the_order_given(tmp_path, capsys):
    torch.manual_seed(4)
    model = LabelAndScores().eval()
    src = _export(model, (torch.zeros(1, 4),), tmp_path / "clf.onnx", ["x"], ["label", "probs"],
                  {"x": {0: "b"}, "label": {0: "b"}, "probs": {0: "b"}})
    with pytest.raises(ExportError, match=r"output 'label' is int64.*outputs=\[\.\.\.\] \(--output NAME"):
        import_onnx(src, tmp_path / "refused", rate_hz=50.0, **QUIET)
    out = tmp_path / "b"
    assert main(["import-onnx", str(src), str(out), "--rate", "50", "--output", "probs", "--no-tensorrt"]) == 0
    b = load_bundle(out)
    assert [t.name for t in b.graph().outputs] == ["probs"]
    assert b.manifest.provenance["export"]["settings"]["file_outputs"] == ["label", "probs"]
    assert b.manifest.provenance["export"]["settings"]["outputs_kept"] == ["probs"]
    x = np.random.default_rng(5).standard_normal((8, 4)).astype(np.float32)
    with torch.no_grad():
        want = model(torch.from_numpy(x))[1].numpy()
    m = Model(out, backend="numba")  # the ArgMax is cut out with the label, so the Numba backend runs the rest
    np.testing.assert_allclose(np.stack([m.step(r[None]).copy()[0] for r in x]), want, atol=1e-6)
    with pytest.raises(ExportError, match=r"outputs names \['scores'\], which the graph does not have"):
        import_onnx(src, tmp_path / "c", rate_hz=50.0, outputs=["scores"], **QUIET)


def test_outputs_keeps_the_state_outputs_it_does_not_name(files, tmp_path):
    bundle = import_onnx(files["recurrent"], tmp_path / "b", rate_hz=50.0, state={"h": "h_next"}, outputs=["logits"],
                         **QUIET)
    spec = load_bundle(bundle).graph()
    assert [(t.name, t.state) for t in spec.outputs] == [("logits", False), ("h_next", True)]
    assert spec.parity["within_tolerance"] and "numba/sequence_step_by_step" in spec.parity["checks"]


class PaddedCausalConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 3, 3, dilation=2)

    def forward(self, x):
        return self.conv(nn.functional.pad(x, (4, 0))).flatten(1)  # torch's exporter states this as ['b', 'b']


def test_an_output_size_the_file_does_not_state_is_measured_and_written_in(tmp_path):
    torch.manual_seed(6)
    model = PaddedCausalConv().eval()
    src = _export(model, (torch.zeros(1, 4, 16),), tmp_path / "tcn.onnx", ["x"], ["y"], {"x": {0: "b"}, "y": {0: "b"}})
    declared = [d.dim_param or d.dim_value for d in onnx.load(str(src)).graph.output[0].type.tensor_type.shape.dim]
    assert declared[1] != 48  # the file does not say the 3 x 16 values
    bundle = import_onnx(src, tmp_path / "b", rate_hz=100.0, **QUIET)
    b = load_bundle(bundle)
    assert b.graph().outputs[0].shape == ["batch", 48]
    assert b.manifest.provenance["export"]["settings"]["output_sizes_stated"] == ["y"]
    assert "output sizes ONNX Runtime gives stated" in b.manifest.provenance["export"]["exporter"]
    x = np.random.default_rng(7).standard_normal((1, 4, 16)).astype(np.float32)
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    for backend in ("onnxruntime", "numba"):
        np.testing.assert_allclose(Model(bundle, backend=backend).step(x), want, atol=1e-5, err_msg=backend)


def test_a_learned_initial_state_comes_in_with_initial_and_the_runtime_starts_there(tmp_path, capsys):
    """A file made elsewhere from a model with a learned h0: `--initial h=h0.npy` puts it in the bundle."""
    torch.manual_seed(0)
    module = LayeredGRU().eval()
    src = _export(module, (torch.zeros(1, 6), torch.zeros(2, 1, 8)), tmp_path / "gru.onnx", ["x", "h"], ["y", "h_next"])
    h0 = np.linspace(-0.5, 0.5, 16, dtype=np.float32).reshape(2, 1, 8)
    np.save(tmp_path / "h0.npy", h0)
    assert main(["import-onnx", str(src), str(tmp_path / "b"), "--rate", "50", "--state", "h=h_next",
                 "--initial", f"h={tmp_path / 'h0.npy'}", "--variants", "none", "--no-tensorrt"]) == 0
    b = load_bundle(tmp_path / "b")
    assert b.manifest.schema_version == 3
    xs = np.random.default_rng(3).standard_normal((20, 6)).astype(np.float32)
    with torch.no_grad():
        want, _ = module.gru(torch.from_numpy(xs)[None], torch.from_numpy(h0))
        want = module.head(want[0]).numpy()
    for backend in ("onnxruntime", "numba"):
        m = Model(b, backend=backend)
        np.testing.assert_allclose([m.step(x[None]).copy()[0] for x in xs], want, atol=1e-5, err_msg=backend)
    capsys.readouterr()
    assert main(["import-onnx", str(src), str(tmp_path / "c"), "--rate", "50", "--state", "h=h_next",
                 "--initial", f"h={tmp_path / 'missing.npy'}"]) == 2
    assert "--initial h=" in capsys.readouterr().err
    with pytest.raises(ExportError, match="has 3 values; its shape \\[2, 1, 8\\] at batch 1 holds 16"):
        import_onnx(src, tmp_path / "d", rate_hz=50.0, state={"h": "h_next"}, initial={"h": np.ones(3)}, **QUIET)


class Conv2dOverChannels(nn.Module):
    """EEGNet's layout, (batch, 1, channels, time): a temporal and a depthwise spatial Conv2d, then a read-out."""

    def __init__(self, channels: int = 6, length: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 4, (1, 5), padding=(0, 2)), nn.Conv2d(4, 8, (channels, 1), groups=4),
                                 nn.ELU(), nn.AvgPool2d((1, 4)))
        self.head = nn.Linear(8 * (length // 4), 3)

    def forward(self, x):
        return self.head(self.net(x).flatten(1))


def test_a_file_over_channels_and_time_imports_with_a_window_and_streams_like_the_model(tmp_path):
    torch.manual_seed(3)
    module = Conv2dOverChannels().eval()
    path = _export(module, (torch.zeros(1, 1, 6, 16),), tmp_path / "eegnet.onnx", ["x"], ["y"],
                   {"x": {0: "N"}, "y": {0: "N"}})
    out = tmp_path / "eegnet_bundle"
    assert main(["import-onnx", str(path), str(out), "--rate", "250", "--window", "x=16:4:channel_major",
                 "--no-tensorrt", "--variants", "none"]) == 0
    assert load_bundle(out).graph().inputs[0].frame_shape == (1, 6)  # a frame is one value per channel
    frames = np.random.default_rng(4).normal(size=(40, 6)).astype(np.float32)
    m = Model(out, backend="numba")
    got = [(i, y.copy()) for i, f in enumerate(frames) if (y := m.feed(f)) is not None]
    assert [i for i, _ in got] == list(range(15, 40, 4))
    for i, y in got:
        with torch.no_grad():
            want = module(torch.from_numpy(frames[i - 15 : i + 1].T.copy()).view(1, 1, 6, 16)).numpy()
        np.testing.assert_allclose(y, want, rtol=1e-3, atol=1e-4)  # the import's own parity tolerance
