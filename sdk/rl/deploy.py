"""Deploy a fine-tuned Panda policy: export it to a bundle, run it against the emulator, compare success rates.

:func:`export_policy` writes the deterministic actor (``tanh(mu(latent_pi(x)))``) as a
feed-forward graph with the ``policy`` family's manifest: observation standardisation
(``preprocess.mean``/``std``), the action scale and the hand's workspace box as the
command limits (``extra.policy``, ``postprocess.low``/``high``).  :func:`run_deployed`
runs the bundle in the runtime's real-time session against ``sim://panda?task=...``
(the emulator behind a pty, over the wire protocol) for a number of episodes and reads
the success counters the device reports; :func:`compare_deployment` sets that against
the in-process evaluation with Wilson 95% intervals.
"""

from __future__ import annotations

import copy
import io
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from closedloop.runtime.families.policy import wilson_interval

__all__ = ["export_policy", "policy_module", "run_deployed", "compare_deployment", "DeploymentComparison"]


def policy_module(actor: nn.Module) -> nn.Module:
    """The deterministic policy of a stable-baselines3 SAC actor as a plain ``Sequential`` (obs -> action)."""
    return nn.Sequential(copy.deepcopy(actor.latent_pi), copy.deepcopy(actor.mu), nn.Tanh()).cpu().eval()


def export_policy(actor: nn.Module, mean: np.ndarray, std: np.ndarray, task: str, out: str | Path,
                  provenance: dict[str, Any] | None = None, overwrite: bool = True, quiet: bool = True) -> Path:
    """Export a policy for ``task`` (``reach``, ``push``, or ``pick_and_place`` through the gripper channel).

    ``actor`` is a SAC actor (or any module mapping standardised observations to actions
    in ``[-1, 1]``); ``mean``/``std`` are the observation statistics it was trained with.
    """
    from closedloop.export import export_bundle
    from closedloop.sim.devices.panda_scene import task_class
    from closedloop.sim.manipulation.tasks import GRIPPER_MAX_M

    cls = task_class(task)
    t = cls()
    if t.n_actions not in (3, 4):
        raise ValueError(f"task {task!r} has {t.n_actions} actions; an END_EFFECTOR JOINT_COMMAND carries the hand "
                         "target (3) and optionally the gripper opening (4)")
    module = policy_module(actor) if hasattr(actor, "latent_pi") else copy.deepcopy(actor).cpu().eval()
    names = [name for name, n in cls.OBS_LAYOUT for _ in range(n)]
    n_obs = len(names)
    if np.asarray(mean).shape != (n_obs,):
        raise ValueError(f"mean has shape {np.asarray(mean).shape}; task {task!r} observations have {n_obs} values")
    ee_index = [i for i, name in enumerate(names) if name == "ee_pos"]
    extra = {
        "policy": {"task": task, "ee_index": ee_index, "action_scale_m": cls.action_scale_m, "n_actions": t.n_actions,
                   "gripper_max_m": GRIPPER_MAX_M if t.n_actions == 4 else 0.0,
                   "safe_position": cls.start_ee.tolist(), "observation_layout": [list(x) for x in cls.OBS_LAYOUT],
                   "episode_steps": cls.episode_steps},
        "session": {"input": "plant_measurement", "command": "none"},
    }
    sink = io.StringIO()
    return export_bundle(
        module, out, kind="feedforward", example_input=torch.zeros(1, n_obs), rate_hz=cls.control_hz,
        family="policy", name=f"panda-{task}-policy",
        preprocess={"mean": np.asarray(mean, np.float32), "std": np.asarray(std, np.float32)},
        postprocess={"low": cls.workspace_low.astype(np.float32), "high": cls.workspace_high.astype(np.float32)},
        extra=extra, provenance=provenance or {}, variants=(), tensorrt=False, overwrite=overwrite,
        report=(lambda s: sink.write(s + "\n")) if quiet else print,
    )


def run_deployed(bundle: str | Path, episodes: int, seed: int = 0, backend: str = "auto",
                 task: str | None = None, status: bool = False) -> dict[str, Any]:
    """Run ``episodes`` emulated episodes through the runtime; return the session summary's dict.

    The session runs at the bundle's rate against ``sim://panda?task=TASK&seed=SEED`` for
    ``episodes`` episodes plus a few steps; ``family`` in the result holds ``episodes``,
    ``successes``, ``success_rate`` and its Wilson interval, ``loop`` the step latencies.
    """
    from closedloop.runtime import Session, SessionConfig, load_bundle

    b = load_bundle(bundle)
    pol = b.manifest.extra["policy"]
    task = task or pol["task"]
    steps = int(episodes * pol["episode_steps"] + 5)
    cfg = SessionConfig(device=f"sim://panda?task={task}&seed={seed}", backend=backend, max_steps=steps,
                        status=status, watchdog_s=0.5)
    with Session(b, cfg) as s:
        s.start()
        summary = s.run()
    return summary.to_dict()


@dataclass
class DeploymentComparison:
    """Deployed vs in-process success rates over the same number of episodes, with Wilson 95% intervals."""

    episodes: int
    deployed_successes: int
    deployed_rate: float
    deployed_ci: tuple[float, float]
    inprocess_successes: int
    inprocess_rate: float
    inprocess_ci: tuple[float, float]
    step_p99_us: float

    @property
    def consistent(self) -> bool:
        """The two 95% intervals overlap (neither rate is clearly different)."""
        return self.deployed_ci[0] <= self.inprocess_ci[1] and self.inprocess_ci[0] <= self.deployed_ci[1]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"consistent": self.consistent}

    def format(self) -> str:
        d, i = self.deployed_ci, self.inprocess_ci
        return (f"deployed {self.deployed_successes}/{self.episodes} = {self.deployed_rate:.2f} [{d[0]:.2f}, {d[1]:.2f}]"
                f"; in-process {self.inprocess_successes}/{self.episodes} = {self.inprocess_rate:.2f} "
                f"[{i[0]:.2f}, {i[1]:.2f}]; {'consistent' if self.consistent else 'DIFFERENT'} (Wilson 95%); "
                f"runtime step p99 {self.step_p99_us:.1f} us")


def compare_deployment(bundle: str | Path, act, episodes: int, seed: int = 0, backend: str = "auto"
                       ) -> DeploymentComparison:
    """Success over ``episodes`` episodes through the runtime + emulator vs ``act`` (raw obs -> action) in-process."""
    from closedloop.runtime import load_bundle
    from closedloop.sim.manipulation import PandaTaskEnv

    from .sb3 import evaluate_success

    summary = run_deployed(bundle, episodes, seed=seed, backend=backend)
    fam = summary["family"]
    won, done = int(fam["successes"]), int(fam["episodes"])
    task = load_bundle(bundle).manifest.extra["policy"]["task"]
    env = PandaTaskEnv(task)
    try:
        rate = evaluate_success(act, env, done or episodes, seed=30_000 + seed * 1000)
    finally:
        env.close()
    n = done or episodes
    inproc = int(round(rate * n))
    return DeploymentComparison(
        episodes=n, deployed_successes=won, deployed_rate=won / n if n else float("nan"),
        deployed_ci=wilson_interval(won, n), inprocess_successes=inproc, inprocess_rate=inproc / n,
        inprocess_ci=wilson_interval(inproc, n), step_p99_us=float(summary["loop"].get("latency_p99_us", float("nan"))),
    )
