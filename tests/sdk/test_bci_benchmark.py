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
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_benchmark_script_writes_every_result_of_an_ablated_two_seed_run(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "bench_bci.py"), "--tiny", "--seeds", "0", "1", "--jobs", "2",
           "--methods", "zero_shot", "two_stage", "--ablate", "gain", "--out", str(tmp_path)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "estimated time:" in run.stdout and "wall time" in run.stdout

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
