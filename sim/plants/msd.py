"""Mass-spring-damper: the smallest plant worth closing a loop around.

State ``x = [position (m), velocity (m/s)]``, input ``u = [force (N)]``, output
``y = [position]``: ``m p'' + c p' + k p = u``.
"""

from __future__ import annotations

import numpy as np

from ..params import Param
from .base import Plant, register_plant

__all__ = ["MassSpringDamper"]


@register_plant("msd")
class MassSpringDamper(Plant):
    """``m p'' + c p' + k p = u`` with ``|u| <= u_max``."""

    PARAMS = (
        Param("mass", float, 1.0, "mass in kg", low=1e-6),
        Param("damping", float, 0.5, "viscous damping in N s/m", low=0.0),
        Param("stiffness", float, 4.0, "spring constant in N/m", low=0.0),
        Param("u_max", float, 10.0, "force limit in N (input is clipped to +-u_max)", low=0.0),
    )

    def __init__(self, mass: float, damping: float, stiffness: float, u_max: float) -> None:
        self.mass, self.damping, self.stiffness = mass, damping, stiffness
        self.n_states, self.n_inputs, self.n_outputs = 2, 1, 1
        self.x0 = np.zeros(2)
        self.u_low = np.array([-u_max])
        self.u_high = np.array([u_max])

    def f(self, x: np.ndarray, u: np.ndarray, t: float) -> np.ndarray:
        p, v = x
        return np.array([v, (u[0] - self.damping * v - self.stiffness * p) / self.mass])

    def h(self, x: np.ndarray) -> np.ndarray:
        return x[:1].copy()
