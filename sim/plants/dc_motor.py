"""Armature-controlled DC motor (the parameters of the classic CTMS speed-control example).

State ``x = [angle (rad), speed (rad/s), armature current (A)]``, input
``u = [voltage (V)]``, outputs ``y = [angle, speed]``::

    J w' = K i - b w
    L i' = V - R i - K w
"""

from __future__ import annotations

import numpy as np

from ..params import Param
from .base import Plant, register_plant

__all__ = ["DCMotor"]


@register_plant("dc-motor")
class DCMotor(Plant):
    """A DC motor with rotor inertia, viscous friction and armature inductance."""

    PARAMS = (
        Param("inertia", float, 0.01, "rotor inertia J in kg m^2", low=1e-9),
        Param("friction", float, 0.1, "viscous friction b in N m s", low=0.0),
        Param("k_motor", float, 0.01, "motor constant K in N m/A (= V s/rad)", low=0.0),
        Param("resistance", float, 1.0, "armature resistance R in ohm", low=1e-9),
        Param("inductance", float, 0.5, "armature inductance L in H", low=1e-9),
        Param("v_max", float, 12.0, "voltage limit in V (input is clipped to +-v_max)", low=0.0),
    )

    def __init__(self, inertia: float, friction: float, k_motor: float, resistance: float,
                 inductance: float, v_max: float) -> None:
        self.J, self.b, self.K, self.R, self.L = inertia, friction, k_motor, resistance, inductance
        self.n_states, self.n_inputs, self.n_outputs = 3, 1, 2
        self.x0 = np.zeros(3)
        self.u_low = np.array([-v_max])
        self.u_high = np.array([v_max])

    def f(self, x: np.ndarray, u: np.ndarray, t: float) -> np.ndarray:
        _, w, i = x
        return np.array([w, (self.K * i - self.b * w) / self.J, (u[0] - self.R * i - self.K * w) / self.L])

    def h(self, x: np.ndarray) -> np.ndarray:
        return x[:2].copy()
