"""``closedloop rl-train``: pre-train a Panda policy, fine-tune it with SAC on a (shaped) success reward, export it.

The command runs :func:`closedloop.sdk.rl.finetune.fine_tune` with a :class:`~closedloop.sdk.rl.FineTuneConfig`
made from its options (or read from a JSON file written by an earlier run), prints the
in-process success curve as it goes, writes the run's record (configuration, curve,
discriminator statistics) as ``run.json`` and, for the hand-only tasks (reach, push),
exports the policy to a bundle that ``closedloop run BUNDLE --device sim://panda?task=push``
deploys.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..cli import command
from .config import SHAPING_KINDS

__all__: list[str] = []


def _rl_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", default=None, choices=["reach", "push", "pick_and_place"], help="default: push")
    p.add_argument("--reward", default="svm", choices=SHAPING_KINDS,
                   help="sparse outcome reward, success visitation matching (svm), its potential-based variant, or "
                        "the success-only discriminator (gail)")
    p.add_argument("--steps", type=int, default=None, help="fine-tuning environment steps (default: the config's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lam", type=float, default=None, help="lambda, the weight of the discriminator term")
    p.add_argument("--beta", type=float, default=None, help="logit clip")
    p.add_argument("--config", default=None, help="a FineTuneConfig as JSON (a run.json's 'config' also works); "
                                                 "the options above override it")
    p.add_argument("--out", default="out/rl", help="folder for run.json and the bundle (OUT/policy)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


@command("rl-train", "behaviour-clone a Panda policy, fine-tune it with SAC on a success-visitation reward, export it",
         _rl_train_args)
def _rl_train(a: argparse.Namespace) -> int:
    import torch

    from .config import FineTuneConfig, ShapingConfig
    from .deploy import export_policy
    from .finetune import fine_tune

    torch.set_num_threads(1)
    base: dict = {}
    if a.config:
        base = json.loads(Path(a.config).read_text())
        base = base.get("config", base)
    cfg = FineTuneConfig.from_dict(base) if base else FineTuneConfig()
    cfg.task, cfg.seed = a.task or cfg.task, a.seed
    shaping = cfg.shaping.to_dict() | {"kind": a.reward}
    for key in ("lam", "beta"):
        if getattr(a, key) is not None:
            shaping[key] = getattr(a, key)
    shaping["gamma"] = cfg.gamma
    cfg.shaping = ShapingConfig.from_dict(shaping)
    if a.steps is not None:
        cfg.total_steps = a.steps
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if not a.quiet:
        print(f"rl-train: {cfg.task}, reward {cfg.shaping.kind} (lambda {cfg.shaping.lam}, beta {cfg.shaping.beta}), "
              f"{cfg.total_steps} steps, seed {cfg.seed}", flush=True)
    result = fine_tune(cfg, verbose=0 if a.quiet else 1)
    rec = dict(result.record)
    rec.pop("train_episodes", None)
    (out / "run.json").write_text(json.dumps(rec, indent=1, default=float))
    curve = ", ".join(f"{s}: {r:.2f}" for s, r in result.curve)
    print(f"success (in-process, deterministic) by step: {curve}")
    print(f"record: {out / 'run.json'} ({rec['wall_s']:.0f} s)")
    if cfg.task in ("reach", "push"):
        bundle = export_policy(result.model.actor, result.mean, result.std, cfg.task, out / "policy",
                               provenance={"run": rec["config"]})
        print(f"bundle: {bundle}; run it: closedloop run {bundle} --device 'sim://panda?task={cfg.task}' --duration 60")
    return 0
