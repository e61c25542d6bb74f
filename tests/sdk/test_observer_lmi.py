"""The observer certificate's LMI: feasibility, the numpy/cvxpy agreement, the sign convention, V decrease."""

from __future__ import annotations

import dataclasses

import cvxpy as cp
import numpy as np
import pytest
import torch

from closedloop.runtime.families.observer.certificate import check_certificate, lft_from_weights, lmi_data
from closedloop.sdk.observer.certify import certify, samples_needed, step_ratios
from closedloop.sdk.observer.lmi import CVXPY_OPS, best_decay_rate, linearised_spectral_radius, solve_lmi
from closedloop.sdk.observer.network import TORCH_OPS, ObserverNet
from closedloop.sdk.observer.neural import NeuralObserver, ObserverModel
from closedloop.sdk.observer.systems import observer_system
from closedloop.sdk.observer.train import TrainConfig, _initial_net

RHO = 0.995


@pytest.fixture(scope="module")
def fj() -> ObserverModel:
    return ObserverModel.from_system(observer_system("flexible-joint", gain="poles"))  # RHO below is for this L


@pytest.fixture(scope="module")
def small_net(fj) -> ObserverNet:
    torch.manual_seed(0)
    return _initial_net(fj, TrainConfig(hidden=(6,), init_gain=0.1)).scale_(0.5)


@pytest.fixture(scope="module")
def small_cert(fj, small_net):
    sol = solve_lmi(fj.error_model(), small_net.lft(), RHO, margin=1e-4)
    assert sol.feasible, sol
    return sol


def _alpha_net(fj: ObserverModel, alpha: float):
    """N(r) = -alpha L tanh(r): its sign decides whether it adds to or removes from the gain L."""
    return [np.array([[1.0]]), -alpha * fj.L], ["tanh"]


def test_small_gain_network_is_certified_and_scaled_up_is_not(fj, small_net, small_cert):
    em = fj.error_model()
    assert small_cert.max_eig <= -1e-4 and np.linalg.eigvalsh(small_cert.P)[0] > 0
    assert np.all(small_cert.t >= 0) and np.all(small_cert.lam >= 0)
    big = ObserverNet(1, 5, (6,), in_scale=small_net.in_scale, out_scale=small_net.out_scale)
    big.load_state_dict(small_net.state_dict())
    big.scale_(10.0)
    sol = solve_lmi(em, big.lft(), RHO, margin=1e-4)
    assert not sol.feasible and sol.max_eig > 0
    rep = certify(fj, big, iters=3)
    text = rep.summary()  # says it failed, never prints the failed inequality as if it held
    assert not rep.certified and "certified: NO" in text and "VIOLATED" in text and "<= -margin" not in text
    assert "no decay rate is proven" in text


def test_numpy_matrix_equals_cvxpy_and_torch(fj, small_net, small_cert):
    em, lft = fj.error_model(), small_net.lft()
    data = lmi_data(em, lft)
    P, t, lam = small_cert.P, small_cert.t, small_cert.lam
    Pv, tv, lv = cp.Variable(P.shape, symmetric=True), cp.Variable(t.size), cp.Variable(lam.size)
    Pv.value, tv.value, lv.value = P, t, lam
    m_cvx = data.matrix(Pv, tv, lv, RHO, CVXPY_OPS).value
    m_np = data.matrix(P, t, lam, RHO)
    assert np.allclose(m_cvx, m_np, rtol=1e-12, atol=1e-9 * np.abs(m_np).max())
    m_torch = lmi_data(em, small_net.torch_lft(), ops=TORCH_OPS).normalised_matrix(P, t, lam, RHO, TORCH_OPS)
    m_norm = data.normalised_matrix(P, t, lam, RHO)
    assert np.allclose(m_torch.detach().numpy(), m_norm, atol=1e-9)
    # the residual the solver saw and the runtime's check agree on the sign and the value
    chk = check_certificate(em, lft, P, t, lam, RHO, 1e-4)
    assert chk.passed and chk.max_eig == pytest.approx(small_cert.max_eig, abs=1e-12)
    assert chk.check_ms < 50


def test_cheap_form_keeps_P_and_solves_multipliers_only(fj, small_net, small_cert):
    em, lft = fj.error_model(), small_net.lft()
    cheap = solve_lmi(em, lft, RHO, margin=1e-4, P_fixed=small_cert.P)
    assert cheap.form == "cheap" and cheap.feasible
    assert np.array_equal(cheap.P, 0.5 * (small_cert.P + small_cert.P.T))
    assert cheap.solve_time_s > 0 and small_cert.solve_time_s > 0
    # a P that is no Lyapunov matrix for these dynamics cannot be completed by multipliers
    assert not solve_lmi(em, lft, RHO, margin=1e-4, P_fixed=np.eye(5)).feasible


