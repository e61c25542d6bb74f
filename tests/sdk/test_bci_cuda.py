"""The iBCI pipeline on CUDA: stage 1, stage 2 and calibration run on the GPU and agree with the CPU.

Skipped where no CUDA device is present (the CPU path is covered by every other iBCI test).
"""

from __future__ import annotations

import copy

import pytest
import torch

from closedloop.sdk.bci.calibrate import CalibrationConfig
from closedloop.sdk.bci.data import collate, make_examples, session_normalization
from closedloop.sdk.bci.evaluate import HarnessConfig, run_harness
from closedloop.sdk.bci.meta import MetaConfig
from closedloop.sdk.bci.toy import toy_recording
from closedloop.sdk.bci.train import BackboneConfig, TrainConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device here: the iBCI GPU path is checked only where one is present")


def _harness(device: str) -> HarnessConfig:
    return HarnessConfig(
        train=TrainConfig(backbone=BackboneConfig(16, 1, 0.0), steps=30, batch_size=4, lr=1e-2),
        meta=MetaConfig(inner_steps=2, n_query=2, tasks_per_step=2, meta_steps=4),
        calibration=CalibrationConfig(steps=4, eval_every=2, folds=2),
        beam_width=4, seed=0, device=device, progress=False,
    )


def test_every_method_trains_calibrates_and_scores_on_cuda():
    sessions = toy_recording(n_channels=8, n_held_in=3, n_held_out=2, n_trials=8, seed=2)
    out = run_harness(sessions, _harness("cuda"))
    assert out["device"].startswith("cuda")
    for name, m in out["methods"].items():
        for dec in ("greedy", "beam"):
            assert 0 <= m["mean"][dec]["CER"], name
    assert "held_in" in out["reference"]


def test_a_backbone_decodes_the_same_on_cuda_as_on_cpu():
    from closedloop.sdk.bci.models import GRUBackbone

    sessions = toy_recording(n_channels=8, n_held_in=1, n_held_out=1, n_trials=6, seed=3)
    s = sessions[0]
    batch = collate(make_examples(s, list(range(len(s.trials))), session_normalization(s)), "cpu")
    torch.manual_seed(0)
    cpu = GRUBackbone(8, 32, 2).eval()
    gpu = copy.deepcopy(cpu).to("cuda").eval()
    # TF32 off: cuDNN may otherwise run the GRU's matrix products at 10-bit mantissa precision
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        a = cpu(batch.x)[0]
        b = gpu(batch.x.to("cuda"))[0].cpu()
    # float32 GRU (cuDNN vs CPU kernels) over ~100 steps: log-probabilities agree to 1e-4
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


def test_a_decoder_trained_on_cuda_exports_with_fp32_parity_and_stays_on_the_gpu(tmp_path):
    """The export checks a CPU copy against ONNX Runtime: cuDNN's TF32 GRU is not the fp32 reference."""
    import numpy as np

    from closedloop.runtime.bundle import load_bundle
    from closedloop.sdk.bci.deploy import export_bci_bundle
    from closedloop.sdk.bci.models import AffineAlignment, AlignedDecoder, GRUBackbone

    torch.manual_seed(0)
    module = AlignedDecoder(AffineAlignment(8), GRUBackbone(8, 32, 2)).to("cuda")
    path = export_bci_bundle(module, tmp_path / "b", n_channels=8, mean=np.zeros(8), std=np.ones(8),
                             session_name="s", variants=(), tensorrt=False, report=lambda s: None)
    manifest = load_bundle(path).manifest
    assert manifest.graphs["main"].parity["reference"] == "torch (cpu)"
    assert manifest.provenance["export"]["settings"]["module_device"].startswith("cuda")
    assert next(module.parameters()).device.type == "cuda"  # the caller's module was not moved


def test_batched_fine_tuning_fits_the_same_on_cuda_as_on_cpu():
    """The stacked backbone (fine-tuning's cross-validation copies) runs its own GRU loop on the GPU too.

    Compared on the validation loss curves (smooth in the weights; Adam's first steps are
    about lr * sign(gradient), so single weights may differ where a gradient is near zero).
    """
    import numpy as np

    from closedloop.sdk.bci.baselines import finetune_batch
    from closedloop.sdk.bci.data import Example
    from closedloop.sdk.bci.models import GRUBackbone

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    bb = GRUBackbone(8, 16, 1).eval()

    def examples(n):
        return [Example(rng.normal(size=(30, 8)).astype(np.float32), rng.integers(1, 31, size=4), "")
                for _ in range(n)]

    sup, val = [examples(2) for _ in range(3)], [examples(1) for _ in range(3)]
    lrs = [1e-4, 3e-4, 1e-3]
    _, _, cpu = finetune_batch(bb, sup, lrs, steps=4, validation=val, eval_every=2, device="cpu")
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 products, as on the CPU
    try:
        _, _, gpu = finetune_batch(copy.deepcopy(bb).to("cuda"), sup, lrs, steps=4, validation=val, eval_every=2,
                                   device="cuda")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    np.testing.assert_allclose(gpu, cpu, rtol=1e-3)
