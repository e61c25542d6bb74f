"""The bit-flip benchmark's tiny configuration runs end to end and writes its results."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest


@pytest.mark.timeout(300)
def test_tiny_bench_writes_json_markdown_and_plot(tmp_path):
    from closedloop.sdk.robust.bench import BitflipBenchConfig, run_bitflip_benchmark

    cfg = replace(BitflipBenchConfig.tiny_config(str(tmp_path)), train_steps=8, finetune_steps=4,
                  random_flips=(1, 100), targeted_flips=(1,), attack_steps=8, timing_reps=2, observer_flips=(1,),
                  families=("bci", "observer"))
    results = run_bitflip_benchmark(cfg, report=lambda s: None)
    data = json.loads((tmp_path / "bitflip_tiny.json").read_text())
    assert set(data["bci"]["random"]) == {"fp32", "int8"} and set(data["observer"]["random"]) == {"fp32"}
    assert (tmp_path / "bitflip_tiny.md").read_text().startswith("# Bit flips")
    assert all(Path(p).is_file() for p in results["plots"]) and len(results["plots"]) == 2
    # scrubbing undoes the flips it can see: with one flip the scrubbed metric equals the clean one
    scrub = data["bci"]["random"]["fp32"]["protected_scrub"]
    assert all(r["CER"] == scrub["clean"]["CER"] for r in scrub["runs"] if r["flips"] == 1)
    obs = data["observer"]["random"]["fp32"]["protected_scrub"]
    assert obs["clean"]["certificate_holds"] == 1.0
