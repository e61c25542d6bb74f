"""bench/bench_monitor.py's verdict: a paired p99 ratio per repeat, its median and bootstrap interval decide the
target only when the interval lies on one side of 1.1."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def bench(bench_script):
    return bench_script("bench_monitor")


def _runs(off, client):
    return ([{"repeat": i, "mode": "off", "p99_us": v} for i, v in enumerate(off)]
            + [{"repeat": i, "mode": "client", "p99_us": v} for i, v in enumerate(client)])


def test_the_ratio_is_paired_by_repeat(bench):
    # the machine drifts 2x between repeats; the monitor adds 5% in each: pairing sees 1.05, pooling would not
    off = [100, 200, 100, 200, 100, 200, 100, 200]
    pr = bench.paired_ratio(_runs(off, [v * 1.05 for v in off]), "client")
    assert pr["median"] == pytest.approx(1.05) and pr["ci95"] == pytest.approx([1.05, 1.05])
    assert pr["verdict"] == "met"


def test_the_verdict_says_when_the_repeats_cannot_tell(bench):
    off = [100.0] * 8
    assert bench.paired_ratio(_runs(off, [150.0] * 8), "client")["verdict"] == "NOT MET"
    noisy = [90, 130, 95, 125, 100, 120, 92, 128]  # ratios straddle 1.1
    pr = bench.paired_ratio(_runs(off, noisy), "client")
    assert pr["ci95"][0] <= 1.1 < pr["ci95"][1] and pr["verdict"] == "undecided"
    # too few repeats for an interval: no verdict either way
    assert bench.paired_ratio(_runs([100.0] * 2, [150.0] * 2), "client")["verdict"].startswith("undecided: 2 repeats")
