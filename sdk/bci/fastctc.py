"""CTC loss and its gradient as one Numba pass on CPU, for training the handwriting decoders.

PyTorch's CPU ``F.ctc_loss`` runs the forward-backward recursion in log space; on the
benchmark's batches (16 trials of ~1,100 bins, sentences of ~60 characters) it takes
120-190 ms per training step, a fifth of the step. Here the recursion runs in linear
space with a rescaling per bin (Graves et al. 2006, ICML, section 4.1): no logarithm or
exponential per cell, float64 throughout.

With :math:`\\ell'` the blank-extended labels (length :math:`S = 2L + 1`), :math:`y_t(k)`
the probability of class :math:`k` in bin :math:`t`, and
:math:`a_t(s) = \\hat\\alpha_{t-1}(s) + \\hat\\alpha_{t-1}(s-1) + [\\ell'_s \\ne \\varnothing
\\wedge \\ell'_s \\ne \\ell'_{s-2}]\\,\\hat\\alpha_{t-1}(s-2)`:

.. math::  \\alpha_t(s) = a_t(s)\\, y_t(\\ell'_s), \\qquad c_t = \\sum_s \\alpha_t(s), \\qquad
           \\hat\\alpha_t = \\alpha_t / c_t, \\qquad
           -\\log p(\\ell|x) = -\\sum_t \\log c_t - \\log\\big(\\hat\\alpha_{T-1}(S-1) + \\hat\\alpha_{T-1}(S-2)\\big)

and the same backwards for :math:`\\hat\\beta`, where :math:`b_t(s)` is the sum over the
successors at :math:`t+1`, before bin :math:`t`'s emission. The state occupancy is
:math:`\\gamma_t(s) \\propto \\hat\\alpha_t(s)\\, b_t(s)` (normalised over :math:`s`), and the
gradient of the negative log-likelihood with respect to the log-probability
:math:`\\log y_t(k)` is :math:`-\\sum_{s:\\ell'_s = k} \\gamma_t(s)`.

That is the true derivative with respect to the log-probabilities. ``F.ctc_loss``
returns it plus :math:`y_t(k)`, a term that ``log_softmax``'s backward removes, so the
gradients reaching the logits (and every weight) are the same; that is what
``tests/sdk/test_bci_fastctc.py`` compares, with the loss, to 1e-6 against ``F.ctc_loss``
in float64.

An impossible sequence (more labels, with their repeats, than bins) has infinite loss,
which ``zero_infinity`` turns into 0 with a zero gradient, as ``F.ctc_loss`` does.

Rescaling keeps each bin's row in range but not every entry: a state whose forward mass is
below 1e-308 of its row's (and so is lost) can still be the one the future needs, when
outputs are confident and wrong for thousands of bins. The check: in exact arithmetic every
bin's overlap :math:`\\sum_s \\hat\\alpha_t(s) b_t(s)`, times the scales, is the same
likelihood; where one differs from the final one by more than 1e-6 nats, mass was lost, and
the whole batch is computed by ``F.ctc_loss`` instead (``counts`` says how often). The
gradient is first order only (differentiating it raises, as with ``F.ctc_loss``);
second-order meta-learning uses :func:`closedloop.sdk.bci.ctc.ctc_nll`.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit
from torch.nn import functional as F

from .charset import BLANK

#: batches computed here, and of those handed to ``F.ctc_loss`` after an underflow (this process)
counts = {"batches": 0, "fallback_batches": 0}
_TINY = 1e-280  # an overlap this small has lost precision in its terms
_CONSISTENCY_NATS = 1e-6  # the likelihood seen from each bin agrees to ~1e-12 relative unless mass underflowed


@njit(cache=True, nogil=True)
def _extended(labels: np.ndarray, blank: int) -> tuple[np.ndarray, np.ndarray]:
    """The blank-extended labels and, per position, whether the skip from ``s - 2`` is allowed."""
    s_len = 2 * labels.shape[0] + 1
    ext = np.full(s_len, blank, np.int64)
    skip = np.zeros(s_len, np.bool_)
    for i in range(labels.shape[0]):
        ext[2 * i + 1] = labels[i]
    for s in range(2, s_len):
        skip[s] = ext[s] != blank and ext[s] != ext[s - 2]
    return ext, skip


@njit(cache=True, nogil=True)
def _repeats(labels: np.ndarray) -> int:
    """Adjacent equal labels: each needs a blank between them, so one more bin."""
    n = 0
    for i in range(1, labels.shape[0]):
        n += labels[i] == labels[i - 1]
    return n


@njit(cache=True, nogil=True)
def _sequence(lp: np.ndarray, labels: np.ndarray, n_bins: int, blank: int, grad: np.ndarray) -> float:
    """One sequence: returns its negative log-likelihood and writes d nll / d lp into ``grad[:n_bins]``.

    ``lp`` is (T, K) log-probabilities (float32), ``grad`` (T, K) float32, zero on entry.
    Returns ``inf`` (and leaves ``grad`` zero) when no alignment is possible, and ``nan``
    when float64 underflowed (the caller then uses ``F.ctc_loss``).
    """
    ext, skip = _extended(labels, blank)
    s_len = ext.shape[0]
    n_classes = lp.shape[1]
    if n_bins <= 0:
        return 0.0 if labels.shape[0] == 0 else np.inf
    y = np.empty((n_bins, n_classes))
    for t in range(n_bins):
        for k in range(n_classes):
            y[t, k] = math.exp(lp[t, k])
    alpha = np.zeros((n_bins, s_len))  # rescaled: each bin's row sums to 1
    log_scale = np.empty(n_bins)  # log of the product of c_0 .. c_t
    alpha[0, 0] = y[0, ext[0]]
    if s_len > 1:
        alpha[0, 1] = y[0, ext[1]]
    for t in range(n_bins):
        if t > 0:
            for s in range(s_len):
                v = alpha[t - 1, s]
                if s >= 1:
                    v += alpha[t - 1, s - 1]
                if skip[s]:
                    v += alpha[t - 1, s - 2]
                alpha[t, s] = v * y[t, ext[s]]
        c = 0.0
        for s in range(s_len):
            c += alpha[t, s]
        if c <= 0.0:  # every path died: a probability of exactly 0 (float64 underflow of exp)
            return np.nan
        for s in range(s_len):
            alpha[t, s] /= c
        log_scale[t] = math.log(c) + (log_scale[t - 1] if t > 0 else 0.0)
    end = alpha[n_bins - 1, s_len - 1] + (alpha[n_bins - 1, s_len - 2] if s_len > 1 else 0.0)
    if end <= 0.0:  # no mass in the final states: impossible, or too improbable for float64 here
        return np.inf if n_bins < labels.shape[0] + _repeats(labels) else np.nan
    nll = -(log_scale[n_bins - 1] + math.log(end))
    # backwards: b holds the successors' rescaled mass before bin t's emission
    log_later = 0.0  # log of the product of the backward scales d_{t+1} .. d_{T-1}
    beta = np.zeros(s_len)
    b = np.zeros(s_len)
    b[s_len - 1] = 1.0
    if s_len > 1:
        b[s_len - 2] = 1.0
    for t in range(n_bins - 1, -1, -1):
        if t < n_bins - 1:
            for s in range(s_len):
                v = beta[s]
                if s + 1 < s_len:
                    v += beta[s + 1]
                if s + 2 < s_len and skip[s + 2]:
                    v += beta[s + 2]
                b[s] = v
        total = 0.0
        for s in range(s_len):
            total += alpha[t, s] * b[s]
        # every bin's overlap must give the same likelihood; a difference means mass underflowed
        if total < _TINY or abs(math.log(total) + log_scale[t] + log_later + nll) > _CONSISTENCY_NATS:
            return np.nan
        for s in range(s_len):
            grad[t, ext[s]] -= alpha[t, s] * b[s] / total
        d = 0.0
        for s in range(s_len):
            beta[s] = b[s] * y[t, ext[s]]
            d += beta[s]
        for s in range(s_len):
            beta[s] /= d
        log_later += math.log(d)
    return nll


@njit(cache=True, nogil=True)
def _batch(lp: np.ndarray, targets: np.ndarray, offsets: np.ndarray, target_lens: np.ndarray,
           input_lens: np.ndarray, blank: int, grad: np.ndarray, nll: np.ndarray) -> None:
    for i in range(lp.shape[0]):
        n = min(input_lens[i], lp.shape[1])
        nll[i] = _sequence(lp[i], targets[offsets[i]: offsets[i] + target_lens[i]], n, blank, grad[i])


def ctc_nll_and_grad(logp: np.ndarray, targets: np.ndarray, input_lengths: np.ndarray,
                     target_lengths: np.ndarray, blank: int = BLANK) -> tuple[np.ndarray, np.ndarray]:
    """Per-sequence negative log-likelihood (B,) float64 and its gradient (B, T, K) float32.

    ``logp`` (B, T, K) log-probabilities; ``targets`` the concatenated labels (no blanks).
    An impossible sequence has ``inf`` and a zero gradient; ``nan`` marks one that underflowed.
    """
    logp = np.ascontiguousarray(logp, dtype=np.float32)
    targets = np.ascontiguousarray(targets, dtype=np.int64)
    input_lengths = np.ascontiguousarray(input_lengths, dtype=np.int64)
    target_lengths = np.ascontiguousarray(target_lengths, dtype=np.int64)
    if logp.ndim != 3 or input_lengths.shape != (logp.shape[0],) or target_lengths.shape != (logp.shape[0],):
        raise ValueError(f"expected logp (B, T, K) with (B,) input and target lengths; got {logp.shape}, "
                         f"{input_lengths.shape}, {target_lengths.shape}")
    if int(target_lengths.sum()) != targets.shape[0]:
        raise ValueError(f"target lengths sum to {int(target_lengths.sum())} but {targets.shape[0]} labels were given")
    if targets.size and (targets.min() < 0 or targets.max() >= logp.shape[2] or (targets == blank).any()):
        raise ValueError(f"target labels must be classes 0..{logp.shape[2] - 1} other than the blank ({blank}); "
                         f"got values {np.unique(targets)[:10].tolist()}...")
    offsets = np.concatenate(([0], np.cumsum(target_lengths)[:-1])).astype(np.int64)
    grad = np.zeros_like(logp)
    nll = np.empty(logp.shape[0])
    _batch(logp, targets, offsets, target_lengths, input_lengths, blank, grad, nll)
    return nll, grad


class _CTC(torch.autograd.Function):
    """The loss, with its gradient computed in the forward pass (``nll`` and ``grad`` given)."""

    @staticmethod
    def forward(ctx, logp, nll, grad):
        ctx.save_for_backward(logp, grad)
        return nll.to(logp.dtype)

    @staticmethod
    def backward(ctx, d_nll):
        logp, grad = ctx.saved_tensors
        d_logp = grad * d_nll[:, None, None].to(grad.dtype)
        if torch.is_grad_enabled():  # create_graph: anything built on this gradient must not be differentiated
            d_logp = _FirstOrderOnly.apply(d_logp, logp)
        return d_logp, None, None


class _FirstOrderOnly(torch.autograd.Function):
    """Passes ``value`` through; differentiating it raises (as ``F.ctc_loss``'s gradient does)."""

    @staticmethod
    def forward(ctx, value, anchor):
        return value.clone()

    @staticmethod
    def backward(ctx, _):
        raise RuntimeError("the CTC loss of sdk.bci.fastctc has no second derivative; for second-order "
                           "meta-learning use sdk.bci.ctc.ctc_nll")


def fast_ctc_loss(logp: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor,
                  target_lengths: torch.Tensor, blank: int = BLANK, reduction: str = "mean",
                  zero_infinity: bool = True) -> torch.Tensor:
    """``F.ctc_loss`` for CPU float32 ``logp`` given batch first, (B, T, K), with the same reductions.

    ``"mean"``: each sequence's loss over its target length, averaged over the batch;
    ``"sum"``: summed; ``"none"``: per sequence.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r}; expected 'mean', 'sum' or 'none'")
    if logp.device.type != "cpu" or logp.dtype != torch.float32:
        raise ValueError(f"fast_ctc_loss runs on CPU float32 log-probabilities; got {logp.dtype} on {logp.device} "
                         "(use F.ctc_loss there)")
    nll, grad = ctc_nll_and_grad(logp.detach().numpy(), targets.cpu().numpy(), input_lengths.cpu().numpy(),
                                 target_lengths.cpu().numpy(), blank)
    counts["batches"] += 1
    if np.isnan(nll).any():  # float64 underflow (see the module notes): PyTorch's log-space recursion
        counts["fallback_batches"] += 1
        return F.ctc_loss(logp.transpose(0, 1), targets, input_lengths, target_lengths, blank=blank,
                          reduction=reduction, zero_infinity=zero_infinity)
    nll = _CTC.apply(logp, torch.from_numpy(nll), torch.from_numpy(grad))
    if zero_infinity:
        nll = torch.where(torch.isinf(nll), torch.zeros_like(nll), nll)
    if reduction == "none":
        return nll
    if reduction == "sum":
        return nll.sum()
    return (nll / target_lengths.to(nll.dtype).clamp(min=1)).mean()
