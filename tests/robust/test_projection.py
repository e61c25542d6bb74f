"""The block projection: constraints hold, gradients flow, it is idempotent; keyed layouts are deterministic."""

from __future__ import annotations

import numpy as np
import torch

from closedloop.runtime.protect.scrubber import block_positions, syndromes
from closedloop.sdk.robust.projection import BlockZeroSum, project_numpy


def test_projection_holds_constraints_is_idempotent_and_passes_gradients():
    pos = block_positions(103, 8, b"k", "w", window=16)  # a short last block (103 = 12*8 + 7)
    proj = BlockZeroSum(pos)
    w = torch.randn(103, dtype=torch.float32, requires_grad=True)
    p = proj(w)
    s0, s1 = syndromes(p.detach().numpy(), pos)
    assert np.abs(s0).max() < 1e-5 and np.abs(s1).max() < 1e-4
    assert torch.allclose(proj(p), p, atol=1e-6)  # P P = P
    (p * torch.arange(103.0)).sum().backward()
    assert w.grad is not None and torch.count_nonzero(w.grad) > 0
    # the projection is linear: its gradient is the projected upstream gradient
    g = project_numpy(np.arange(103.0), pos)
    assert np.allclose(w.grad.numpy(), g, atol=1e-4)


def test_float64_projection_matches_and_blocks_of_two_are_left_free():
    pos = block_positions(18, 8, None)  # 18 = 2*8 + 2: the last two elements are unprotected
    assert pos.shape == (2, 8)
    w = np.random.default_rng(0).standard_normal(18)
    p = project_numpy(w, pos)
    assert np.allclose(p[16:], w[16:])
    assert np.allclose(p, BlockZeroSum(pos)(torch.tensor(w, dtype=torch.float32)).numpy(), atol=1e-5)


def test_keyed_permutation_is_deterministic_local_and_key_dependent():
    a = block_positions(5000, 16, b"secret", "t", window=1024)
    b = block_positions(5000, 16, b"secret", "t", window=1024)
    c = block_positions(5000, 16, b"other", "t", window=1024)
    d = block_positions(5000, 16, b"secret", "u", window=1024)
    assert np.array_equal(a, b) and not np.array_equal(a, c) and not np.array_equal(a, d)
    assert sorted(a[a >= 0].tolist()) == list(range(5000))  # a permutation: every element in one block
    # members of a block stay inside one window (memory locality for the scrubber)
    full = a[(a >= 0).all(axis=1)]
    assert np.all(full.max(axis=1) // 1024 == full.min(axis=1) // 1024)
    assert np.array_equal(block_positions(64, 16, None), np.arange(64).reshape(4, 16))
