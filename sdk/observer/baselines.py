"""Classical observers to compare the certified neural observer against, on the same plant models.

Each baseline runs the :class:`~closedloop.sdk.observer.systems.ObserverSystem` model in predictor
form with the interface of the neural observer, ``reset(z0_hat)`` and
``update(y, u) -> zhat_{k+1}``, and each is tuned by a fixed rule from the system's own
numbers (its bandwidth ``omega_o``, noise levels and error box), never on test data.

Notes
-----
With ``x = z[:n_x]`` and the model step ``m(z, u) = A_d z + B_d u + F_d f(x, u)``:

- :class:`Luenberger`: ``zhat+ = m(zhat, u) + L (y - C_d zhat)`` with the system's own
  ``L`` (poles ``-omega_o (1 + 0.25 i)``): exactly the neural observer without its network.
- :class:`HighGainObserver`: the same structure with the gains of a high-gain observer,
  ``L_i = alpha_i / eps^i`` in observability canonical form, i.e. the poles of
  ``s^n + alpha_1 s^(n-1) + ... + alpha_n`` divided by ``eps``.  Rule: ``alpha`` from
  ``(s + 1)^n`` (all poles at ``-1/eps``) for one output; for several outputs, where
  at most ``n_y`` poles may coincide, the prototype poles ``-(1 + 0.25 i)``; and
  ``eps = 1 / (3 omega_o)``: three times the Luenberger bandwidth.  Peaking: for an
  initial error ``e0`` the transient of the ``i``-th canonical coordinate grows like
  ``|e0| / eps^(i-1)`` before it decays; ``saturation`` clips the *returned* estimate
  (Khalil's remedy: the internal state stays unclipped).
- :class:`LinearESO`: all ``n_z`` poles at ``-omega_o`` (rule: ``omega_o`` of the
  system).  In the canonical case (``canonical=True``: a single-output integrator chain
  ``x_i' = x_(i+1)``, ``x_n' = phi(x) + b u + d``) the model is the chain and the extended
  state is the *total* disturbance ``phi + d``; the gains are then
  ``beta_i = C(n+1, i) omega_o^i`` (of ``(s + omega_o)^(n+1)``), and ``d`` is returned as
  the total estimate minus the known ``phi(xhat)``.  With several outputs, where
  ``place_poles`` accepts at most ``n_y`` equal poles, the "pole-placement equivalent"
  puts them in groups of ``n_y`` at ``-omega_o (1 + 0.05 j)``, ``j = 0, 1, ...``.
- :class:`ExtendedKalmanFilter`: the disturbance is a random-walk state; measurement
  update then prediction (Joseph form),

  .. math::

     K = P C^T (C P C^T + R)^{-1}, \\quad z^+ = z + K (y - C z), \\quad
     P^+ = (I - K C) P (I - K C)^T + K R K^T,

     z_{k+1} = m(z^+, u), \\quad P_{k+1} = F P^+ F^T + Q, \\quad
     F = A_d + F_d [\\partial f / \\partial x, 0].

  Rule: ``Q = diag(process_noise_std^2) dt``, ``R = diag(meas_noise_std^2)``,
  ``P_0 = diag(error_box^2 / 3)`` (the variance of a uniform draw from the error box).
"""

from __future__ import annotations

from collections.abc import Callable
from math import comb
from typing import Any

import numpy as np

from .systems import ObserverSystem, place_observer_gain

__all__ = ["Luenberger", "HighGainObserver", "LinearESO", "ExtendedKalmanFilter", "BASELINES", "make_baseline"]


