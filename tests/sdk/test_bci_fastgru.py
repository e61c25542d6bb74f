"""The GRU with its own backward pass (sdk.bci.fastgru) against nn.GRU, and the batched fine-tuning it serves.

Tolerances: float32 sums in a different order, so outputs agree to 1e-5 and gradients to a
relative 1e-5 of their largest entry; fitted weights after a few Adam steps to 1e-4.
"""

import numpy as np
import pytest
import torch

from closedloop.sdk.bci import fastgru
from closedloop.sdk.bci.baselines import finetune_batch
from closedloop.sdk.bci.data import Example, collate, ctc_loss
from closedloop.sdk.bci.fastgru import gru_layers, gru_sequence, stacked_backbone
from closedloop.sdk.bci.models import GRUBackbone

FAST = "_GRURecurrenceBackward"  # the autograd node of the fastgru recurrence


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


@pytest.mark.parametrize("n_layers", [1, 2])
def test_gru_sequence_matches_nn_gru_values_and_every_gradient(n_layers):
    torch.manual_seed(0)
    gru = torch.nn.GRU(12, 10, n_layers, batch_first=True)
    x = torch.randn(3, 17, 12, requires_grad=True)
    h0 = torch.randn(n_layers, 3, 10, requires_grad=True)
    w_out, w_last = torch.randn(3, 17, 10), torch.randn(n_layers, 3, 10)
    ins = [x, h0, *gru.parameters()]

    y_ref, h_ref = gru(x, h0)
    g_ref = torch.autograd.grad((y_ref * w_out).sum() + (h_ref * w_last).sum(), ins)
    y, h = gru_sequence(x, gru_layers(gru), h0)
    g = torch.autograd.grad((y * w_out).sum() + (h * w_last).sum(), ins)

    assert (y - y_ref).abs().max() < 1e-5 and (h - h_ref).abs().max() < 1e-5
    for name, a, b in zip(["x", "h0"] + [n for n, _ in gru.named_parameters()], g, g_ref, strict=True):
        assert _rel(a, b) < 1e-5, name


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch, hidden", [(9, 5), (4, 8), (1, 3)])
def test_the_compiled_recurrence_and_the_torch_loop_both_match_nn_gru(monkeypatch, compiled, dtype, batch, hidden):
    """Both recurrences of the fast path against nn.GRU: the compiled kernels (float32 and float64,
    row blocks of four with a remainder, an odd gate width 3H) and the torch loop they replace."""
    monkeypatch.setattr(fastgru, "use_compiled", compiled)
    torch.manual_seed(batch)
    gru = torch.nn.GRU(7, hidden, batch_first=True).to(dtype)
    x = torch.randn(batch, 13, 7, dtype=dtype, requires_grad=True)
    h0 = torch.randn(1, batch, hidden, dtype=dtype, requires_grad=True)
    w_out, w_last = torch.randn(batch, 13, hidden, dtype=dtype), torch.randn(1, batch, hidden, dtype=dtype)
    ins = [x, h0, *gru.parameters()]
    y_ref, h_ref = gru(x, h0)
    g_ref = torch.autograd.grad((y_ref * w_out).sum() + (h_ref * w_last).sum(), ins)
    y, h = gru_sequence(x, gru_layers(gru), h0)
    g = torch.autograd.grad((y * w_out).sum() + (h * w_last).sum(), ins)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert y.dtype == dtype and (y - y_ref).abs().max() < tol and (h - h_ref).abs().max() < tol
    for name, a, b in zip(["x", "h0"] + [n for n, _ in gru.named_parameters()], g, g_ref, strict=True):
        assert _rel(a, b) < tol, name


def test_large_step_products_on_several_threads_run_the_torch_loop(monkeypatch):
    """The kernels run on one thread; where torch has more and the step's product is large, MKL's threaded
    product is faster, so the torch loop runs (fastgru.COMPILED_MAX_STEP_MACS)."""
    calls = []
    kernel = fastgru._forward_kernel
    monkeypatch.setattr(fastgru, "_forward_kernel", lambda *a: calls.append(1) or kernel(*a))
    monkeypatch.setattr(fastgru, "COMPILED_MAX_STEP_MACS", 3 * 8 * 8 * 4)  # a batch of 4 at H = 8 is at the limit
    gru = torch.nn.GRU(3, 8, batch_first=True)
    threads = torch.get_num_threads()
    try:
        for n_threads, batch, compiled in [(2, 4, True), (2, 5, False), (1, 5, True)]:
            torch.set_num_threads(n_threads)
            calls.clear()
            x = torch.randn(batch, 6, 3, requires_grad=True)
            y, _ = gru_sequence(x, gru_layers(gru))
            assert bool(calls) == compiled, (n_threads, batch)
            assert (y - gru(x)[0]).abs().max() < 1e-5
    finally:
        torch.set_num_threads(threads)


