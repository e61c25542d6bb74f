"""A stable-baselines3 policy trained on the user's own environment, exported through ``SB3Policy``, acts as
``model.predict(obs, deterministic=True)`` does: the runtime's action against SB3's own, within the fp32 export
tolerance (abs 1e-4 or rel 1e-3). The policies train for a few dozen steps first, as a user's would have: a
policy that has acted keeps state (PPO's and A2C's last action distribution) that a plain copy refuses."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gym = pytest.importorskip("gymnasium")
sb3 = pytest.importorskip("stable_baselines3")

from closedloop import Model, export_bundle  # noqa: E402
from closedloop.sdk.rl import SB3Policy  # noqa: E402


def _observations(env, n: int = 40) -> np.ndarray:
    env.observation_space.seed(0)
    obs = np.stack([env.observation_space.sample() for _ in range(n)]).astype(np.float32)
    return np.concatenate([obs, 4.0 * obs])  # far outside training's range too: the action bounds bind


def _export(policy, env, tmp_path, name):
    return export_bundle(policy, tmp_path / name, kind="feedforward", rate_hz=50.0, variants=(), tensorrt=False,
                         example_input=torch.zeros(1, *env.observation_space.shape), report=lambda s: None,
                         postprocess={"low": policy.low.tolist(), "high": policy.high.tolist()})


@pytest.mark.parametrize("algo", ["SAC", "TD3", "DDPG", "PPO", "A2C"])
def test_an_sb3_policy_exports_and_acts_as_its_predict(algo, tmp_path):
    env = gym.make("Pendulum-v1")
    small = {"PPO": {"n_steps": 32, "batch_size": 32}, "A2C": {"n_steps": 8}}.get(
        algo, {"learning_starts": 16, "batch_size": 16})
    model = getattr(sb3, algo)("MlpPolicy", env, seed=0, device="cpu", **small)
    model.learn(64)
    obs = _observations(env)
    if algo in ("PPO", "A2C"):  # an unsquashed mean past the bounds on about half the observations: SB3's clip
        p = model.policy  # decides those, the network the others (computed beside the policy, which keeps the
        with torch.no_grad():  # last training step's distribution, as a user's does)
            latent = p.mlp_extractor.forward_actor(p.extract_features(torch.as_tensor(obs), p.pi_features_extractor))
            p.action_net.bias.zero_()
            p.action_net.weight.mul_(2.0 / float(p.action_net(latent).abs().median()))
    bundle = _export(SB3Policy(model), env, tmp_path, algo)
    runtime = Model(bundle, backend="numba")
    got = np.stack([runtime.step(o[None]).copy()[0] for o in obs])
    want, _ = model.predict(obs, deterministic=True)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)
    assert np.all(got >= -2.0) and np.all(got <= 2.0)
    if algo in ("PPO", "A2C"):
        assert np.any(np.abs(got) == 2.0) and np.any(np.abs(got) < 2.0)


def test_vec_normalize_statistics_go_in_front_of_the_policy(tmp_path):
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    venv = VecNormalize(DummyVecEnv([lambda: gym.make("Pendulum-v1")]), clip_obs=2.0)
    venv.obs_rms.mean = np.array([0.3, -0.2, 1.5])
    venv.obs_rms.var = np.array([0.5, 2.0, 4.0])
    model = sb3.SAC("MlpPolicy", venv, seed=1, device="cpu")
    policy = SB3Policy(model, vec_normalize=venv)
    bundle = _export(policy, venv, tmp_path, "normalised")
    runtime = Model(bundle, backend="onnxruntime")
    obs = _observations(venv)
    got = np.stack([runtime.step(o[None]).copy()[0] for o in obs])
    want, _ = model.predict(venv.normalize_obs(obs), deterministic=True)  # what a VecNormalize'd env feeds it
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)
    assert not np.allclose(got, model.predict(obs, deterministic=True)[0], atol=1e-3)  # the statistics matter


class GoalEnv(gym.Env):
    """A goal-conditioned environment's Dict observation (the keys panda-gym and HER use), continuous actions."""

    from gymnasium import spaces as _s

    observation_space = _s.Dict({"observation": _s.Box(-5, 5, (6,)), "achieved_goal": _s.Box(-1, 1, (3,)),
                                 "desired_goal": _s.Box(-1, 1, (3,))})
    action_space = _s.Box(-1.0, 1.0, (4,))

    def reset(self, *, seed=None, options=None):
        return self.observation_space.sample(), {}

    def step(self, action):
        return self.observation_space.sample(), 0.0, False, False, {}


@pytest.mark.parametrize("normalised", [False, True])
def test_a_goal_conditioned_policy_takes_the_flat_observation_a_device_streams(normalised, tmp_path):
    from gymnasium import spaces
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    env = GoalEnv()
    venv = VecNormalize(DummyVecEnv([GoalEnv]), norm_obs_keys=["observation", "desired_goal"], clip_obs=1.5)
    rng = np.random.default_rng(3)
    for stats in venv.obs_rms.values():  # statistics other than 0 / 1, so that the normalisation shows
        stats.mean, stats.var = rng.normal(size=stats.mean.shape), rng.uniform(0.3, 3.0, stats.var.shape)
    model = sb3.SAC("MultiInputPolicy", venv if normalised else env, seed=2, device="cpu")
    policy = SB3Policy(model, vec_normalize=venv if normalised else None)
    flat_env = gym.wrappers.FlattenObservation(env)  # what the device streams: one flat measurement
    bundle = _export(policy, flat_env, tmp_path, f"goal{normalised}")
    runtime = Model(bundle, backend="numba")
    env.observation_space.seed(4)
    samples = [env.observation_space.sample() for _ in range(30)]
    flat = np.stack([spaces.flatten(env.observation_space, o) for o in samples]).astype(np.float32)
    got = np.stack([runtime.step(f[None]).copy()[0] for f in flat])
    batch = {k: np.stack([o[k] for o in samples]) for k in samples[0]}
    want, _ = model.predict(venv.normalize_obs(batch) if normalised else batch, deterministic=True)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


def test_a_discrete_policy_or_an_image_space_is_refused_with_what_to_change():
    with pytest.raises(ValueError, match=r"action space is Discrete: SB3Policy exports continuous \(Box\) actions"):
        SB3Policy(sb3.PPO("MlpPolicy", gym.make("CartPole-v1"), device="cpu"))
    from gymnasium import spaces

    class ImageEnv(gym.Env):
        observation_space = spaces.Dict({"image": spaces.MultiBinary(4), "b": spaces.Box(-1, 1, (1,))})
        action_space = spaces.Box(-1, 1, (1,))

        def reset(self, *, seed=None, options=None):
            return self.observation_space.sample(), {}

        def step(self, action):
            return self.observation_space.sample(), 0.0, False, False, {}

    with pytest.raises(ValueError, match="a flat Box or a Dict of Box spaces"):
        SB3Policy(sb3.SAC("MultiInputPolicy", ImageEnv(), device="cpu"))
