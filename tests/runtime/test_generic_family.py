"""The generic family: normalisation in, scaling and clipping out, safe output, bad limits refused."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from closedloop.export import export_bundle
from closedloop.runtime import BundleError, Model, get_family, load_bundle
from closedloop.runtime.integrity import seal_manifest


def test_commands_are_clipped_to_the_bundle_limits(mlp_bundle):
    b = load_bundle(mlp_bundle)
    m = Model(b, backend="onnxruntime")
    fam = get_family(b.manifest.family)(b, m)
    worst = 0.0
    for x in np.random.default_rng(0).standard_normal((200, 6)).astype(np.float32) * 50:
        fam.preprocess(x)
        m.run()
        worst = max(worst, float(np.abs(fam.postprocess()).max()))
    assert worst <= 0.5 + 1e-7
    assert np.all(fam.safe_output() == 0)


def test_normalisation_and_scaling_match_manual(tmp_path, tiny_models):
    mean, std = np.linspace(-1, 1, 6), np.linspace(0.5, 2, 6)
    path = export_bundle(
        tiny_models["mlp"], tmp_path / "b", kind="feedforward", example_input=torch.zeros(1, 6), rate_hz=100,
        preprocess={"mean": mean.tolist(), "std": std.tolist()},
        postprocess={"scale": [2.0, 3.0, 4.0], "offset": [0.1, 0.2, 0.3]}, variants=(), report=lambda s: None,
    )
    b = load_bundle(path)
    m = Model(b, backend="onnxruntime")
    fam = get_family("generic")(b, m)
    x = np.random.default_rng(1).standard_normal(6).astype(np.float32)
    fam.preprocess(x)
    m.run()
    got = fam.postprocess().copy()
    with torch.no_grad():
        y = tiny_models["mlp"](torch.from_numpy(((x - mean) / std).astype(np.float32))[None]).numpy()
    np.testing.assert_allclose(got, y * [2, 3, 4] + [0.1, 0.2, 0.3], atol=1e-5)


def test_bad_postprocess_shape_refused_at_load(tmp_path, mlp_bundle):
    bad = tmp_path / "bad"
    shutil.copytree(mlp_bundle, bad)
    mpath = bad / "manifest.json"
    d = json.loads(mpath.read_text())
    d["postprocess"]["low"] = [0.0, 0.0]  # 2 values for 3 outputs
    d["preprocess"]["std"] = [1, 1, 0, 1, 1, 1]
    mpath.write_text(json.dumps(seal_manifest(d)))
    with pytest.raises(BundleError) as e:
        load_bundle(bad)
    msg = str(e.value)
    assert "low has shape (2,), expected (3,)" in msg
    assert "std has values <= 0" in msg


def test_unknown_family_is_refused(tmp_path, mlp_bundle):
    bad = tmp_path / "fam"
    shutil.copytree(mlp_bundle, bad)
    d = json.loads((bad / "manifest.json").read_text())
    d["family"] = "teleporter"
    (bad / "manifest.json").write_text(json.dumps(seal_manifest(d)))
    with pytest.raises(BundleError, match="family 'teleporter' is not known"):
        load_bundle(bad)


def test_an_output_without_a_feature_axis_is_refused_at_export_with_the_fix(tmp_path):
    from closedloop.export import ExportError

    class OneValue(torch.nn.Module):  # a single-actuator policy written with .squeeze(-1)
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(1, 1)

        def forward(self, x):
            return self.a(x).squeeze(-1)

    with pytest.raises(ExportError, match=r"output 'y' has shape \['batch'\].* return y.unsqueeze\(-1\)"):
        export_bundle(OneValue().eval(), tmp_path / "b", kind="feedforward", example_input=torch.zeros(1, 1),
                      rate_hz=200.0, variants=(), tensorrt=False, report=lambda s: None,
                      postprocess={"low": [-1.0], "high": [1.0]})
    assert not (tmp_path / "b").exists()


def test_inspect_says_a_safe_output_outside_the_limits_goes_out_clipped(tmp_path):
    import torch

    from closedloop.export import export_bundle
    from closedloop.sdk.inspect_bundle import inspect_bundle
    from closedloop.sdk.models import MLPPolicy

    torch.manual_seed(0)
    b = export_bundle(MLPPolicy(1, 1, (8,)).eval(), tmp_path / "p", kind="feedforward", example_input=torch.zeros(1, 1),
                      rate_hz=100.0, postprocess={"low": [-2.0], "high": [2.0], "safe_output": [5.0]},
                      variants=(), tensorrt=False, report=lambda s: None)
    text, ok = inspect_bundle(str(b))
    assert ok and "postprocess.safe_output [5.0] lies outside [low, high]: the safe command goes out clipped, as [2.0]" in text
