"""The ways people write a recurrent step: grouped outputs and states, a forward that is the step itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from closedloop.export import ExportError, export_bundle
from closedloop.runtime import Model, load_bundle


def _export(module, out, n_in, **kw):
    return export_bundle(module.eval(), out, kind="recurrent", example_input=torch.zeros(1, n_in), rate_hz=50.0,
                         variants=(), tensorrt=False, report=kw.pop("report", lambda s: None), **kw)


def _rollout(bundle, module, n_in, steps=12):
    """The bundle's outputs step by step on ONNX Runtime against the module's own step, from init_state(1)."""
    model = Model(load_bundle(bundle), backend="onnxruntime")
    g = torch.Generator().manual_seed(0)
    states = module.init_state(1)
    states = states if isinstance(states, tuple) else (states,)
    worst = 0.0
    for _ in range(steps):
        x = torch.randn(1, n_in, generator=g)
        got = model.step(x.numpy())
        with torch.no_grad():
            out = module.step(x, *states)
        flat = []
        for part in out:
            flat.extend(part.values() if isinstance(part, dict) else part if isinstance(part, tuple | list) else [part])
        n_state = len(states)
        want, states = flat[:-n_state], tuple(flat[-n_state:])
        got_all = [got] + [model.outputs[t.name] for t in model.spec.data_outputs[1:]]
        for a, b in zip(got_all, want, strict=True):
            worst = max(worst, float(np.abs(np.asarray(a) - b.numpy()).max()))
    return model, worst


class GroupedOutputs(nn.Module):
    """step -> ({"velocity": v, "click": c}, h): a cursor decoder's two heads and its GRU state."""

    def __init__(self):
        super().__init__()
        self.cell, self.vel, self.click = nn.GRUCell(6, 8), nn.Linear(8, 2), nn.Linear(8, 1)

    def init_state(self, batch):
        return (torch.zeros(batch, 8),)

    def step(self, x, h):
        h = self.cell(x, h)
        return {"velocity": self.vel(h), "click": self.click(h)}, h


class TupleOutputsNestedStates(nn.Module):
    """step -> ((y, logit), (h, c)): an LSTMCell decoder, its outputs and its two states grouped as torch returns them."""

    def __init__(self):
        super().__init__()
        self.cell, self.y, self.logit = nn.LSTMCell(5, 7), nn.Linear(7, 3), nn.Linear(7, 1)

    def init_state(self, batch):
        return torch.zeros(batch, 7), torch.zeros(batch, 7)

    def step(self, x, h, c):
        h, c = self.cell(x, (h, c))
        return (self.y(h), self.logit(h)), (h, c)


class ForwardIsTheStep(nn.Module):
    """forward(x, h) is one step (a GRUCell model as people write it); step calls it."""

    def __init__(self):
        super().__init__()
        self.cell, self.out = nn.GRUCell(4, 6), nn.Linear(6, 2)

    def init_state(self, batch):
        return (torch.zeros(batch, 6),)

    def forward(self, x, h):
        h = self.cell(x, h)
        return self.out(h), h

    def step(self, x, h):
        return self.forward(x, h)


def test_a_step_may_group_its_outputs_in_a_dict_named_by_its_keys(tmp_path):
    torch.manual_seed(0)
    m = GroupedOutputs()
    b = _export(m, tmp_path / "grouped", 6)
    model, worst = _rollout(b, m, 6)
    assert [t.name for t in model.spec.data_outputs] == ["velocity", "click"]
    assert [t.name for t in model.spec.state_inputs] == ["h"]
    assert worst < 1e-5


def test_a_step_may_group_its_outputs_and_its_states_in_tuples(tmp_path):
    torch.manual_seed(1)
    m = TupleOutputsNestedStates()
    b = _export(m, tmp_path / "nested", 5)
    model, worst = _rollout(b, m, 5)
    assert len(model.spec.data_outputs) == 2 and len(model.spec.state_inputs) == 2
    assert worst < 1e-5


def test_a_forward_that_is_the_step_itself_is_not_checked_over_a_sequence_and_says_so(tmp_path):
    """forward(x, h)'s signature looks like forward(seq, h): the whole-sequence check is tried, cannot take a
    sequence, and is skipped with a note (it is an error only where the check was asked for)."""
    from closedloop.export import ExportOptions

    torch.manual_seed(2)
    m, said = ForwardIsTheStep(), []
    b = _export(m, tmp_path / "fwd", 4, report=said.append)
    assert any("whole-sequence check is skipped" in s and "ForwardIsTheStep.forward(seq, *states)" in s for s in said)
    noted = load_bundle(b).manifest.provenance["export"]["settings"]["export_warnings"]
    assert any(w.startswith("whole-sequence check skipped") for w in noted)  # the bundle says so too
    _, worst = _rollout(b, m, 4)
    assert worst < 1e-5
    with pytest.raises(ExportError, match="cannot be checked over a whole sequence"):
        _export(ForwardIsTheStep(), tmp_path / "fwd2", 4, options=ExportOptions(full_sequence_check=True))


def test_a_step_that_returns_something_else_is_told_the_forms_it_may_return(tmp_path):
    class Bad(GroupedOutputs):
        def step(self, x, h):
            h = self.cell(x, h)
            return [self.vel(h), "click"], h

    with pytest.raises(ExportError, match=r"item 0 is a list of Tensor, str; expected \(y, \*new_states\)"):
        _export(Bad(), tmp_path / "bad", 6)
