"""The batch axis is dynamic in every graph and variant: batch 1 (deployment) and 4 both run."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from closedloop.runtime.bundle import load_bundle


@pytest.mark.parametrize("variant", [None, "fp16", "int8"])
def test_gru_runs_at_batch_1_and_4(gru_bundle, gru_module, variant):
    bundle = load_bundle(gru_bundle)
    sess = ort.InferenceSession(str(bundle.graph_path("main", variant)), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for batch in (1, 4):
        x = rng.standard_normal((batch, 12)).astype(np.float32)
        (h,) = gru_module.init_state(batch)
        y, h_out = sess.run(None, {"x": x, "h": h.numpy()})
        assert y.shape == (batch, 5) and h_out.shape == (2, batch, 16)
        with torch.no_grad():
            y_t, _ = gru_module.step(torch.from_numpy(x), h)
        np.testing.assert_allclose(y, y_t.numpy(), atol=1e-5 if variant is None else 5e-2)


def test_mlp_runs_at_batch_1_and_4(mlp_bundle, mlp_module):
    bundle = load_bundle(mlp_bundle)
    assert bundle.graph("main").inputs[0].shape == ["batch", 6]
    sess = ort.InferenceSession(str(bundle.graph_path("main")), providers=["CPUExecutionProvider"])
    for batch in (1, 4):
        x = np.random.default_rng(batch).standard_normal((batch, 6)).astype(np.float32)
        (y,) = sess.run(None, {"x": x})
        with torch.no_grad():
            np.testing.assert_allclose(y, mlp_module(torch.from_numpy(x)).numpy(), atol=1e-5)
