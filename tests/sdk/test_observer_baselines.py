"""Classical observers, the simulation harness and the metrics that score every observer."""

from __future__ import annotations

from math import comb

import numpy as np
import pytest

from closedloop.sdk.observer import (
    BASELINES,
    ExtendedKalmanFilter,
    HighGainObserver,
    LinearESO,
    Luenberger,
    SimResult,
    make_baseline,
    monte_carlo,
    observer_metrics,
    observer_system,
    sample_box,
    simulate,
)
from closedloop.sdk.observer.baselines import leso_gains
from closedloop.sdk.observer.metrics import cost_us, noise_amplification, peak_error, rmse, settling_time


def _excitation(t, z_hat):
    return np.array([0.5 * np.sin(3.0 * t)])


def _run(name, baseline, T, *, noise=0.0, dist="none", u_fn=None, seed=0, **tuning):
    s = observer_system(name)
    plant = s.make_plant(dist=dist)
    e0 = 0.5 * s.error_box * np.where(np.arange(s.n_z) % 2, -1.0, 1.0)
    z0 = np.r_[plant.x0, np.zeros(s.n_d)]
    obs = make_baseline(baseline, s, **tuning)
    try:
        return s, simulate(plant, obs, u_fn, T, s.dt, noise, seed, z0_hat=z0 - e0, substeps=2)
    finally:
        if hasattr(plant, "close"):
            plant.close()


def _drop(s, r):
    norm = np.linalg.norm(r.error / s.error_box, axis=1)
    return norm[-50:].max() / norm[0]


@pytest.mark.parametrize("baseline", sorted(BASELINES))
@pytest.mark.parametrize("name", ["x29-nd-ua-lon", "flexible-joint"])
def test_every_baseline_converges_on_the_linear_plants(name, baseline):
    u_fn = _excitation if name == "flexible-joint" else None
    # the flexible joint's Luenberger gain is its steady-state Kalman gain: its slowest error mode decays at
    # 2.4 /s (the measurement noise is small, the link's process noise too), so it needs longer than 2 s
    T = 4.0 if (name, baseline) == ("flexible-joint", "luenberger") else 2.0
    s, r = _run(name, baseline, T, u_fn=u_fn)
    assert _drop(s, r) < 1e-2


@pytest.mark.parametrize("name, T", [("van-der-pol", 2.0), ("cartpole", 0.6)])
def test_ekf_handles_the_nonlinear_plants(name, T):
    s, r = _run(name, "ekf", T)
    assert _drop(s, r) < 1e-2


def test_canonical_gains_high_gain_and_leso():
    # A pure integrator chain at a tiny sample time: the discrete gains are dt * (continuous gains).
    s = observer_system("van-der-pol", mu=0.0).with_dt(1e-5)
    hgo = HighGainObserver(s, eps=0.05)
    n = s.n_z
    assert np.allclose(hgo.alphas, [comb(n, i) for i in range(1, n + 1)])
    leso = LinearESO(s, omega_o=20.0, canonical=True)
    np.testing.assert_allclose(leso.L[:, 0] / s.dt, leso_gains(2, 20.0), rtol=2e-3)  # 3 w, 3 w^2, w^3
    # the plant's own model (not a chain: x2' has -x1) still gets every pole at -omega_o
    model_based = LinearESO(s, omega_o=20.0)
    assert np.allclose(np.linalg.eigvals(model_based.system.Ad - model_based.L @ s.Cd), np.exp(-20.0 * 1e-5),
                       atol=1e-4)
    with pytest.raises(ValueError, match="not a single-output integrator chain"):
        LinearESO(observer_system("flexible-joint"), canonical=True)


