"""The observer benchmark's logic end to end on tiny settings: results written, every part measured."""

from __future__ import annotations

import json

from closedloop.sdk.observer.benchmark import (
    LINEAR_PART,
    NEURAL,
    STAGE1,
    ObserverBenchConfig,
    run_observer_benchmark,
)


def test_smoke_benchmark_writes_every_result(tmp_path):
    cfg = ObserverBenchConfig.smoke(out_dir=str(tmp_path))
    assert ObserverBenchConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    record = run_observer_benchmark(cfg, report=lambda s: None)

    for suffix in (".json", ".md", "_estimates.png", "_errors.png"):
        assert (tmp_path / f"{cfg.stem}{suffix}").stat().st_size > 0
    saved = json.loads((tmp_path / f"{cfg.stem}.json").read_text())
    res = saved["results"]["van-der-pol"]
    assert res["certificate"]["certified"] and res["certificate"]["coverage"]["violations"] == 0
    assert res["training"]["selected"] == 0.75
    mc = res["monte_carlo"]
    assert set(mc) == {NEURAL, STAGE1, *cfg.baselines} and LINEAR_PART in mc
    assert all(m["state_rmse"]["mean"] > 0 for m in mc.values())
    assert mc[NEURAL]["noise_amplification"] is not None
    assert res["runtime"]["check_passed"] and res["runtime"]["step_us"]["n"] == cfg.runtime_steps
    assert saved["training_time"]["two_stage_certified"] and "speedup" in saved["training_time"]
    names = [t["target"] for t in record["targets"]]
    assert len(names) == 5 and any("p99" in n for n in names) and any("van-der-pol" in n for n in names)
