"""The Python side of ``closedloop rl-train``: a run's configuration from its options, the run, its record and bundle.

:func:`rl_train_config` builds a :class:`~closedloop.sdk.rl.FineTuneConfig` from an optional JSON
file (a config, or a ``run.json`` whose ``config`` it takes) with the given settings over it;
:func:`rl_train` pre-trains and fine-tunes (:func:`closedloop.sdk.rl.finetune.fine_tune`), writes the
run's record as ``OUT/run.json`` and exports the policy to ``OUT/policy``, a bundle that
``closedloop run BUNDLE --device sim://panda?task=TASK`` deploys (pick-and-place through the
protocol's gripper channel).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from closedloop.common.atomic import atomic_write_bytes
from closedloop.common.jsonout import json_text

from .config import FineTuneConfig, ShapingConfig

__all__ = ["RLTrainResult", "rl_train", "rl_train_config"]

#: tasks whose policy the wire can command (the hand target, and the gripper opening for pick-and-place)
EXPORTABLE_TASKS = ("reach", "push", "pick_and_place")


@dataclass
class RLTrainResult:
    record_path: Path
    record: dict[str, Any]
    curve: list[tuple[int, float]]
    bundle: Path | None


def rl_train_config(config_file: str | Path | None = None, *, task: str | None = None, seed: int | None = None,
                    reward: str | None = None, lam: float | None = None, beta: float | None = None,
                    steps: int | None = None) -> FineTuneConfig:
    """The run's configuration: ``config_file`` (if any) with each given setting (not None) over it, so a run.json
    repeats its run, reward and seed included.

    The reward's discount is the SAC discount, so the potential-based form keeps its invariance; a config whose
    ``shaping.gamma`` is set to another is refused for that form.
    """
    base: dict[str, Any] = {}
    if config_file:
        path = Path(config_file)
        try:
            base = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"--config {path}: no such file; give a FineTuneConfig as JSON (or a run.json)") from None
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"--config {path}: not a JSON file we could read ({exc}); give a FineTuneConfig as "
                             "JSON (or a run.json)") from None
        if not isinstance(base, dict):
            raise ValueError(f"--config {path}: holds a JSON {type(base).__name__}, not an object of settings")
        base = base.get("config", base)
    where = f"--config {config_file}" if config_file else "rl-train"
    try:
        cfg = FineTuneConfig.from_dict(base) if base else FineTuneConfig()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    cfg.task = task or cfg.task
    cfg.seed = cfg.seed if seed is None else seed
    shaping = cfg.shaping.to_dict() | ({"kind": reward} if reward else {})
    for key, value in (("lam", lam), ("beta", beta)):
        if value is not None:
            shaping[key] = value
    if shaping["kind"] == "potential" and shaping.get("gamma") not in (None, cfg.gamma):
        raise ValueError(f"{where}: shaping.gamma {shaping['gamma']} is not SAC's discount gamma {cfg.gamma}: the "
                         "potential form keeps the optimal policy only with the algorithm's discount; leave "
                         "shaping.gamma out (null) or set gamma")
    shaping["gamma"] = cfg.gamma
    cfg.shaping = ShapingConfig.from_dict(shaping)
    if steps is not None:
        cfg.total_steps = steps
    return cfg


def rl_train(cfg: FineTuneConfig, out: str | Path, *, verbose: int = 1) -> RLTrainResult:
    """Pre-train and fine-tune on ``cfg.task``; write ``out/run.json`` (atomically) and, where the task
    allows, the policy bundle ``out/policy``."""
    import torch

    from .deploy import export_policy
    from .finetune import fine_tune

    torch.set_num_threads(1)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    result = fine_tune(cfg, verbose=verbose)
    record = dict(result.record)
    record.pop("train_episodes", None)
    record_path = atomic_write_bytes(out / "run.json", json_text(record, indent=1).encode())  # strict JSON
    bundle = None
    if cfg.task in EXPORTABLE_TASKS:
        bundle = export_policy(result.model.actor, result.mean, result.std, cfg.task, out / "policy",
                               provenance={"run": record["config"]})
    return RLTrainResult(record_path, record, list(result.curve), bundle)
