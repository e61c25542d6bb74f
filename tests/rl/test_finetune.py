"""Fine-tuning plumbing: the cloned actor acts like the cloned network, time-limit truncation bootstraps, the
prior-regularised actor stays near its prior, and ``closedloop rl-train`` runs end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("stable_baselines3")

from closedloop.sdk.rl import FineTuneConfig, ShapingConfig  # noqa: E402
from closedloop.sdk.rl.finetune import behaviour_clone, make_task_env  # noqa: E402
from closedloop.sdk.rl.regularised_sac import PriorRegularisedSAC  # noqa: E402


@pytest.fixture(scope="module")
def reach_model():
    env = make_task_env("reach")
    model = PriorRegularisedSAC("MlpPolicy", env, learning_starts=0, batch_size=32, ent_coef="0.002",
                                policy_kwargs={"net_arch": [32, 32]}, seed=0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 9)).astype(np.float32)
    y = np.tanh(x[:, :3] - x[:, 6:9]).astype(np.float32)  # something smooth to clone
    behaviour_clone(model.actor, x, y, epochs=30, init_log_std=-1.5)
    yield model, x
    env.close()


def test_sac_actor_loaded_from_behaviour_cloning_acts_like_the_clone(reach_model):
    model, x = reach_model
    det = model.predict(x, deterministic=True)[0]
    clone = torch.tanh(model.actor.mu(model.actor.latent_pi(torch.as_tensor(x)))).detach().numpy()
    np.testing.assert_allclose(det, clone, atol=1e-6)  # no rescaling between the clone and SAC's squashed mean
    stoch = np.stack([model.predict(x, deterministic=False)[0] for _ in range(20)])
    assert np.all(np.abs(stoch) <= 1.0)
    # pre-tanh std exp(-1.5) = 0.22: samples stay near the mean, the stochastic policy is the clone plus noise
    assert 0.02 < float(np.abs(stoch.mean(0) - det).mean()) < 0.15


def test_time_limit_truncation_is_stored_as_a_timeout_and_bootstraps():
    env = make_task_env("reach")
    model = PriorRegularisedSAC("MlpPolicy", env, learning_starts=100, policy_kwargs={"net_arch": [8]}, seed=0)
    model.learn(60)
    buf = model.replay_buffer
    last = env.max_episode_steps - 1
    assert buf.dones[last, 0] == 1 and buf.timeouts[last, 0] == 1  # the episode ended by its time limit ...
    sample = buf._get_samples(np.array([last]))
    assert float(sample.dones[0, 0]) == 0.0  # ... so the TD target bootstraps from the next state
    env.close()


def test_prior_regularised_actor_stays_near_its_prior_and_critic_pretraining_leaves_it_alone(reach_model):
    model, x = reach_model
    model.learn(60)  # some replay (actor also updates: plain SAC until a prior is set)
    model.set_prior(1.0)
    before = model.predict(x, deterministic=True)[0]
    model.pretrain_critic(50)
    np.testing.assert_array_equal(model.predict(x, deterministic=True)[0], before)
    model.set_prior(1e4)  # a very strong pull: the policy cannot leave the prior
    model.actor_lr_scale = 1.0
    prior = model.predict(x, deterministic=True)[0]
    model.train(100, 32)
    assert float(np.abs(model.predict(x, deterministic=True)[0] - prior).max()) < 0.1


def test_rl_train_command_writes_a_record_and_a_bundle_and_nothing_in_the_temp_folder(tmp_path, monkeypatch):
    import tempfile

    from closedloop.sdk.cli import build_parser
    from closedloop.sdk.rl import cli  # noqa: F401  (registers rl-train)

    cfg = FineTuneConfig(task="reach", demos=3, prior_episodes=1, bc_epochs=5, total_steps=60, net=(16, 16),
                         batch_size=16, critic_pretrain_steps=10, actor_warmup_steps=20, eval_every=60,
                         eval_episodes=1, shaping=ShapingConfig(hidden=(8,), updates_per_episode=2))
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg.to_dict()))
    args = build_parser().parse_args(["rl-train", "--config", str(path), "--reward", "potential", "--quiet",
                                      "--out", str(tmp_path / "run")])
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.delenv("SB3_LOGDIR", raising=False)
    assert args.func(args) == 0
    assert not list(temp.glob("SB3-*"))  # SB3's default logger would leave an empty SB3-<date> folder per run
    rec = json.loads((tmp_path / "run" / "run.json").read_text())
    assert rec["config"]["task"] == "reach" and rec["config"]["shaping"]["kind"] == "potential"
    assert [s for s, _ in rec["curve"]] == [0, 60]
    assert (tmp_path / "run" / "policy" / "manifest.json").exists()
    # the same --out again is refused before any training (exit 2 through main), --overwrite replaces it
    with pytest.raises(FileExistsError, match="run.json, .*policy exist.*--overwrite"):
        args.func(args)
    args = build_parser().parse_args(["rl-train", "--steps", "0", "--out", str(tmp_path / "zero")])
    with pytest.raises(ValueError, match="--steps 0: give the fine-tuning steps, 1 or more"):
        args.func(args)
    # a --config that is missing, not JSON or not an object is named, with what to give (exit 2 through main)
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "bad.json").write_text("{task: reach")
    for name, words in (("nope.json", "no such file"), ("bad.json", "not a JSON file"),
                        ("list.json", "holds a JSON list, not an object")):
        args = build_parser().parse_args(["rl-train", "--config", str(tmp_path / name), "--out", str(tmp_path / "c")])
        with pytest.raises(ValueError, match=f"--config .*{name}: {words}"):
            args.func(args)


def test_a_config_repeats_its_run_and_bad_settings_are_named(tmp_path):
    """A run.json's config gives the same run again: its reward and seed are kept unless an option says otherwise
    (--reward's default replaced a config's gail with svm); a setting that cannot mean anything is refused by name,
    before any training, instead of failing inside it (exit 70) or training a discriminator that never learns."""
    from closedloop.sdk.rl.workflow import rl_train_config

    cfg = FineTuneConfig(task="reach", seed=7, shaping=ShapingConfig(kind="gail", lam=0.2, beta=2.0))
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"config": cfg.to_dict()}))
    again = rl_train_config(path)
    assert (again.shaping.kind, again.shaping.lam, again.shaping.beta, again.seed) == ("gail", 0.2, 2.0, 7)
    assert rl_train_config(path, reward="sparse", seed=1).shaping.kind == "sparse"
    for change, words in (({"total_steps": "abc"}, "FineTuneConfig.total_steps: \"abc\" is not a whole number"),
                          ({"task": "stack"}, "FineTuneConfig.task='stack': one of reach, push, pick_and_place"),
                          ({"total_steps": 0}, "total_steps=0: give a whole number, 1 or more"),
                          ({"shaping": {"capacity": 0}}, "ShapingConfig.capacity=0: give a whole number, 1 or more"),
                          ({"shaping": {"updates_per_episode": -1}}, "updates_per_episode=-1"),
                          ({"shaping": {"kind": "potential", "gamma": 0.5}}, "shaping.gamma 0.5 is not SAC's discount"),
                          ({"seed": -1}, "seed=-1: a whole number from 0"),
                          ({"shaping": {"lam": float("inf")}}, "ShapingConfig needs beta > 0, lam >= 0")):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(cfg.to_dict() | change))
        with pytest.raises(ValueError, match=f"--config .*bad.json: .*{words}"):
            rl_train_config(bad)


def test_rl_demo_clones_exports_and_runs_against_the_emulator(tmp_path):
    from closedloop.sdk.rl.demo import rl_demo

    out = rl_demo(tmp_path, task="reach", demos=3, episodes=1, quiet=True)
    assert out["family"]["episodes"] == 1 and out["family"]["successes"] in (0, 1)
    assert (tmp_path / "reach_policy" / "manifest.json").exists()
