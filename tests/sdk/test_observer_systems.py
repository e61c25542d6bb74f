"""The observer's plant models: extended matrices, ZOH discretisation, pole placement, torch parity."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.linalg

from closedloop.sdk.observer import (
    SYSTEMS,
    ObserverSystem,
    default_poles,
    observer_system,
    place_observer_gain,
)
from closedloop.sim.plants import cartpole_model, rk4_step

NAMES = ("x29-nd-pa-lon", "x29-nd-ua-lon", "x29-nd-pa-lat", "x29-nd-ua-lat", "flexible-joint", "van-der-pol",
         "cartpole")


@pytest.fixture(scope="module")
def systems():
    return {name: observer_system(name) for name in NAMES}


def _char_poly_close(M, roots, rtol=1e-8):
    want = np.real(np.poly(roots))
    return np.max(np.abs(np.real(np.poly(M)) - want)) <= rtol * np.max(np.abs(want))


def test_every_plant_has_a_model():
    assert set(NAMES) <= set(SYSTEMS)
    with pytest.raises(KeyError, match="known: .*flexible-joint"):
        observer_system("x29")


@pytest.mark.parametrize("name", NAMES)
def test_shapes_structure_and_discretisation(systems, name):
    s = systems[name]
    n_x, n_d, n_u, n_y, n_z = s.n_x, s.n_d, s.n_u, s.n_y, s.n_z
    assert n_z == n_x + n_d and s.dt == 1e-3
    shapes = {"Ae": (n_z, n_z), "Be": (n_z, n_u), "Ce": (n_y, n_z), "Ad": (n_z, n_z), "Bd": (n_z, n_u),
              "Cd": (n_y, n_z), "Fd": (n_z, n_x), "L": (n_z, n_y), "error_box": (n_z,),
              "process_noise_std": (n_z,), "meas_noise_std": (n_y,), "nominal_x0": (n_x,)}
    for key, shape in shapes.items():
        assert getattr(s, key).shape == shape, key
    np.testing.assert_array_equal(s.Ae[:n_x, :n_x], s.A)
    np.testing.assert_array_equal(s.Ae[:n_x, n_x:], s.E)
    assert not s.Ae[n_x:].any() and not s.Be[n_x:].any() and not s.Ce[:, n_x:].any()
    np.testing.assert_allclose(s.Ad, scipy.linalg.expm(s.Ae * s.dt), rtol=1e-12, atol=1e-15)
    # ZOH input matrices: integral of expm(Ae t) over one sample (Simpson on a fine grid)
    ts = np.linspace(0.0, s.dt, 11)
    w = np.r_[1, np.tile([4, 2], 4), 4, 1] * (ts[1] - ts[0]) / 3
    integral = sum(wi * scipy.linalg.expm(s.Ae * t) for wi, t in zip(w, ts, strict=True))
    np.testing.assert_allclose(s.Bd, integral @ s.Be, rtol=1e-8, atol=1e-14)
    np.testing.assert_allclose(s.Fd, integral @ s.Ge, rtol=1e-8, atol=1e-14)
    np.testing.assert_array_equal(s.Cd, s.Ce)
    # the model and the plant are built from the same numbers
    plant = s.make_plant()
    if hasattr(plant, "A"):
        np.testing.assert_array_equal(plant.A, s.A)
        np.testing.assert_array_equal(plant.E, s.E)
        np.testing.assert_array_equal(plant.C, s.C)
    assert plant.n_disturbances == s.n_d and plant.n_outputs == n_y
    if hasattr(plant, "close"):
        plant.close()


@pytest.mark.parametrize("name", NAMES)
def test_default_gain_is_the_documented_one(systems, name):
    s = systems[name]
    assert s.gain == ("poles" if name.startswith("x29") else "kalman")
    assert np.max(np.abs(np.linalg.eigvals(s.Ad - s.L @ s.Cd))) < 1.0
    if s.gain == "kalman":  # the steady-state Kalman predictor gain of the linearisation at x = 0
        F, Q, R = s.linearisation(), s.process_noise_cov(), np.diag(s.meas_noise_std ** 2)
        X = s.kalman_cov
        S = s.Cd @ X @ s.Cd.T + R
        np.testing.assert_allclose(F @ X @ F.T + Q - F @ X @ s.Cd.T @ np.linalg.solve(S, s.Cd @ X @ F.T), X,
                                   rtol=1e-6, atol=1e-12)
        np.testing.assert_allclose(s.L, F @ X @ s.Cd.T @ np.linalg.inv(S), rtol=1e-8, atol=1e-14)
        np.testing.assert_allclose(np.sort(np.abs(s.poles)), np.sort(np.abs(np.linalg.eigvals(s.Ad - s.L @ s.Cd))))


def test_kalman_gain_filters_noise_the_placed_gain_amplifies():
    kal, placed = observer_system("flexible-joint"), observer_system("flexible-joint", gain="poles")
    # stationary error covariance of the linearised observer under the stated noise: Kalman is optimal
    F, Q, R = kal.linearisation(), kal.process_noise_cov(), np.diag(kal.meas_noise_std ** 2)

    def cov(L):
        A = F - L @ kal.Cd
        return scipy.linalg.solve_discrete_lyapunov(A, Q + L @ R @ L.T)

    assert np.trace(cov(kal.L)) < 0.05 * np.trace(cov(placed.L))  # measured: 2.3 vs 234
    with pytest.raises(ValueError, match="gain 'bogus'"):
        kal.with_gain("bogus")


@pytest.mark.parametrize("name", NAMES)
def test_observable_and_L_places_the_documented_poles(systems, name):
    s = systems[name].with_gain("poles")
    assert s.is_observable()
    np.testing.assert_allclose(s.poles_c, default_poles(s.omega_o, s.n_z))
    np.testing.assert_allclose(s.poles, np.exp(s.poles_c * s.dt))
    assert _char_poly_close(s.Ad - s.L @ s.Cd, s.poles)
    assert np.max(np.abs(np.linalg.eigvals(s.Ad - s.L @ s.Cd))) < 1.0


def test_other_poles_and_sample_times():
    s = observer_system("flexible-joint", omega_o=15.0)
    assert s.omega_o == 15.0 and _char_poly_close(s.Ad - s.L @ s.Cd, np.exp(default_poles(15.0, 5) * 1e-3))
    repeated = s.with_poles(np.full(5, -20.0))  # one output: any multiplicity (Ackermann)
    assert _char_poly_close(repeated.Ad - repeated.L @ repeated.Cd, np.full(5, np.exp(-0.02)))
    complex_poles = np.array([-10 + 5j, -10 - 5j, -12, -14, -16])
    x29 = observer_system("x29-nd-pa-lon", poles=complex_poles)
    assert _char_poly_close(x29.Ad - x29.L @ x29.Cd, np.exp(complex_poles * 1e-3))
    slow = s.with_dt(0.01)
    assert slow.dt == 0.01 and _char_poly_close(slow.Ad - slow.L @ slow.Cd, np.exp(slow.poles_c * 0.01))


def test_unobservable_pair_is_refused():
    Ad, Cd = np.eye(2), np.array([[1.0, 0.0]])
    with pytest.raises(ValueError, match="not observable"):
        place_observer_gain(Ad, Cd, np.array([-1.0, -2.0]), 1e-3)


def test_zoh_model_matches_the_linear_plant_over_one_sample(systems):
    s = systems["x29-nd-ua-lon"]
    plant = s.make_plant(dist="step", dist_amp=0.03, dist_time_s=0.5)  # constant d after 0.5 s
    rng = np.random.default_rng(2)
    x, u = 0.01 * rng.standard_normal(4), rng.standard_normal(3)
    x1 = x.copy()
    for k in range(100):
        x1 = rk4_step(plant, x1, u, 1.0 + k * 1e-5, 1e-5)
    z1 = s.step(np.r_[x, 0.03], u)
    np.testing.assert_allclose(z1, np.r_[x1, 0.03], rtol=1e-9, atol=1e-14)


def test_numpy_and_torch_agree_batched(systems):
    torch = pytest.importorskip("torch")
    for name in ("flexible-joint", "van-der-pol", "cartpole"):
        s = systems[name]
        z = torch.randn(16, s.n_z, dtype=torch.float64) * 0.3
        u = torch.randn(16, s.n_u, dtype=torch.float64)
        out = s.step(z, u)
        assert isinstance(out, torch.Tensor) and out.shape == (16, s.n_z)
        np.testing.assert_allclose(out.numpy(), s.step(z.numpy(), u.numpy()), rtol=1e-12)
        np.testing.assert_allclose(s.f(z[:, :s.n_x], u).numpy(), s.f(z[:, :s.n_x].numpy(), u.numpy()), rtol=1e-12)
        np.testing.assert_allclose(s.output(z).numpy(), z.numpy() @ s.Cd.T)


def test_nonlinearities_and_their_jacobians(systems):
    x = np.array([0.3, -0.2, 0.9, 0.4])
    fj = systems["flexible-joint"]
    np.testing.assert_allclose(fj.f(x), [0, 0, 0, -3.33 * np.sin(0.9)])
    assert fj.lipschitz == 3.33
    cp = systems["cartpole"]
    u = np.array([0.7])
    np.testing.assert_allclose(cp.A @ x + cp.B @ u + cp.f(x, u), cartpole_model(x, 0.7), rtol=1e-12)
    assert np.abs(cp.f(1e-4 * x)).max() < 1e-9  # second order at the linearisation point
    assert not systems["x29-nd-pa-lon"].f(x).any()
    for name, xx in (("flexible-joint", x), ("van-der-pol", x[:2]), ("cartpole", x)):
        s = systems[name]
        h, J = 1e-6, s.f_jacobian(xx, u)
        fd = np.stack([(s.f(xx + h * e, u) - s.f(xx - h * e, u)) / (2 * h) for e in np.eye(s.n_x)], axis=1)
        np.testing.assert_allclose(J, fd, atol=1e-6)


def test_error_box_sampling_and_record(systems):
    s = systems["cartpole"]
    e = s.sample_errors(200, 0)
    assert e.shape == (200, 5) and np.all(np.abs(e) <= s.error_box)
    assert np.array_equal(e, s.sample_errors(200, 0))
    np.testing.assert_allclose(s.process_noise_cov(), np.diag(s.process_noise_std ** 2) * 1e-3)
    record = json.loads(json.dumps(s.describe()))
    assert record["discretisation"] == "zoh" and np.array(record["L"]).shape == (5, 2)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="error_box has shape"):
        ObserverSystem(name="bad", dt=1e-3, A=np.zeros((2, 2)), B=np.ones((2, 1)), E=np.ones((2, 1)),
                       C=np.array([[1.0, 0.0]]), nonlinearity=None, poles_c=[-1, -2, -3], omega_o=1.0,
                       nominal_x0=np.zeros(2), error_box=np.ones(2), meas_noise_std=[0.1],
                       process_noise_std=np.ones(3))


def _msd(**kw):
    """A mass-spring-damper with a force disturbance, as a user of their own plant writes it."""
    args = dict(name="msd", dt=1e-3, A=[[0.0, 1.0], [-3.0, -0.8]], B=[[0.0], [2.0]], E=[[0.0], [2.0]],
                C=[[1.0, 0.0]], nonlinearity=None, poles_c=None, omega_o=5.0, nominal_x0=[0.0, 0.0],
                error_box=[1.0, 1.0, 1.0], meas_noise_std=[0.01], process_noise_std=[0.1, 0.1, 0.1])
    return ObserverSystem(**(args | kw))


@pytest.mark.parametrize("change, said", [
    ({"B": [[0.0], [2.0], [1.0]]}, "B has shape (3, 1); expected (2, 1)"),  # the argument that is wrong, by name
    ({"E": [0.0, 2.0]}, "E has shape (2,); give a 2-D matrix"),
    ({"dt": 0.0}, "dt 0.0 must be the sample period in seconds, > 0"),
    ({"C": [[0.0, 1.0]]}, "is not observable (modes 0 1/s do not show in the outputs)"),  # velocity only: p and d mix
    ({"A": [[0.0, 1.0], [float("nan"), -0.8]]}, "A holds a NaN or an infinity"),  # not numpy's SVD failure
    ({"error_box": [1.0, -1.0, 1.0]}, "error_box [1.0, -1.0, 1.0] must be half-widths > 0"),
])
def test_a_users_own_plant_with_a_mistake_is_told_what_is_wrong(change, said):
    assert _msd().n_z == 3  # the plant as given is fine
    with pytest.raises(ValueError) as e:
        _msd(**change)
    assert said in str(e.value)


def test_a_users_nonlinear_plant_gets_its_runtime_form_checked_against_its_f():
    """The runtime runs the nonlinearity in a form of its own (E sin(H z), ...): a plant of the user's needs it
    given, and a form that does not reproduce the plant's f (a sign, a gain) is refused, since the certified
    observer would then run another model than the one it was trained and certified on."""
    from closedloop.sdk.observer.neural import ObserverModel

    def pendulum(x, u, xp):  # gravity on the angle: -2 sin(x1) in the velocity's equation
        return xp.stack([x[..., 0] * 0, -2.0 * xp.sin(x[..., 0])], -1)

    s = _msd(name="my-pendulum", nonlinearity=pendulum)
    with pytest.raises(ValueError, match=r"give it to ObserverModel.from_system\(system, nonlinearity=\{'name': 'sin'"):
        ObserverModel.from_system(s, u_max=2.0)
    right = {"name": "sin", "E": [[0.0], [-2.0]], "H": [[1.0, 0.0, 0.0]]}
    assert ObserverModel.from_system(s, u_max=2.0, nonlinearity=right).nonlinearity == right
    with pytest.raises(ValueError, match="does not reproduce my-pendulum's f .*largest difference"):
        ObserverModel.from_system(s, u_max=2.0, nonlinearity=right | {"E": [[0.0], [-20.0]]})
    with pytest.raises(ValueError, match=r"E has shape \(2, 1\) and H \(1, 2\); they must be \(n_x, c\)"):
        ObserverModel.from_system(s, u_max=2.0, nonlinearity=right | {"H": [[1.0, 0.0]]})
    with pytest.raises(ValueError, match="would run a linear model"):
        ObserverModel.from_system(s, u_max=2.0, nonlinearity={"name": "none"})
