"""Stage-2 variants on the benchmark's own stage-1 backbones: what moves the two-stage method's held-out WER.

    python bench/explore_bci_meta.py --seed 0 --variant base --variant lr3e-3:meta.outer_lr_init=3e-3
    python bench/explore_bci_meta.py --seed 0 --variant fresh:meta.drift.fresh_p=0.1 --methods two_stage alignment
    python bench/explore_bci_meta.py --seed 0 --methods alignment session_layers --calibration-trials 24 \
        --variant many:calibration.tune=false,calibration.steps=120


Each ``--variant NAME:FIELD=VALUE,FIELD=VALUE`` overrides fields of the benchmark's
harness configuration (``meta.*``, ``calibration.*``; nested with dots). The stage-1
backbone of a model seed is trained once with the benchmark's recipe and cached under
``--cache`` (it depends only on the data seed, the model seed and the training recipe),
so each variant costs only its meta-learning and calibration (the per-session-input-layer
decoder of ``session_layers`` is cached the same way). Every variant is scored
by the benchmark's harness on the benchmark's data (held-out beam and greedy WER/CER,
mean of the held-out sessions) and appended, with its full configuration, to
``bench/results/bci_meta_variants.jsonl``. ``--calibration-trials N`` is a diagnostic:
held-out sessions are calibrated on their first N non-evaluation trials instead of three,
which shows how far any calibration of the same layer could go on this data. This is an
exploration tool: the numbers that count are those of ``bench/bench_bci.py`` with the
chosen defaults.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from closedloop.sdk.bci.baselines import TrainedModels
from closedloop.sdk.bci.benchmark import BciBenchConfig, generate_data
from closedloop.sdk.bci.config import override, to_dict
from closedloop.sdk.bci.evaluate import HarnessConfig, build_lexicon, run_harness
from closedloop.sdk.bci.meta import meta_train_alignment
from closedloop.sdk.bci.train import TrainConfig, train_backbone, train_session_layers
from closedloop.sim.handwriting import VOCABULARY


def apply_overrides(harness: HarnessConfig, overrides: dict[str, str]) -> HarnessConfig:
    """``harness`` with dotted fields replaced (``meta.drift.fresh_p=0.1``); unknown fields are refused by name."""
    try:
        for key, value in overrides.items():
            harness = override(harness, f"{key}={value}")
    except ValueError as exc:
        raise SystemExit(f"--variant: {exc}") from None
    return harness


def parse_setting(text: str, option: str = "--train") -> tuple[str, str]:
    key, eq, value = text.partition("=")
    if not eq:
        raise SystemExit(f"{option} {text!r}: expected FIELD=VALUE")
    return key.strip(), value.strip()


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, rest = text.partition(":")
    return name, dict(parse_setting(item, f"--variant {text!r}: item") for item in filter(None, rest.split(",")))


def cached(what: str, train, sessions, recipe: TrainConfig, cache: Path, data_seed: int = 0):
    """``train(sessions, recipe)``'s model, trained once per recipe (seed included) and data seed, kept under ``cache``."""
    key = hashlib.sha256(json.dumps(to_dict(recipe), sort_keys=True).encode()).hexdigest()[:12]
    data = f"_data{data_seed}" if data_seed else ""  # the benchmark's own data (seed 0) keeps the older names
    path = cache / f"{what}_seed{recipe.seed}{data}_{key}.pt"
    if path.exists():
        return torch.load(path, weights_only=False), json.loads(path.with_suffix(".json").read_text())["wall_s"]
    model, log = train(sessions, recipe)
    cache.mkdir(parents=True, exist_ok=True)
    curve = [float(sum(log.loss[i:i + 50]) / len(log.loss[i:i + 50])) for i in range(0, len(log.loss), 50)]
    info = {"wall_s": log.wall_s, "loss_per_50_steps": curve}
    path.with_suffix(".json").write_text(json.dumps(info))  # before the .pt that marks it done
    tmp = path.with_suffix(".tmp")
    torch.save(model, tmp)
    tmp.replace(path)
    return model, log.wall_s


