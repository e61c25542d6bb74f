"""Benchmark: fine-tuning a pre-trained push policy with sparse vs success-visitation rewards, and its deployment.

For each reward form (sparse, svm, potential, gail) and seed, one process runs
:func:`closedloop.sdk.rl.finetune.fine_tune` (behaviour cloning from scripted demonstrations,
then SAC) with one torch thread; ``workers`` processes run at a time. Reported: in-process
success rate (deterministic policy, outcome only) against environment steps (PNG), the steps
each run needs to reach 80% and 90% success (mean over seeds; runs that never get there count
as not reached), and, for the best final policy, the deployed success rate through the runtime
and the panda emulator (Wilson 95% interval, next to the in-process rate) and the runtime's
policy step latency (family + model, p99).

``run_rl_benchmark(full_config(), out, "rl")`` (``python bench/bench_rl.py``) writes
``rl.json``, ``rl.md`` and ``rl_success.png``; ``tiny_config()`` is a smoke run of about a minute.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from closedloop.common.jsonout import write_json

KINDS = ("sparse", "svm", "potential", "gail")


def _say(line: str) -> None:
    print(line, flush=True)


def full_config() -> dict:
    # 12 runs of 10k steps with an evaluation (30 episodes) every 250 steps: about 45 min on 2 loaded cores
    # (estimate_minutes); every reward gets the same budget and SAC settings, only ``kind`` differs.
    return {"task": "push", "seeds": [0, 1, 2], "kinds": list(KINDS), "workers": 2, "deploy_episodes": 30,
            "run": {"total_steps": 10_000, "demos": 30, "prior_episodes": 20, "net": [256, 256], "batch_size": 256,
                    "eval_every": 250, "eval_episodes": 30, "critic_pretrain_steps": 2_000, "actor_warmup_steps": 500,
                    "actor_lr_scale": 0.3, "prior_weight": 1.0},
            "shaping": {"lam": 0.05, "beta": 5.0, "updates_per_episode": 10}}


def tiny_config() -> dict:
    return {"task": "push", "seeds": [0], "kinds": ["sparse", "svm"], "workers": 2, "deploy_episodes": 2,
            "run": {"total_steps": 150, "demos": 4, "prior_episodes": 2, "net": [32, 32], "batch_size": 32,
                    "bc_epochs": 20, "eval_every": 150, "eval_episodes": 2, "critic_pretrain_steps": 20,
                    "actor_warmup_steps": 50},
            "shaping": {"lam": 0.05, "beta": 5.0, "updates_per_episode": 2, "hidden": [16, 16]}}


# Measured on 2 cores shared with other work (load about 5), one torch thread, 256x256 nets: demonstrations, BC,
# prior episodes and 2000 critic steps; one fine-tuning step (environment + one SAC update); one 30-episode
# evaluation.  Two runs side by side slow each other down by about CONTENTION.
_PRETRAIN_S, _STEP_S, _EVAL_EPISODE_S, _CONTENTION = 27.0, 0.015, 0.10, 1.5


def estimate_minutes(cfg: dict) -> float:
    """Rough wall time of the whole benchmark (runs in rounds of ``workers``, then the deployment check)."""
    r = cfg["run"]
    width = max(r.get("net", [256]))
    per_step = _STEP_S * (0.5 + 0.5 * (width / 256) ** 2)
    evals = r["total_steps"] // r["eval_every"] + 1
    run_s = (_PRETRAIN_S * r.get("demos", 30) / 30 + r["total_steps"] * per_step
             + evals * r["eval_episodes"] * _EVAL_EPISODE_S)
    workers = max(1, min(cfg["workers"], len(cfg["seeds"]) * len(cfg["kinds"])))
    rounds = -(-len(cfg["seeds"]) * len(cfg["kinds"]) // workers)
    deploy_s = cfg["deploy_episodes"] * 2.0 * 2 + 10.0  # deployed episodes at 25 Hz, then in-process ones
    return (rounds * run_s * (_CONTENTION if workers > 1 else 1.0) + deploy_s) / 60.0


def _rl_cell(config: dict, seed: int) -> dict:
    """A grid cell of the RL benchmark: one (reward, seed) run, as JSON values (its record is stored as a line)."""
    rec = _one_run((config["kind"], seed, config["cfg"], config["save_dir"]))
    return json.loads(json.dumps(rec, default=float))


def _one_run(args: tuple[str, int, dict, str]) -> dict:
    """One (kind, seed) fine-tuning run in its own process, one thread."""
    kind, seed, cfg, save_dir = args
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from closedloop.sdk.rl import FineTuneConfig, ShapingConfig
    from closedloop.sdk.rl.finetune import fine_tune

    shaping = ShapingConfig(kind=kind, **cfg["shaping"])
    ft = FineTuneConfig(task=cfg["task"], seed=seed, shaping=shaping, **cfg["run"])
    result = fine_tune(ft)
    rec = result.record
    rec.pop("train_episodes", None)
    actor_path = Path(save_dir) / f"{kind}_{seed}.pt"
    torch.save({"actor": result.model.actor.state_dict(), "mean": result.mean, "std": result.std,
                "net": list(ft.net)}, actor_path)
    rec.update(kind=kind, seed=seed, actor=str(actor_path), final_success=result.curve[-1][1])
    return rec


def steps_to(curve: list[tuple[int, float]], level: float) -> int | None:
    for step, rate in curve:
        if rate >= level:
            return int(step)
    return None


def _load_policy(path: str, task: str):
    """The deterministic policy of a saved SAC actor as a torch module, with its normalisation."""
    import torch
    from stable_baselines3 import SAC

    from closedloop.sdk.rl.finetune import make_task_env

    saved = torch.load(path, weights_only=False)
    env = make_task_env(task, saved["mean"], saved["std"])
    model = SAC("MlpPolicy", env, policy_kwargs={"net_arch": saved["net"]}, device="cpu")
    model.actor.load_state_dict(saved["actor"])
    env.close()
    return model, saved["mean"], saved["std"]


def deploy_best(runs: list[dict], cfg: dict, out_dir: Path) -> dict:
    import torch

    from closedloop.runtime import LoopConfig, Model, RealTimeLoop, get_family, load_bundle
    from closedloop.sdk.rl.deploy import compare_deployment, export_policy

    torch.set_num_threads(1)
    best = max(runs, key=lambda r: r["final_success"])
    model, mean, std = _load_policy(best["actor"], cfg["task"])
    bundle = export_policy(model.actor, mean, std, cfg["task"], out_dir / "policy_bundle",
                           provenance={"run": {k: best[k] for k in ("kind", "seed", "config")}})

    def act(raw):
        return model.predict((np.asarray(raw, np.float32) - mean) / std, deterministic=True)[0]

    cmp = compare_deployment(bundle, act, cfg["deploy_episodes"], seed=1)
    # The runtime's own step (family + model, no I/O) on recorded-like observations.
    b = load_bundle(bundle)
    rt = Model(b, backend="auto")
    fam = get_family("policy")(b, rt)
    obs = (np.random.default_rng(0).standard_normal((256, mean.size)) * std + mean).astype(np.float32)

    def step(k: int) -> None:
        fam.preprocess(obs[k & 255])
        rt.run()
        fam.postprocess()

    loop = RealTimeLoop(LoopConfig(rate_hz=1000.0, duration_s=3.0)).run(step)
    out = cmp.to_dict() | {"from_run": {"kind": best["kind"], "seed": best["seed"]}, "backend": rt.backend_name,
                           "runtime_step_p50_us": loop.latency_p50_us, "runtime_step_p99_us": loop.latency_p99_us}
    rt.close()
    return out


def summarise(runs: list[dict], cfg: dict) -> dict:
    table = {}
    for kind in cfg["kinds"]:
        mine = [r for r in runs if r["kind"] == kind]
        row = {}
        for level in (0.8, 0.9):
            hits = [steps_to(r["curve"], level) for r in mine]
            reached = [h for h in hits if h is not None]
            row[f"steps_to_{int(level * 100)}"] = hits
            row[f"mean_steps_to_{int(level * 100)}"] = float(np.mean(reached)) if len(reached) == len(hits) else None
        row["final_success_mean"] = float(np.mean([r["final_success"] for r in mine]))
        row["start_success_mean"] = float(np.mean([r["curve"][0][1] for r in mine]))
        table[kind] = row
    return table


def plot(runs: list[dict], cfg: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, kind in enumerate(cfg["kinds"]):
        mine = [np.array(r["curve"], dtype=float) for r in runs if r["kind"] == kind]
        steps = mine[0][:, 0]
        rates = np.stack([c[: len(steps), 1] for c in mine])
        ax.plot(steps, rates.mean(0), color=f"C{i}", label=f"{kind} (mean of {len(mine)})")
        if len(mine) > 1:
            ax.fill_between(steps, rates.min(0), rates.max(0), color=f"C{i}", alpha=0.15)
    ax.axhline(0.8, color="grey", lw=0.8, ls="--")
    ax.axhline(0.9, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("environment steps of fine-tuning")
    ax.set_ylabel("success rate (in-process, deterministic)")
    ax.set_title(f"Panda {cfg['task']}: fine-tuning a behaviour-cloned policy")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_markdown(report: dict, path: Path) -> None:
    cfg, table, dep = report["config"], report["table"], report["deployment"]
    fmt = lambda v: "not reached" if v is None else f"{v:,.0f}"  # noqa: E731
    lines = [f"# RL fine-tuning on Panda {cfg['task']} ({'tiny' if report['tiny'] else 'full'} run)", "",
             f"Seeds {cfg['seeds']}, {cfg['run']['total_steps']:,} fine-tuning steps per run, lambda "
             f"{cfg['shaping']['lam']}, beta {cfg['shaping']['beta']}; wall time {report['wall_s'] / 60:.1f} min.", "",
             "| reward | start success | final success | steps to 80% (mean) | steps to 90% (mean) | per seed (80%) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for kind, row in table.items():
        lines.append(f"| {kind} | {row['start_success_mean']:.2f} | {row['final_success_mean']:.2f} | "
                     f"{fmt(row['mean_steps_to_80'])} | {fmt(row['mean_steps_to_90'])} | {row['steps_to_80']} |")
    lines += ["", "A mean is given only when every seed reached the level.", "",
              "## Deployment (runtime + panda emulator over the wire)", "",
              f"Best run ({dep['from_run']['kind']}, seed {dep['from_run']['seed']}), {dep['episodes']} episodes: "
              f"deployed {dep['deployed_rate']:.2f} (Wilson 95% [{dep['deployed_ci'][0]:.2f}, "
              f"{dep['deployed_ci'][1]:.2f}]) vs in-process {dep['inprocess_rate']:.2f} ([{dep['inprocess_ci'][0]:.2f}, "
              f"{dep['inprocess_ci'][1]:.2f}]): {'consistent' if dep['consistent'] else 'different'}.", "",
              f"Runtime policy step (family + model, backend {dep['backend']}): p50 {dep['runtime_step_p50_us']:.1f} us, "
              f"p99 {dep['runtime_step_p99_us']:.1f} us (target: under 50 us).", ""]
    path.write_text("\n".join(lines))




def run_rl_benchmark(cfg: dict, out: Path, stem: str = "rl", tiny: bool = False, report=_say) -> dict:
    """Every (reward, seed) run in ``cfg["workers"]`` processes, then the deployment check of the best policy.

    Writes ``STEM.json``, ``STEM.md`` and ``STEM_success.png`` to ``out``; returns the report. Each run's
    record is appended to ``out/cells/STEM/cells.jsonl`` and its actor saved beside it as the run ends, so
    the same command after a kill runs only the runs not finished (delete the folder to start afresh).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report(f"bench_rl: {len(cfg['kinds'])} rewards x {len(cfg['seeds'])} seeds on {cfg['task']}, "
           f"{cfg['run']['total_steps']:,} steps each, {cfg['workers']} processes of one thread; estimated "
           f"{estimate_minutes(cfg):.0f} min")
    t0 = time.perf_counter()
    from closedloop.sdk.grid import Cell, append_record, read_results, run_grid

    # each (reward, seed) run is a cell on the grid runner (Ray where installed, else one by one, docs/grid.md);
    # its record goes to cells.jsonl and its actor beside it as it finishes, so a rerun continues a killed one
    store = out / "cells" / stem
    store.mkdir(parents=True, exist_ok=True)
    results = store / "cells.jsonl"
    run_cfg = {k: v for k, v in cfg.items() if k != "workers"}  # how many run at once changes no result
    cells = [Cell({"kind": kind, "cfg": run_cfg, "save_dir": str(store)}, seed)
             for seed in cfg["seeds"] for kind in cfg["kinds"]]
    stored = read_results(results)
    reused = 0
    for cell in cells:  # a stored run whose actor file is gone runs again (the deployment check loads it)
        rec = stored.get(cell.key)
        if rec is None or rec.get("status") != "ok":
            continue
        if Path(rec["result"]["actor"]).is_file():
            reused += 1
        else:
            append_record(results, {"key": cell.key, "status": "failed", "error": "its actor file is missing"})
    if reused:
        report(f"bench_rl: {reused} of {len(cells)} runs were finished by an earlier run ({results}) and are not "
               "run again")
    records = run_grid(_rl_cell, cells, results=results, workers=cfg["workers"], desc="bench_rl")
    failed = [r for r in records if r["status"] != "ok"]
    if failed:
        raise RuntimeError(f"bench_rl: {len(failed)} runs failed; first, {failed[0]['key']}: {failed[0]['error']}")
    runs = []
    for r in records:
        rec = r["result"]
        report(f"{rec['kind']:>9} seed {rec['seed']}: start {rec['curve'][0][1]:.2f} -> final "
               f"{rec['final_success']:.2f} in {rec['wall_s']:.0f} s")
        runs.append(rec)
    with tempfile.TemporaryDirectory(prefix="bench-rl-") as tmp:
        deployment = deploy_best(runs, cfg, Path(tmp))
    for r in runs:
        r.pop("actor", None)
    result = {"tiny": tiny, "config": cfg, "table": summarise(runs, cfg), "deployment": deployment, "runs": runs,
              "wall_s": time.perf_counter() - t0}
    write_json(out / f"{stem}.json", result)
    write_markdown(result, out / f"{stem}.md")
    plot(runs, cfg, out / f"{stem}_success.png")
    return result
