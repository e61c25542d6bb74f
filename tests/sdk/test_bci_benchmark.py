"""The iBCI benchmark driver end to end on its tiny configuration, as a user runs it from the shell.

``bench/bench_bci.py --tiny`` with two seeds in two worker processes and one drift component
ablated: the results a reader relies on (table, JSON, plot) are written under the ablation's
name, every seed and held-out session is in them, and the paired comparison is made.
The numbers of a tiny run mean nothing; the full run's are checked by reading its committed
results, never by a test.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.uses_ray  # starts Ray instances (tests/conftest.py)


def test_the_benchmark_script_writes_every_result_of_an_ablated_two_seed_run(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "bench_bci.py"), "--tiny", "--seeds", "0", "1", "--jobs", "2",
           "--methods", "zero_shot", "two_stage", "--ablate", "gain", "--out", str(tmp_path)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "estimated time:" in run.stdout and "wall time" in run.stdout
    assert re.search(r"iBCI tasks: 100%.*8/8", run.stderr), run.stderr[-2000:]  # the progress bar, on stderr
    # a line as each of the seeds' tasks ends: train the backbone (and meta-learn), train the session-layer
    # decoder (the drift reference's), score the two methods, score the reference; numbered in order
    progress = re.findall(r"^\[(\d+)/(\d+)\] seed (\d+): (.*) in \d+ s$", run.stdout, re.M)
    assert [(int(i), int(n)) for i, n, *_ in progress] == [(i, 8) for i in range(1, 9)], progress
    for seed in ("0", "1"):
        assert {what for *_, s, what in progress if s == seed} == {
            "trained backbone + meta", "trained session_layers", "scored zero_shot + two_stage", "scored drift reference"}

    stem = "bci_tiny_ablate_gain"
    for suffix in (".json", ".md", "_wer_vs_days.png"):
        assert (tmp_path / f"{stem}{suffix}").stat().st_size > 0, suffix
    saved = json.loads((tmp_path / f"{stem}.json").read_text())
    summary = saved["summary"]
    assert summary["seeds"] == [0, 1] and [r["seed"] for r in saved["runs"]] == [0, 1]
    assert set(summary["methods"]) == {"zero_shot", "two_stage"}
    assert list(summary["sessions"]) == ["2023.04.17", "2023.10.09"]  # the tiny recording's held-out days
    assert all(s["days_since_last_held_in"] > 0 for s in summary["sessions"].values())
    for name, m in summary["methods"].items():
        for dec in ("greedy", "beam"):
            v = m["mean"][dec]["WER"]["values"]
            assert len(v) == 2 and all(math.isfinite(x) and x >= 0 for x in v), (name, dec)
        assert len(m["train_s"]["values"]) == 2
        assert set(m["sessions"]) == set(summary["sessions"])
    # the two seeds are two models: their stage-1 loss curves differ
    curves = [r["loss_curves"]["backbone"]["loss"] for r in saved["runs"]]
    assert curves[0] != curves[1]
    assert "zero_shot" in summary["paired"] and 0 <= summary["paired"]["zero_shot"]["p_better"] <= 1
    # the run records how it was made: the ablated data, the configuration, the machine, the time
    bench = saved["benchmark"]
    drift = bench["data_config"]["drift"]
    assert drift["gain"] == 0 and drift["baseline"] > 0 and drift["unit_turnover"] > 0  # gain alone switched off
    assert bench["bench_config"]["seeds"] == [0, 1] and bench["wall_s"] > 0 and bench["estimated_s"] > 0
    table = (tmp_path / f"{stem}.md").read_text()
    assert "two_stage" in table and "zero_shot" in table
    # where a seed's time went: decoding per method and the whole seed, beside training and calibration
    for r in saved["runs"]:
        assert r["wall_s"] >= max(m["train_s"] + m["calibrate_s"] + m["decode_s"] for m in r["methods"].values())
        assert all(m["decode_s"] > 0 for m in r["methods"].values())
    # how often the Numba CTC handed a batch to F.ctc_loss is on record per seed
    assert all(0 <= r["fast_ctc"]["fallback_batches"] <= r["fast_ctc"]["batches"] and r["fast_ctc"]["batches"] > 0
               for r in saved["runs"])


def _fake_result(path: Path, wers: dict[int, tuple[float, float]], data_seed: int = 0, steps: int = 800) -> Path:
    """A bench_bci.py result file with the given (two-stage, session-layers) beam WER per seed."""
    runs = [{"seed": s, "methods": {"two_stage": {"mean": {"beam": {"WER": a}}},
                                    "session_layers": {"mean": {"beam": {"WER": b}}}}} for s, (a, b) in wers.items()]
    bench = {"data_config": {"seed": data_seed}, "bench_config": {"ablate": "", "harness": {"train": {"steps": steps}}}}
    path.write_text(json.dumps({"benchmark": bench, "runs": runs}))
    return path


def test_pooling_runs_resamples_seed_numbers_and_refuses_another_benchmark(tmp_path):
    a = _fake_result(tmp_path / "a.json", {0: (0.02, 0.04), 1: (0.03, 0.03)})
    b = _fake_result(tmp_path / "b.json", {0: (0.01, 0.05), 2: (0.02, 0.02)}, steps=600)
    cmd = [sys.executable, str(ROOT / "bench" / "pool_bci_runs.py"), "--runs", str(a), str(b), "--out", str(tmp_path)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    pooled = json.loads((tmp_path / "bci_pooled.json").read_text())
    assert len(pooled["draws"]) == 4
    v = pooled["versus"]["session_layers"]
    assert math.isclose(v["ratio"], (0.02 + 0.03 + 0.01 + 0.02) / (0.04 + 0.03 + 0.05 + 0.02))
    assert v["n_seed_numbers"] == 3 and v["ci95"][0] <= v["ratio"] <= v["ci95"][1]
    assert "train.steps (800 -> 600)" in pooled["config_differences"][0]  # a recipe change is listed
    assert (tmp_path / "bci_pooled.png").stat().st_size > 0
    other = _fake_result(tmp_path / "c.json", {0: (0.02, 0.04)}, data_seed=1)
    cmd[cmd.index(str(b))] = str(other)
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "not the same benchmark" in run.stderr


def _descendants(pid: int) -> dict[int, bytes]:
    """Every live process below ``pid`` at any depth (Ray's workers are the raylet's children), with its
    command line, from /proc."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue

    def below(p: int) -> bool:
        seen = 0
        while p in parent and seen < 64:
            p, seen = parent[p], seen + 1
            if p == pid:
                return True
        return False

    return {p: cmd for p in parent if below(p) and (cmd := _cmdline(p))}


