"""Scores of an observer run: RMSE, settling time, peak error, noise amplification, cost, Monte Carlo.

Computed from :class:`~closedloop.sdk.observer.simulate.SimResult` arrays, so the neural observer
and the baselines are scored by the same code; the benchmark's results table is made of
these numbers.

Notes
-----
With the estimation error ``e_k = z_k - zhat_k`` over samples ``k`` in the scored window
(``t_k >= from_s``), split into states ``e^x`` and disturbances ``e^d``:

- RMSE per component ``sqrt(mean_k e_{k,i}^2)``; the scalar state (disturbance) RMSE is
  ``sqrt(mean_k |e^x_k|^2)``, the root of the mean squared Euclidean norm.
- Error norms are taken after dividing each component by ``scale`` (default the
  system's error box, so that feet per second and radians count alike):
  ``n_k = |e_k / scale|``.
- Settling time: the first ``t_k`` after which ``n_j <= fraction * n_0`` for every
  ``j >= k`` (default ``fraction = 0.02``, the 2 % band); ``inf`` when the run ends
  outside the band.
- Peak error ``max_k n_k`` and peak ratio ``max_k n_k / n_0`` (> 1: peaking).
- Noise amplification: two runs identical but for measurement noise ``v`` (same
  initial error and input); the estimate noise is ``zhat^noisy - zhat^clean``.  Its
  per-component standard deviation over the window is ``estimate_noise_std``; the scalar
  ``noise_amplification`` is the RMS over components of ``estimate_noise_std / scale``
  divided by the RMS over outputs of ``noise_std / y_scale`` with
  ``y_scale = |C_d| scale``, the output range of the error box: the estimate's noise
  as a fraction of the error domain per unit of measurement noise as a fraction of the
  same domain seen through the outputs.  Below 1 the observer filters, above 1 it
  amplifies.
- Cost per update: mean, median, 99th percentile and maximum of the ``update`` wall
  time in microseconds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .simulate import SimResult

__all__ = ["rmse", "settling_time", "peak_error", "noise_amplification", "cost_us", "ObserverMetrics",
           "observer_metrics", "MonteCarloResult", "monte_carlo", "sample_box"]


def rmse(err: np.ndarray) -> np.ndarray:
    """Root mean square over time (axis 0) per component."""
    err = np.asarray(err, dtype=float)
    return np.sqrt(np.mean(err ** 2, axis=0))


def settling_time(t: np.ndarray, err_norm: np.ndarray, fraction: float = 0.02) -> float:
    """First time after which ``err_norm`` stays within ``fraction`` of its initial value (``inf``: never).

    Examples
    --------
    >>> t = np.arange(5.0)
    >>> settling_time(t, np.array([1.0, 0.5, 0.01, 0.03, 0.001]), 0.02)
    4.0
    """
    err_norm = np.asarray(err_norm, dtype=float)
    bound = fraction * err_norm[0]
    outside = np.nonzero(err_norm > bound)[0]
    if outside.size == 0:
        return float(t[0])
    last = outside[-1]
    return float(t[last + 1]) if last + 1 < len(t) else float("inf")


def peak_error(err_norm: np.ndarray) -> tuple[float, float]:
    """``(max_k n_k, max_k n_k / n_0)``."""
    err_norm = np.asarray(err_norm, dtype=float)
    peak = float(np.max(err_norm))
    return peak, (peak / float(err_norm[0]) if err_norm[0] > 0 else float("inf"))


def noise_amplification(z_hat_noisy: np.ndarray, z_hat_clean: np.ndarray, noise_std: float | np.ndarray,
                        scale: np.ndarray, y_scale: np.ndarray) -> tuple[float, np.ndarray]:
    """``(noise_amplification, estimate_noise_std)`` as defined in the module notes."""
    est = np.std(np.asarray(z_hat_noisy) - np.asarray(z_hat_clean), axis=0)
    y_scale = np.asarray(y_scale, dtype=float)
    sigma = np.broadcast_to(np.asarray(noise_std, dtype=float), y_scale.shape)
    den = float(np.sqrt(np.mean((sigma / y_scale) ** 2)))
    if den == 0.0:
        raise ValueError("noise_amplification: the measurement noise is zero; run the noisy case with noise > 0")
    return float(np.sqrt(np.mean((est / scale) ** 2))) / den, est


def cost_us(update_ns: np.ndarray) -> dict[str, float]:
    """Mean, median, p99 and max of the update cost in microseconds."""
    us = np.asarray(update_ns, dtype=float) / 1e3
    return {"mean": float(us.mean()), "p50": float(np.median(us)), "p99": float(np.percentile(us, 99)),
            "max": float(us.max())}


@dataclass
class ObserverMetrics:
    """One run's scores (see the module notes for each definition)."""

    state_rmse: float
    disturbance_rmse: float
    state_rmse_each: list[float]
    disturbance_rmse_each: list[float]
    settling_time_s: float
    peak_error: float
    peak_ratio: float
    cost_us: dict[str, float]
    noise_amplification: float | None = None
    estimate_noise_std: list[float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def observer_metrics(result: SimResult, *, scale: np.ndarray | None = None, fraction: float = 0.02,
                     from_s: float = 0.0, clean: SimResult | None = None, noise_std: float | np.ndarray = 0.0,
                     Cd: np.ndarray | None = None) -> ObserverMetrics:
    """Score one run.

    Parameters
    ----------
    result : SimResult
        The run to score (with noise, when ``clean`` is given).
    scale : array, optional
        Per-component normalisation of the error norm (default ones; pass the system's
        ``error_box``).
    fraction : float
        Settling band as a fraction of the initial error norm.
    from_s : float
        RMSE and noise amplification use samples with ``t >= from_s`` (settling and peak
        always use the whole run).
    clean, noise_std, Cd
        The noise-free twin of ``result``, the noise level of ``result`` and the output
        matrix, for the noise amplification.
    """
    err = result.error
    n_x = result.n_x
    scale = np.ones(err.shape[1]) if scale is None else np.asarray(scale, dtype=float)
    norm = np.linalg.norm(err / scale, axis=1)
    window = result.t >= from_s
    ew = err[window]
    peak, ratio = peak_error(norm)
    amp, est = None, None
    if clean is not None:
        C = np.eye(err.shape[1])[: result.y.shape[1]] if Cd is None else np.asarray(Cd, dtype=float)
        a, e = noise_amplification(result.z_hat[window], clean.z_hat[window], noise_std, scale, np.abs(C) @ scale)
        amp, est = a, e.tolist()
    return ObserverMetrics(
        state_rmse=float(np.sqrt(np.mean(np.sum(ew[:, :n_x] ** 2, axis=1)))),
        disturbance_rmse=float(np.sqrt(np.mean(np.sum(ew[:, n_x:] ** 2, axis=1)))) if err.shape[1] > n_x else 0.0,
        state_rmse_each=rmse(ew[:, :n_x]).tolist(), disturbance_rmse_each=rmse(ew[:, n_x:]).tolist(),
        settling_time_s=settling_time(result.t, norm, fraction), peak_error=peak, peak_ratio=ratio,
        cost_us=cost_us(result.update_ns), noise_amplification=amp, estimate_noise_std=est)


def sample_box(half_widths: np.ndarray, n: int, seed: int = 0) -> np.ndarray:
    """``n`` points drawn uniformly from the box ``|e_i| <= half_widths[i]``, shape ``(n, len(half_widths))``."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x3C]))
    w = np.asarray(half_widths, dtype=float)
    return rng.uniform(-1.0, 1.0, (n, w.size)) * w


@dataclass
class MonteCarloResult:
    """Scores of runs from several initial errors, and their summary (mean, std, median, worst)."""

    initial_errors: np.ndarray
    runs: list[ObserverMetrics]
    summary: dict[str, dict[str, float]] = field(default_factory=dict)


_SUMMARISED = ("state_rmse", "disturbance_rmse", "settling_time_s", "peak_error", "peak_ratio")


def monte_carlo(run: Callable[[np.ndarray], SimResult], initial_errors: np.ndarray | Sequence[Sequence[float]],
                **metric_kw: Any) -> MonteCarloResult:
    """Run ``run(e0)`` (which simulates with ``z0_hat = z0 - e0``) for each initial error and score each.

    ``metric_kw`` goes to :func:`observer_metrics` (``scale``, ``fraction``, ``from_s``).
    Draw the errors with :func:`sample_box` (or ``ObserverSystem.sample_errors``) from the
    set the certificate covers.
    """
    errors = np.atleast_2d(np.asarray(initial_errors, dtype=float))
    runs = [observer_metrics(run(e0), **metric_kw) for e0 in errors]
    summary: dict[str, dict[str, float]] = {}
    for key in _SUMMARISED:
        vals = np.array([getattr(m, key) for m in runs], dtype=float)
        finite = vals[np.isfinite(vals)]
        summary[key] = {"mean": float(finite.mean()) if finite.size else float("inf"),
                        "std": float(finite.std()) if finite.size else 0.0,
                        "median": float(np.median(vals)), "worst": float(vals.max()),
                        "n_inf": int(np.sum(~np.isfinite(vals)))}
    cost = np.array([m.cost_us["mean"] for m in runs])
    summary["cost_us_mean"] = {"mean": float(cost.mean()), "worst": float(cost.max())}
    return MonteCarloResult(errors, runs, summary)
