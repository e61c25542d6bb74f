"""Independent Poisson spike counts with per-channel baseline rates and an optional slow drift.

Each channel fires at its own baseline rate (log-normal around ``mean_hz``), optionally
modulated by a slow sinusoid of relative amplitude ``drift`` and period
``drift_period_s`` with a random phase per channel: a cheap stand-in for the slow
non-stationarity of real recordings.  Counts per bin are Poisson with mean
``rate * bin_s``.
"""

from __future__ import annotations

import numpy as np

from ..params import Param
from .base import NeuralSource, register_source

__all__ = ["PoissonSource"]


@register_source("poisson")
class PoissonSource(NeuralSource):
    """Poisson counts, baseline rate per channel, optional sinusoidal drift."""

    PARAMS = (
        Param("mean_hz", float, 8.0, "median baseline firing rate per channel in Hz", low=0.0),
        Param("spread", float, 0.5, "log-normal sigma of the baseline rates across channels", low=0.0),
        Param("drift", float, 0.0, "relative amplitude of the slow rate drift (0: none)", 0.0, 1.0),
        Param("drift_period_s", float, 60.0, "period of the drift in seconds", low=1e-3),
    )

    def __init__(self, n_channels: int, rate_hz: float, seed: int = 0, *, mean_hz: float = 8.0,
                 spread: float = 0.5, drift: float = 0.0, drift_period_s: float = 60.0) -> None:
        super().__init__(n_channels, rate_hz, seed)
        self.mean_hz, self.spread = mean_hz, spread
        self.drift, self.drift_period_s = drift, drift_period_s
        self.reset(seed)

    def reset(self, seed: int | None = None) -> None:
        if seed is not None:
            self.seed = seed
        self.rng = np.random.default_rng(self.seed)
        self.baseline_hz = self.mean_hz * self.rng.lognormal(0.0, self.spread, self.n_channels)
        self.phase = self.rng.uniform(0.0, 2.0 * np.pi, self.n_channels)
        self.bin_index = 0

    def rates_hz(self, bin_index: int) -> np.ndarray:
        """Each channel's firing rate during bin ``bin_index``."""
        if not self.drift:
            return self.baseline_hz
        t = bin_index * self.bin_s
        return self.baseline_hz * (1.0 + self.drift * np.sin(2.0 * np.pi * t / self.drift_period_s + self.phase))

    def next_bin(self) -> np.ndarray:
        lam = self.rates_hz(self.bin_index) * self.bin_s
        self.bin_index += 1
        return np.minimum(self.rng.poisson(lam), 0xFFFF).astype(np.uint16)
