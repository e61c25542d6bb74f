"""Nonlinear benchmark plants: the flexible-joint robot and Van der Pol, and their disturbance signals."""

from __future__ import annotations

import numpy as np
import pytest

from closedloop.sim.plants import FLEXIBLE_JOINT, DisturbanceSignal, make_plant, rk4_step


def test_flexible_joint_is_the_published_model_plus_a_disturbance():
    plant = make_plant("flexible-joint", dist="step", dist_amp=0.7, dist_time_s=0.5)
    assert (plant.n_states, plant.n_inputs, plant.n_outputs, plant.n_disturbances) == (4, 1, 1, 1)
    A = np.array([[0, 1, 0, 0], [-48.6, -1.25, 48.6, 0], [0, 0, 0, 1], [19.5, 0, -19.5, 0]])
    np.testing.assert_array_equal(plant.A, A)
    np.testing.assert_array_equal(plant.B.ravel(), [0, 21.6, 0, 0])
    x, u = np.array([0.3, -0.2, 0.9, 0.4]), np.array([0.25])
    f = np.array([0, 0, 0, -3.33 * np.sin(0.9)])
    np.testing.assert_allclose(plant.f(x, u, 0.0), A @ x + 21.6 * 0.25 * np.eye(4)[1] + f)
    np.testing.assert_allclose(plant.f(x, u, 1.0) - plant.f(x, u, 0.0), [0, 0.7, 0, 0])
    assert plant.h(x).tolist() == [0.3]  # the motor angle
    assert FLEXIBLE_JOINT["gravity"] == 3.33


def test_van_der_pol_settles_on_its_limit_cycle():
    plant = make_plant("van-der-pol", dist="none", mu=1.0)
    x, u = np.array([0.1, 0.0]), np.zeros(1)
    np.testing.assert_allclose(plant.f(np.array([2.0, 1.0]), u, 0.0), [1.0, 1.0 * (1 - 4) * 1.0 - 2.0])
    dt, peaks = 0.01, []
    for k in range(3000):
        x = rk4_step(plant, x, u, k * dt, dt)
        if k > 2000:
            peaks.append(abs(x[0]))
    assert max(peaks) == pytest.approx(2.01, abs=0.03)  # the mu = 1 limit cycle's amplitude
    assert plant.h(x).shape == (1,)


def test_disturbance_kinds():
    assert DisturbanceSignal("none", 1.0)(3.0).tolist() == [0.0]
    step = DisturbanceSignal("step", 2.0, 1.5)
    assert step(1.49)[0] == 0.0 and step(1.5)[0] == 2.0
    sine = DisturbanceSignal("sine", 1.0, 4.0, n=2)
    np.testing.assert_allclose(sine(1.0), [1.0, 0.0], atol=1e-12)
    with pytest.raises(ValueError, match="not one of"):
        DisturbanceSignal("wind")
