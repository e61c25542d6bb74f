"""Parity checks: recorded in the manifest, and an export that differs from torch raises and writes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from closedloop.export import ExportError, ParityError, Tolerance, export_bundle
from closedloop.runtime.bundle import load_bundle


class FrozenBranch(nn.Module):
    """Python control flow on data: tracing freezes the branch the example took."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        if x.sum() > 0:  # the example is all zeros, so the graph keeps the else-branch
            return self.lin(x) * 2.0
        return self.lin(x) * 3.0


def test_tolerance_rule():
    tol = Tolerance(abs=1e-4, rel=1e-3)
    assert tol.passes(5e-5, 1.0)  # small absolute error
    assert tol.passes(1.0, 5e-4)  # large output, small relative error
    assert not tol.passes(2e-4, 2e-3)


def test_zero_tolerance_raises_with_numbers_and_writes_nothing(tmp_path, gru_module, quiet):
    out = tmp_path / "gru"
    with pytest.raises(ParityError) as info:
        export_bundle(gru_module, out, kind="recurrent", example_input=torch.zeros(1, 12), rate_hz=50.0,
                      variants=(), tolerance=Tolerance(abs=0.0, rel=0.0), report=quiet)
    msg = str(info.value)
    assert "max abs" in msg and "max rel" in msg and "abs 0 or rel 0" in msg
    assert "random_batch_3" in msg or "sequence_step_by_step" in msg
    assert isinstance(info.value, ValueError)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_graph_that_differs_from_torch_raises(tmp_path, quiet):
    lines: list[str] = []
    with pytest.raises(ParityError, match="differs from torch"):
        export_bundle(FrozenBranch(), tmp_path / "b", kind="feedforward", example_input=torch.zeros(1, 4),
                      rate_hz=10.0, variants=(), report=lines.append)
    assert any("TracerWarning" in line for line in lines)  # the user's own trace warning is passed on
    assert not (tmp_path / "b").exists()