class _LinearGainObserver:
    """``zhat+ = m(zhat, u) + L (y - C_d zhat)`` for a given gain; the shared core of three baselines."""

    name = "linear"

    def __init__(self, system: ObserverSystem, L: np.ndarray, use_nonlinearity: bool = True) -> None:
        self.system = system
        self.L = np.asarray(L, dtype=float)
        if self.L.shape != (system.n_z, system.n_y):
            raise ValueError(f"{type(self).__name__}: L has shape {self.L.shape}; expected "
                             f"({system.n_z}, {system.n_y})")
        self._nonlinear = use_nonlinearity and system.nonlinearity is not None
        self._Ad, self._Bd, self._Cd, self._Fd = system.Ad, system.Bd, system.Cd, system.Fd
        self._n_x = system.n_x
        self.z = np.zeros(system.n_z)

    def reset(self, z0_hat: np.ndarray) -> None:
        """Start from the estimate ``z0_hat``."""
        self.z = np.array(z0_hat, dtype=float).reshape(self.system.n_z)

    def update(self, y: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Read ``y_k``, ``u_k``; return ``zhat_{k+1}``."""
        z = self.z
        nxt = self._Ad @ z + self._Bd @ u + self.L @ (y - self._Cd @ z)
        if self._nonlinear:
            nxt += self._Fd @ self.system.f(z[:self._n_x], u)
        self.z = nxt
        return nxt.copy()


class Luenberger(_LinearGainObserver):
    """The linear observer with the system's own gain ``L`` (the neural observer's linear part).

    Examples
    --------
    >>> from closedloop.sdk.observer import observer_system
    >>> obs = Luenberger(observer_system("van-der-pol"))
    >>> obs.reset(np.zeros(3)); obs.update(np.array([0.1]), np.zeros(1)).shape
    (3,)
    """

    name = "luenberger"

    def __init__(self, system: ObserverSystem, L: np.ndarray | None = None, use_nonlinearity: bool = True) -> None:
        super().__init__(system, system.L if L is None else L, use_nonlinearity)


class HighGainObserver(_LinearGainObserver):
    """High-gain observer: poles of the ``alpha`` polynomial scaled by ``1/eps`` (see module notes)."""

    name = "high-gain"

    def __init__(self, system: ObserverSystem, eps: float | None = None, alphas: np.ndarray | None = None,
                 saturation: np.ndarray | None = None) -> None:
        n = system.n_z
        self.eps = 1.0 / (3.0 * system.omega_o) if eps is None else float(eps)
        if alphas is None:
            proto = -np.ones(n) if system.n_y == 1 else -(1.0 + 0.25 * np.arange(n))
        else:
            proto = np.roots(np.r_[1.0, np.asarray(alphas, dtype=float)])
            if np.any(proto.real >= 0):
                raise ValueError(f"HighGainObserver: s^n + alpha_1 s^(n-1) + ... with alphas={list(alphas)} is "
                                 "not Hurwitz")
        self.alphas = np.real(np.poly(proto))[1:]
        self.poles_c = proto / self.eps
        self.saturation = None if saturation is None else np.asarray(saturation, dtype=float)
        super().__init__(system, place_observer_gain(system.Ad, system.Cd, self.poles_c, system.dt))

    def update(self, y: np.ndarray, u: np.ndarray) -> np.ndarray:
        z = super().update(y, u)
        return z if self.saturation is None else np.clip(z, -self.saturation, self.saturation)


def _eso_poles(omega_o: float, n: int, n_y: int) -> np.ndarray:
    if n_y == 1:  # Ackermann places an n-fold pole
        return np.full(n, -omega_o)
    return -omega_o * (1.0 + 0.05 * (np.arange(n) // n_y))


class LinearESO(_LinearGainObserver):
    """Linear extended state observer with every pole at ``-omega_o`` (see module notes)."""

    name = "leso"

    def __init__(self, system: ObserverSystem, omega_o: float | None = None, canonical: bool = False) -> None:
        self.omega_o = system.omega_o if omega_o is None else float(omega_o)
        self.canonical = canonical
        self._plant_system = system
        if canonical:
            system = _canonical_chain(system)
        self.poles_c = _eso_poles(self.omega_o, system.n_z, system.n_y)
        super().__init__(system, place_observer_gain(system.Ad, system.Cd, self.poles_c, system.dt))

    def reset(self, z0_hat: np.ndarray) -> None:
        z0 = np.array(z0_hat, dtype=float)
        if self.canonical:  # the extended state is the total disturbance phi(x) + d
            ps, n = self._plant_system, self._plant_system.n_x
            z0[n] = self._known(z0[:n], np.zeros(ps.n_u)) + ps.E[-1, 0] * z0[n]
        super().reset(z0)

    def update(self, y: np.ndarray, u: np.ndarray) -> np.ndarray:
        z = super().update(y, u)
        if self.canonical:
            ps, n = self._plant_system, self._plant_system.n_x
            z[n] = (z[n] - self._known(z[:n], u)) / ps.E[-1, 0]
        return z

    def _known(self, x: np.ndarray, u: np.ndarray) -> float:
        ps = self._plant_system
        return float(ps.A[-1] @ x + ps.f(x, u)[-1])


def _canonical_chain(system: ObserverSystem) -> ObserverSystem:
    """The integrator-chain model of a single-output chain plant (ADRC's canonical form)."""
    n, A, B, E, C = system.n_x, system.A, system.B, system.E, system.C
    chain = np.eye(n, k=1)
    ok = (system.n_y == 1 and system.n_u == 1 and system.n_d == 1 and np.allclose(A[:-1], chain[:-1])
          and np.allclose(B[:-1], 0) and np.allclose(E[:-1], 0) and B[-1, 0] != 0 and E[-1, 0] != 0
          and np.allclose(C[0, 1:], 0) and C[0, 0] != 0)
    if ok and system.nonlinearity is not None:
        probe = np.random.default_rng(0).standard_normal(n)
        ok = bool(np.allclose(system.f(probe, np.zeros(1))[:-1], 0))
    if not ok:
        raise ValueError(f"LinearESO(canonical=True): plant {system.name!r} is not a single-output integrator "
                         "chain with input and disturbance in the last state; use canonical=False "
                         "(the model-based ESO)")
    e_n = np.zeros((n, 1))
    e_n[-1, 0] = 1.0
    return ObserverSystem(name=f"{system.name}-chain", dt=system.dt, A=chain, B=B[-1, 0] * e_n, E=e_n, C=C,
                          nonlinearity=None, poles_c=_eso_poles(system.omega_o, n + 1, 1), omega_o=system.omega_o,
                          nominal_x0=system.nominal_x0, error_box=system.error_box,
                          meas_noise_std=system.meas_noise_std, process_noise_std=system.process_noise_std,
                          gain="poles")


class ExtendedKalmanFilter:
    """EKF on the extended state with the disturbance as a random walk (see module notes)."""

    name = "ekf"

    def __init__(self, system: ObserverSystem, Q: np.ndarray | None = None, R: np.ndarray | None = None,
                 P0: np.ndarray | None = None) -> None:
        self.system = system
        self.Q = system.process_noise_cov() if Q is None else np.asarray(Q, dtype=float)
        self.R = np.diag(system.meas_noise_std ** 2) if R is None else np.asarray(R, dtype=float)
        self.P0 = np.diag(system.error_box ** 2 / 3.0) if P0 is None else np.asarray(P0, dtype=float)
        self._I = np.eye(system.n_z)
        self.z = np.zeros(system.n_z)
        self.P = self.P0.copy()

    def reset(self, z0_hat: np.ndarray) -> None:
        """Start from ``z0_hat`` with covariance ``P0``."""
        self.z = np.array(z0_hat, dtype=float).reshape(self.system.n_z)
        self.P = self.P0.copy()

    def update(self, y: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Measurement update with ``y_k``, then prediction with ``u_k``; returns ``zhat_{k+1}``."""
        s, z, P = self.system, self.z, self.P
        C = s.Cd
        PCt = P @ C.T
        K = np.linalg.solve(C @ PCt + self.R, PCt.T).T
        z = z + K @ (y - C @ z)
        IKC = self._I - K @ C
        P = IKC @ P @ IKC.T + K @ self.R @ K.T
        x = z[:s.n_x]
        F = s.Ad
        nxt = s.Ad @ z + s.Bd @ u
        if s.nonlinearity is not None:
            nxt += s.Fd @ s.f(x, u)
            F = s.Ad.copy()
            F[:, :s.n_x] += s.Fd @ s.f_jacobian(x, u)
        self.P = F @ P @ F.T + self.Q
        self.z = nxt
        return nxt.copy()


#: Baselines by name: ``make_baseline(name, system, **tuning)``.
BASELINES: dict[str, Callable[..., Any]] = {
    Luenberger.name: Luenberger,
    HighGainObserver.name: HighGainObserver,
    LinearESO.name: LinearESO,
    ExtendedKalmanFilter.name: ExtendedKalmanFilter,
}


def make_baseline(name: str, system: ObserverSystem, **tuning: Any) -> Any:
    """The baseline ``name`` on ``system`` with its default tuning rule unless ``tuning`` overrides it."""
    try:
        cls = BASELINES[name]
    except KeyError:
        raise KeyError(f"no baseline named {name!r}; known: {', '.join(sorted(BASELINES))}") from None
    return cls(system, **tuning)


def leso_gains(n: int, omega_o: float) -> np.ndarray:
    """The canonical-form LESO gains ``beta_i = C(n+1, i) omega_o^i``, ``i = 1 .. n+1``."""
    return np.array([comb(n + 1, i) * omega_o ** i for i in range(1, n + 2)], dtype=float)
