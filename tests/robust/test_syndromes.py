"""Locate and repair every single bit flip of a block, for fp32, fp16 and int8; several faults are refused."""

from __future__ import annotations

import numpy as np
import pytest

from closedloop.runtime.protect.scrubber import Scrubber, ScrubTarget, block_positions, tolerances
from closedloop.sdk.robust.projection import project_numpy
from closedloop.sdk.robust.quantize import quantize_blocks

K = 16


def _block(dtype):
    rng = np.random.default_rng(3)
    w = project_numpy(rng.standard_normal(4 * K) * 0.1, block_positions(4 * K, K))
    pos = block_positions(w.size, K)
    if dtype == np.int8:
        q, _ = quantize_blocks(w.astype(np.float32), pos)
        return q.reshape(-1), pos
    return w.astype(dtype), pos


def _target(values, pos, clean=None):
    """A scrub target over ``values`` with the tolerances measured on the clean block (as at export)."""
    return ScrubTarget("test", values, [("w", pos, pos, *tolerances(values if clean is None else clean, pos))])


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int8])
def test_every_bit_of_every_member_is_repaired_or_harmless(dtype):
    clean, pos = _block(dtype)
    ref = _target(clean.copy(), pos)
    tol0, tol1 = ref.tol0[0], ref.tol1[0]
    # Above this change only the true member explains the syndromes (docs/robustness.md).
    locate = 1.5 * (tol1 + (K - 1) * tol0)
    width = clean.itemsize * 8
    ut = {1: np.uint8, 2: np.uint16, 4: np.uint32}[clean.itemsize]
    undetected, located = [], 0
    for member in range(K):
        for bit in range(width):
            buf = clean.copy()
            buf.view(ut)[member] ^= ut(1) << ut(bit)
            with np.errstate(all="ignore"):
                d = float(buf[member].astype(np.float64)) - float(clean[member])
            events = Scrubber([_target(buf, pos, clean)]).scrub_all()
            if not np.isfinite(d) or abs(d) > locate:
                assert len(events) == 1 and events[0].status == "repaired", (member, bit, d, events)
                assert events[0].member == member and events[0].bit == bit
                assert np.array_equal(buf.view(ut), clean.view(ut)), (member, bit)  # bit-exact
                located += 1
            elif not events:
                undetected.append((member, bit))
                # the clean residual is at most tol0 / 2, so only changes below 1.5 tol0 can hide
                assert abs(d) <= 1.5 * tol0, (member, bit, d, tol0)
            else:  # detected near the tolerance: whatever was done leaves only tolerance-sized errors
                err = np.abs(buf.astype(np.float64) - clean.astype(np.float64)).max()
                assert err <= 2 * locate, (member, bit, err, locate)
    assert located >= K * {np.float32: 9, np.float16: 5, np.int8: 8}[dtype]
    if dtype == np.int8:
        assert not undetected  # integer checks are exact: every flip is seen
    elif dtype == np.float32:
        assert all(bit < 23 for _, bit in undetected)  # only low mantissa bits hide under the fp32 tolerance
    # fp16: sign and exponent flips of weights smaller than the tolerance can hide too (asserted harmless above)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int8])
def test_two_faults_in_a_block_are_reported_unrepairable_and_not_miscorrected(dtype):
    clean, pos = _block(dtype)
    ut = {1: np.uint8, 2: np.uint16, 4: np.uint32}[clean.itemsize]
    top = {1: 6, 2: 14, 4: 30}[clean.itemsize]
    buf = clean.copy()
    for m in (2, 9):
        buf.view(ut)[m] ^= ut(1) << ut(top)
    events = Scrubber([_target(buf, pos, clean)]).scrub_all(restore=False)
    assert [e.status for e in events] == ["unrepairable"]
    assert np.sum(buf.view(ut) != clean.view(ut)) == 2  # nothing was "repaired" into a third wrong value


def test_int8_quantizer_keeps_both_sums_exact_and_stays_close():
    rng = np.random.default_rng(0)
    pos = block_positions(4096, K, b"k", "w")
    w = project_numpy(rng.standard_normal(4096) * 0.05, pos).astype(np.float32)
    q, scale = quantize_blocks(w, pos)
    v = np.where(pos >= 0, q[np.maximum(pos, 0)].astype(np.int64), 0)
    assert np.all(v.sum(1) == 0) and np.all(v @ np.arange(K) == 0)
    assert np.abs(q * scale - w).max() <= 2.0 * scale
