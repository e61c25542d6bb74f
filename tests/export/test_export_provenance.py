"""Provenance: versions, platform, git and time recorded automatically, beside the caller's record."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from closedloop.export import ExportError, export_bundle
from closedloop.export.provenance import export_provenance, jsonable
from closedloop.runtime.bundle import load_bundle


def test_bundle_provenance(tmp_path, mlp_module, quiet):
    training = {"config": {"lr": 1e-3, "epochs": 3}, "data": "synthetic-v1", "seed": np.int64(7)}
    out = export_bundle(mlp_module, tmp_path / "m", kind="feedforward", example_input=torch.zeros(1, 6),
                        rate_hz=100.0, variants=(), provenance=training, report=quiet)
    prov = load_bundle(out).manifest.provenance
    assert prov["config"] == {"lr": 1e-3, "epochs": 3} and prov["data"] == "synthetic-v1" and prov["seed"] == 7
    auto = prov["export"]
    for key in ("closedloop", "torch", "onnx", "onnxruntime", "numpy", "python", "platform", "exported_utc", "git_commit"):
        assert key in auto
    assert auto["torch"] == torch.__version__ and auto["exported_utc"].endswith("+00:00")
    assert auto["settings"]["kind"] == "feedforward" and auto["settings"]["options"]["opset"] == 17


def test_provenance_without_git_or_install(monkeypatch):
    import closedloop.export.provenance as p

    monkeypatch.setattr(p, "_git", lambda *a: None)
    monkeypatch.setattr(p, "_dist_version", lambda name: None)
    auto = export_provenance()
    assert auto["git_commit"] is None and auto["git_dirty"] is None
    assert auto["closedloop"].startswith("unknown")


def test_jsonable_refuses_what_json_cannot_hold():
    assert jsonable({"a": np.arange(3), "b": (1, np.float32(0.5))}, "x") == {"a": [0, 1, 2], "b": [1, 0.5]}
    with pytest.raises(ExportError, match=r"preprocess.mean = .* cannot be written to JSON"):
        jsonable({"mean": object()}, "preprocess")
    with pytest.raises(ExportError, match="NaN"):
        jsonable({"scale": float("nan")}, "postprocess")
