"""CTC loss written with plain tensor operations, so it can be differentiated twice.

PyTorch's ``F.ctc_loss`` has no double backward, which second-order meta-learning
(:mod:`closedloop.sdk.bci.meta` with ``second_order=True``) needs. This is the textbook forward
recursion (Graves et al. 2006) in log space over the blank-extended label sequence
:math:`\\ell'` (length :math:`S = 2L + 1`):

.. math::  \\alpha_t(s) = \\Big(\\alpha_{t-1}(s) \\oplus \\alpha_{t-1}(s-1) \\oplus
           [\\ell'_s \\ne \\varnothing \\wedge \\ell'_s \\ne \\ell'_{s-2}]\\,\\alpha_{t-1}(s-2)\\Big) + \\log y_t(\\ell'_s)

with :math:`\\oplus` the log-sum-exp, and :math:`-\\log p(\\ell|x) = -(\\alpha_{T-1}(S-1) \\oplus
\\alpha_{T-1}(S-2))`. It matches ``F.ctc_loss`` (tested) and is a Python loop over bins,
so it is slower: use it only where the second derivative is needed.
"""

from __future__ import annotations

import torch

from .charset import BLANK

_NEG = -1e30  # finite "minus infinity": log-sum-exp of all-impossible paths keeps finite gradients


def ctc_nll(logp: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor,
            target_lengths: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood per sequence.

    Parameters
    ----------
    logp
        ``(B, T, K)`` log-probabilities (batch first).
    targets
        Concatenated target labels (as ``F.ctc_loss`` takes them), no blanks.
    input_lengths, target_lengths
        ``(B,)`` valid bins and labels per sequence.
    """
    b, t_max, _ = logp.shape
    dev = logp.device
    # the labels are laid out on the CPU (on CUDA, reading lengths element by element would sync per sequence)
    tl_cpu = target_lengths.detach().cpu().long()
    flat = targets.detach().cpu().long()
    l_max = int(tl_cpu.max()) if b else 0
    s_max = 2 * l_max + 1
    padded = torch.full((b, max(l_max, 1)), BLANK, dtype=torch.long)
    start = 0
    for i, n in enumerate(tl_cpu.tolist()):
        padded[i, :n] = flat[start: start + n]
        start += n
    padded = padded.to(dev)
    tl = tl_cpu.to(dev)
    il = input_lengths.to(dev).long()
    ext = torch.full((b, s_max), BLANK, dtype=torch.long, device=dev)
    ext[:, 1::2] = padded[:, :l_max]
    lp = logp.gather(2, ext[:, None, :].expand(b, t_max, s_max))  # (B, T, S)
    skip = torch.zeros(b, s_max, dtype=torch.bool, device=dev)
    skip[:, 2:] = (ext[:, 2:] != BLANK) & (ext[:, 2:] != ext[:, :-2])
    neg = torch.full((b, s_max), _NEG, dtype=logp.dtype, device=dev)
    alpha = neg.clone()
    alpha[:, 0] = lp[:, 0, 0]
    if s_max > 1:
        alpha[:, 1] = lp[:, 0, 1]
    alpha = torch.where(torch.arange(s_max, device=dev)[None] < 2, alpha, neg)
    neg1 = neg[:, :1]
    neg2 = neg[:, :2]
    for t in range(1, t_max):
        a1 = torch.cat([neg1, alpha[:, :-1]], 1)
        a2 = torch.where(skip, torch.cat([neg2, alpha[:, :-2]], 1), neg)
        new = torch.logsumexp(torch.stack([alpha, a1, a2]), 0) + lp[:, t]
        alpha = torch.where((t < il)[:, None], new, alpha)
    last = 2 * tl  # index of the final blank
    end_blank = alpha.gather(1, last[:, None])[:, 0]
    end_label = alpha.gather(1, (last - 1).clamp(min=0)[:, None])[:, 0]
    end_label = torch.where(tl > 0, end_label, torch.full_like(end_label, _NEG))
    return -torch.logaddexp(end_blank, end_label)