def test_bisection_finds_the_fastest_certified_rate(fj, small_net):
    em, lft = fj.error_model(), small_net.lft()
    search = best_decay_rate(em, lft, margin=1e-4, iters=6)
    best = search.best
    assert best is not None and best.feasible
    assert linearised_spectral_radius(em, lft) <= best.rho < RHO
    infeasible = [r for r, ok in search.tried if not ok]
    assert infeasible and max(infeasible) < best.rho


def test_flipped_sign_certificate_does_not_hold_for_the_true_dynamics(fj):
    """Certify with Bw = +Dow (the sign slip) for a network that removes gain: the slip 'certifies' it."""
    em = fj.error_model()
    weights, acts = _alpha_net(fj, 0.8)
    lft = lft_from_weights(weights, acts)
    flipped = solve_lmi(em, dataclasses.replace(lft, Dow=-lft.Dow), RHO, margin=1e-4)
    assert flipped.feasible
    assert not solve_lmi(em, lft, RHO, margin=1e-4).feasible
    assert not check_certificate(em, lft, flipped.P, flipped.t, flipped.lam, RHO, 1e-4).passed
    e = fj.error_box * np.random.default_rng(0).uniform(-1, 1, (2000, 5))
    ratios = step_ratios(em, weights, acts, flipped.P, e)
    assert np.mean(ratios > RHO ** 2) > 0.01


def test_V_decreases_along_simulated_trajectories(fj, small_net, small_cert):
    """The true flexible-joint model (sin gravity) and the observer, from random errors: every step."""
    P = small_cert.P
    obs = NeuralObserver(fj, small_net)
    rng = np.random.default_rng(1)
    worst = 0.0
    for _ in range(8):
        z = rng.uniform(-1, 1, 5) * fj.error_box
        obs.reset(z - rng.uniform(-1, 1, 5) * fj.error_box)
        for _ in range(150):
            e = z - obs.z_hat
            u = obs.command()
            y = fj.Cd @ z
            z_hat = obs.update(y, u)
            z = fj.Ad @ z + fj.Bd @ u + fj.f(z, y)
            e_next = z - z_hat
            worst = max(worst, (e_next @ P @ e_next) / (e @ P @ e))
    assert worst <= RHO ** 2 - 1e-4 + 1e-9


def test_sampled_decrease_matches_the_certificate_and_the_flip(fj, small_net, small_cert):
    """At sampled errors the true one-step ratio respects the certified rate (worst sector vertex)."""
    e = fj.error_box * np.random.default_rng(2).uniform(-1, 1, (5000, 5)) * np.logspace(-3, 0, 5000)[:, None]
    ratios = step_ratios(fj.error_model(), small_net.weights(), list(small_net.activations), small_cert.P, e)
    assert ratios.max() <= RHO ** 2 - 1e-4 + 1e-9


def test_certify_report_local_radius_and_coverage(fj, small_net):
    rep = certify(fj, small_net, iters=5, local_vbar=1.0, coverage_eps=0.01, coverage_beta=1e-3)
    assert rep.certified and rep.max_eig <= -rep.margin
    assert rep.decay_rate_per_s == pytest.approx(-np.log(rep.rho) / fj.dt)
    cov = rep.coverage
    assert cov.n_samples == samples_needed(0.01, 1e-3) == 691
    assert cov.violations == 0 and cov.sampled_rho <= rep.rho
    loc = rep.local
    assert loc.feasible and loc.rho <= rep.rho + 1e-3 and loc.level > 0 and loc.radius > 0 and loc.box_fraction > 0
    block = rep.to_manifest()
    assert block["kind"] == "discrete_lyapunov_lmi" and len(block["t"]) == 6 and "Bw = -Dow" in block["layout"]["lft"]
    assert "decay rate" in rep.summary()


def test_the_nonlinearity_sector_term_is_needed(fj):
    """sin(x3) is not measured, so it cannot cancel: a certificate that ignores it is wrong."""
    from closedloop.runtime.families.observer.certificate import ErrorModel

    em = fj.error_model()
    linear_only = ErrorModel.linear(em.Ad, em.Cd, em.L)
    weights, acts = [np.zeros((6, 1)), np.zeros((5, 6))], ["tanh"]
    lft = lft_from_weights(weights, acts)
    rho = 0.98
    wrong = solve_lmi(linear_only, lft, rho, margin=1e-4)
    assert wrong.feasible and not solve_lmi(em, lft, rho, margin=1e-4).feasible
    # With N = 0, e+ = (A_L + s Gf H) e for the slope s = cos(xi) of sin between x3 and its estimate;
    # the worst error direction for a slope s is the top singular vector in P's coordinates.
    R = np.linalg.cholesky(wrong.P).T
    worst = max(np.linalg.norm(R @ (em.luenberger + s * em.Gf @ em.H) @ np.linalg.inv(R), 2) ** 2
                for s in np.linspace(-1, 1, 21))
    assert worst > rho ** 2