def test_the_compiled_recurrence_runs_each_weight_set_of_a_stack_with_its_own_gradients():
    torch.manual_seed(6)
    grus = [torch.nn.GRU(5, 6, batch_first=True) for _ in range(3)]
    stacked = [torch.stack([getattr(g, k).detach() for g in grus]).requires_grad_()
               for k in ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0")]
    x = torch.randn(3, 5, 10, 5)  # (tasks, batch, time, channels)
    w = torch.randn(3, 5, 10, 6)
    y, _ = gru_sequence(x, [tuple(stacked)])
    grads = torch.autograd.grad((y * w).sum(), stacked)
    for i, g in enumerate(grus):
        y_ref, _ = g(x[i])
        ref = torch.autograd.grad((y_ref * w[i]).sum(), list(g.parameters()))
        assert (y[i] - y_ref).abs().max() < 1e-5
        for a, b in zip(grads, ref, strict=True):
            assert _rel(a[i], b) < 1e-5


def test_the_backward_pass_refuses_a_second_derivative():
    """Second-order meta-learning must not run through it silently wrong: it raises instead."""
    gru = torch.nn.GRU(4, 5, batch_first=True)
    x = torch.randn(2, 6, 4, requires_grad=True)
    y, _ = gru_sequence(x, gru_layers(gru))
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        gx.sum().backward()


def test_backbone_takes_the_fast_path_only_where_a_first_order_gradient_flows_and_both_paths_agree(autograd_nodes):
    torch.manual_seed(1)
    bb = GRUBackbone(8, 6, 2, dropout=0.0)
    x = torch.randn(2, 9, 8)
    trained, _ = bb(x)  # weights require grad, CPU: fast path
    assert FAST in autograd_nodes(trained)
    with torch.no_grad():
        plain, _ = bb(x)  # nn.GRU
    assert (trained - plain).abs().max() < 1e-5
    for p in bb.parameters():
        p.requires_grad_(False)
    assert FAST not in autograd_nodes(bb(x)[0])  # nothing to differentiate: nn.GRU
    # a frozen backbone behind a trained input (calibration, first-order meta-learning): fast path
    x.requires_grad_()
    w = torch.randn(2, 9, 32)
    frozen, _ = bb(x)
    assert FAST in autograd_nodes(frozen)
    (gx,) = torch.autograd.grad((frozen * w).sum(), x)
    with fastgru.twice_differentiable():  # second-order meta-learning: nn.GRU, differentiable twice
        twice, _ = bb(x)
    assert FAST not in autograd_nodes(twice) and not fastgru.in_twice_differentiable()
    (gx_ref,) = torch.autograd.grad((twice * w).sum(), x, create_graph=True)
    gx_ref.square().sum().backward()
    assert x.grad is not None and x.grad.abs().max() > 0
    assert (frozen - plain).abs().max() < 1e-5 and (twice - plain).abs().max() < 1e-6
    assert _rel(gx, gx_ref.detach()) < 1e-5


def test_backbone_dropout_between_layers_in_training_only():
    torch.manual_seed(2)
    bb = GRUBackbone(8, 6, 2, dropout=0.5)
    x = torch.randn(4, 9, 8)
    bb.train()
    a, b = bb(x)[0], bb(x)[0]
    assert (a - b).abs().max() > 1e-3  # a new mask per call
    bb.eval()
    c, d = bb(x)[0], bb(x)[0]
    assert torch.equal(c, d)


def test_stacked_backbone_runs_each_task_with_its_own_weights():
    torch.manual_seed(3)
    backbones = [GRUBackbone(8, 6, 2).eval() for _ in range(3)]
    params = {k: torch.stack([dict(b.named_parameters())[k].detach() for b in backbones])
              for k, _ in backbones[0].named_parameters()}
    x = torch.randn(3, 2, 11, 8)
    out = stacked_backbone(params, x, n_layers=2)
    for i, b in enumerate(backbones):
        with torch.no_grad():
            ref, _ = b(x[i])  # nn.GRU
        assert (out[i] - ref).abs().max() < 1e-5


def _examples(rng: np.random.Generator, n: int, channels: int = 8) -> list[Example]:
    return [Example(rng.normal(size=(int(rng.integers(25, 40)), channels)).astype(np.float32),
                    rng.integers(1, 31, size=int(rng.integers(3, 7))), "") for _ in range(n)]


def _reference_finetune(backbone, support, lr, steps, validation, eval_every):
    """One task the plain way: a copy of the backbone, torch.optim.Adam, clip_grad_norm_ 1.0, nn.GRU."""
    import copy

    bb = copy.deepcopy(backbone).eval()
    opt = torch.optim.Adam(bb.parameters(), lr=lr)
    sup, val = collate(support), collate(validation)
    curve = []
    for k in range(steps + 1):
        if k % eval_every == 0 or k == steps:
            with torch.no_grad():
                curve.append(float(ctc_loss(torch.log_softmax(bb.readout(bb.gru(val.x)[0]), -1), val)))
        if k == steps:
            break
        logp = torch.log_softmax(bb.readout(bb.gru(sup.x)[0]), -1)
        loss = ctc_loss(logp, sup)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(bb.parameters(), 1.0)
        opt.step()
    return dict(bb.named_parameters()), curve


def test_finetune_batch_equals_one_fit_per_task_with_torch_adam():
    torch.manual_seed(4)
    rng = np.random.default_rng(4)
    bb = GRUBackbone(8, 6, 1)
    lrs = [1e-3, 3e-3, 1e-2]
    support = [_examples(rng, 2) for _ in lrs]
    validation = [_examples(rng, 1) for _ in lrs]
    fitted, checkpoints, curve = finetune_batch(bb, support, lrs, steps=5, validation=validation, eval_every=2)
    assert checkpoints == [0, 2, 4, 5] and curve.shape == (4, 3)
    for t, lr in enumerate(lrs):
        ref, ref_curve = _reference_finetune(bb, support[t], lr, 5, validation[t], 2)
        np.testing.assert_allclose(curve[:, t], ref_curve, rtol=1e-4)
        for name, p in ref.items():
            assert _rel(fitted[name][t] - dict(bb.named_parameters())[name].detach(),
                        p.detach() - dict(bb.named_parameters())[name].detach()) < 1e-3, (t, name)
            assert (fitted[name][t] - p).abs().max() < 1e-4, (t, name)


def test_finetune_batch_refuses_tasks_of_unequal_size():
    rng = np.random.default_rng(5)
    with pytest.raises(ValueError, match="same number of support sentences"):
        finetune_batch(GRUBackbone(8, 6, 1), [_examples(rng, 2), _examples(rng, 1)], [1e-3, 1e-3], steps=1)


@pytest.mark.parametrize("which", ["backbone", "session_layers"])
def test_training_through_fastgru_follows_nn_gru(monkeypatch, which, autograd_nodes):
    """The whole training loop (augmentation, Adam, clipping, the session layers' lr scale) on either path.

    Dropout off: nn.GRU's batch-first output is laid out time-major, so the same seed draws the
    same dropout numbers into other positions; with dropout the two runs are different draws.
    """
    from closedloop.sdk.bci.toy import toy_recording
    from closedloop.sdk.bci.train import BackboneConfig, TrainConfig, train_backbone, train_session_layers

    sessions = toy_recording(n_channels=8, n_held_in=3, n_held_out=1, n_trials=6, seed=2)
    config = TrainConfig(backbone=BackboneConfig(12, 2, 0.0), steps=8, batch_size=4, lr=1e-2, device="cpu",
                         progress=False, plateau_steps=0)
    train = train_backbone if which == "backbone" else train_session_layers
    _, fast = train(sessions, config)
    monkeypatch.setattr(GRUBackbone, "use_fastgru", False)
    assert FAST not in autograd_nodes(GRUBackbone(8, 12, 2)(torch.zeros(1, 3, 8))[0])
    _, plain = train(sessions, config)
    np.testing.assert_allclose(fast.loss, plain.loss, rtol=1e-4)


@pytest.mark.parametrize("optimizer", ["adam", "meta"])
def test_calibration_through_fastgru_fits_the_same_alignment_as_nn_gru(monkeypatch, optimizer):
    """A frozen backbone behind the alignment being fitted (calibration) also runs the fast path:
    the fitted maps and validation curves of three tasks at once agree with nn.GRU's to 1e-4."""
    from closedloop.sdk.bci.calibrate import fit_alignment_batch
    from closedloop.sdk.bci.meta import MetaAlignment
    from closedloop.sdk.bci.models import alignment_params

    torch.manual_seed(3)
    bb = GRUBackbone(8, 10, 1).eval()
    for p in bb.parameters():
        p.requires_grad_(False)
    rng = np.random.default_rng(4)
    support = [_examples(rng, 2) for _ in range(3)]
    validation = [_examples(rng, 1) for _ in range(3)]
    start = alignment_params("full", 8)
    meta = MetaAlignment(8, inner_steps=2) if optimizer == "meta" else None
    kwargs = dict(steps=6, optimizer=optimizer, meta=meta, validation=validation, eval_every=2)
    from closedloop.sdk.bci import models

    calls = []
    monkeypatch.setattr(models, "gru_sequence", lambda *a: calls.append(1) or gru_sequence(*a))
    fast, _, fast_curve = fit_alignment_batch(bb, start, support, [1e-2, 3e-2, 1e-1], **kwargs)
    assert len(calls) == 6  # every fitting step took the fast path (the validation passes, no_grad, do not)
    monkeypatch.setattr(GRUBackbone, "use_fastgru", False)
    plain, _, plain_curve = fit_alignment_batch(bb, start, support, [1e-2, 3e-2, 1e-1], **kwargs)
    for k in fast:
        assert (fast[k] - start[k]).abs().max() > 1e-3  # it moved
        torch.testing.assert_close(fast[k], plain[k], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(fast_curve, plain_curve, rtol=1e-4)