def test_canonical_leso_returns_the_plant_disturbance():
    # The canonical ESO estimates the total disturbance phi = -x1 + d (mu = 0) and reports d = phi - (-x1hat).
    # Its tracking lag is about 3 |phi'| / omega_o = 3 * 2 / 200: fast enough to check the bookkeeping.
    s = observer_system("van-der-pol", mu=0.0)
    plant = s.make_plant(dist="step", dist_amp=0.5, dist_time_s=0.5)
    r = simulate(plant, LinearESO(s, omega_o=200.0, canonical=True), None, 2.0, z0_hat=np.r_[plant.x0, 0.0])
    assert abs(r.z[-1, 2] - 0.5) < 1e-12 and np.max(np.abs(r.error[-500:, 2])) < 0.05


def test_high_gain_peaks_and_amplifies_noise_more_than_luenberger():
    scores = {}
    for baseline in ("luenberger", "high-gain"):
        s, clean = _run("flexible-joint", baseline, 1.0, u_fn=_excitation)
        _, noisy = _run("flexible-joint", baseline, 1.0, u_fn=_excitation, noise=1e-3)
        scores[baseline] = observer_metrics(noisy, scale=s.error_box, clean=clean, noise_std=1e-3, Cd=s.Cd,
                                            from_s=0.5)
    assert scores["high-gain"].peak_ratio > 5 * scores["luenberger"].peak_ratio
    assert scores["high-gain"].noise_amplification > 5 * scores["luenberger"].noise_amplification


def test_mimo_leso_groups_its_poles_at_omega_o():
    s = observer_system("cartpole")
    leso = LinearESO(s)
    assert np.allclose(leso.poles_c, -20.0 * np.array([1.0, 1.0, 1.05, 1.05, 1.1]))


def test_interface_and_defaults():
    s = observer_system("x29-nd-pa-lat")
    for cls in (Luenberger, HighGainObserver, LinearESO, ExtendedKalmanFilter):
        obs = cls(s)
        obs.reset(np.ones(s.n_z))
        out = obs.update(np.zeros(s.n_y), np.zeros(s.n_u))
        assert out.shape == (s.n_z,)
        out[:] = 1e9  # the caller's copy: the observer's state is untouched
        assert np.all(np.abs(obs.update(np.zeros(s.n_y), np.zeros(s.n_u))) < 1e3)
    assert np.array_equal(Luenberger(s).L, s.L)
    assert HighGainObserver(s).eps == pytest.approx(1 / 30)
    ekf = ExtendedKalmanFilter(s)
    np.testing.assert_allclose(ekf.P0, np.diag(s.error_box ** 2 / 3))
    np.testing.assert_allclose(ekf.R, np.diag(s.meas_noise_std ** 2))
    with pytest.raises(KeyError, match="known: ekf"):
        make_baseline("smo", s)


# -- the harness -------------------------------------------------------------------------------------------
class _Perfect:
    """Knows the truth (an integrator with x' = u): predicts x_{k+1} = x_k + dt u exactly."""

    def reset(self, z0_hat):
        self.z = np.array(z0_hat, dtype=float)

    def update(self, y, u):
        self.z = self.z + 1e-3 * u
        return self.z.copy()


def test_simulate_records_truth_estimate_output_and_cost():
    r = simulate(lambda x, u, t: u.copy(), _Perfect(), np.array([2.0]), 0.1, 1e-3, noise=0.01, seed=1,
                 x0=np.zeros(1), h=lambda x: x.copy(), n_u=1)
    assert r.t.shape == (100,) and r.z.shape == r.z_hat.shape == (100, 1) and r.n_x == 1
    np.testing.assert_allclose(r.z[:, 0], 2.0 * r.t, atol=1e-12)
    np.testing.assert_allclose(r.error, 0.0, atol=1e-12)  # the estimate is aligned with the truth
    assert 0.007 < np.std(r.y[:, 0] - r.z[:, 0]) < 0.013
    assert np.all(r.update_ns > 0) and r.dt == pytest.approx(1e-3)
    again = simulate(lambda x, u, t: u.copy(), _Perfect(), np.array([2.0]), 0.1, 1e-3, noise=0.01, seed=1,
                     x0=np.zeros(1), h=lambda x: x.copy(), n_u=1)
    np.testing.assert_array_equal(again.y, r.y)


