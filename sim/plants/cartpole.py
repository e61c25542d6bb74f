"""Cart-pole whose truth is PyBullet's physics (``cartpole.urdf`` from ``pybullet_data``).

``x = [cart position (m), cart velocity (m/s), pole angle (rad), pole rate (rad/s)]``,
angle 0 upright and positive when the pole leans toward +x; input ``u`` a horizontal
force on the cart (N); output ``y = [cart position (m), pole angle (rad)]``; disturbance
``d`` an extra force on the cart (N), so ``E = B``.

Notes
-----
The URDF's own values: cart 1.0 kg, pole 0.1 kg with its centre of mass 0.5 m above the
pivot (a 1.0 m box, half-length 0.5), a prismatic slider limited to +-15 m, a continuous
pole joint about +y, no joint damping or friction; gravity is not in the URDF (9.8 m/s^2
is set here).  Its inertia tensors are placeholders: 1.0 kg m^2 about every axis, for
the pole too, where a uniform 0.1 kg, 1 m rod has ``m (2 l)^2 / 12 = 0.0083 kg m^2``
about its centre.  With 1.0 the pole falls about 5.7 times slower than the textbook
cart-pole.  This plant therefore sets the pole's inertia to ``pole_inertia`` (default
the uniform rod) through ``changeDynamics``; pass ``pole_inertia=1.0`` for the URDF's
value.  PyBullet's default link damping (0.04) is switched off and its default joint
velocity motors are disabled, so the only forces are gravity and ``u + d``.

The model (``cartpole_model``) is the Lagrangian cart-pole with a pole of inertia ``I``
about its centre of mass at distance ``l`` from the pivot:

.. math::

   (M + m) \\ddot p + m l \\cos\\theta \\, \\ddot\\theta = F + m l \\sin\\theta \\, \\dot\\theta^2, \\qquad
   m l \\cos\\theta \\, \\ddot p + (I + m l^2) \\ddot\\theta = m g l \\sin\\theta,

with ``F = u + d``; for ``I = m l^2 / 3`` it is the textbook (Barto, Sutton, Anderson
1983) model.  The truth (:meth:`CartPole.advance`) resets PyBullet's joints to ``x``,
applies the force and calls ``stepSimulation`` once with time step ``dt`` (PyBullet's
semi-implicit Euler); ``f`` is this model, used only where a derivative is asked for.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..params import Param
from .base import Plant, register_plant
from .disturbance import DisturbanceSignal, disturbance_params

__all__ = ["CartPole", "CARTPOLE", "cartpole_model", "cartpole_linearization"]

#: Textbook constants (the URDF agrees on the masses and the length).
CARTPOLE = {"cart_mass": 1.0, "pole_mass": 0.1, "half_length": 0.5, "gravity": 9.8}
ROD_INERTIA = CARTPOLE["pole_mass"] * (2 * CARTPOLE["half_length"]) ** 2 / 12.0


def cartpole_model(x: Any, force: Any, xp: Any = np, *, cart_mass: float = 1.0, pole_mass: float = 0.1,
                   half_length: float = 0.5, gravity: float = 9.8, pole_inertia: float = ROD_INERTIA) -> Any:
    """State derivative of the cart-pole for states ``x[..., 4]`` and forces ``force[...]``.

    ``xp`` is the array module (``numpy`` or ``torch``), so the observer's training code
    can use the same function on batched tensors.
    """
    M, m, half, g, inertia = cart_mass, pole_mass, half_length, gravity, pole_inertia
    v, th, om = x[..., 1], x[..., 2], x[..., 3]
    s, c = xp.sin(th), xp.cos(th)
    r1 = force + m * half * s * om * om
    r2 = m * g * half * s
    a11, a12, a22 = M + m, m * half * c, inertia + m * half * half
    det = a11 * a22 - a12 * a12
    acc = (a22 * r1 - a12 * r2) / det
    alpha = (a11 * r2 - a12 * r1) / det
    return xp.stack([v, acc, om, alpha], -1)


def cartpole_linearization(**consts: float) -> dict[str, np.ndarray]:
    """``A, B, E, C`` of the model linearised at the upright equilibrium."""
    p = {**CARTPOLE, "pole_inertia": ROD_INERTIA, **consts}
    M, m, half, g, inertia = p["cart_mass"], p["pole_mass"], p["half_length"], p["gravity"], p["pole_inertia"]
    a22 = inertia + m * half * half
    det = (M + m) * a22 - (m * half) ** 2
    A = np.array([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, -(m * half) * m * g * half / det, 0.0], [0.0, 0.0, 0.0, 1.0],
                  [0.0, 0.0, (M + m) * m * g * half / det, 0.0]])
    B = np.array([[0.0], [a22 / det], [0.0], [-(m * half) / det]])
    C = np.array([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    return {"A": A, "B": B, "E": B.copy(), "C": C}


@register_plant("cartpole")
class CartPole(Plant):
    """PyBullet cart-pole; see the module notes for the URDF's values and what is changed."""

    PARAMS = (
        Param("theta0", float, 0.05, "initial pole angle in rad (0 is upright)", low=-np.pi, high=np.pi),
        Param("pole_inertia", float, ROD_INERTIA, "pole inertia about its centre in kg m^2 (URDF: 1.0)",
              low=1e-6),
        *disturbance_params("none", 0.5, 1.0, "force on the cart in N"),
        Param("u_max", float, 20.0, "force limit in N (input is clipped to +-u_max)", low=0.0),
    )

    def __init__(self, theta0: float, pole_inertia: float, dist: str, dist_amp: float, dist_time_s: float,
                 dist_seed: int, u_max: float) -> None:
        self.pole_inertia = pole_inertia
        self.n_states, self.n_inputs, self.n_outputs, self.n_disturbances = 4, 1, 2, 1
        self.x0 = np.array([0.0, 0.0, theta0, 0.0])
        self.u_low, self.u_high = np.array([-u_max]), np.array([u_max])
        self.dist = DisturbanceSignal(dist, dist_amp, dist_time_s, 1, dist_seed)
        self._client: int | None = None
        self._dt: float | None = None

    # -- the engine ---------------------------------------------------------------------------------
    def _connect(self) -> None:
        import pybullet as pb
        import pybullet_data

        self._pb = pb
        cid = pb.connect(pb.DIRECT)
        pb.setAdditionalSearchPath(pybullet_data.getDataPath(), physicsClientId=cid)
        pb.setGravity(0, 0, -CARTPOLE["gravity"], physicsClientId=cid)
        body = pb.loadURDF("cartpole.urdf", useFixedBase=True, physicsClientId=cid)
        for link in (-1, 0, 1):
            pb.changeDynamics(body, link, linearDamping=0.0, angularDamping=0.0, jointDamping=0.0,
                              physicsClientId=cid)
        inertia = self.pole_inertia
        pb.changeDynamics(body, 1, localInertiaDiagonal=[inertia, inertia, inertia], physicsClientId=cid)
        for joint in (0, 1):
            pb.setJointMotorControl2(body, joint, pb.VELOCITY_CONTROL, force=0.0, physicsClientId=cid)
        self._client, self._body = cid, body

    def urdf_values(self) -> dict[str, float]:
        """Masses and inertias as PyBullet holds them (after this plant's changes)."""
        if self._client is None:
            self._connect()
        pb, cid, body = self._pb, self._client, self._body
        cart, pole = (pb.getDynamicsInfo(body, j, physicsClientId=cid) for j in (0, 1))
        com = pb.getLinkState(body, 1, physicsClientId=cid)[2]  # local inertial frame position
        return {"cart_mass": cart[0], "pole_mass": pole[0], "pole_inertia_yy": pole[2][1],
                "pole_com_z_in_link": com[2]}

    def advance(self, x: np.ndarray, u: np.ndarray, t: float, dt: float) -> np.ndarray:
        """One PyBullet step of ``dt`` seconds from state ``x`` with force ``u + d(t)`` on the cart."""
        if self._client is None:
            self._connect()
        pb, cid, body = self._pb, self._client, self._body
        if dt != self._dt:
            pb.setTimeStep(dt, physicsClientId=cid)
            self._dt = dt
        pb.resetJointState(body, 0, float(x[0]), float(x[1]), physicsClientId=cid)
        pb.resetJointState(body, 1, float(x[2]), float(x[3]), physicsClientId=cid)
        force = float(u[0]) + float(self.dist(t)[0])
        pb.setJointMotorControl2(body, 0, pb.TORQUE_CONTROL, force=force, physicsClientId=cid)
        pb.stepSimulation(physicsClientId=cid)
        (p, v, *_), (th, om, *_) = pb.getJointStates(body, (0, 1), physicsClientId=cid)
        return np.array([p, v, th, om])

    def close(self) -> None:
        """Disconnect from PyBullet (a later step reconnects)."""
        if self._client is not None:
            try:
                self._pb.disconnect(physicsClientId=self._client)
            except Exception:  # already gone (interpreter shutdown)
                pass
            self._client = None
            self._dt = None

    def __del__(self) -> None:
        self.close()

    # -- the model ----------------------------------------------------------------------------------
    def disturbance(self, t: float) -> np.ndarray:
        return self.dist(t)

    def f(self, x: np.ndarray, u: np.ndarray, t: float) -> np.ndarray:
        return cartpole_model(np.asarray(x, dtype=float), float(u[0]) + float(self.dist(t)[0]),
                              pole_inertia=self.pole_inertia)

    def h(self, x: np.ndarray) -> np.ndarray:
        return np.array([x[0], x[2]])
