"""The shaped reward's formulas, its labelled replay and the discriminator's training."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from closedloop.sdk.rl import ShapingConfig, VisitationReward, clipped_logit


class _FixedLogit(torch.nn.Module):
    """logit = w . x (a discriminator whose output the test knows)."""

    def __init__(self, w):
        super().__init__()
        self.w = torch.as_tensor(w, dtype=torch.float32)

    def forward(self, x):
        return x @ self.w


def _with_logit(kind, w, **kw):
    n_obs = 2
    vr = VisitationReward(ShapingConfig(kind=kind, **kw), obs_dim=n_obs, act_dim=1)
    vr.net = _FixedLogit(w)
    vr.updates = 1  # "trained"
    return vr


def test_svm_bonus_is_lambda_times_clipped_logit():
    vr = _with_logit("svm", [1.0, 2.0, 3.0], lam=0.1, beta=2.0)
    obs = np.array([[0.1, 0.2], [1.0, 1.0], [-3.0, 0.0]])
    act = np.array([[0.5], [1.0], [0.0]])
    logit = obs @ [1.0, 2.0] + act[:, 0] * 3.0
    np.testing.assert_allclose(vr.bonus(obs, act, obs), 0.1 * np.clip(logit, -2.0, 2.0), rtol=1e-6)
    np.testing.assert_allclose(clipped_logit(np.array([-9.0, 0.3, 9.0]), 2.0), [-2.0, 0.3, 2.0])


def test_potential_bonus_is_gamma_phi_next_minus_phi_and_zero_after_termination():
    vr = _with_logit("potential", [1.0, -1.0], lam=0.5, beta=1.5, gamma=0.9)
    s = np.array([[0.2, 0.1], [3.0, 0.0], [0.0, 0.5]])
    s2 = np.array([[0.4, 0.0], [0.0, 3.0], [1.0, 0.0]])
    phi = lambda x: np.clip(x @ [1.0, -1.0], -1.5, 1.5)  # noqa: E731
    done = np.array([0.0, 0.0, 1.0])
    expected = 0.5 * (0.9 * phi(s2) * (1 - done) - phi(s))
    np.testing.assert_allclose(vr.bonus(s, np.zeros((3, 1)), s2, done), expected, rtol=1e-6)


def test_sparse_and_untrained_rewards_add_nothing():
    for kind in ("sparse", "svm"):
        vr = VisitationReward(ShapingConfig(kind=kind), obs_dim=2, act_dim=1)
        assert not vr.ready
        assert np.all(vr.bonus(np.ones((4, 2)), np.ones((4, 1)), np.ones((4, 2))) == 0)


def _two_clusters(vr, n_episodes=4, seed=0):
    rng = np.random.default_rng(seed)
    for e in range(n_episodes):
        ok = e % 2 == 0
        centre = 1.0 if ok else -1.0
        obs = centre + 0.1 * rng.standard_normal((20, 2))
        vr.add_episode(obs, np.full((20, 1), centre), obs, success=ok)


@pytest.mark.parametrize("kind", ["svm", "potential"])
def test_discriminator_learns_to_separate_success_from_failure(kind):
    vr = VisitationReward(ShapingConfig(kind=kind, lam=1.0, beta=5.0, gamma=0.95, updates_per_episode=0), obs_dim=2,
                          act_dim=1)
    _two_clusters(vr)
    assert vr.replay.episodes == {"positive": 2, "negative": 2}
    vr.fit(300)
    assert vr.ready and vr.last_accuracy > 0.95
    good, bad = np.ones((1, 2)), -np.ones((1, 2))
    if kind == "svm":
        assert vr.bonus(good, np.ones((1, 1)), good)[0] > 2 and vr.bonus(bad, -np.ones((1, 1)), bad)[0] < -2
    else:  # moving from a failure-like state to a success-like one is rewarded, the reverse penalised
        assert vr.bonus(bad, np.zeros((1, 1)), good)[0] > 2 and vr.bonus(good, np.zeros((1, 1)), bad)[0] < -2


def test_success_only_discriminator_uses_the_policys_own_data_as_negatives():
    cfg = ShapingConfig(kind="gail", lam=1.0, beta=5.0, updates_per_episode=0, policy_window=40)
    vr = VisitationReward(cfg, obs_dim=2, act_dim=1)
    rng = np.random.default_rng(1)
    good = 1.0 + 0.1 * rng.standard_normal((20, 2))
    vr.add_episode(good, np.ones((20, 1)), good, success=True)
    for _ in range(3):  # the policy's own recent episodes, whatever their outcome
        other = -1.0 + 0.1 * rng.standard_normal((20, 2))
        vr.add_episode(other, -np.ones((20, 1)), other, success=False)
    assert len(vr.replay.recent) == 40 and all(row[0] < 0 for row in vr.replay.recent)
    vr.fit(300)
    g, o = np.ones((1, 2)), -np.ones((1, 2))
    assert vr.bonus(g, np.ones((1, 1)), g)[0] > 2 and vr.bonus(o, -np.ones((1, 1)), o)[0] < -2


def test_refit_after_every_episode_counts_updates():
    vr = VisitationReward(ShapingConfig(kind="svm", updates_per_episode=7), obs_dim=2, act_dim=1)
    vr.fit()
    assert vr.updates == 0  # one class only: nothing to fit
    _two_clusters(vr, 2)
    vr.fit()
    assert vr.updates == 7


def test_config_round_trips_through_json():
    import json

    from closedloop.sdk.rl import FineTuneConfig

    cfg = FineTuneConfig(task="reach", shaping=ShapingConfig(kind="potential", lam=0.2, hidden=(8,)),
                         prior_band=(0.1, 0.3))
    again = FineTuneConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    with pytest.raises(ValueError, match="kind"):
        ShapingConfig(kind="dense")


def test_gamma_is_the_algorithms_unless_set_and_a_different_one_is_refused_for_the_potential_form():
    vr = VisitationReward(ShapingConfig(kind="potential", updates_per_episode=0), obs_dim=2, act_dim=1)
    _two_clusters(vr)
    vr.fit(5)
    with pytest.raises(RuntimeError, match="bind_gamma"):
        vr.bonus(np.ones((1, 2)), np.zeros((1, 1)), np.ones((1, 2)))
    vr.bind_gamma(0.99)
    assert vr.gamma == 0.99 and np.isfinite(vr.bonus(np.ones((1, 2)), np.zeros((1, 1)), np.ones((1, 2)))).all()
    fixed = VisitationReward(ShapingConfig(kind="potential", gamma=0.95), obs_dim=2, act_dim=1)
    with pytest.raises(ValueError, match="algorithm's gamma is 0.99"):
        fixed.bind_gamma(0.99)
    fixed.bind_gamma(0.95)
    VisitationReward(ShapingConfig(kind="svm", gamma=0.95), obs_dim=2, act_dim=1).bind_gamma(0.99)  # unused by svm
