"""The PyBullet cart-pole: the URDF's values, the physics engine as the truth, and the textbook model beside it."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pybullet")

from closedloop.sim.devices.base import device_params  # noqa: E402
from closedloop.sim.plants import cartpole_linearization, cartpole_model, make_plant, rk4_step  # noqa: E402


@pytest.fixture
def cartpole():
    plant = make_plant("cartpole")
    yield plant
    plant.close()


def _fall(plant, T=1.0, dt=1e-3):
    x = plant.x0.copy()
    for k in range(int(round(T / dt))):
        x = rk4_step(plant, x, np.zeros(1), k * dt, dt)  # rk4_step hands the step to PyBullet
    return x


def test_urdf_values_as_pybullet_holds_them(cartpole):
    v = cartpole.urdf_values()
    assert v["cart_mass"] == pytest.approx(1.0) and v["pole_mass"] == pytest.approx(0.1)
    assert v["pole_com_z_in_link"] == pytest.approx(0.5)  # half-length
    assert v["pole_inertia_yy"] == pytest.approx(0.1 * 1.0 ** 2 / 12)  # uniform rod, set by the plant
    urdf = make_plant("cartpole", pole_inertia=1.0)
    try:
        assert urdf.urdf_values()["pole_inertia_yy"] == pytest.approx(1.0)  # the URDF's own placeholder
    finally:
        urdf.close()


def test_the_pole_falls_from_a_small_angle_and_outputs_cart_and_angle(cartpole):
    x = _fall(cartpole)
    assert cartpole.x0[2] == pytest.approx(0.05) and abs(x[2]) > 0.5 and np.sign(x[2]) == 1
    assert x[0] < 0  # the cart recoils against the falling pole
    np.testing.assert_array_equal(cartpole.h(x), [x[0], x[2]])


def test_physics_engine_agrees_with_the_model_over_a_short_horizon(cartpole):
    x_engine, x_model, dt = cartpole.x0.copy(), cartpole.x0.copy(), 1e-3
    u = np.array([1.0])
    for k in range(300):
        x_engine = cartpole.advance(x_engine, u, k * dt, dt)
        x_model = x_model + dt * cartpole_model(x_model, 1.0)  # the engine is semi-implicit Euler
    np.testing.assert_allclose(x_engine, x_model, atol=0.02)
    # ...but it is not the model: the engine's integrator differs
    assert not np.allclose(x_engine, x_model, atol=1e-9)


def test_urdf_inertia_makes_the_pole_fall_slower():
    urdf = make_plant("cartpole", pole_inertia=1.0)
    try:
        assert abs(_fall(urdf)[2]) < 0.2
    finally:
        urdf.close()


def test_linearisation_matches_the_model_at_upright():
    m = cartpole_linearization()
    rng = np.random.default_rng(1)
    for _ in range(3):
        dx, du = 1e-6 * rng.standard_normal(4), 1e-6 * rng.standard_normal()
        np.testing.assert_allclose(cartpole_model(dx, du), m["A"] @ dx + m["B"][:, 0] * du, atol=1e-12)
    np.testing.assert_array_equal(m["E"], m["B"])


def test_usable_as_an_emulator_url():
    cls, params = device_params("plant", {"model": "cartpole", "theta0": "0.1", "dist": "step"})
    device = cls(params)
    try:
        device.start(0.0)
        for i in range(1, 201):
            (meas,) = device.tick(i, i * 1e-3)
        assert meas.y.shape == (2,) and meas.y[1] > 0.1
    finally:
        device.plant.close()
