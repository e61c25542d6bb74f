"""The bit-flip benchmark's policy family (a cloned Panda reach policy) runs end to end in its tiny configuration."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest


@pytest.mark.timeout(300)
def test_policy_family_success_rate_under_flips(tmp_path):
    pytest.importorskip("pybullet")
    pytest.importorskip("gymnasium")
    from closedloop.sdk.robust.bench import BitflipBenchConfig, run_bitflip_benchmark

    cfg = replace(BitflipBenchConfig.tiny_config(str(tmp_path)), families=("policy",), timing=False,
                  targeted_flips=(1, 2))
    results = run_bitflip_benchmark(cfg, report=lambda s: None)
    rec = json.loads((tmp_path / "bitflip_tiny.json").read_text())["policy"]
    assert rec["metric"] == "success_rate" and rec["higher_is_better"] is True
    assert set(rec["random"]["fp32"]) == {"unprotected", "protected_noscrub", "protected_scrub",
                                          "scrub_protected_flips_only"}
    for cond in rec["random"]["fp32"].values():
        assert all(0.0 <= r["success_rate"] <= 1.0 and r["final_distance_cm"] >= 0 for r in cond["runs"])
    # the targeted search attacks int8 weights, all of them protected here: the scrubber puts every flip back
    keyed = rec["targeted"]["bfa_vs_protected_keyed"]
    assert [r["repaired"] for r in keyed["scrub"]] == [1, 2] and all(r["unrepairable"] == 0 for r in keyed["scrub"])
    assert [r["flips"] for r in keyed["noscrub"]] == [1, 2]
    assert len(results["plots"]) == 1
    assert "## policy (success_rate)" in (tmp_path / "bitflip_tiny.md").read_text()
