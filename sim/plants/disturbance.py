"""Seeded, smooth disturbance signals ``d(t)`` for plants (gusts, steps, sines), and their URL parameters.

A plant that is driven by an unknown input ``x' = ... + E d(t)`` owns one
:class:`DisturbanceSignal`; the observer tests compare their estimate of ``d`` with
:meth:`DisturbanceSignal.__call__`.  The signal is a deterministic function of time once
built (so RK4 can evaluate it at intermediate stages), reproducible from its seed.

Notes
-----
``gust`` is a Dryden-like first-order gust: an Ornstein-Uhlenbeck process
``tau d' = -d + sigma sqrt(2 tau) w`` (stationary standard deviation ``sigma``, corner
frequency ``1/tau``), drawn exactly on a 1 ms grid,

.. math:: d_{k+1} = a d_k + \\sigma \\sqrt{1 - a^2} \\, w_k, \\qquad a = e^{-\\Delta/\\tau},

started from its stationary law and interpolated linearly between grid points.  After
``horizon_s`` seconds the record repeats.  ``step`` is ``amp`` from ``time_s`` on, ``sine``
is ``amp sin(2 pi t / time_s)``; with several channels, channel ``i`` of a sine has phase
``i pi / 2``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..params import Param

__all__ = ["DisturbanceSignal", "DISTURBANCE_KINDS", "disturbance_params"]

DISTURBANCE_KINDS = ("none", "step", "sine", "gust")


def disturbance_params(kind: str, amp: float, time_s: float, what: str) -> tuple[Param, ...]:
    """The four URL parameters of a plant's disturbance, with that plant's defaults.

    ``what`` names the disturbance and its unit for the help text (e.g. ``"vertical gust angle in rad"``).
    """
    return (
        Param("dist", str, kind, f"disturbance d(t) ({what}): none, step, sine or gust (first-order, Dryden-like)",
              choices=lambda: DISTURBANCE_KINDS),
        Param("dist_amp", float, amp, "step height, sine amplitude or gust standard deviation (units of d)",
              low=0.0),
        Param("dist_time_s", float, time_s, "step time, sine period or gust correlation time in s", low=1e-6),
        Param("dist_seed", int, 0, "seed of the gust record and of any model perturbation", low=0),
    )


@dataclass
class DisturbanceSignal:
    """``d(t)`` with ``n`` channels; see the module notes for each kind."""

    kind: str = "none"
    amp: float = 0.0
    time_s: float = 1.0
    n: int = 1
    seed: int = 0
    grid_s: float = 1e-3
    horizon_s: float = 120.0

    def __post_init__(self) -> None:
        if self.kind not in DISTURBANCE_KINDS:
            raise ValueError(f"disturbance kind {self.kind!r} is not one of {', '.join(DISTURBANCE_KINDS)}")
        self._record: np.ndarray | None = None
        if self.kind == "gust" and self.amp > 0:
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, 0x6057]))
            steps = int(round(self.horizon_s / self.grid_s)) + 1
            a = float(np.exp(-self.grid_s / self.time_s))
            w = rng.standard_normal((steps, self.n))
            rec = np.empty((steps, self.n))
            rec[0] = self.amp * w[0]
            scale = self.amp * np.sqrt(1.0 - a * a)
            for k in range(1, steps):
                rec[k] = a * rec[k - 1] + scale * w[k]
            self._record = rec

    def __call__(self, t: float) -> np.ndarray:
        """The disturbance at time ``t`` (seconds), shape ``(n,)``."""
        if self.kind == "none" or self.amp == 0.0:
            return np.zeros(self.n)
        if self.kind == "step":
            return np.full(self.n, self.amp if t >= self.time_s else 0.0)
        if self.kind == "sine":
            phase = np.arange(self.n) * (np.pi / 2)
            return self.amp * np.sin(2 * np.pi * t / self.time_s + phase)
        rec = self._record
        assert rec is not None
        s = (t % self.horizon_s) / self.grid_s
        k = min(int(s), rec.shape[0] - 2)
        frac = s - k
        return (1.0 - frac) * rec[k] + frac * rec[k + 1]
