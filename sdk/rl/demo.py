"""The RL family's part of ``make demo``: a cloned Panda policy, exported, driving the emulated robot over the wire.

:func:`rl_demo` does the deployment half of the workflow in well under a minute on a
loaded 2-core machine: scripted demonstrations of the task (with action noise), a small
MLP behaviour-cloned on the successful ones (plain torch, no RL: fine-tuning is
``closedloop rl-train`` and takes minutes), its in-process success rate, the export to a
``policy`` bundle, and a real-time session of the runtime against
``sim://panda?task=...`` (the emulator behind a pty, over the wire protocol) for a few
episodes, whose summary prints the episodes, successes and the step latency.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = ["rl_demo"]


def _interval(v: Any) -> str:
    return f"[{v[0]:.3f}, {v[1]:.3f}]" if isinstance(v, list | tuple) and len(v) == 2 else str(v)


def _clone(x: np.ndarray, y: np.ndarray, hidden: int, epochs: int, seed: int) -> nn.Module:
    from .finetune import fit_actions

    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(x.shape[1], hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                        nn.Linear(hidden, y.shape[1]), nn.Tanh())
    fit_actions(net, list(net.parameters()), x, y, epochs=epochs, lr=2e-3, batch_size=128, seed=seed)
    return net.eval()


def rl_demo(out_dir: str | Path, task: str = "push", demos: int = 20, episodes: int = 8, seed: int = 0,
            backend: str = "auto", quiet: bool = False) -> dict[str, Any]:
    """Clone, export and run a ``task`` policy (``push`` or ``reach``) against ``sim://panda``; return the numbers.

    Prints each stage; the returned dict has ``demo_success``, ``inprocess_success``,
    ``bundle`` and the session summary's ``family`` (``episodes``, ``successes``,
    ``success_rate``) and ``loop`` parts.
    """
    from closedloop.runtime import SessionConfig, load_bundle, run_session

    from .deploy import export_policy
    from .finetune import collect_demonstrations, make_task_env, observation_stats
    from .sb3 import evaluate_success

    say = (lambda s: None) if quiet else (lambda s: print(s, flush=True))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    say(f"\n== RL policy: behaviour cloning on Panda {task}, exported, run against sim://panda?task={task} ==")
    eps = collect_demonstrations(task, demos, noise=0.1, seed=seed)
    mean, std = observation_stats(eps)
    good = [e for e in eps if e["success"]] or eps
    x = (np.concatenate([e["obs"] for e in good]) - mean) / std
    net = _clone(x, np.concatenate([e["actions"] for e in good]), hidden=64, epochs=60, seed=seed)
    demo_rate = float(np.mean([e["success"] for e in eps]))
    say(f"{demos} scripted demonstrations (noise 0.1): {demo_rate:.2f} successful; cloned a 64x64 MLP on "
        f"{len(good)} of them in {time.perf_counter() - t0:.1f} s")

    def act(raw: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return net(torch.as_tensor((np.asarray(raw, np.float32) - mean) / std)[None]).numpy()[0]

    env = make_task_env(task)
    try:
        inproc = evaluate_success(act, env, 10, seed=30_000 + seed * 1000)
    finally:
        env.close()
    say(f"in-process success (deterministic, 10 episodes): {inproc:.2f}")
    bundle = export_policy(net, mean, std, task, out / f"{task}_policy", provenance={"demo": "closedloop.sdk.rl.demo.rl_demo"})
    steps = int(episodes * load_bundle(bundle).manifest.extra["policy"]["episode_steps"] + 5)
    say(f"exported {bundle}; running {episodes} episodes ({steps} steps at 25 Hz) through the runtime")
    summary = run_session(bundle, SessionConfig(device=f"sim://panda?task={task}&seed={seed + 1}", backend=backend,
                                                max_steps=steps, watchdog_s=0.5, status=False))
    say(summary.format())
    d = summary.to_dict()
    fam = d.get("family", {})
    say(f"deployed: {fam.get('successes')} of {fam.get('episodes')} episodes succeeded "
        f"(success rate {fam.get('success_rate', float('nan')):.2f}, Wilson 95% {_interval(fam.get('success_rate_wilson95'))}); "
        f"demo took {time.perf_counter() - t0:.0f} s. Fine-tune it: closedloop rl-train --task {task}")
    return {"demo_success": demo_rate, "inprocess_success": inproc, "bundle": str(bundle), "family": fam,
            "loop": d.get("loop", {})}
