"""Neural sources: the Poisson source's rates, drift and determinism, and the source registry."""

from __future__ import annotations

import numpy as np
import pytest

from closedloop.sim.sources import NEURAL_SOURCES, UnknownSourceError, make_source


def test_poisson_counts_match_the_baseline_rates():
    src = make_source("poisson", n_channels=64, rate_hz=50.0, seed=1, mean_hz=20.0)
    counts = np.stack([src.next_bin() for _ in range(2000)])
    assert counts.dtype == np.uint16 and counts.shape == (2000, 64)
    np.testing.assert_allclose(counts.mean(0), src.baseline_hz * 0.02, rtol=0.15, atol=0.02)


def test_drift_modulates_rates_slowly():
    src = make_source("poisson", n_channels=8, rate_hz=50.0, drift=0.5, drift_period_s=10.0)
    r0, r_quarter = src.rates_hz(0), src.rates_hz(125)  # 2.5 s = a quarter period later
    assert not np.allclose(r0, r_quarter)
    assert np.all(r_quarter >= 0.5 * src.baseline_hz - 1e-9) and np.all(r_quarter <= 1.5 * src.baseline_hz + 1e-9)


def test_reset_replays_the_same_bins():
    src = make_source("poisson", n_channels=16, rate_hz=50.0, seed=4)
    first = [src.next_bin() for _ in range(5)]
    src.reset(4)
    assert all(np.array_equal(a, src.next_bin()) for a in first)
    src.reset(5)
    assert not all(np.array_equal(a, src.next_bin()) for a in first)


def test_unknown_source_names_the_registered_ones():
    assert "poisson" in NEURAL_SOURCES
    with pytest.raises(UnknownSourceError, match="poisson"):
        make_source("handwriting-v9", 4, 50.0)
