"""Run a true plant and an observer side by side at the observer's sample time.

The harness behind the baselines' tests, the benchmark's results table and the neural
observer's evaluation: the truth is a :class:`closedloop.sim.plants.Plant` (RK4 at a finer internal
step, or the physics engine for a physics-backed plant), the observer anything with
``reset(z0_hat)`` and ``update(y, u) -> z_hat`` (predictor form, see
:mod:`closedloop.sdk.observer.systems`).

Notes
-----
At sample ``k`` (time ``t_k = k dt``) the harness records the true extended state
``z_k = [x(t_k); d(t_k)]`` and the observer's current estimate ``zhat_k`` (``z0_hat`` at
``k = 0``, afterwards what the previous ``update`` returned), draws
``y_k = h(x(t_k)) + v_k`` with ``v_k ~ N(0, diag(noise**2))``, asks the input
``u_k = u_fn(t_k, zhat_k)`` (clipped to the plant's limits, as the plant emulator
does), times ``zhat_{k+1} = observer.update(y_k, u_k)`` with ``perf_counter_ns`` and
integrates the plant over ``[t_k, t_{k+1}]`` with ``u_k`` held.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from closedloop.sim.plants import Plant, rk4_step

__all__ = ["Observer", "SimResult", "simulate"]


class Observer(Protocol):
    """What the harness needs of an observer (the neural observer implements the same)."""

    def reset(self, z0_hat: np.ndarray) -> None: ...

    def update(self, y: np.ndarray, u: np.ndarray) -> np.ndarray: ...


@dataclass
class SimResult:
    """One run: arrays over samples ``k = 0 .. K-1`` (see the module notes for their timing)."""

    t: np.ndarray          #: (K,) sample times in s
    z: np.ndarray          #: (K, n_z) true extended state [x; d]
    z_hat: np.ndarray      #: (K, n_z) the observer's estimate of z at the same instant
    y: np.ndarray          #: (K, n_y) measured outputs (with noise)
    u: np.ndarray          #: (K, n_u) applied inputs
    update_ns: np.ndarray  #: (K,) wall-clock cost of each update in ns
    n_x: int               #: plant states; the rest of z is the disturbance

    @property
    def error(self) -> np.ndarray:
        """``z - z_hat``, shape ``(K, n_z)``."""
        return self.z - self.z_hat

    @property
    def dt(self) -> float:
        return float(self.t[1] - self.t[0]) if self.t.size > 1 else 0.0


class _FunctionPlant(Plant):
    """A plant given as functions (for tests and quick experiments)."""

    def __init__(self, f: Callable[[np.ndarray, np.ndarray, float], np.ndarray],
                 h: Callable[[np.ndarray], np.ndarray], x0: np.ndarray, n_u: int,
                 disturbance: Callable[[float], np.ndarray] | None, n_d: int) -> None:
        self._f, self._h, self._d = f, h, disturbance
        self.x0 = np.asarray(x0, dtype=float)
        self.n_states, self.n_inputs = self.x0.size, n_u
        self.n_outputs = np.asarray(h(self.x0)).size
        self.n_disturbances = n_d
        self.u_low, self.u_high = np.full(n_u, -np.inf), np.full(n_u, np.inf)

    def f(self, x: np.ndarray, u: np.ndarray, t: float) -> np.ndarray:
        return self._f(x, u, t)

    def h(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(self._h(x), dtype=float)

    def disturbance(self, t: float) -> np.ndarray:
        return np.zeros(self.n_disturbances) if self._d is None else np.asarray(self._d(t), dtype=float)


def simulate(truth: Plant | Callable[[np.ndarray, np.ndarray, float], np.ndarray], observer: Observer,
             u_fn: Callable[[float, np.ndarray], np.ndarray] | np.ndarray | None, T: float, dt: float = 1e-3,
             noise: float | np.ndarray = 0.0, seed: int = 0, *, x0: np.ndarray | None = None,
             z0_hat: np.ndarray | None = None, substeps: int = 5, h: Callable[[np.ndarray], np.ndarray] | None = None,
             n_u: int | None = None, disturbance: Callable[[float], np.ndarray] | None = None,
             n_d: int | None = None) -> SimResult:
    """Simulate ``T`` seconds of ``truth`` observed by ``observer`` at sample time ``dt``.

    Parameters
    ----------
    truth : Plant or callable
        A plant from :mod:`closedloop.sim.plants`; or ``f(x, u, t) -> dx/dt``, then ``h``, ``x0`` and
        ``n_u`` are required and ``disturbance(t)`` / ``n_d`` optional.
    observer : Observer
        ``reset(z0_hat)``, ``update(y, u) -> z_hat`` (one call per sample).
    u_fn : callable, array or None
        ``u_fn(t, z_hat) -> u`` (state feedback on the estimate), a constant input, or
        ``None`` for zero input.
    T, dt : float
        Duration and the observer's sample time in s (``round(T / dt)`` samples).
    noise : float or array
        Measurement noise standard deviation, per output or for all.
    seed : int
        Seed of the measurement noise.
    x0 : array, optional
        Initial plant state (default the plant's ``x0``).
    z0_hat : array, optional
        The observer's initial estimate (default ``[x0; 0]``: no initial error in ``x``).
    substeps : int
        Integration steps per sample (RK4, or engine steps of ``dt / substeps``).
    """
    if isinstance(truth, Plant):
        plant = truth
    else:
        if h is None or x0 is None or n_u is None:
            raise TypeError("simulate: a function truth needs h=, x0= and n_u= (or pass a sim.plants.Plant)")
        plant = _FunctionPlant(truth, h, x0, n_u, disturbance, n_d or 0)
    x = np.array(plant.x0 if x0 is None else x0, dtype=float)
    n_x, n_u_, n_d_ = plant.n_states, plant.n_inputs, plant.n_disturbances
    if x.shape != (n_x,):
        raise ValueError(f"simulate: x0 has shape {x.shape}; the plant has {n_x} states")
    n_z = n_x + n_d_
    z_hat = np.concatenate([x, np.zeros(n_d_)]) if z0_hat is None else np.array(z0_hat, dtype=float)
    if z_hat.shape != (n_z,):
        raise ValueError(f"simulate: z0_hat has shape {z_hat.shape}; expected ({n_z},) = {n_x} states + "
                         f"{n_d_} disturbances of plant {type(plant).__name__}")
    K = int(round(T / dt))
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x0B5E]))
    sigma = np.broadcast_to(np.asarray(noise, dtype=float), (plant.n_outputs,))
    u_low = np.asarray(plant.u_low, dtype=float)
    u_high = np.asarray(plant.u_high, dtype=float)
    if u_fn is None:
        u_const: np.ndarray | None = np.zeros(n_u_)
    elif callable(u_fn):
        u_const = None
    else:
        u_const = np.broadcast_to(np.asarray(u_fn, dtype=float), (n_u_,)).copy()

    out_t = np.arange(K) * dt
    out_z, out_zh = np.empty((K, n_z)), np.empty((K, n_z))
    out_y, out_u = np.empty((K, plant.n_outputs)), np.empty((K, n_u_))
    cost = np.empty(K, dtype=np.int64)
    h_step = dt / substeps
    observer.reset(z_hat.copy())
    for k in range(K):
        t = k * dt
        out_z[k, :n_x], out_z[k, n_x:] = x, plant.disturbance(t)
        out_zh[k] = z_hat
        y = np.asarray(plant.h(x), dtype=float)
        if sigma.any():
            y = y + sigma * rng.standard_normal(y.shape)
        u = u_const if u_const is not None else np.asarray(u_fn(t, z_hat), dtype=float)  # type: ignore[misc]
        u = np.clip(u, u_low, u_high)
        out_y[k], out_u[k] = y, u
        t0 = time.perf_counter_ns()
        z_hat = np.asarray(observer.update(y, u), dtype=float)
        cost[k] = time.perf_counter_ns() - t0
        for j in range(substeps):
            x = rk4_step(plant, x, u, t + j * h_step, h_step)
        if not np.all(np.isfinite(x)):
            raise FloatingPointError(f"simulate: the plant state became non-finite at t = {t + dt:.4g} s "
                                     f"(x = {x.tolist()}); shorten T or stabilise the plant")
    return SimResult(out_t, out_z, out_zh, out_y, out_u, cost, n_x)
