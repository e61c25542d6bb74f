"""Single-link flexible-joint robot: a motor driving a link through a torsional spring.

``x = [motor angle (rad), motor speed (rad/s), link angle (rad), link speed (rad/s)]``,
input ``u`` (motor command), output ``y = [motor angle]``, disturbance ``d`` a torque on
the motor side, in rad/s^2 of motor acceleration.

Notes
-----
The benchmark of the neural-observer literature (numbers as given there):

.. math::

   \\dot x = A x + B u + E d + f(x), \\qquad y = x_1,

   A = \\begin{bmatrix} 0 & 1 & 0 & 0 \\\\ -48.6 & -1.25 & 48.6 & 0 \\\\
   0 & 0 & 0 & 1 \\\\ 19.5 & 0 & -19.5 & 0 \\end{bmatrix}, \\quad
   B = [0, 21.6, 0, 0]^T, \\quad E = [0, 1, 0, 0]^T, \\quad
   f(x) = [0, 0, 0, -3.33 \\sin x_3]^T.

``f`` (link gravity) is globally Lipschitz with constant 3.33.  Default disturbance: a
sine of amplitude 1 rad/s^2 and period 2 s.
"""

from __future__ import annotations

import numpy as np

from ..params import Param
from .base import register_plant
from .disturbance import DisturbanceSignal, disturbance_params
from .structured import StructuredPlant

__all__ = ["FlexibleJoint", "FLEXIBLE_JOINT"]

FLEXIBLE_JOINT = {
    "A": np.array([[0.0, 1.0, 0.0, 0.0], [-48.6, -1.25, 48.6, 0.0], [0.0, 0.0, 0.0, 1.0],
                   [19.5, 0.0, -19.5, 0.0]]),
    "B": np.array([[0.0], [21.6], [0.0], [0.0]]),
    "E": np.array([[0.0], [1.0], [0.0], [0.0]]),
    "C": np.array([[1.0, 0.0, 0.0, 0.0]]),
    "gravity": 3.33,
}


@register_plant("flexible-joint")
class FlexibleJoint(StructuredPlant):
    """The single-link flexible-joint robot with link gravity ``-3.33 sin(x3)``."""

    PARAMS = (
        *disturbance_params("sine", 1.0, 2.0, "motor-side torque in rad/s^2"),
        Param("u_max", float, 5.0, "input limit (input is clipped to +-u_max)", low=0.0),
    )

    def __init__(self, dist: str, dist_amp: float, dist_time_s: float, dist_seed: int, u_max: float) -> None:
        m = FLEXIBLE_JOINT
        self._setup(m["A"], m["B"], m["E"], m["C"], np.zeros(4), u_max,
                    DisturbanceSignal(dist, dist_amp, dist_time_s, 1, dist_seed))

    def nonlinearity(self, x: np.ndarray) -> np.ndarray:
        return np.array([0.0, 0.0, 0.0, -FLEXIBLE_JOINT["gravity"] * np.sin(x[2])])
