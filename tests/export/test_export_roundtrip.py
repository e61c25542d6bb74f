"""Export -> load_bundle round trips, folder and zip, and the runtime running the loaded graph."""

from __future__ import annotations

import json

import numpy as np
import torch

from closedloop.export import export_bundle
from closedloop.runtime.backends.base import BackendOptions
from closedloop.runtime.backends.onnxruntime_backend import OrtCpuBackend
from closedloop.runtime.bundle import load_bundle, sha256_file


def test_gru_bundle_loads_with_state_pairs_and_checksums(gru_bundle):
    bundle = load_bundle(gru_bundle)
    m = bundle.manifest
    g = m.graphs["main"]
    assert (m.schema_version, m.family, m.rate_hz, g.kind) == (2, "generic", 50.0, "recurrent")
    assert [(t.name, t.shape, t.state, t.state_pair) for t in g.inputs] == [
        ("x", ["batch", 12], False, None),
        ("h", [2, "batch", 16], True, "h_out"),  # nn.GRU state: batch on axis 1
    ]
    assert [(t.name, t.shape, t.state, t.state_pair) for t in g.outputs] == [
        ("y", ["batch", 5], False, None),
        ("h_out", [2, "batch", 16], True, "h"),
    ]
    assert set(m.files) == {"main.onnx", "main.fp16.onnx", "main.int8.onnx"}
    for rel, meta in m.files.items():
        assert meta["sha256"] == sha256_file(gru_bundle / rel)
        assert meta["bytes"] == (gru_bundle / rel).stat().st_size
    # The manifest on disk is plain JSON an outsider can read.
    raw = json.loads((gru_bundle / "manifest.json").read_text())
    assert raw["graphs"]["main"]["parity"]["within_tolerance"] is True


def test_loaded_gru_runs_in_the_runtime_like_torch(gru_bundle, gru_module):
    bundle = load_bundle(gru_bundle)
    spec = bundle.graph("main")
    backend = OrtCpuBackend(bundle.graph_path("main"), spec, BackendOptions(batch=1))
    (h,) = gru_module.init_state(1)
    rng = np.random.default_rng(3)
    for _ in range(20):
        x = rng.standard_normal((1, 12)).astype(np.float32)
        backend.inputs["x"][...] = x
        backend.run()
        backend.inputs["h"][...] = backend.outputs["h_out"]
        with torch.no_grad():
            y, h = gru_module.step(torch.from_numpy(x), h)
        np.testing.assert_allclose(backend.outputs["y"], y.numpy(), atol=1e-5)


def test_mlp_zip_bundle_loads(tmp_path, mlp_module, quiet):
    out = export_bundle(
        mlp_module, tmp_path / "mlp.zip", kind="feedforward", example_input=torch.zeros(1, 6), rate_hz=1000.0,
        variants=(), zip=True, report=quiet, postprocess={"low": np.full(3, -0.5), "high": [0.5] * 3},
    )
    assert out.is_file()
    bundle = load_bundle(out)
    g = bundle.manifest.graphs["main"]
    assert g.kind == "feedforward" and [t.shape for t in g.inputs] == [["batch", 6]]
    assert bundle.manifest.postprocess == {"low": [-0.5] * 3, "high": [0.5] * 3}  # numpy became JSON lists
    assert g.parity["checks"]["sequence_as_batch"]["steps"] == 64


def test_an_output_path_ending_in_zip_writes_a_zip(tmp_path, mlp_module, quiet):
    out = export_bundle(mlp_module, tmp_path / "named.zip", kind="feedforward", example_input=torch.zeros(1, 6),
                        rate_hz=1000.0, variants=(), report=quiet)
    assert out.is_file() and load_bundle(out).manifest.graphs["main"].kind == "feedforward"  # not a folder "named.zip"


def test_same_zip_bytes_for_the_same_content(tmp_path, mlp_module, quiet):
    import zipfile

    out = export_bundle(mlp_module, tmp_path / "a.zip", kind="feedforward", example_input=torch.zeros(1, 6),
                        rate_hz=100.0, variants=(), zip=True, report=quiet)
    with zipfile.ZipFile(out) as zf:
        assert sorted(zf.namelist()) == ["main.onnx", "manifest.json"]
        assert {i.date_time for i in zf.infolist()} == {(1980, 1, 1, 0, 0, 0)}


def test_a_module_that_kept_a_forward_pass_tensor_copies_to_the_cpu_for_export():
    """A module on a GPU is exported from a CPU copy. A streaming model that keeps its last hidden state
    (``self.h = h``, computed with gradients) holds a tensor ``copy.deepcopy`` refuses: the copy takes it
    detached; one deepcopy cannot take even so is an ExportError saying what to do."""
    import pytest

    from closedloop.export.errors import ExportError
    from closedloop.export.onnx_export import cpu_copy

    class Streaming(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = torch.nn.GRUCell(4, 3)
            self.h = None

        def forward(self, x):
            self.h = self.cell(x, self.h)
            return self.h

    m = Streaming()
    m(torch.ones(1, 4)).sum().backward()
    assert m.h is not None and not m.h.is_leaf
    copied = cpu_copy(m)
    assert copied is not m and copied.h is not None and copied.h.is_leaf and torch.equal(copied.h, m.h.detach())
    for a, b in zip(copied.parameters(), m.parameters(), strict=True):
        assert torch.equal(a, b) and a is not b
    assert not m.h.is_leaf  # the user's module is left as it was

    m.history = [m.h * 2]  # a tensor inside a container is out of reach of the detaching
    with pytest.raises(ExportError, match=r"move it there yourself \(module\.cpu\(\)\)"):
        cpu_copy(m)
