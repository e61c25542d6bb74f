"""X-29A linearized aircraft models with gusts, actuator and model uncertainty.

Four plants from ``sim/data/x29.json`` (normal digital mode; see ``sim/data/README.md``
for the source): ``x29-nd-pa-lon``, ``x29-nd-ua-lon`` (longitudinal, open-loop unstable:
eigenvalues +1.511 and +2.865 1/s) and ``x29-nd-pa-lat``, ``x29-nd-ua-lat``
(lateral-directional, a slow spiral root +0.032 / +0.018 1/s).  PA: powered approach;
UA: up-and-away.  States are deviations from trim.

Notes
-----
Units are inferred from the data's notes, not confirmed: longitudinal state
``x = [u (ft/s), alpha (rad), q (rad/s), theta (rad)]``, three inputs (probably canard,
symmetric flaperon, strake flap; taken as deg: the B entries are small); lateral
``x = [beta (rad), p (rad/s), r (rad/s), phi (rad)]``, two inputs (probably aileron,
rudder).  The plant is

.. math:: \\dot x = A_\\text{true} x + B (1 + \\delta_u) u + E d(t), \\qquad y = C x,

- gust ``d``: an angle-of-attack gust ``alpha_g`` (longitudinal) or a sideslip gust
  ``beta_g`` (lateral) in rad, acting on the aerodynamics like the state angle itself:
  ``E = A[:, alpha]`` resp. ``E = A[:, beta]``.  Default a first-order Dryden-like gust,
  0.01 rad (0.57 deg) standard deviation, 0.5 s correlation time (``dist*`` parameters);
- actuator uncertainty: a gain error ``delta_u = gain_error`` on every input;
- model uncertainty: ``A_true = A * (1 + model_error * N(0, 1))`` entrywise (structural
  zeros stay zero), seeded by ``dist_seed``;
- outputs (deg, as in the data's ``C_example`` scaling 57.3): longitudinal
  ``y = [u (ft/s), alpha (deg), q (deg/s)]`` (pitch attitude unmeasured), lateral
  ``y = [beta (deg), p (deg/s), phi (deg)]`` (yaw rate unmeasured).  These choices keep
  the gust-extended model observable and well conditioned (measuring alpha resp. beta is
  needed: the gust enters exactly like the angle itself).
  Measurement noise is added by whoever samples ``y`` (the plant emulator's ``noise``,
  ``closedloop.sdk.observer.simulate``'s ``noise``).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import numpy as np

from ..params import Param
from .base import register_plant
from .disturbance import DisturbanceSignal, disturbance_params
from .structured import StructuredPlant

__all__ = ["X29", "X29_MODELS", "x29_matrices", "DATA_PATH"]

DATA_PATH = Path(__file__).resolve().parents[1] / "data" / "x29.json"
RAD_TO_DEG = 180.0 / np.pi

#: plant name -> (json key, measured state indices, gust state index)
X29_MODELS: dict[str, tuple[str, tuple[int, ...], int]] = {
    "x29-nd-pa-lon": ("nd_pa_longitudinal", (0, 1, 2), 1),
    "x29-nd-ua-lon": ("nd_ua_longitudinal", (0, 1, 2), 1),
    "x29-nd-pa-lat": ("nd_pa_lateral", (0, 1, 3), 0),
    "x29-nd-ua-lat": ("nd_ua_lateral", (0, 1, 3), 0),
}


@cache
def _data() -> dict:
    with open(DATA_PATH) as fh:
        return json.load(fh)


def x29_matrices(name: str) -> dict[str, np.ndarray]:
    """Nominal ``A, B, E, C`` of the X-29 plant ``name`` (fresh copies)."""
    key, measured, gust = X29_MODELS[name]
    entry = _data()[key]
    A = np.array(entry["A"], dtype=float)
    B = np.array(entry["B"], dtype=float)
    E = A[:, [gust]].copy()
    lon = key.endswith("longitudinal")
    # ft/s stays ft/s; angles and rates read in degrees.
    scale = np.array([1.0, RAD_TO_DEG, RAD_TO_DEG, RAD_TO_DEG]) if lon else np.full(4, RAD_TO_DEG)
    C = np.diag(scale)[list(measured)]
    return {"A": A, "B": B, "E": E, "C": C}


class X29(StructuredPlant):
    """One X-29A linearized model; subclasses below fix which one."""

    MODEL = ""
    PARAMS = (
        *disturbance_params("gust", 0.01, 0.5, "gust angle in rad"),
        Param("gain_error", float, 0.0, "actuator gain error delta_u (B_true = (1 + delta_u) B)", low=-0.9,
              high=10.0),
        Param("model_error", float, 0.0, "relative std of the entrywise perturbation of A (model uncertainty)",
              low=0.0, high=1.0),
        Param("u_max", float, 30.0, "input limit (deg, inferred) on every surface", low=0.0),
    )

    def __init__(self, dist: str, dist_amp: float, dist_time_s: float, dist_seed: int, gain_error: float,
                 model_error: float, u_max: float) -> None:
        m = x29_matrices(self.MODEL)
        A_true = m["A"]
        if model_error:
            rng = np.random.default_rng(np.random.SeedSequence([dist_seed, 0xA29]))
            A_true = m["A"] * (1.0 + model_error * rng.standard_normal(m["A"].shape))
        self._setup(m["A"], m["B"], m["E"], m["C"], np.zeros(4), u_max,
                    DisturbanceSignal(dist, dist_amp, dist_time_s, 1, dist_seed),
                    A_true=A_true, B_true=(1.0 + gain_error) * m["B"])


def _register(name: str) -> type[X29]:
    cls = type(f"X29_{name.replace('-', '_')}", (X29,), {"MODEL": name, "__doc__": f"X-29A model {name}."})
    return register_plant(name)(cls)


for _name in X29_MODELS:
    _register(_name)