def test_simulate_clips_inputs_and_checks_sizes():
    s = observer_system("van-der-pol")
    plant = s.make_plant(dist="none", u_max=1.0)
    r = simulate(plant, Luenberger(s), lambda t, z: np.array([5.0]), 0.01)
    assert np.all(r.u == 1.0)
    with pytest.raises(ValueError, match="z0_hat has shape"):
        simulate(plant, Luenberger(s), None, 0.01, z0_hat=np.zeros(2))


# -- metrics on constructed signals ---------------------------------------------------------------------
def test_rmse_settling_and_peak():
    t = np.arange(0.0, 10.0, 1e-3)
    decay = np.exp(-t)
    assert settling_time(t, decay, 0.02) == pytest.approx(np.log(50), abs=2e-3)
    assert settling_time(t, np.ones_like(t), 0.02) == float("inf")
    bump = np.exp(-t) + 3 * t * np.exp(-5 * t)
    peak, ratio = peak_error(bump)
    assert ratio > 1 and peak == pytest.approx(bump.max())
    np.testing.assert_allclose(rmse(np.array([[3.0, -1.0], [-3.0, 1.0]])), [3.0, 1.0])
    c = cost_us(np.array([1000, 2000, 3000, 1_000_000]))
    assert c["p50"] == 2.5 and c["max"] == 1000.0


def test_noise_amplification_of_a_known_filter():
    rng = np.random.default_rng(0)
    clean = np.zeros((20000, 2))
    noisy = clean + rng.standard_normal((20000, 2)) * [0.2, 0.0]  # estimate noise std 0.2 on the first state
    amp, est = noise_amplification(noisy, clean, 0.1, scale=np.array([1.0, 1.0]), y_scale=np.array([1.0]))
    assert est[0] == pytest.approx(0.2, rel=0.03) and est[1] == 0.0
    assert amp == pytest.approx(np.sqrt(0.2 ** 2 / 2) / 0.1, rel=0.03)


def _fake_result(e0, rate=5.0):
    t = np.arange(0.0, 2.0, 1e-3)
    err = np.outer(np.exp(-rate * t), e0)
    z = np.ones_like(err)
    return SimResult(t, z, z - err, z[:, :1], np.zeros((t.size, 1)), np.full(t.size, 2000), n_x=2)


def test_observer_metrics_and_monte_carlo():
    m = observer_metrics(_fake_result(np.array([1.0, 0.0, 2.0])), scale=np.array([1.0, 1.0, 2.0]))
    t = np.arange(0.0, 2.0, 1e-3)
    assert m.state_rmse == pytest.approx(np.sqrt(np.mean(np.exp(-10 * t))), rel=1e-9)
    assert m.disturbance_rmse == pytest.approx(2 * np.sqrt(np.mean(np.exp(-10 * t))), rel=1e-9)
    assert m.settling_time_s == pytest.approx(np.log(50) / 5, abs=2e-3)
    assert m.peak_ratio == 1.0 and m.cost_us["mean"] == 2.0 and m.noise_amplification is None
    errors = sample_box(np.array([1.0, 1.0, 0.5]), 8, seed=3)
    assert errors.shape == (8, 3) and np.all(np.abs(errors) <= [1.0, 1.0, 0.5])
    np.testing.assert_array_equal(errors, sample_box(np.array([1.0, 1.0, 0.5]), 8, seed=3))
    mc = monte_carlo(_fake_result, errors)
    assert len(mc.runs) == 8
    assert mc.summary["settling_time_s"]["worst"] == pytest.approx(np.log(50) / 5, abs=2e-3)
    assert mc.summary["state_rmse"]["mean"] > 0 and mc.summary["cost_us_mean"]["mean"] == 2.0