class LogOfInput(nn.Module):
    """log1p of the raw input: NaN for inputs below -1, which the standard-normal parity inputs hold."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(torch.log1p(x))


def test_a_model_undefined_on_the_parity_inputs_is_told_so_not_that_onnx_differs(tmp_path, quiet):
    with pytest.raises(ParityError) as info:
        export_bundle(LogOfInput().eval(), tmp_path / "log", kind="feedforward", example_input=torch.zeros(1, 4),
                      rate_hz=50.0, variants=(), report=quiet)
    msg = str(info.value)
    assert "the torch model itself gives a non-finite output" in msg and "standard-normal values" in msg
    assert "ONNX Runtime differs" not in msg and not (tmp_path / "log").exists()


def test_recorded_sequence_is_used_and_checked(tmp_path, gru_module, quiet):
    seq = np.random.default_rng(1).standard_normal((30, 12)).astype(np.float32)
    out = export_bundle(gru_module, tmp_path / "g", kind="recurrent", example_input=torch.zeros(1, 12),
                        rate_hz=50.0, variants=(), recorded_sequence=seq, report=quiet)
    parity = load_bundle(out).manifest.graphs["main"].parity
    assert parity["sequence_source"] == "recorded" and parity["sequence_steps"] == 30
    assert parity["checks"]["sequence_vs_torch_full_forward"]["steps"] == 30
    assert parity["tolerance"] == {"abs": 1e-4, "rel": 1e-3} and parity["ort_threads"] == 1

    with pytest.raises(ExportError, match=r"expected \(T, 12\)"):
        export_bundle(gru_module, tmp_path / "bad", kind="recurrent", example_input=torch.zeros(1, 12),
                      rate_hz=50.0, variants=(), recorded_sequence=seq[:, :5], report=quiet)
    seq[4, 2] = np.nan
    with pytest.raises(ExportError, match=r"non-finite value at index \(4, 2\)"):
        export_bundle(gru_module, tmp_path / "nan", kind="recurrent", example_input=torch.zeros(1, 12),
                      rate_hz=50.0, variants=(), recorded_sequence=seq, report=quiet)


def test_bad_arguments_are_named(tmp_path, gru_module, mlp_module, quiet):
    with pytest.raises(ExportError, match="kind 'rnn'"):
        export_bundle(gru_module, tmp_path / "a", kind="rnn", example_input=torch.zeros(1, 12), rate_hz=50.0)
    with pytest.raises(ExportError, match="rate_hz 0"):
        export_bundle(gru_module, tmp_path / "a", kind="recurrent", example_input=torch.zeros(1, 12), rate_hz=0)
    with pytest.raises(ExportError, match="no step or init_state"):
        export_bundle(mlp_module, tmp_path / "a", kind="recurrent", example_input=torch.zeros(1, 6), rate_hz=50.0,
                      report=quiet)
    with pytest.raises(ExportError, match="reserved"):
        export_bundle(mlp_module, tmp_path / "a", kind="feedforward", example_input=torch.zeros(1, 6), rate_hz=50.0,
                      provenance={"export": 1}, report=quiet)
    assert not (tmp_path / "a").exists()


class LearnedInitialState(nn.Module):
    """An RNN whose starting state is learned (LFADS-style h0), not zeros."""

    def __init__(self):
        super().__init__()
        self.cell = nn.GRUCell(3, 4)
        self.h0 = nn.Parameter(torch.linspace(-0.8, 0.9, 4)[None])

    def init_state(self, batch):
        return (self.h0.expand(batch, 4).detach().clone(),)

    def step(self, x, h):
        h = self.cell(x, h)
        return h.sum(-1, keepdim=True), h


@pytest.mark.parametrize("backend", ["onnxruntime", "numba"])
def test_a_learned_initial_state_is_kept_and_the_runtime_starts_and_resets_there(tmp_path, quiet, backend):
    """The bundle carries h0 (schema version 3), and a session's model starts each trial from it: the outputs
    match torch rolled out from h0, again after a reset. With zeros instead, the first outputs would differ."""
    from closedloop.runtime import Model

    torch.manual_seed(0)
    module = LearnedInitialState().eval()
    path = export_bundle(module, tmp_path / "a", kind="recurrent", example_input=torch.zeros(1, 3), rate_hz=50.0,
                         variants=(), tensorrt=False, report=quiet)
    b = load_bundle(path)
    assert b.manifest.schema_version == 3
    h = b.manifest.graphs["main"].input("h")
    np.testing.assert_allclose(h.initial, module.h0.detach().numpy().ravel(), rtol=0, atol=1e-7)
    xs = torch.randn(12, 1, 3)
    with torch.no_grad():
        state, want = module.init_state(1)[0], []
        for x in xs:
            y, state = module.step(x, state)
            want.append(y.numpy().copy())
    model = Model(b, backend=backend)
    for _ in range(2):  # a fresh model, then after a reset (a new trial)
        got = [model.step(x.numpy()).copy() for x in xs]
        np.testing.assert_allclose(np.concatenate(got), np.concatenate(want), rtol=1e-5, atol=1e-6)
        model.reset()
    np.testing.assert_allclose(model.inputs["h"], module.h0.detach().numpy(), atol=1e-7)


def test_a_zero_initial_state_leaves_the_bundle_at_version_2(gru_bundle):
    """Only a bundle that needs the field is written as version 3, so older readers keep reading the rest."""
    b = load_bundle(gru_bundle)
    assert b.manifest.schema_version == 2 and all(t.initial is None for t in b.manifest.graphs["main"].inputs)
    assert "initial" not in (gru_bundle / "manifest.json").read_text()


def test_a_non_finite_initial_state_is_refused(tmp_path, quiet):
    module = LearnedInitialState()
    with torch.no_grad():
        module.h0[0, 1] = float("nan")
    with pytest.raises(ExportError, match=r"init_state\(1\)\[0\] is not finite"):
        export_bundle(module, tmp_path / "a", kind="recurrent", example_input=torch.zeros(1, 3), rate_hz=50.0,
                      report=quiet)
