"""``closedloop rl-train``: argument parsing only; the run is :func:`closedloop.sdk.rl.workflow.rl_train`.

It pre-trains a Panda policy, fine-tunes it with SAC on a (shaped) success reward, prints the
in-process success curve, writes ``OUT/run.json`` and, for reach and push, the bundle ``OUT/policy``.
"""

from __future__ import annotations

import argparse
import sys

from ..cli import command
from .config import SHAPING_KINDS

__all__: list[str] = []


def _rl_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", default=None, choices=["reach", "push", "pick_and_place"], help="default: push")
    p.add_argument("--reward", default=None, choices=SHAPING_KINDS,
                   help="sparse outcome reward, success visitation matching (svm), its potential-based variant, or "
                        "the success-only discriminator (gail); default: the config's (svm)")
    p.add_argument("--steps", type=int, default=None, help="fine-tuning environment steps (default: the config's)")
    p.add_argument("--seed", type=int, default=None,
                   help="seeds the demonstrations, the cloning, SAC and the evaluation episodes (default: the config's, "
                        "0)")
    p.add_argument("--lam", type=float, default=None, help="lambda, the weight of the discriminator term")
    p.add_argument("--beta", type=float, default=None, help="logit clip")
    p.add_argument("--config", default=None, help="a FineTuneConfig as JSON (a run.json's 'config' also works); "
                                                 "the options above override it")
    p.add_argument("--out", default="out/rl", help="folder for run.json and the bundle (OUT/policy)")
    p.add_argument("--quiet", action="store_true", help="no progress lines (the global -q also hides warnings' "
                                                          "neighbours: only warnings and errors)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT/run.json and OUT/policy if they exist")


@command("rl-train", "behaviour-clone a Panda policy, fine-tune it with SAC on a success-visitation reward, export it",
         _rl_train_args)
def _rl_train(a: argparse.Namespace) -> int:
    from .workflow import rl_train, rl_train_config

    if a.steps is not None and a.steps < 1:
        raise ValueError(f"--steps {a.steps}: give the fine-tuning steps, 1 or more (leave it out for the config's)")
    from pathlib import Path

    if not a.out or (Path(a.out).exists() and not Path(a.out).is_dir()):
        raise ValueError(f"--out {a.out!r}: give a folder for run.json and the bundle (it is made if missing)")
    there = [str(p) for p in (Path(a.out) / "run.json", Path(a.out) / "policy") if p.exists()]
    if there and not a.overwrite:  # before any training: exit 2, nothing replaced
        raise FileExistsError(f"{', '.join(there)} exist(s): give another --out, or --overwrite to replace them")
    cfg = rl_train_config(a.config, task=a.task, seed=a.seed, reward=a.reward, lam=a.lam, beta=a.beta, steps=a.steps)
    if cfg.total_steps <= cfg.actor_warmup_steps:
        print(f"warning: {cfg.total_steps} steps do not pass the actor's warm-up ({cfg.actor_warmup_steps} steps, "
              "the critic learns first): the policy will not change; give --steps above it", file=sys.stderr)
    if not a.quiet:
        print(f"rl-train: {cfg.task}, reward {cfg.shaping.kind} (lambda {cfg.shaping.lam}, beta {cfg.shaping.beta}), "
              f"{cfg.total_steps} steps, seed {cfg.seed}", flush=True)
    r = rl_train(cfg, a.out, verbose=0 if a.quiet else 1)
    print(f"success (in-process, deterministic) by step: {', '.join(f'{s}: {v:.2f}' for s, v in r.curve)}")
    print(f"record: {r.record_path} ({r.record['wall_s']:.0f} s)")
    if r.bundle is not None:
        print(f"bundle: {r.bundle}; run it: closedloop run {r.bundle} --device 'sim://panda?task={cfg.task}' "
              "--duration 60")
    return 0