def with_calibration_trials(sessions, n: int):
    """Copies of ``sessions`` whose held-out sessions offer their first ``n`` non-evaluation trials for calibration.

    A diagnostic, not a method: FALCON allows three. With many more, the calibrated
    decoders show how far any calibration of the same layer could take a method.
    """
    out = []
    for s in sessions:
        if s.split == "held_out":
            scored = set(s.evaluation)
            free = [i for i in range(len(s.trials)) if i not in scored]
            if len(free) < n:
                raise SystemExit(f"--calibration-trials {n}: held-out session {s.name} has {len(free)} non-evaluation trials")
            s = replace(s, calibration=free[:n])
        out.append(s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0, help="model seed")
    ap.add_argument("--data-seed", type=int, default=None,
                    help="generate the recording from this seed instead of the benchmark's (a development set: "
                         "choose stage-2 settings here, then run bench_bci.py once with the choice)")
    ap.add_argument("--variant", action="append", default=[], help="NAME:FIELD=VALUE[,FIELD=VALUE] (repeatable)")
    ap.add_argument("--methods", nargs="+", default=["two_stage"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache", default="/tmp/closedloop_bci_cache")
    ap.add_argument("--calibration-trials", type=int, default=0,
                    help="diagnostic: calibrate held-out sessions on their first N non-evaluation trials, not 3")
    ap.add_argument("--train", action="append", default=[], metavar="FIELD=VALUE",
                    help="stage-1 recipe override for every model trained here (train.FIELD; repeatable), "
                         "e.g. augmentation.dropout_p=0.1; the cache keys on the recipe")
    ap.add_argument("--session-train", action="append", default=[], metavar="FIELD=VALUE",
                    help="the same for the session_layers baseline's recipe (session_train.FIELD; "
                         "unset in the benchmark: stage 1's recipe)")
    ap.add_argument("--out", default="bench/results/bci_meta_variants.jsonl")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    bench = BciBenchConfig()
    if a.data_seed is not None:
        bench = replace(bench, data_seed=a.data_seed)
    sessions, _ = generate_data(bench)
    lexicon = build_lexicon(sessions, list(VOCABULARY))
    base = replace(bench.harness, seed=a.seed, methods=tuple(a.methods), reference=False)
    if a.session_train and base.session_train is None:  # unset means "stage 1's recipe": override a copy of it
        base = replace(base, session_train=base.train)
    base = apply_overrides(base, {f"train.{k}": v for k, v in map(parse_setting, a.train)}
                           | {f"session_train.{k}": v for k, v in (parse_setting(t, "--session-train")
                                                                  for t in a.session_train)}).seeded()
    backbone, backbone_s = cached("backbone", train_backbone, sessions, base.train, Path(a.cache), bench.data_seed)
    session_model = None
    if "session_layers" in a.methods:
        session_model, _ = cached("session_layers", train_session_layers, sessions, base.session_recipe(), Path(a.cache),
                                  bench.data_seed)
    if a.calibration_trials:
        sessions = with_calibration_trials(sessions, a.calibration_trials)
        base = replace(base, n_calibration=a.calibration_trials)
    for text in a.variant or ["base:"]:
        name, overrides = parse_variant(text)
        harness = apply_overrides(base, overrides).seeded()
        t0 = time.perf_counter()
        models = TrainedModels(backbone=backbone, session_model=session_model,
                               held_in_days={s.name: float(s.day) for s in sessions if s.split == "held_in"})
        if "two_stage" in harness.methods:
            models.meta, models.logs["meta"] = meta_train_alignment(backbone, sessions, harness.meta)
        out = run_harness(sessions, harness, lexicon=lexicon, models=models)
        row = {"variant": name, "data_seed": bench.data_seed, "overrides": overrides, "train_overrides": a.train,
               "session_train_overrides": a.session_train, "seed": a.seed,
               "calibration_trials": harness.n_calibration,
               "wall_s": time.perf_counter() - t0,
               "backbone_train_s": backbone_s, "meta": out.get("meta"),
               "methods": {m: {"mean": v["mean"], "chosen": v["chosen"], "calibrate_s": v["calibrate_s"],
                               "sessions": v["sessions"]}
                           for m, v in out["methods"].items()},
               "config": harness.to_dict()}
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        cells = "  ".join(f"{m}: beam WER {100 * v['mean']['beam']['WER']:.2f}% greedy CER "
                          f"{100 * v['mean']['greedy']['CER']:.2f}%" for m, v in out["methods"].items())
        print(f"data {bench.data_seed} seed {a.seed} {name:>16s} ({row['wall_s']:.0f} s)  {cells}", flush=True)


if __name__ == "__main__":
    main()
