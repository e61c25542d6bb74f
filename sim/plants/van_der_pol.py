"""Van der Pol oscillator with a forcing input and an unknown disturbance.

``x = [x1, x2]``, ``y = [x1]``, dimensionless.

Notes
-----
.. math::

   \\dot x_1 = x_2, \\qquad \\dot x_2 = \\mu (1 - x_1^2) x_2 - x_1 + u + d,

written as ``x' = A x + B u + E d + f(x)`` with the linear part
``A = [[0, 1], [-1, mu]]``, ``B = E = [0, 1]^T`` and ``f(x) = [0, -mu x1^2 x2]^T``
(locally, not globally, Lipschitz).  It starts at ``x0 = [2, 0]``, near the limit cycle
(amplitude about 2 for ``mu = 1``).  Default disturbance: a 0.5 step at 1 s.
"""

from __future__ import annotations

import numpy as np

from ..params import Param
from .base import register_plant
from .disturbance import DisturbanceSignal, disturbance_params
from .structured import StructuredPlant

__all__ = ["VanDerPol", "van_der_pol_matrices"]


def van_der_pol_matrices(mu: float) -> dict[str, np.ndarray]:
    """``A, B, E, C`` of the linear part for damping parameter ``mu``."""
    return {"A": np.array([[0.0, 1.0], [-1.0, mu]]), "B": np.array([[0.0], [1.0]]),
            "E": np.array([[0.0], [1.0]]), "C": np.array([[1.0, 0.0]])}


@register_plant("van-der-pol")
class VanDerPol(StructuredPlant):
    """``x1'' - mu (1 - x1^2) x1' + x1 = u + d``."""

    PARAMS = (
        Param("mu", float, 1.0, "nonlinear damping parameter", low=0.0),
        *disturbance_params("step", 0.5, 1.0, "force on x2'"),
        Param("u_max", float, 10.0, "input limit (input is clipped to +-u_max)", low=0.0),
    )

    def __init__(self, mu: float, dist: str, dist_amp: float, dist_time_s: float, dist_seed: int,
                 u_max: float) -> None:
        self.mu = mu
        m = van_der_pol_matrices(mu)
        self._setup(m["A"], m["B"], m["E"], m["C"], np.array([2.0, 0.0]), u_max,
                    DisturbanceSignal(dist, dist_amp, dist_time_s, 1, dist_seed))

    def nonlinearity(self, x: np.ndarray) -> np.ndarray:
        return np.array([0.0, -self.mu * x[0] ** 2 * x[1]])
