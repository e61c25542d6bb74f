"""The block-wise zero-sum projection as a torch parametrization.

Each protected weight is split into blocks (index matrices in the tensor's own flat
layout, ``-1`` padding); every block is projected onto ``{w : sum_j w_j = 0,
sum_j j w_j = 0}``. With the centred index ``c_j = j - mean(j)`` the two constraint
rows are orthogonal, so the orthogonal projection is

.. math:: P w = w - \\bar w \\mathbf 1 - \\frac{c^\\top w}{c^\\top c} c,

linear in ``w``: gradients pass straight through, and ``P P = P``. Registered with
``torch.nn.utils.parametrize``, training sees only constrained weights and the
optimizer updates the unconstrained ``original``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


def _centred(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = (index >= 0).to(torch.float64)
    cnt = mask.sum(1, keepdim=True).clamp(min=1)
    j = torch.arange(index.shape[1], dtype=torch.float64).expand_as(mask) * mask
    c = (j - j.sum(1, keepdim=True) / cnt) * mask
    return mask, cnt, c


class BlockZeroSum(nn.Module):
    """Parametrization: project every block of a weight onto zero sum and zero index-weighted sum.

    Parameters
    ----------
    index
        ``(blocks, k)`` flat indices into the weight (``-1`` where a block is shorter);
        column ``j`` is the member with index weight ``j``.
    """

    def __init__(self, index: np.ndarray | torch.Tensor):
        super().__init__()
        index = torch.as_tensor(np.asarray(index), dtype=torch.long)
        mask, cnt, c = _centred(index)
        self.register_buffer("index", index, persistent=False)
        self.register_buffer("mask", mask.float(), persistent=False)
        self.register_buffer("count", cnt.float(), persistent=False)
        self.register_buffer("centred", (c / (c * c).sum(1, keepdim=True).clamp(min=1e-30).sqrt()).float(),
                             persistent=False)
        self.register_buffer("valid", (index >= 0).reshape(-1), persistent=False)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        flat = w.reshape(-1)
        idx = self.index.clamp(min=0)
        b = flat[idx] * self.mask
        b = b - (b.sum(1, keepdim=True) / self.count) * self.mask
        b = b - (b * self.centred).sum(1, keepdim=True) * self.centred
        out = flat.index_put((self.index.reshape(-1)[self.valid],), b.reshape(-1)[self.valid])
        return out.reshape(w.shape)


def project_numpy(w: np.ndarray, index: np.ndarray) -> np.ndarray:
    """The same projection in float64 (used to bake exact-as-possible values at export)."""
    flat = np.asarray(w, dtype=np.float64).reshape(-1).copy()
    t = torch.as_tensor(index, dtype=torch.long)
    mask, cnt, c = (a.numpy() for a in _centred(t))
    b = flat[np.maximum(index, 0)] * mask
    b -= b.sum(1, keepdims=True) / cnt * mask
    cc = (c * c).sum(1, keepdims=True)
    b -= (b * c).sum(1, keepdims=True) / np.where(cc > 0, cc, 1.0) * c
    valid = index >= 0
    flat[index[valid]] = b[valid]
    return flat.reshape(np.shape(w))
