"""The reward wrapper on another suite's environment (panda-gym PandaReach), and its stable-baselines3 plumbing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from closedloop.sdk.rl import ShapingConfig, SuccessVisitationWrapper

pytestmark = pytest.mark.uses_ray  # the tiny benchmark starts a local Ray instance (tests/conftest.py)


def test_wrapper_on_panda_gym_reach_labels_refits_and_shapes():
    pytest.importorskip("panda_gym")
    import gymnasium as gym

    env = SuccessVisitationWrapper(gym.make("PandaReach-v3"), ShapingConfig(kind="svm", lam=0.1, updates_per_episode=20))
    rng = np.random.default_rng(0)
    try:
        seen = []
        for episode in range(4):
            obs, _ = env.reset(seed=episode)
            done = False
            while not done:
                if episode % 2 == 0:  # straight at the goal: succeeds
                    a = np.clip(10 * (obs["desired_goal"] - obs["achieved_goal"]), -1, 1)
                else:  # away from it: fails
                    a = np.clip(-10 * (obs["desired_goal"] - obs["achieved_goal"]), -1, 1) + 0.1 * rng.standard_normal(3)
                obs, r, term, trunc, info = env.step(a)
                assert r == pytest.approx(info["outcome_reward"] + info["shaping_bonus"])
                done = term or trunc
            seen.append(info["episode_success"])
        assert seen == [True, False, True, False]
        assert env.reward_model.ready and env.reward_model.replay.episodes == {"positive": 2, "negative": 2}
        assert info["shaping_bonus"] != 0.0 and "episode_shaped_return" in info
    finally:
        env.close()


def test_sac_with_relabelling_buffer_and_outcome_logger_on_push():
    pytest.importorskip("stable_baselines3")
    from stable_baselines3 import SAC

    from closedloop.sdk.rl.finetune import make_task_env
    from closedloop.sdk.rl.sb3 import ActorWarmup, OutcomeLogger, ShapedReplayBuffer

    env = SuccessVisitationWrapper(make_task_env("push"), ShapingConfig(kind="potential", updates_per_episode=2))
    eval_env = make_task_env("push")
    vr = env.reward_model
    vr.add_episode(np.ones((5, 21)), np.zeros((5, 3)), np.ones((5, 21)), True)  # a labelled past
    model = SAC("MlpPolicy", env, learning_starts=20, batch_size=16, policy_kwargs={"net_arch": [16, 16]},
                replay_buffer_class=ShapedReplayBuffer, replay_buffer_kwargs={"reward_model": vr}, seed=0)
    log = OutcomeLogger(eval_env, eval_every=100, eval_episodes=1, reward_model=vr)
    warm = ActorWarmup(60)
    model.learn(120, callback=[log, warm])
    assert [s for s, _ in log.curve] == [0, 100] and not warm.frozen
    assert len(log.episodes) == 2 and {"success", "outcome_return", "shaped_return"} <= set(log.episodes[0])
    assert vr.ready  # the failures of the two episodes gave it its second class
    batch = model.replay_buffer.sample(8)
    outcome = model.replay_buffer.outcome_rewards[: model.replay_buffer.size(), 0]
    assert batch.rewards.shape == (8, 1) and np.all(outcome == 0)
    assert float(batch.rewards.abs().sum()) > 0  # relabelled with the current potential
    env.close()
    eval_env.close()


def test_the_documented_outcome_logger_binds_gamma_and_an_unbound_potential_fails_at_the_first_step():
    """``model.learn(..., callback=OutcomeLogger(eval_env))`` as docs/rl.md writes it (no reward_model=) gives the
    potential form the algorithm's gamma; without any binding the first step says so, not a fit thousands of steps
    later."""
    pytest.importorskip("stable_baselines3")
    from stable_baselines3 import SAC

    from closedloop.sdk.rl.finetune import make_task_env
    from closedloop.sdk.rl.sb3 import OutcomeLogger, ShapedReplayBuffer

    env = SuccessVisitationWrapper(make_task_env("push"), ShapingConfig(kind="potential", updates_per_episode=2))
    model = SAC("MlpPolicy", env, learning_starts=20, batch_size=16, policy_kwargs={"net_arch": [16, 16]},
                replay_buffer_class=ShapedReplayBuffer, replay_buffer_kwargs={"reward_model": env.reward_model},
                gamma=0.9, seed=0)
    log = OutcomeLogger()
    model.learn(30, callback=log)
    assert env.reward_model.gamma == 0.9 and log.reward_model is env.reward_model
    env.close()
    unbound = SuccessVisitationWrapper(make_task_env("push"), ShapingConfig(kind="potential"))
    unbound.reset(seed=0)
    with pytest.raises(RuntimeError, match="no algorithm's gamma was bound: train with .*OutcomeLogger"):
        unbound.step(unbound.action_space.sample())
    unbound.close()


def test_an_environment_that_never_reports_success_is_warned_about():
    import gymnasium as gym

    class Quiet(gym.Env):  # an episode of three steps whose info never says is_success
        observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
        action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)

        def reset(self, *, seed=None, options=None):
            self.t = 0
            return np.zeros(2, np.float32), {}

        def step(self, action):
            self.t += 1
            return np.zeros(2, np.float32), 0.0, self.t >= 3, False, {}

    env = SuccessVisitationWrapper(Quiet(), ShapingConfig(kind="svm"))
    env.reset(seed=0)
    with pytest.warns(UserWarning, match="never has 'is_success'"):
        for _ in range(3):
            env.step(env.action_space.sample())


@pytest.mark.slow
def test_bench_tiny_writes_its_reports(tmp_path, monkeypatch):
    import subprocess
    import sys
    from pathlib import Path

    from closedloop.sdk.rl import benchmark

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(root / "bench" / "bench_rl.py"), "--tiny", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=280, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    for name in ("rl_tiny.json", "rl_tiny.md", "rl_tiny_success.png"):
        assert (tmp_path / name).stat().st_size > 0
    # every run was stored as it ended: the same benchmark again runs none of them and writes the same table
    # (run in this process, its over-the-wire deployment check -- the first run's -- stood in for)
    cells = tmp_path / "cells" / "rl_tiny" / "cells.jsonl"
    lines = cells.read_text().splitlines()
    assert lines and all('"status": "ok"' in ln for ln in lines)
    first = json.loads((tmp_path / "rl_tiny.json").read_text())
    assert first["deployment"]["episodes"] == 2 and first["deployment"]["runtime_step_p99_us"] > 0
    assert "## Deployment" in (tmp_path / "rl_tiny.md").read_text()

    def no_cell(*a, **k):
        raise AssertionError("a finished run ran again")

    # the stand-in answers to the cell function's name: a results file refuses another function's records
    no_cell.__module__, no_cell.__qualname__ = benchmark._rl_cell.__module__, benchmark._rl_cell.__qualname__
    monkeypatch.setattr(benchmark, "_rl_cell", no_cell)
    monkeypatch.setattr(benchmark, "deploy_best", lambda runs, cfg, out_dir: first["deployment"])
    said = []
    benchmark.run_rl_benchmark(benchmark.tiny_config(), tmp_path, "rl_tiny", tiny=True, report=said.append)
    assert any(f"{len(lines)} of {len(lines)} runs were finished by an earlier run" in s for s in said), said
    assert cells.read_text().splitlines() == lines
    assert json.loads((tmp_path / "rl_tiny.json").read_text())["table"] == first["table"]


def test_observations_the_discriminator_cannot_read_and_her_on_a_flat_space_are_refused_by_name():
    import gymnasium as gym

    from closedloop.sdk.rl.sb3 import ShapedHerReplayBuffer

    with pytest.raises(ValueError, match="reads Box observations .* one-hot Box"):
        SuccessVisitationWrapper(gym.make("FrozenLake-v1"), ShapingConfig())
    flat = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    env = SuccessVisitationWrapper(gym.make("Pendulum-v1"), ShapingConfig())
    with pytest.raises(ValueError, match="needs a goal-conditioned Dict observation space .* use ShapedReplayBuffer"):
        ShapedHerReplayBuffer(100, flat, flat, reward_model=env.reward_model, env=None)
    env.close()
