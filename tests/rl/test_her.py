"""SAC + HER + the success-visitation reward on panda-gym's goal-conditioned tasks: relabelled goals keep the bonus."""

from __future__ import annotations

import numpy as np
import pytest

from closedloop.sdk.rl import ShapingConfig, SuccessVisitationWrapper

pytest.importorskip("panda_gym")


def _sac_her(task: str, kind: str, steps: int = 120):
    import gymnasium as gym
    from stable_baselines3 import SAC

    from closedloop.sdk.rl.sb3 import OutcomeLogger, ShapedHerReplayBuffer

    env = SuccessVisitationWrapper(gym.make(task, max_episode_steps=25),
                                   ShapingConfig(kind=kind, lam=0.2, beta=2.0, updates_per_episode=5, batch_size=16,
                                                 hidden=(16, 16)))
    vr = env.reward_model
    model = SAC("MultiInputPolicy", env, buffer_size=1_000, learning_starts=50, batch_size=32, gamma=0.9, train_freq=4,
                policy_kwargs={"net_arch": [16, 16]}, replay_buffer_class=ShapedHerReplayBuffer,
                replay_buffer_kwargs={"reward_model": vr, "n_sampled_goal": 4, "goal_selection_strategy": "future"},
                seed=0, device="cpu")
    # Label one episode each way by hand so the discriminator has both classes early (a few hundred random
    # steps rarely succeed on push).
    flat = lambda o: np.asarray(env._flat(o))  # noqa: E731
    o, _ = env.reset(seed=0)
    n = flat(o).size
    vr.add_episode(np.ones((5, n)), np.ones((5, 3)) * 0.5, np.ones((5, n)), True)
    vr.add_episode(-np.ones((5, n)), -np.ones((5, 3)) * 0.5, -np.ones((5, n)), False)
    model.learn(steps, callback=OutcomeLogger(reward_model=vr))
    return model, env, vr


@pytest.mark.parametrize("task", ["PandaReach-v3", "PandaPush-v3"])
def test_her_relabelled_rewards_are_outcome_for_the_new_goal_plus_its_bonus(task):
    model, env, vr = _sac_her(task, "svm")
    try:
        buf = model.replay_buffer
        assert vr.ready and model.num_timesteps == 120
        batch = buf.sample(64)
        n_virtual = int(buf.her_ratio * 64)
        n_real = 64 - n_virtual  # SB3 puts the real rows first, the relabelled ones after them
        virtual = buf.last_virtual
        rewards = batch.rewards.cpu().numpy().reshape(-1)
        # Relabelled rows: the outcome for the relabelled goal plus the bonus of the discriminator for that goal.
        goals = batch.observations["desired_goal"].cpu().numpy()
        expected_outcome = env.unwrapped.compute_reward(batch.next_observations["achieved_goal"].cpu().numpy(),
                                                        goals, {})
        np.testing.assert_allclose(virtual["outcome"], expected_outcome[n_real:])
        space = env.observation_space
        from closedloop.sdk.rl.wrapper import flatten_batch

        obs = flatten_batch(space, {k: v.cpu().numpy() for k, v in batch.observations.items()})
        bonus = vr.bonus(obs, batch.actions.cpu().numpy(), obs)
        np.testing.assert_allclose(rewards[n_real:] - expected_outcome[n_real:], bonus[n_real:], atol=1e-5)
        assert np.abs(bonus[n_real:]).min() > 0  # the bonus is there, not a no-op
        # The bonus depends on the goal: the same states with another goal get another bonus.
        other = obs.copy()
        d = slice(3, 6)  # desired_goal follows achieved_goal (3 values) in spaces.flatten's order
        other[:, d] += 0.3
        assert not np.allclose(vr.bonus(other, batch.actions.cpu().numpy(), other), bonus)
        # Real rows: the stored outcome plus the bonus.
        np.testing.assert_allclose(rewards[:n_real] - expected_outcome[:n_real], bonus[:n_real], atol=1e-5)
    finally:
        env.close()


def test_potential_form_under_her_takes_sacs_gamma():
    model, env, vr = _sac_her("PandaReach-v3", "potential", steps=60)
    try:
        assert vr.gamma == model.gamma == 0.9
    finally:
        env.close()


def test_plain_her_and_flat_buffers_refuse_a_shaped_dict_env():
    import gymnasium as gym
    from stable_baselines3 import SAC
    from stable_baselines3.her import HerReplayBuffer

    from closedloop.sdk.rl.sb3 import ShapedReplayBuffer

    env = SuccessVisitationWrapper(gym.make("PandaReach-v3", max_episode_steps=5), ShapingConfig(kind="svm"))
    try:
        with pytest.raises(TypeError, match="ShapedDictReplayBuffer"):
            SAC("MultiInputPolicy", env, buffer_size=100, replay_buffer_class=ShapedReplayBuffer,
                replay_buffer_kwargs={"reward_model": env.reward_model})
        model = SAC("MultiInputPolicy", env, buffer_size=100, learning_starts=6, batch_size=4, replay_buffer_class=HerReplayBuffer,
                    policy_kwargs={"net_arch": [8]}, device="cpu")
        with pytest.raises(TypeError, match="ShapedHerReplayBuffer"):
            model.learn(12)
    finally:
        env.close()


def test_no_combination_silently_loses_the_bonus():
    """A shaped buffer without a reward model, with another wrapper's, over an unwrapped environment, or shaped HER
    over two environments: each refused with what to give, never a buffer whose bonus nothing trains."""
    import gymnasium as gym
    from stable_baselines3 import SAC
    from stable_baselines3.common.vec_env import DummyVecEnv

    from closedloop.sdk.rl.finetune import make_task_env
    from closedloop.sdk.rl.sb3 import ShapedHerReplayBuffer, ShapedReplayBuffer

    env = SuccessVisitationWrapper(make_task_env("reach"), ShapingConfig(kind="svm"))
    other = SuccessVisitationWrapper(make_task_env("reach"), ShapingConfig(kind="svm"))
    small = {"learning_starts": 5, "batch_size": 4, "buffer_size": 200, "policy_kwargs": {"net_arch": [8]},
             "device": "cpu"}
    try:
        with pytest.raises(ValueError, match="needs reward_model="):
            SAC("MlpPolicy", env, replay_buffer_class=ShapedReplayBuffer, **small)
        model = SAC("MlpPolicy", env, replay_buffer_class=ShapedReplayBuffer,
                    replay_buffer_kwargs={"reward_model": other.reward_model}, **small)
        with pytest.raises(ValueError, match="not the one the environment's SuccessVisitationWrapper trains"):
            model.learn(10)
        bare = make_task_env("reach")
        model = SAC("MlpPolicy", bare, replay_buffer_class=ShapedReplayBuffer,
                    replay_buffer_kwargs={"reward_model": env.reward_model}, **small)
        with pytest.raises(ValueError, match="no outcome_reward: wrap the environment"):
            model.learn(10)
        bare.close()
    finally:
        env.close()
        other.close()
    two = DummyVecEnv([lambda: SuccessVisitationWrapper(gym.make("PandaReach-v3", max_episode_steps=5),
                                                        ShapingConfig(kind="svm"))] * 2)
    try:
        with pytest.raises(ValueError, match="relabels one environment's transitions; got n_envs=2"):
            SAC("MultiInputPolicy", two, replay_buffer_class=ShapedHerReplayBuffer,
                replay_buffer_kwargs={"reward_model": two.envs[0].reward_model}, **small)
    finally:
        two.close()
