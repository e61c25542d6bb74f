"""panda-gym tasks: the scripted controllers solve them, weak cloned priors land in their band, replays are seeded
with whole episodes, and a fine-tuning cell starts from the prior it cloned."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("panda_gym")
import gymnasium as gym  # noqa: E402
import panda_gym  # noqa: E402,F401

from closedloop.sdk.rl.panda_gym import (  # noqa: E402
    GymScriptedController,
    clone_weak_prior,
    collect_gym_demonstrations,
    fine_tune_gym,
    seed_replay,
)
from closedloop.sdk.rl.sb3 import evaluate_success  # noqa: E402


@pytest.mark.parametrize("task", ["PandaReach-v3", "PandaPush-v3", "PandaPickAndPlace-v3"])
def test_the_scripted_controller_solves_the_panda_gym_task(task):
    env = gym.make(task)
    controller = GymScriptedController(task)

    def act(obs):
        return controller.act(obs)

    wins = 0
    for e in range(10):
        obs, _ = env.reset(seed=e)
        controller.reset()
        done = False
        while not done:
            obs, _, term, trunc, info = env.step(act(obs))
            done = term or trunc
        wins += info["is_success"]
    env.close()
    assert wins >= 6, f"{task}: the scripted controller succeeded in {wins} of 10 episodes"


def test_an_unknown_task_is_refused_by_name():
    with pytest.raises(ValueError, match="PandaSlide-v3.*known"):
        GymScriptedController("PandaSlide-v3")


def _sac(task, buffer_class=None, **buffer_kwargs):
    from closedloop.sdk.rl.regularised_sac import PriorRegularisedSAC

    kwargs = {"replay_buffer_class": buffer_class, "replay_buffer_kwargs": buffer_kwargs} if buffer_class else {}
    env = gym.make(task)
    return PriorRegularisedSAC("MultiInputPolicy", env, learning_starts=0, buffer_size=5_000, batch_size=32,
                               policy_kwargs={"net_arch": [64, 64]}, seed=0, device="cpu", **kwargs), env


def test_a_weak_prior_stops_at_the_first_check_inside_its_band_and_keeps_those_weights():
    model, env = _sac("PandaReach-v3")
    demos = collect_gym_demonstrations("PandaReach-v3", 10, noise=0.1, seed=0)
    rec = clone_weak_prior(model, demos, env, band=(0.5, 1.0), max_epochs=400, check_episodes=10,
                           check_gradient_steps=20, batch_size=32, lr=3e-3)
    assert rec["in_band"] and 0.5 <= rec["check_success"] <= 1.0
    assert rec["untrained_success"] < 0.5 and rec["history"][-1] == [rec["epochs"], rec["check_success"]]
    assert all(r < 0.5 for _, r in rec["history"][1:-1])  # it stopped at the first check in the band
    again = evaluate_success(lambda o: model.predict(o, deterministic=True)[0], env, 10, 50_000)
    assert again == rec["check_success"]  # the weights checked are the weights kept
    env.close()


def test_a_band_the_cloning_never_enters_is_reported_not_hidden():
    model, env = _sac("PandaReach-v3")
    demos = collect_gym_demonstrations("PandaReach-v3", 10, noise=0.1, seed=0)
    # an empty band above the untrained rate: no check can be inside it
    rec = clone_weak_prior(model, demos, env, band=(0.0, 0.0), max_epochs=20, check_episodes=5, check_gradient_steps=5,
                           batch_size=32)
    assert not rec["in_band"] and rec["band_floor"] > 0
    again = evaluate_success(lambda o: model.predict(o, deterministic=True)[0], env, 5, 50_000)
    assert again == rec["check_success"]  # the kept checkpoint is the one the record names
    with pytest.raises(ValueError, match="band"):
        clone_weak_prior(model, demos, env, band=(0.5, 0.2))
    env.close()


def test_seeded_episodes_are_whole_her_episodes_and_labelled_for_the_discriminator():
    from closedloop.sdk.rl import ShapingConfig, SuccessVisitationWrapper
    from closedloop.sdk.rl.regularised_sac import PriorRegularisedSAC
    from closedloop.sdk.rl.sb3 import ShapedHerReplayBuffer

    env = SuccessVisitationWrapper(gym.make("PandaPush-v3"), ShapingConfig(kind="svm", hidden=(16, 16)))
    vr = env.reward_model
    model = PriorRegularisedSAC("MultiInputPolicy", env, learning_starts=0, buffer_size=5_000, batch_size=32,
                                policy_kwargs={"net_arch": [32, 32]}, seed=0, device="cpu",
                                replay_buffer_class=ShapedHerReplayBuffer,
                                replay_buffer_kwargs={"reward_model": vr, "n_sampled_goal": 4,
                                                      "goal_selection_strategy": "future"})
    demos = collect_gym_demonstrations("PandaPush-v3", 6, noise=0.3, seed=1)
    assert {d["success"] for d in demos} == {True, False}  # both labels present for the discriminator
    seed_replay(model, demos, vr)
    buf = model.replay_buffer
    n = sum(len(d["actions"]) for d in demos)
    assert buf.pos == n
    ends = np.cumsum([len(d["actions"]) for d in demos])
    np.testing.assert_array_equal(buf.ep_length[:n, 0], np.repeat([len(d["actions"]) for d in demos],
                                                                   [len(d["actions"]) for d in demos]))
    # time-outs (failed episodes end at the limit) are marked, so they are not taken for terminal states
    np.testing.assert_array_equal(buf.timeouts[ends - 1, 0], [not d["success"] for d in demos])
    assert vr.replay.episodes == {"positive": sum(d["success"] for d in demos),
                                  "negative": sum(not d["success"] for d in demos)}
    batch = buf.sample(16, env=None)
    assert batch.rewards.shape == (16, 1)
    env.close()


def test_a_cloned_prior_cell_starts_from_its_prior_and_records_it():
    out = fine_tune_gym("PandaReach-v3", "svm", seed=0, prior="bc", her=True, steps=200, eval_every=100,
                        eval_episodes=5, net=(32, 32), batch_size=32, demos=10, band=(0.5, 1.0),
                        critic_pretrain_steps=20, actor_warmup_steps=50, prior_episodes=2,
                        prior_options={"check_episodes": 10, "check_gradient_steps": 20, "max_epochs": 400,
                                       "batch_size": 32, "lr": 3e-3})
    prior = out["prior"]
    assert prior["in_band"] and prior["successful_demos"] >= 1
    assert [s for s, _ in out["curve"]] == [0, 100, 200]
    assert out["curve"][0][1] >= 0.4  # the first point is the cloned prior, well above an untrained reach policy
    with pytest.raises(ValueError, match="prior"):
        fine_tune_gym("PandaReach-v3", "svm", seed=0, prior="dagger")


def test_cloning_that_overshoots_the_band_stops_after_the_checks_above_it():
    """A prior learned within a few epochs passes the band at once: with ``above_limit`` the cloning ends after
    that many checks in a row above it (keeping the check nearest the band) instead of running every epoch."""
    model, env = _sac("PandaReach-v3")
    demos = collect_gym_demonstrations("PandaReach-v3", 10, noise=0.1, seed=0)
    rec = clone_weak_prior(model, demos, env, band=(0.0, 0.05), max_epochs=400, check_episodes=10,
                           check_gradient_steps=20, batch_size=32, lr=3e-3, above_limit=3)
    rates = [r for _, r in rec["history"]]
    assert all(r > 0.05 for r in rates[-3:]) and rec["history"][-1][0] < 400  # stopped by the rule, not the ceiling
    assert not rec["in_band"]
    again = evaluate_success(lambda o: model.predict(o, deterministic=True)[0], env, 10, 50_000)
    assert again == rec["check_success"] and rec["check_success"] == min(rates[1:], key=lambda r: abs(r - 0.025))
    env.close()
