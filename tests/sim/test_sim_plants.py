"""Plants: the registry, the interface check, and RK4 accuracy against a closed-form solution."""

from __future__ import annotations

import numpy as np
import pytest

from closedloop.sim.plants import (
    PLANTS,
    Plant,
    UnknownPlantError,
    make_plant,
    plant_class,
    register_plant,
    rk4_step,
)


def test_shipped_plants_are_registered_and_consistent():
    assert {"msd", "dc-motor"} <= set(PLANTS)
    for name in ("msd", "dc-motor"):
        plant = make_plant(name)
        assert plant.NAME == name
        plant.check()


def test_rk4_matches_the_undamped_oscillator_exactly_enough():
    plant = make_plant("msd", damping=0.0, stiffness=4.0, mass=1.0)
    x, dt = np.array([1.0, 0.0]), 1 / 5000
    for k in range(5000):  # one second at 5 kHz
        x = rk4_step(plant, x, np.zeros(1), k * dt, dt)
    np.testing.assert_allclose(x, [np.cos(2.0), -2.0 * np.sin(2.0)], atol=1e-9)


def test_msd_steady_state_is_force_over_stiffness():
    plant = make_plant("msd", damping=4.0)
    x, dt = plant.x0.copy(), 1 / 1000
    for k in range(10_000):
        x = rk4_step(plant, x, np.array([2.0]), k * dt, dt)
    assert plant.h(x)[0] == pytest.approx(0.5, abs=1e-6)


def test_unknown_plant_names_the_registered_ones():
    with pytest.raises(UnknownPlantError, match="dc-motor, msd") as info:
        plant_class("x29")
    assert isinstance(info.value, KeyError)


def test_a_new_plant_registers_by_name_and_a_bad_one_is_caught():
    @register_plant("test-integrator")
    class Integrator(Plant):
        def __init__(self) -> None:
            self.n_states = self.n_inputs = self.n_outputs = 1
            self.x0, self.u_low, self.u_high = np.zeros(1), -np.ones(1), np.ones(1)

        def f(self, x, u, t):
            return u.copy()

        def h(self, x):
            return x.copy()

    try:
        assert make_plant("test-integrator").NAME == "test-integrator"
        with pytest.raises(ValueError, match="already registered"):
            register_plant("msd")(Integrator)

        class WrongSizes(Integrator):
            def h(self, x):
                return np.zeros(3)

        with pytest.raises(ValueError, match=r"h returned shape \(3,\); expected \(1,\)"):
            WrongSizes().check()
    finally:
        PLANTS.pop("test-integrator", None)
