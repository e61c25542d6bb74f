"""X-29A plants: the four models from the data file, their disturbances and uncertainty, and the emulator URL."""

from __future__ import annotations

import json

import numpy as np
import pytest

from closedloop.sim.devices.base import device_params
from closedloop.sim.plants import PLANTS, X29_MODELS, make_plant, rk4_step, x29_matrices
from closedloop.sim.plants.x29 import DATA_PATH

NAMES = ("x29-nd-pa-lon", "x29-nd-ua-lon", "x29-nd-pa-lat", "x29-nd-ua-lat")


def _run(plant, x0, T, dt=5e-3):
    x = np.array(x0, dtype=float)
    for k in range(int(round(T / dt))):
        x = rk4_step(plant, x, np.zeros(plant.n_inputs), k * dt, dt)
    return x


def test_the_four_models_are_registered_with_their_sizes():
    assert set(NAMES) == set(X29_MODELS) and set(NAMES) <= set(PLANTS)
    for name in NAMES:
        plant = make_plant(name)
        lon = name.endswith("lon")
        assert (plant.n_states, plant.n_inputs, plant.n_outputs, plant.n_disturbances) == (4, 3 if lon else 2, 3, 1)
        assert plant.h(plant.x0).shape == (3,) and plant.disturbance(0.3).shape == (1,)


def test_dynamics_are_the_data_files_matrices():
    data = json.loads(DATA_PATH.read_text())
    rng = np.random.default_rng(0)
    for name in NAMES:
        key, measured, gust = X29_MODELS[name]
        A, B = np.array(data[key]["A"]), np.array(data[key]["B"])
        plant = make_plant(name, dist="step", dist_amp=0.02, dist_time_s=0.1)
        x, u = rng.standard_normal(4), rng.standard_normal(B.shape[1])
        np.testing.assert_allclose(plant.f(x, u, 0.0), A @ x + B @ u, rtol=1e-12)
        np.testing.assert_allclose(plant.f(x, u, 1.0), A @ x + B @ u + A[:, gust] * 0.02, rtol=1e-12)
        y = plant.h(x)
        if key.endswith("longitudinal"):  # airspeed stays in ft/s, angles and rates read in degrees
            np.testing.assert_allclose(y, [x[0], np.degrees(x[1]), np.degrees(x[2])], rtol=1e-12)
        else:
            np.testing.assert_allclose(y, np.degrees(x)[list(measured)], rtol=1e-12)


def test_longitudinal_models_are_open_loop_unstable_and_diverge():
    for name, root in (("x29-nd-pa-lon", 1.511), ("x29-nd-ua-lon", 2.865)):
        A = x29_matrices(name)["A"]
        assert np.max(np.linalg.eigvals(A).real) == pytest.approx(root, abs=1e-3)
        plant = make_plant(name, dist="none")
        x0 = np.array([0.0, 0.01, 0.0, 0.0])  # 0.57 deg of angle of attack
        assert np.linalg.norm(_run(plant, x0, 3.0)) > 50 * np.linalg.norm(x0)


def test_gust_is_seeded_smooth_and_has_its_standard_deviation():
    a, b = make_plant("x29-nd-pa-lon", dist_seed=3), make_plant("x29-nd-pa-lon", dist_seed=3)
    c = make_plant("x29-nd-pa-lon", dist_seed=4)
    t = np.arange(0.0, 120.0, 0.01)
    da = np.array([a.disturbance(s)[0] for s in t])
    assert np.array_equal(da, [b.disturbance(s)[0] for s in t])
    assert not np.array_equal(da, [c.disturbance(s)[0] for s in t])
    assert 0.006 < np.std(da) < 0.014  # 0.01 rad nominal; 0.5 s correlation over 120 s
    # continuous (RK4 evaluates it between samples), with the increments of an OU process
    assert max(abs(a.disturbance(s + 1e-6)[0] - a.disturbance(s)[0]) for s in t[:500]) < 1e-4
    assert 0.0015 < np.std(np.diff(da)) < 0.0025  # sigma sqrt(2 dt / tau) = 0.002


def test_actuator_and_model_uncertainty():
    nominal = make_plant("x29-nd-ua-lon")
    biased = make_plant("x29-nd-ua-lon", gain_error=0.2)
    np.testing.assert_allclose(biased.B_true, 1.2 * nominal.B)
    p1, p2 = make_plant("x29-nd-ua-lon", model_error=0.05), make_plant("x29-nd-ua-lon", model_error=0.05)
    np.testing.assert_array_equal(p1.A_true, p2.A_true)  # seeded
    assert not np.allclose(p1.A_true, nominal.A)
    assert np.array_equal(p1.A_true == 0, nominal.A == 0)  # structural zeros stay
    np.testing.assert_array_equal(p1.A, nominal.A)  # the model the observer gets is the nominal one


def test_usable_as_an_emulator_url():
    cls, params = device_params("plant", {"model": "x29-nd-pa-lon", "dist": "gust", "dist_amp": "0.02",
                                          "gain_error": "0.1", "noise": "0.05"})
    device = cls(params)
    device.start(0.0)
    for i in range(1, 101):
        (meas,) = device.tick(i, i * 1e-3)
    assert meas.y.shape == (3,) and np.all(np.isfinite(meas.y))
    assert device.plant.B_true[0, 0] == pytest.approx(1.1 * device.plant.B[0, 0])
