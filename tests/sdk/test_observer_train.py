"""Two-stage training of the certified observer, the direct baseline, and the differentiable LMI."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from closedloop.runtime.families.observer.certificate import check_certificate
from closedloop.sdk.observer.direct import train_direct
from closedloop.sdk.observer.neural import NeuralObserver, ObserverModel
from closedloop.sdk.observer.systems import observer_system
from closedloop.sdk.observer.train import (
    TrainConfig,
    _initial_net,
    _Problem,
    train_observer,
    train_stage1,
    train_stage2,
)

TINY = TrainConfig(hidden=(8,), stage1_steps=30, horizon=20, n_traj=8, n_points=64, stage2_rounds=6, stage2_steps=30)


@pytest.fixture(scope="module")
def fj() -> ObserverModel:
    return ObserverModel.from_system(observer_system("flexible-joint"))


@pytest.fixture(scope="module")
def trained(fj):
    return train_observer(fj, TINY)


def test_two_stage_training_reaches_a_certificate_in_seconds(fj, trained):
    assert trained.certified
    cert = trained.certificate
    chk = check_certificate(fj.error_model(), trained.net.lft(), cert.P, cert.t, cert.lam, trained.rho, TINY.margin)
    assert chk.passed and chk.max_eig <= -TINY.margin
    t = trained.times
    assert t["total_s"] < 30 and t["stage1_s"] > 0 and t["stage2_s"] > 0
    assert t["stage2_sdp_solves"] >= 1
    stage1 = [h for h in trained.history if h["stage"] == 1 and "lyapunov_hinge" in h]
    assert stage1[-1]["lyapunov_hinge"] <= stage1[0]["lyapunov_hinge"]
    first = [h for h in trained.history if "final_accuracy" in h]
    assert first[0]["final_accuracy"] < 1.0  # stage 1 beats the Luenberger observer on its own loss


def test_stage2_pushes_an_uncertified_network_to_a_certificate(fj):
    """A network made too strong for the LMI is fine-tuned until it is certified."""
    cfg = TrainConfig(hidden=(6,), stage1_steps=0, stage2_rounds=8, stage2_steps=40, seed=3)
    torch.manual_seed(3)
    result = train_stage1(fj, cfg, _initial_net(fj, cfg).scale_(2.0), rho=0.999)
    from closedloop.sdk.observer.lmi import solve_lmi

    assert not solve_lmi(fj.error_model(), result.net.lft(), 0.999, margin=cfg.margin).feasible
    result = train_stage2(result, fj)
    assert result.certified and result.times["stage2_grad_steps"] > 0


def test_torch_lmi_eigenvalue_is_differentiable(fj, trained):
    prob = _Problem(fj, TINY)
    lmax = prob.lmi_max_eig(trained.net, trained.certificate, trained.rho)
    lmax.backward()
    grads = [w.grad for w in trained.net.raw]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert lmax.item() == pytest.approx(trained.certificate.max_eig, abs=1e-8)
    trained.net.zero_grad()


def test_direct_baseline_solves_an_sdp_every_step(fj, trained):
    cfg = TrainConfig(**{**TINY.to_dict(), "stage1_steps": 10, "hidden": (8,)})
    direct = train_direct(fj, cfg, max_extra_steps=40)
    assert direct.certified
    assert direct.times["sdp_solves"] >= cfg.stage1_steps + 1
    assert direct.times["sdp_solves"] > trained.times["stage2_sdp_solves"]


def test_trained_observer_runs_behind_the_harness_interface(fj, trained):
    obs = NeuralObserver(fj, trained.net)
    obs.reset(np.zeros(5))
    z = np.array([0.2, 0.0, 0.1, 0.0, 0.5])
    for _ in range(50):
        y = fj.Cd @ z
        u = obs.command()
        obs.update(y, u)
        z = fj.Ad @ z + fj.Bd @ u + fj.f(z, y)
    assert np.all(np.isfinite(obs.z_hat)) and np.all(np.abs(obs.command()) <= 5.0)


def test_config_round_trips():
    assert TrainConfig.from_dict(TINY.to_dict()) == TINY
