"""The Numba CTC loss (sdk.bci.fastctc) against PyTorch's F.ctc_loss.

The reference is ``F.ctc_loss`` in float64, whose float32 result itself differs by ~1e-5 of
the largest gradient on the benchmark's sequence lengths. Tolerances: losses to a relative
1e-6; gradients reaching the logits (through ``log_softmax``, as in every model here) to
1e-6 of their largest entry.
"""

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from closedloop.sdk.bci import data
from closedloop.sdk.bci.data import Example, collate, ctc_loss
from closedloop.sdk.bci.fastctc import ctc_nll_and_grad, fast_ctc_loss


def _loss_and_logit_grad(loss_fn, logits: torch.Tensor, dtype=torch.float32, weights=None):
    lg = logits.to(dtype).clone().requires_grad_(True)
    loss = loss_fn(torch.log_softmax(lg, -1))
    (loss * weights).sum().backward() if weights is not None else loss.backward()
    return loss.detach().double(), lg.grad.double()


def _reference(tg, il, tl, reduction="mean"):
    return lambda lp: F.ctc_loss(lp.transpose(0, 1), tg, il, tl, blank=0, reduction=reduction, zero_infinity=True)


def _fast(tg, il, tl, reduction="mean"):
    return lambda lp: fast_ctc_loss(lp, tg, il, tl, blank=0, reduction=reduction)


