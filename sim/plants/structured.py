"""Plants of the form ``x' = A x + B u + E d(t) + f(x)``, ``y = C x``: the observer benchmarks' shape.

The X-29A, the flexible-joint robot and Van der Pol share this structure; each
subclass supplies its matrices, its known nonlinearity and its disturbance.  The
matrices are public (``A``, ``B``, ``E``, ``C``) because the observer's model
(``closedloop.sdk.observer.systems``) is built from the same numbers, so the plant and the model
cannot drift apart silently; a plant may still differ from the model on purpose
(``A_true``, ``B_true``: model and actuator uncertainty).
"""

from __future__ import annotations

import numpy as np

from .base import Plant
from .disturbance import DisturbanceSignal

__all__ = ["StructuredPlant"]


class StructuredPlant(Plant):
    """``x' = A_true x + B_true u + E d(t) + nonlinearity(x)``, ``y = C x``.

    Subclasses call :meth:`_setup` from ``__init__`` and may override :meth:`nonlinearity`.
    """

    A: np.ndarray
    B: np.ndarray
    E: np.ndarray
    C: np.ndarray
    A_true: np.ndarray
    B_true: np.ndarray

    def _setup(self, A: np.ndarray, B: np.ndarray, E: np.ndarray, C: np.ndarray, x0: np.ndarray,
               u_max: float, dist: DisturbanceSignal, A_true: np.ndarray | None = None,
               B_true: np.ndarray | None = None) -> None:
        self.A, self.B, self.E, self.C = (np.asarray(m, dtype=float) for m in (A, B, E, C))
        self.A_true = self.A if A_true is None else np.asarray(A_true, dtype=float)
        self.B_true = self.B if B_true is None else np.asarray(B_true, dtype=float)
        self.n_states, self.n_inputs = self.B.shape
        self.n_outputs = self.C.shape[0]
        self.n_disturbances = self.E.shape[1]
        self.x0 = np.asarray(x0, dtype=float)
        self.u_low = np.full(self.n_inputs, -u_max)
        self.u_high = np.full(self.n_inputs, u_max)
        self.dist = dist

    def nonlinearity(self, x: np.ndarray) -> np.ndarray:
        """The known nonlinear part ``f(x)`` of the dynamics (zero for linear plants)."""
        return np.zeros(self.n_states)

    def disturbance(self, t: float) -> np.ndarray:
        return self.dist(t)

    def f(self, x: np.ndarray, u: np.ndarray, t: float) -> np.ndarray:
        return self.A_true @ x + self.B_true @ u + self.E @ self.dist(t) + self.nonlinearity(x)

    def h(self, x: np.ndarray) -> np.ndarray:
        return self.C @ x
