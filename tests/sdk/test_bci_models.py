"""The decoder's modules stream (step == forward) and the aligned decoder exports as one single-step graph."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from closedloop.sdk.bci.models import (
    AffineAlignment,
    AlignedDecoder,
    GRUBackbone,
    SessionInputDecoder,
    affine,
)

C = 10


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _rollout(module, seq):
    h = module.init_state(seq.shape[0])
    out = []
    for t in range(seq.shape[1]):
        y, h = module.step(seq[:, t], h)
        out.append(y)
    return torch.stack(out, 1), h


def _decoder(seed: int = 0) -> AlignedDecoder:
    torch.manual_seed(seed)
    align = AffineAlignment(C)
    with torch.no_grad():  # a non-trivial alignment, so the test sees it applied in both paths
        align.weight.add_(0.1 * torch.randn(C, C))
        align.bias.add_(0.1 * torch.randn(C))
    return AlignedDecoder(align, GRUBackbone(C, 16, 2)).eval()


@pytest.mark.parametrize("make", [lambda: GRUBackbone(C, 16, 2).eval(), _decoder])
def test_streaming_step_equals_forward_over_a_sequence(make):
    torch.manual_seed(1)
    module = make()
    seq = torch.randn(3, 25, C)
    with torch.no_grad():
        full, h_full = module(seq)
        steps, h_steps = _rollout(module, seq)
    assert full.shape == (3, 25, 32)
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h_steps, h_full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(full.exp().sum(-1), torch.ones(3, 25))  # log-softmax over 32 classes


def test_alignment_starts_as_identity_and_batched_affine_matches_per_task():
    a = AffineAlignment(C)
    x = torch.randn(2, 7, C)
    assert torch.equal(a(x), x)
    w, b = torch.randn(2, C, C), torch.randn(2, C)
    batched = affine(x, w, b)
    for i in range(2):
        torch.testing.assert_close(batched[i], x[i] @ w[i].T + b[i])


def test_session_input_decoder_routes_each_trial_through_its_sessions_layer():
    torch.manual_seed(2)
    model = SessionInputDecoder(["s0", "s1"], GRUBackbone(C, 8, 1)).eval()
    with torch.no_grad():
        model.layers[1].weight.mul_(2.0)
    x = torch.randn(2, 5, C)
    with torch.no_grad():
        both, _ = model(x, torch.tensor([0, 1]))
        one = model.decoder_for("s1")(x[1:])[0]
    torch.testing.assert_close(both[1:], one)
    assert not torch.allclose(both[0], model.decoder_for(1)(x[:1])[0])


def test_aligned_decoder_exports_as_one_step_graph_and_loads_in_the_runtime(tmp_path):
    from closedloop.export import export_bundle
    from closedloop.runtime import load_bundle

    module = _decoder(seed=3)
    path = export_bundle(module, tmp_path / "aligned", kind="recurrent", example_input=torch.zeros(1, C),
                         rate_hz=50.0, preprocess={"mean": [0.0] * C, "std": [1.0] * C}, variants=(),
                         tensorrt=False, report=lambda s: None)
    bundle = load_bundle(path)
    spec = bundle.graph()
    assert spec.kind == "recurrent"
    assert spec.parity["max_abs"] < 1e-4
    # the alignment is inside the graph: run it with onnxruntime and compare to torch
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path / spec.file), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    x = np.random.default_rng(0).normal(size=(1, C)).astype(np.float32)
    h = np.zeros((2, 1, 16), dtype=np.float32)
    y = sess.run(None, dict(zip(names, [x, h], strict=True)))[0]
    with torch.no_grad():
        ref = module.step(torch.from_numpy(x), torch.from_numpy(h))[0].numpy()
    np.testing.assert_allclose(y, ref, atol=1e-5)
