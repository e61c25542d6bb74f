"""A behaviour-cloned Panda reach policy under bit flips: success rate through the runtime."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import numpy as np

from .config import KEY, BitflipBenchConfig
from .evaluate_bci import plain_int8


def _behaviour_clone(net, x: np.ndarray, y: np.ndarray, epochs: int, lr: float, seed: int):
    """Mean squared error on the (squashed) scripted actions, Adam with cosine decay; ``net`` in place."""
    from closedloop.sdk.rl.finetune import fit_actions

    net.train()
    fit_actions(net, list(net.parameters()), x, y, epochs=epochs, lr=lr, batch_size=128, seed=seed,
                lr_final_fraction=0.05)
    return net.eval()


class PolicyEvaluator:
    """A behaviour-cloned Panda reach policy: success rate over fixed seeded episodes, run through the runtime
    (observations standardised as the ``policy`` family does, a non-finite action replaced by the safe one:
    hold the hand), and the mean final hand-goal distance."""

    name = "policy"
    metric = "success_rate"
    extra = "final_distance_cm"
    higher_is_better = True
    split_protected = True  # the biases are not protected
    precisions = (None,)
    targeted = True

    def __init__(self, cfg: BitflipBenchConfig, work: Path, report=print):
        import torch

        from closedloop.sdk.rl.deploy import export_policy
        from closedloop.sdk.rl.finetune import collect_demonstrations, make_task_env, observation_stats
        from closedloop.sdk.robust import finalize, protect, protect_bundle

        torch.set_num_threads(1)
        self.cfg, self.random_flips, self.seeds = cfg, cfg.policy_flips, cfg.policy_seeds
        t0 = time.perf_counter()
        task = cfg.policy_task
        demos = collect_demonstrations(task, cfg.policy_demos, noise=0.1, seed=0)
        self.mean, self.std = observation_stats(demos)
        good = [e for e in demos if e["success"]] or demos
        x = (np.concatenate([e["obs"] for e in good]) - self.mean) / self.std
        y = np.concatenate([e["actions"] for e in good])
        n_obs = x.shape[1]
        torch.manual_seed(0)
        h = cfg.policy_hidden
        base = torch.nn.Sequential(torch.nn.Linear(n_obs, h), torch.nn.ReLU(), torch.nn.Linear(h, h), torch.nn.ReLU(),
                                   torch.nn.Linear(h, y.shape[1]), torch.nn.Tanh())
        _behaviour_clone(base, x, y, cfg.policy_bc_epochs, 2e-3, 0)
        ex = torch.zeros(1, n_obs)
        models = {"unprotected": copy.deepcopy(base), "protected": copy.deepcopy(base),
                  "protected_unkeyed": copy.deepcopy(base)}
        plans = {}
        for name, m in models.items():  # the same fine-tuning budget for all three (BC loss, lr decay)
            key = KEY if name == "protected" else None
            if name != "unprotected":
                plans[name] = (protect(m, ex, kind="feedforward", k=cfg.k, key=key,
                                       include_bias=cfg.policy_include_bias), key)
            _behaviour_clone(m, x, y, cfg.policy_finetune_epochs, 1e-3, 1)
            if name != "unprotected":
                finalize(m, *plans[name])
        self.bundles = {}
        for name, m in models.items():
            path = export_policy(m, self.mean, self.std, task, work / f"policy_{name}")
            if name in plans:
                protect_bundle(path, plans[name][0], plans[name][1], report=lambda s: None)
            else:
                plain_int8(path, m, ex, "feedforward")
            self.bundles[name] = path
        self.plan_summary = plans["protected"][0].summary(models["protected"])
        # the attack's data: recorded observations (standardised), the clean policy's actions are its reference
        rec = [e["obs"] for e in demos[: max(1, cfg.attack_batch)]]
        self._attack_obs = ((np.concatenate(rec) - self.mean) / self.std).astype(np.float32)
        self.env = make_task_env(task)
        report(f"policy: {len(demos)} scripted {task} demonstrations ({np.mean([e['success'] for e in demos]):.2f} "
               f"successful), cloned a {h}x{h} MLP, fine-tuned and exported in {time.perf_counter() - t0:.0f} s; "
               f"protected {self.plan_summary['protected_fraction']:.1%} of the weights")

    def evaluate(self, model, mem=None) -> dict[str, float]:
        wins, dist = 0, []
        for e in range(self.cfg.policy_episodes):
            obs, info = self.env.reset(seed=50_000 + e)
            done = False
            while not done:
                a = np.array(model.step((obs - self.mean) / self.std)[0], dtype=np.float64)
                a = np.clip(np.where(np.isfinite(a), a, 0.0), -1.0, 1.0)  # the family's safe action: hold the hand
                obs, _, term, trunc, info = self.env.step(a)
                done = term or trunc
            wins += bool(info["is_success"])
            dist.append(float(np.linalg.norm(obs[0:3] - obs[-3:])) * 100)
        return {"success_rate": wins / self.cfg.policy_episodes, "final_distance_cm": float(np.mean(dist))}

    def attack_data(self) -> np.ndarray:
        return self._attack_obs


