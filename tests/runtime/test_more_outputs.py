"""A graph with several data outputs: the session records every one, replay compares every one, NWB holds every one.

A cursor decoder's click head beside its velocity, or a controller's state estimate beside its command: the family
acts on one output, and the others must not vanish from the session's record (docs/recording.md, MORE_OUTPUT).
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from torch import nn

from closedloop.export import export_bundle
from closedloop.runtime import (
    RecordingReader,
    RecordType,
    SessionConfig,
    SessionObserver,
    replay_recording,
    run_session,
)
from closedloop.runtime.recording_view import view_recording
from closedloop.sdk.cli import main

SESSION = {"session": {"input": "plant_measurement", "command": "actuator_command"}}
LIMITS = {"low": [-2.0], "high": [2.0]}


class CommandAndEstimate(nn.Module):
    """A controller that also reports what it estimates: a command head and a three-value estimate head."""

    def __init__(self, n_in: int = 1, window: int = 0):
        super().__init__()
        self.window = window
        self.body = nn.Linear(n_in * max(1, window), 8)
        self.u, self.estimate = nn.Linear(8, 1), nn.Linear(8, 3)

    def forward(self, y):
        h = torch.tanh(self.body(y.flatten(1)))
        return {"u": self.u(h), "estimate": self.estimate(h)}


def _export(path, window: int = 0, seed: int = 0):
    torch.manual_seed(seed)
    model = CommandAndEstimate(window=window).eval()
    return model, export_bundle(
        model, path, kind="feedforward",
        example_input=torch.zeros(1, window, 1) if window else torch.zeros(1, 1), rate_hz=200.0,
        windows={"x": {"length": window, "hop": 2}} if window else None,
        postprocess=LIMITS, extra=SESSION, variants=(), tensorrt=False, report=lambda s: None,
    )


def _session(bundle, record, seed):
    return run_session(bundle, SessionConfig(device=f"sim://plant?model=msd&rate=200&seed={seed}", duration_s=1.0,
                                             status=False, backend="onnxruntime", record=str(record)))


@pytest.mark.parametrize("window", [0, 4], ids=["newest-frame", "windowed"])
def test_every_data_output_is_recorded_and_replay_compares_each(tmp_path, window):
    _, bundle = _export(tmp_path / "b", window)
    record = tmp_path / "s.clrec"
    s = _session(bundle, record, seed=3)
    assert s.commands_sent > 20
    reader = RecordingReader(record)
    assert reader.meta["outputs"] == [{"name": "u", "shape": [1, 1], "role": "command", "size": 1, "offset": 0},
                                      {"name": "estimate", "shape": [1, 3], "role": "output", "size": 3, "offset": 1}]
    records = [r for r in reader if r.type in (RecordType.OUTPUT, RecordType.MORE_OUTPUT)]
    firsts = [r for r in records if r.type == RecordType.OUTPUT]
    assert len(firsts) == s.inputs_used if not window else len(firsts) == s.commands_sent
    # each step's estimate follows its command output, with the same loop step and input frame and index 1
    for a, b in zip(records[::2], records[1::2], strict=True):
        assert (a.type, b.type, b.output_index) == (RecordType.OUTPUT, RecordType.MORE_OUTPUT, 1)
        assert a.output()[:2] == b.output()[:2] and b.output()[2].shape == (3,)
        assert struct.unpack_from("<I", b.payload, 8) == (1,)  # the layout docs/recording.md gives
    rep = replay_recording(record, bundle, backend="onnxruntime")
    assert rep.outputs["u"]["compared"] == rep.outputs["estimate"]["compared"] == len(firsts)
    assert rep.outputs["estimate"]["max_abs_diff"] <= 1e-6 and rep.unmatched_outputs == 0


def test_replay_finds_a_difference_in_an_output_that_is_not_the_command(tmp_path, capsys):
    model, bundle = _export(tmp_path / "b")
    record = tmp_path / "s.clrec"
    _session(bundle, record, seed=4)
    with torch.no_grad():  # the same command head, another estimate head: only the second output differs
        model.estimate.weight.add_(0.5)
    _, other = _export(tmp_path / "other", seed=0)
    torch.manual_seed(0)
    changed = export_bundle(model, tmp_path / "changed", kind="feedforward", example_input=torch.zeros(1, 1),
                            rate_hz=200.0, postprocess=LIMITS, extra=SESSION, variants=(), tensorrt=False,
                            report=lambda s: None)
    rep = replay_recording(record, changed, backend="onnxruntime")
    assert rep.outputs["u"]["max_abs_diff"] <= 1e-6 and rep.outputs["estimate"]["max_abs_diff"] > 0.05
    assert rep.max_abs_diff == rep.outputs["estimate"]["max_abs_diff"]
    assert main(["replay", str(record), "--bundle", str(changed), "--tolerance", "1e-4"]) == 1
    out = capsys.readouterr().out
    assert "output estimate:" in out and "outputs differ by more than" in out
    assert main(["replay", str(record), "--bundle", str(other), "--tolerance", "1e-4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["outputs"]["estimate"]["compared"] > 20


def test_nwb_and_the_recording_view_hold_every_output(tmp_path):
    _, bundle = _export(tmp_path / "b")
    record = tmp_path / "s.clrec"
    _session(bundle, record, seed=5)
    view = view_recording(record)
    est = view.more_outputs["estimate"]
    assert len(est) == len(view.outputs) > 20 and est.array().shape[1] == 3
    assert main(["export-nwb", str(record), str(tmp_path / "s.nwb")]) == 0
    from pynwb import NWBHDF5IO

    with NWBHDF5IO(str(tmp_path / "s.nwb"), "r") as io:
        mod = io.read().processing["closedloop"]
        first, second = mod["model_output"], mod["model_output_estimate"]
        assert first.data.shape == (len(view.outputs), 1) and second.data.shape == (len(view.outputs), 3)
        np.testing.assert_array_equal(second.data[:], est.array())
        np.testing.assert_array_equal(second.timestamps[:], first.timestamps[:])
        assert "'estimate'" in second.description and "'u'" in first.description


class _Rows(SessionObserver):
    def __init__(self) -> None:
        self.info: dict = {}
        self.seq: list[np.ndarray] = []
        self.rows: list[np.ndarray] = []

    def on_start(self, info) -> None:
        self.info = dict(info)

    def on_steps(self, batch) -> None:
        acted = batch.input_seq >= 0
        self.seq.append(batch.input_seq[acted].copy())
        self.rows.append(batch.outputs[acted].copy())


def test_observers_get_every_output_in_each_steps_row_where_info_says(tmp_path):
    _, bundle = _export(tmp_path / "b")
    record, rows = tmp_path / "s.clrec", _Rows()
    run_session(bundle, SessionConfig(device="sim://plant?model=msd&rate=200&seed=6", duration_s=1.0, status=False,
                                      backend="onnxruntime", record=str(record), observers=[rows]))
    assert rows.info["n_out"] == 4 and [(o["name"], o["offset"], o["size"]) for o in rows.info["outputs"]] == [
        ("u", 0, 1), ("estimate", 1, 3)]
    seq, got = np.concatenate(rows.seq), np.concatenate(rows.rows)
    reader = RecordingReader(record)
    recorded = {r.output()[1]: r.output()[2] for r in reader.of_type(RecordType.OUTPUT)}
    more = {r.output()[1]: r.output()[2] for r in reader.of_type(RecordType.MORE_OUTPUT)}
    assert len(seq) > 20
    for k, row in zip(seq, got, strict=True):  # the observer's row is the recorded u, then the recorded estimate
        np.testing.assert_array_equal(row, np.concatenate([recorded[int(k)], more[int(k)]]))
