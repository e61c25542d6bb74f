"""Benchmark of the grid runner (closedloop.sdk.grid, docs/grid.md): three measurements, one run.

    python bench/bench_grid.py                   # all three (~10 min on 2 cores); writes bench/results/grid/
    python bench/bench_grid.py --only ibci       # one of: ibci, cluster, validate
    python bench/bench_grid.py --only ibci_full  # the full iBCI benchmark on both schedulers (~2x bench_bci.py)

(a) ibci: the iBCI benchmark's task scheduler (sdk.bci.benchmark.run_seeds: per seed, training tasks
then scoring tasks) at a SMALL setting (a toy recording, 3 seeds, a few hundred training steps), or
with ``ibci_full`` on bench_bci.py's own recording and harness, on the grid runner (a local Ray
instance) and on a spawn ``multiprocessing.Pool`` scheduler, the baseline;
same workers, same tasks, wall time of each, the runner's including Ray's start-up. (b) cluster: a Ray head and a
worker node on 127.0.0.1 (one CPU each), a grid of CPU-bound cells, which node each cell ran on.
(c) validate: a batch of emulator sessions with every fault (drops, corruption, silences, resets),
every session's summary present and every recording accounted for (kept, or deleted because the
session behaved). Writes ``grid.json`` and ``grid.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import platform
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "grid"


def _cpu() -> str:
    from closedloop.runtime.timing import _cpu_name

    return _cpu_name()


# ------------------------------------------------------------------ (a) iBCI scheduler, runner vs spawn pool

def _spawn_pool(workers: int, ready: list, next_ready, task, finish) -> None:
    """The baseline: a spawn multiprocessing.Pool keeping ``workers`` tasks running."""
    done: queue.Queue = queue.Queue()
    running = 0
    with mp.get_context("spawn").Pool(workers) as pool:
        while ready or running:
            while ready and running < workers:
                kind, args = next_ready()
                fn, task_args = task(kind, args)
                pool.apply_async(fn, task_args, callback=lambda r, k=kind, a=args: done.put((k, a, r, None)),
                                 error_callback=lambda e, k=kind, a=args: done.put((k, a, None, e)))
                running += 1
            kind, args, result, error = done.get()
            running -= 1
            if error is not None:
                raise error
            finish(kind, args, result)
        pool.close()
        pool.join()


def _compare_schedulers(sessions: list, words: list, harness, seeds: int, workers: int, out: dict) -> dict:
    """run_seeds on the spawn Pool and on the grid runner, same data, harness, seeds and workers."""
    from closedloop.sdk.bci import benchmark

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.pkl"
        path.write_bytes(pickle.dumps((sessions, words)))
        runs = {}
        for name, pool in (("spawn_pool", _spawn_pool), ("grid_runner", benchmark._run_on_pool)):
            original = benchmark._run_on_pool
            benchmark._run_on_pool = pool
            try:
                t0 = time.perf_counter()
                runs[name] = benchmark.run_seeds(str(path), harness, list(range(seeds)), workers=workers,
                                                 report=lambda line, n=name: print(f"ibci {n}: {line}", flush=True))
                out[f"{name}_wall_s"] = round(time.perf_counter() - t0, 2)
            finally:
                benchmark._run_on_pool = original
            print(f"ibci: {name} {out[f'{name}_wall_s']} s", flush=True)
    same = all(a["methods"][m]["mean"] == b["methods"][m]["mean"]
               for a, b in zip(runs["spawn_pool"], runs["grid_runner"], strict=True) for m in a["methods"])
    out["same_results"] = bool(same)
    out["ratio"] = round(out["grid_runner_wall_s"] / out["spawn_pool_wall_s"], 3)
    out["target_met"] = out["ratio"] <= 1.1
    out["load_average_1min_after"] = round(os.getloadavg()[0], 2)
    return out


def bench_ibci(workers: int, seeds: int, steps: int) -> dict:
    from closedloop.sdk.bci.calibrate import CalibrationConfig
    from closedloop.sdk.bci.evaluate import HarnessConfig
    from closedloop.sdk.bci.meta import MetaConfig
    from closedloop.sdk.bci.toy import toy_recording
    from closedloop.sdk.bci.train import BackboneConfig, TrainConfig

    sessions = toy_recording(n_channels=16, n_held_in=4, n_held_out=2, n_trials=12, seed=2)
    harness = HarnessConfig(train=TrainConfig(backbone=BackboneConfig(32, 1, 0.0), steps=steps, batch_size=4, lr=1e-2),
                            meta=MetaConfig(inner_steps=2, n_query=2, tasks_per_step=2, meta_steps=10),
                            calibration=CalibrationConfig(steps=10, eval_every=5, folds=2),
                            beam_width=4, device="cpu", progress=False)
    out: dict = {"setting": f"toy recording 16 ch, 4 held-in + 2 held-out sessions x 12 trials; {seeds} seeds; "
                            f"backbone 32 units, {steps} training steps; {workers} workers",
                 "workers": workers, "seeds": seeds}
    return _compare_schedulers(sessions, [], harness, seeds, workers, out)


def bench_ibci_full(workers: int, seeds: int) -> dict:
    """The iBCI benchmark's own data and harness (bench_bci.py's defaults), its seeds 0..seeds-1."""
    from closedloop.sdk.bci.benchmark import BciBenchConfig, generate_data
    from closedloop.sim.handwriting import VOCABULARY

    cfg = BciBenchConfig()
    sessions, _hw = generate_data(cfg)
    out: dict = {"setting": f"bench_bci.py's default recording and harness (every method, {seeds} seeds, "
                            f"{workers} workers)", "workers": workers, "seeds": seeds}
    return _compare_schedulers(sessions, list(VOCABULARY), cfg.harness, seeds, workers, out)


# ------------------------------------------------------------------ (b) two-node loopback cluster

def _burn(config: dict, seed: int) -> dict:
    t0 = time.perf_counter()
    x = 0
    while time.perf_counter() - t0 < config["seconds"]:
        x += 1
    return {"loops": x}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_cluster(cells: int, seconds: float) -> dict:
    import ray

    from closedloop.sdk.grid import grid, run_grid

    ray_cli = str(Path(sys.executable).with_name("ray"))
    port = _free_port()
    # a loopback cluster of this user's own processes: Ray 2.60's default token authentication refused the
    # driver's connection to a `ray start` head here ("Missing authorization header"), so it is off for it
    os.environ["RAY_AUTH_MODE"] = "disabled"
    env = os.environ | {"RAY_USAGE_STATS_ENABLED": "0"}
    common = ["--num-cpus=1", "--block", "--disable-usage-stats"]
    procs = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            procs.append(subprocess.Popen([ray_cli, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
                                           "--include-dashboard=false", f"--temp-dir={tmp}", *common],
                                          start_new_session=True, env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.2)
            address = f"127.0.0.1:{port}"
            procs.append(subprocess.Popen([ray_cli, "start", f"--address={address}", "--node-ip-address=127.0.0.1",
                                           '--resources={"second_node": 1}', *common], start_new_session=True,
                                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
            while sum(1 for n in ray.nodes() if n["Alive"]) < 2:
                time.sleep(0.2)
            up_s = time.perf_counter() - t0
            worker = {n["NodeID"] for n in ray.nodes() if n["Alive"] and "second_node" in n["Resources"]}
            t1 = time.perf_counter()
            recs = run_grid(_burn, grid(range(cells), seconds=[seconds]), results=Path(tmp) / "r.jsonl",
                            address=address, progress=False)
            wall = time.perf_counter() - t1
        finally:
            if ray.is_initialized():
                ray.shutdown()
            for p in reversed(procs):
                os.killpg(p.pid, signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
    per_node: dict[str, int] = {}
    for r in recs:
        role = "worker" if r["node"] in worker else "head"
        per_node[role] = per_node.get(role, 0) + 1
    return {"cells": cells, "cell_s": seconds, "cluster_up_s": round(up_s, 1), "grid_wall_s": round(wall, 2),
            "serial_s": round(cells * seconds, 2), "cells_per_node": per_node,
            "failed": sum(r["status"] != "ok" for r in recs),
            "target_met": len(per_node) == 2 and all(r["status"] == "ok" for r in recs)}


# ------------------------------------------------------------------ (c) 100-session validate batch

def bench_validate(sessions: int, duration_s: float, workers: int) -> dict:
    import torch

    from closedloop.export import export_bundle
    from closedloop.sdk.grid.validate import ValidateConfig, validate
    from closedloop.sdk.models import GRUDecoder

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        bundle = export_bundle(GRUDecoder(n_inputs=12, n_hidden=16, n_layers=2, n_outputs=5).eval(),
                               Path(tmp) / "gru", kind="recurrent", example_input=torch.zeros(1, 12), rate_hz=50.0,
                               name="tiny-gru", variants=(), report=lambda s: None)
        cfg = ValidateConfig(str(bundle), "sim://headstage?channels=12", sessions, duration_s,
                             ("drops", "corruption", "silences", "resets"), str(Path(tmp) / "v"), "onnxruntime")
        r = validate(cfg, workers=workers, progress=False)
        on_disk = {str(p) for p in Path(cfg.out_dir).glob("*.clrec")}
        lines = len((Path(cfg.out_dir) / "sessions.jsonl").read_text().splitlines())
    summaries = r["session_summaries"]
    complete = [s for s in summaries if "steps" in s]
    lost = [s["index"] for s in summaries if s.get("recording_kept") and s["recording"] not in on_disk]
    return {"sessions": sessions, "duration_s": duration_s, "workers": workers, "faults": r["faults"],
            "wall_s": r["wall_s"], "summaries": len(complete), "jsonl_lines": lines,
            "success_rate": r["success_rate"], "deadline_miss_rate": r["deadline_miss_rate"],
            "safe_command_periods": r["safe_command_periods"],
            "misbehaved": len(r["misbehaved"]), "misbehaviour_reasons": _reasons(r["misbehaved"]),
            "recordings_kept": len(r["recordings_kept"]), "recordings_on_disk": len(on_disk),
            "recordings_lost": lost,
            "target_met": len(complete) == sessions and not lost and len(on_disk) == len(r["recordings_kept"])}


def _reasons(bad: list[dict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for b in bad:
        for why in b["why"]:
            key = re.sub(r"\d+(\.\d+)?%?", "N", why.split(" (")[0])
            counts[key] = counts.get(key, 0) + 1
    return counts


def markdown(rec: dict) -> str:
    lines = [f"# Grid runner benchmark\n\n`{rec['command']}` on {rec['machine']}, {rec['date']}.\n"]
    for key, title in (("ibci", "small setting"), ("ibci_full", "the full benchmark")):
        if key not in rec:
            continue
        b = rec[key]
        lines += [f"## iBCI benchmark scheduler: grid runner vs spawn Pool ({title})\n", f"{b['setting']}.\n",
                  "| pool | wall s |", "| --- | --- |",
                  f"| spawn multiprocessing.Pool (baseline) | {b['spawn_pool_wall_s']} |",
                  f"| grid runner, local Ray | {b['grid_runner_wall_s']} |",
                  f"\nratio {b['ratio']} (target <= 1.1: {'met' if b['target_met'] else 'NOT met'}); "
                  f"same results: {b['same_results']}.\n"]
    if "cluster" in rec:
        c = rec["cluster"]
        lines += ["## Two-node loopback cluster\n",
                  f"{c['cells']} cells of {c['cell_s']} s CPU each on a head and a worker node (1 CPU each) on "
                  f"127.0.0.1: cells per node {c['cells_per_node']}, grid wall {c['grid_wall_s']} s "
                  f"(serial {c['serial_s']} s), cluster start {c['cluster_up_s']} s, failed {c['failed']} "
                  f"(target, both nodes busy: {'met' if c['target_met'] else 'NOT met'}).\n"]
    if "validate" in rec:
        v = rec["validate"]
        lines += ["## Validate batch\n",
                  f"{v['sessions']} sessions of {v['duration_s']} s, faults {','.join(v['faults'])}, {v['workers']} "
                  f"workers: {v['wall_s']} s; summaries {v['summaries']}/{v['sessions']}, lines in sessions.jsonl "
                  f"{v['jsonl_lines']}; behaved {100 * v['success_rate']:.0f}%, misbehaved {v['misbehaved']} "
                  f"({v['misbehaviour_reasons']}); recordings kept {v['recordings_kept']}, on disk "
                  f"{v['recordings_on_disk']}, lost {len(v['recordings_lost'])} (target: "
                  f"{'met' if v['target_met'] else 'NOT met'}).\n"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("ibci", "ibci_full", "cluster", "validate"), action="append",
                    help="run these only (default: ibci, cluster and validate; ibci_full, the full iBCI benchmark "
                         "on both schedulers, takes about twice bench_bci.py's time and runs only when named)")
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--ibci-seeds", type=int, default=3)
    ap.add_argument("--ibci-steps", type=int, default=300)
    ap.add_argument("--sessions", type=int, default=100)
    ap.add_argument("--duration", type=float, default=2.5)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    which = args.only or ["ibci", "cluster", "validate"]
    rec: dict = {"command": "python bench/bench_grid.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "machine": f"{_cpu()}, {os.cpu_count()} cores, {platform.system()}",
                 "load_average_1min_before": round(os.getloadavg()[0], 2),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if "ibci" in which:
        rec["ibci"] = bench_ibci(args.workers, args.ibci_seeds, args.ibci_steps)
    if "ibci_full" in which:
        rec["ibci_full"] = bench_ibci_full(args.workers, args.ibci_seeds)
    if "cluster" in which:
        rec["cluster"] = bench_cluster(cells=8, seconds=1.0)
        print(f"cluster: {rec['cluster']}", flush=True)
    if "validate" in which:
        rec["validate"] = bench_validate(args.sessions, args.duration, args.workers)
        print(f"validate: {rec['validate']}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "grid" if sorted(which) == ["cluster", "ibci", "validate"] else "grid_" + "_".join(which)
    (args.out / f"{stem}.json").write_text(json.dumps(rec, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(rec))
    print(markdown(rec))
    return 0 if all(rec[k].get("target_met") for k in which) else 1


if __name__ == "__main__":
    sys.exit(main())