def _cmdline(pid: int) -> bytes:
    """``pid``'s command line; empty once it has ended (a zombie's is empty too)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _runs_a_seed(cmd: bytes) -> bool:
    """A worker running a grid task: a Ray worker names itself ``ray::<task>`` while it runs one
    (``ray::IDLE`` between tasks); a multiprocessing worker is ``spawn_main``."""
    return b"spawn_main" in cmd or (cmd.startswith(b"ray::") and b"Agent" not in cmd and not cmd.startswith(b"ray::IDLE"))


def test_killing_the_benchmark_ends_its_seed_processes_too(tmp_path):
    """`kill PID` on a running benchmark must not leave its workers training for an hour, nor the Ray
    instance it started (raylet, GCS, agents) running."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "bench_bci.py"), "--tiny", "--seeds", "0", "1",
                             "--jobs", "2", "--methods", "zero_shot", "--out", str(tmp_path)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started: dict[int, bytes] = {}
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            started = _descendants(proc.pid)
            if sum(map(_runs_a_seed, started.values())) >= 2:
                break
            time.sleep(0.2)
        seeds = [p for p, cmd in started.items() if _runs_a_seed(cmd)]
        assert len(seeds) == 2, f"the two seed tasks never started: {sorted(started.values())}"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM  # ended by the signal, through the runner's close()
        deadline = time.monotonic() + 15
        while any(_cmdline(p) == c for p, c in started.items()) and time.monotonic() < deadline:
            time.sleep(0.2)
        alive = [c.split(b"\0")[0].decode(errors="replace") for p, c in started.items() if _cmdline(p) == c]
        assert not alive, f"processes {alive} outlived the killed benchmark by 15 s"
        assert not list(tmp_path.glob("bci_tiny*"))  # nothing half-written
    finally:
        if proc.poll() is None:
            proc.kill()
        for p, c in started.items():  # a failing run must not leave them to the rest of the suite either
            if _cmdline(p) == c:
                os.kill(p, signal.SIGKILL)


def test_a_device_the_machine_lacks_is_refused_before_any_data_are_generated(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device; the refusal is checked where it has none")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_bci.py"), "--tiny", "--device", "cuda", "--out",
                        str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "bench_bci.py: error: device 'cuda': no CUDA GPU is available" in r.stderr
    assert "Traceback" not in r.stderr and not any(tmp_path.iterdir())


def test_a_baseline_without_errors_in_some_resamples_gives_an_unbounded_interval_not_nan(tmp_path):
    """Paired bootstrap of a ratio whose baseline has 0 errors in some replicates: the upper bound is inf (no finite
    bound; "inf" in the table, null in the JSON), never NaN, and the results file is strict JSON."""
    import json as _json

    import numpy as np

    from closedloop.common.jsonout import write_json
    from closedloop.sdk.bci.report import paired_bootstrap

    refs = ["ab", "cd", "ef", "gh"]

    def run(texts):
        return {"methods": {m: {"sessions": {"s1": {"texts": {"reference": refs, "beam": t}}}}
                            for m, t in texts.items()}}

    # the baseline errs on one trial of four: a quarter of the resamples or so leave it out (0 errors)
    runs = [run({"two_stage": ["ab", "xd", "ef", "gh"], "base": ["ab", "cd", "ef", "gx"]})]
    p = paired_bootstrap(runs, "two_stage", "base", decoder="beam", metric="CER", n_boot=400)
    lo, hi = p["ratio_95"]
    assert not np.isnan(lo) and not np.isnan(hi) and hi == np.inf
    write_json(tmp_path / "r.json", p)
    text = (tmp_path / "r.json").read_text()
    assert "NaN" not in text and "Infinity" not in text and _json.loads(text)["ratio_95"][1] is None