def _case(seed: int, b: int, t: int, k: int, l_range: tuple[int, int], scale: float):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, k, generator=g) * scale
    tl = torch.randint(*l_range, (b,), generator=g)
    tg = torch.randint(1, k, (int(tl.sum()),), generator=g)
    il = torch.randint(max(int(tl.max()) * 2, t // 2), t + 1, (b,), generator=g)
    il[0] = t
    return logits, tg, il, tl


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("seed,b,t,k,l_range,scale", [
    (0, 4, 60, 6, (1, 12), 1.0),  # few classes: many repeated labels, which need a blank between them
    (1, 3, 400, 32, (20, 60), 4.0),  # confident outputs over long trials, padded to different lengths
])
def test_loss_and_gradients_match_float64_f_ctc_loss(reduction, seed, b, t, k, l_range, scale):
    logits, tg, il, tl = _case(seed, b, t, k, l_range, scale)
    w = torch.rand(b, generator=torch.Generator().manual_seed(9)).double() if reduction == "none" else None
    ref_loss, ref_grad = _loss_and_logit_grad(_reference(tg, il, tl, reduction), logits, torch.float64, w)
    loss, grad = _loss_and_logit_grad(_fast(tg, il, tl, reduction), logits, torch.float32,
                                      None if w is None else w.float())
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0)
    assert (grad - ref_grad).abs().max() <= 1e-6 * ref_grad.abs().max()
    assert grad[1, il[1]:].abs().max() == 0 if il[1] < t else True  # padding gets no gradient


def _aligned_logits(seed: int, t: int, k: int, n_labels: int, confidence: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a decoder that is mostly right: each label's bins favour it, the rest favour blank."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(1, k, (n_labels,), generator=g)
    truth = torch.zeros(t, dtype=torch.long)
    starts = torch.linspace(0, t - 8, n_labels).long()
    for c, s0 in zip(labels, starts, strict=True):
        truth[s0: s0 + 3] = c
    logits = torch.randn(t, k, generator=g)
    logits[torch.arange(t), truth] += confidence
    return logits, labels


def test_2000_bins_of_a_mostly_right_decoder_stay_exact_on_the_fast_path():
    """Per-bin rescaling: the likelihood is ~1e-1500 here, far below float64's range, and still exact."""
    rows = [_aligned_logits(s, 2000, 32, 80, 3.0) for s in (6, 7)]
    logits = torch.stack([r[0] for r in rows])
    tg, tl, il = torch.cat([r[1] for r in rows]), torch.tensor([80, 80]), torch.tensor([2000, 2000])
    nll, _ = ctc_nll_and_grad(torch.log_softmax(logits, -1).numpy(), tg.numpy(), il.numpy(), tl.numpy(), 0)
    assert np.isfinite(nll).all()  # no fallback
    ref_loss, ref_grad = _loss_and_logit_grad(_reference(tg, il, tl, "sum"), logits, torch.float64)
    loss, grad = _loss_and_logit_grad(_fast(tg, il, tl, "sum"), logits)
    assert ref_loss > 2 * 745  # nats: each sequence's likelihood underflows float64 without rescaling
    assert torch.allclose(loss, ref_loss, rtol=1e-6)
    assert (grad - ref_grad).abs().max() <= 1e-6 * ref_grad.abs().max()


def test_mass_lost_to_underflow_is_detected_and_the_batch_goes_to_f_ctc_loss():
    """Confident and wrong for 2,000 bins (44,756 nats): the state the future needs underflows in the
    forward rows; the bins' likelihoods disagree, so the batch is computed by F.ctc_loss instead."""
    logits, tg, il, tl = _case(2, 2, 2000, 32, (80, 81), 8.0)
    lp = torch.log_softmax(logits, -1)
    nll, _ = ctc_nll_and_grad(lp.numpy(), tg.numpy(), il.numpy(), tl.numpy(), 0)
    assert np.isnan(nll).all()
    ref_loss, ref_grad = _loss_and_logit_grad(_reference(tg, il, tl, "sum"), logits)
    loss, grad = _loss_and_logit_grad(_fast(tg, il, tl, "sum"), logits)
    assert torch.equal(loss, ref_loss) and torch.equal(grad, ref_grad)


def test_edge_cases_empty_sentence_tight_fit_and_impossible_alignment():
    """No labels; exactly as many bins as labels plus repeats; one bin too few (infinite loss, zeroed)."""
    labels = [[], [3, 3, 4], [3, 3, 4], [5, 6, 7, 8]]
    lens = [5, 4, 3, 6]
    logits = torch.randn(4, 6, 9, generator=torch.Generator().manual_seed(3))
    tg = torch.tensor([c for row in labels for c in row])
    tl, il = torch.tensor([len(r) for r in labels]), torch.tensor(lens)
    ref_loss, ref_grad = _loss_and_logit_grad(_reference(tg, il, tl, "none"), logits, torch.float64,
                                              torch.ones(4, dtype=torch.float64))
    loss, grad = _loss_and_logit_grad(_fast(tg, il, tl, "none"), logits, torch.float32, torch.ones(4))
    assert loss[2] == 0 and grad[2].abs().max() == 0  # [3, 3, 4] needs 4 bins: zero_infinity
    assert torch.allclose(loss, ref_loss, rtol=1e-6)
    assert (grad - ref_grad).abs().max() <= 1e-6 * ref_grad.abs().max()
    nll, _ = ctc_nll_and_grad(torch.log_softmax(logits, -1).numpy(), tg.numpy(), il.numpy(), tl.numpy(), 0)
    assert np.isinf(nll[2]) and np.isfinite(nll[[0, 1, 3]]).all()


def test_probabilities_of_exactly_zero():
    """A bin where the blank is impossible is exact on the fast path; a bin where nothing is possible
    empties a row (the batch goes to F.ctc_loss) and, the sentence being impossible, its loss is zeroed."""
    logits, tg, il, tl = _case(4, 2, 40, 6, (3, 6), 1.0)
    logits[0, 10, 0] = -1000.0  # exp underflows to exactly 0, even in float64
    ones = torch.ones(2, dtype=torch.float64)
    ref_loss, ref_grad = _loss_and_logit_grad(_reference(tg, il, tl, "none"), logits, torch.float64, ones)
    loss, grad = _loss_and_logit_grad(_fast(tg, il, tl, "none"), logits, torch.float32, ones.float())
    assert torch.allclose(loss, ref_loss, rtol=1e-6) and (grad - ref_grad).abs().max() <= 1e-6 * ref_grad.abs().max()
    lp = torch.log_softmax(logits, -1)
    lp[1, 5] = -float("inf")
    nll, _ = ctc_nll_and_grad(lp.numpy(), tg.numpy(), il.numpy(), tl.numpy(), 0)
    assert np.isfinite(nll[0]) and np.isnan(nll[1])
    fast = fast_ctc_loss(lp, tg, il, tl, 0, "none")
    assert fast[1] == 0 and torch.equal(fast, _reference(tg, il, tl, "none")(lp))


def test_the_gradient_is_first_order_only():
    logits, tg, il, tl = _case(5, 2, 30, 6, (2, 5), 1.0)
    lg = logits.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(fast_ctc_loss(torch.log_softmax(lg, -1), tg, il, tl, 0), lg, create_graph=True)
    with pytest.raises(RuntimeError, match="no second derivative"):
        g.square().sum().backward()


def test_bad_input_is_refused_with_what_was_wrong():
    lp = torch.log_softmax(torch.randn(2, 10, 5), -1)
    with pytest.raises(ValueError, match="sum to 5 but 4 labels"):
        fast_ctc_loss(lp, torch.tensor([1, 2, 3, 4]), torch.tensor([10, 10]), torch.tensor([2, 3]))
    with pytest.raises(ValueError, match="reduction"):
        fast_ctc_loss(lp, torch.tensor([1, 2]), torch.tensor([10, 10]), torch.tensor([1, 1]), reduction="avg")
    with pytest.raises(ValueError, match="other than the blank"):
        fast_ctc_loss(lp, torch.tensor([1, 0]), torch.tensor([10, 10]), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="other than the blank"):
        fast_ctc_loss(lp, torch.tensor([1, 5]), torch.tensor([10, 10]), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="CPU float32"):
        fast_ctc_loss(lp.double(), torch.tensor([1, 2]), torch.tensor([10, 10]), torch.tensor([1, 1]))


def test_the_training_loss_uses_it_on_cpu_and_equals_f_ctc_loss(monkeypatch, autograd_nodes):
    """``data.ctc_loss`` (every training loop's loss) takes the Numba path on CPU; the switch turns it off."""
    rng = np.random.default_rng(0)
    examples = [Example(rng.standard_normal((n, 8)).astype(np.float32), rng.integers(1, 32, m), 0)
                for n, m in [(50, 12), (35, 8), (44, 20)]]
    batch = collate(examples)
    logits = torch.randn(3, 50, 32, requires_grad=True)
    fast = ctc_loss(torch.log_softmax(logits, -1), batch)
    assert "_CTCBackward" in autograd_nodes(fast) and "CtcLossBackward0" not in autograd_nodes(fast)
    monkeypatch.setattr(data, "USE_FAST_CTC", False)
    ref = ctc_loss(torch.log_softmax(logits, -1), batch)
    assert "CtcLossBackward0" in autograd_nodes(ref)
    (g_fast,) = torch.autograd.grad(fast, logits)
    (g_ref,) = torch.autograd.grad(ref, logits)
    # against float32 F.ctc_loss, whose own rounding is ~1e-5 of the largest gradient
    assert torch.allclose(fast, ref, rtol=1e-5) and (g_fast - g_ref).abs().max() <= 1e-4 * g_ref.abs().max()
