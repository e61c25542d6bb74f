"""Exporting decoder bundles (checks before export, the manifest block) and a closed-loop typing session."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from closedloop.firmware_bridge import DecoderOutput, FrameParser, NeuralFrame
from closedloop.runtime import (
    DeviceMismatchError,
    RecordingReader,
    RecordType,
    SessionConfig,
    load_bundle,
    run_session,
)
from closedloop.sdk.bci.deploy import bench_bci_step_latency, export_bci_bundle
from closedloop.sdk.models import GRUDecoder
from closedloop.sim.handwriting import CHARSET

C = 12


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    torch.manual_seed(3)
    module = GRUDecoder(C, 16, 1, 32).eval()
    with torch.no_grad():  # a random decoder that types now and then on Poisson input
        module.readout.weight.mul_(10)
    # the headstage's Poisson source fires around 8 Hz: 0.16 counts per 20 ms bin
    return export_bci_bundle(
        module, tmp_path_factory.mktemp("bci") / "typing", n_channels=C, mean=np.full(C, 0.16),
        std=np.full(C, 0.4), session_name="2023.04.17", calibration_info={"trials": [0, 1, 2], "method": "test"},
        provenance={"training": {"seed": 3}}, variants=(), tensorrt=False, report=lambda s: None,
    )


def test_manifest_carries_normalisation_charset_and_session(bundle):
    m = load_bundle(bundle).manifest
    assert m.family == "bci_handwriting" and m.rate_hz == 50.0 and m.name == "bci-2023.04.17"
    assert m.preprocess["mean"] == [0.16] * C and m.preprocess["std"] == [0.4] * C
    bci = m.extra["bci"]
    assert bci["charset"] == CHARSET and bci["blank"] == 0 and bci["n_channels"] == C
    assert bci["session"] == "2023.04.17" and bci["calibration"]["trials"] == [0, 1, 2]
    assert bci["display"] == {">": " ", "~": "."} and bci["char_probs"] is False
    assert m.provenance["training"] == {"seed": 3} and "export" in m.provenance
    assert m.graphs["main"].kind == "recurrent"


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"mean": np.zeros(C - 1)}, f"mean has {C - 1} values; expected {C}"),
        ({"std": np.r_[np.ones(C - 1), 0.0]}, rf"std is <= 0 at channels \[{C - 1}\]"),
        ({"module": GRUDecoder(C, 8, 1, 20)}, r"returns shape \(1, 20\); expected \(1, 32\)"),
        ({"module": torch.nn.Linear(C, 32)}, r"has no init_state\(\)"),
        ({"recorded_bins": np.zeros((10, C + 1))}, rf"recorded_bins has shape \(10, {C + 1}\)"),
    ],
)
def test_export_refuses_inconsistent_inputs_before_exporting(tmp_path, kw, match):
    args = {"module": GRUDecoder(C, 8, 1, 32), "mean": np.zeros(C), "std": np.ones(C)} | kw
    with pytest.raises(ValueError, match=match):
        export_bci_bundle(args.pop("module"), tmp_path / "x", n_channels=C, session_name="s", variants=(),
                          tensorrt=False, report=lambda s: None, **args)
    assert not (tmp_path / "x").exists()


def _sent_outputs(path):
    p = FrameParser()
    return [f.message for rec in RecordingReader(path).of_type(RecordType.TX)
            for f in p.feed(rec.payload) if isinstance(f.message, DecoderOutput)]


def _received_bins(path):
    p = FrameParser()
    return [f.message.bin_index for rec in RecordingReader(path).of_type(RecordType.RX)
            for f in p.feed(rec.payload) if isinstance(f.message, NeuralFrame)]


def test_typing_session_decodes_every_bin_and_reports_the_text(bundle, tmp_path):
    out = io.StringIO()
    cfg = SessionConfig(device=f"sim://headstage?channels={C}&seed=5", backend="numba", duration_s=1.5,
                        record=str(tmp_path / "typing.clrec"), status=True, status_interval_s=0.25)
    s = run_session(bundle, cfg, out=out)
    assert s.device["n_channels"] == C and s.frames_received >= 50
    assert s.inputs_used == s.commands_sent and s.inputs_skipped == 0
    assert s.safe_commands_sent == 0 and s.link["lost"] == 0
    sent = _sent_outputs(cfg.record)
    # overrun policy "hold" re-sends the last output for a skipped period (a loaded machine overruns)
    assert len(sent) == s.commands_sent + s.commands_resent
    received = _received_bins(cfg.record)
    sent = [m for k, m in enumerate(sent) if k == 0 or m.bin_index != sent[k - 1].bin_index]  # drop re-sends
    assert [m.bin_index for m in sent] == received  # one output per frame, in order
    typed = "".join(m.text for m in sent)
    assert len(typed) >= 3 and all(len(m.text) <= 1 for m in sent)
    shown = typed.replace(">", " ").replace("~", ".")  # the summary carries the whole text
    assert s.family["chars"] == len(typed) and s.family["text"] == shown
    assert f"text: {shown}" in s.format()  # the session summary
    assert "| chars " in out.getvalue() and "| text " in out.getvalue()  # the live status line


def test_headstage_with_other_channel_count_is_refused(bundle):
    cfg = SessionConfig(device=f"sim://headstage?channels={C + 4}", backend="onnxruntime", duration_s=0.5, status=False)
    with pytest.raises(DeviceMismatchError, match=f"n_channels={C + 4}.*takes frames of {C} values"):
        run_session(bundle, cfg)


def test_latency_bench_reports_each_backend(bundle):
    r = bench_bci_step_latency(bundle, n_bins=100, warmup=10)
    for backend in ("numba", "onnxruntime"):
        assert r[backend]["bins"] == 100
        assert 0 < r[backend]["p50_us"] <= r[backend]["p99_us"] <= r[backend]["max_us"]
