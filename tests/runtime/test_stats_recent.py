"""The live status (status line, the monitor's status updates) reads the newest steps only.

A p99 over the whole run's latency ring (a million samples after 17 minutes at 1 kHz) takes
tens of milliseconds in the loop's thread; over the newest 2,048 it costs microseconds.
"""

from __future__ import annotations

import numpy as np

from closedloop.runtime.stats import RingRecorder


def test_recent_percentile_reads_only_the_newest_samples_across_the_wrap():
    r = RingRecorder(100)
    for v in range(250):
        r.add(v * 1000)
    assert r.recent_percentile_us(100, 10) == 249.0 and r.recent_percentile_us(0, 10) == 240.0
    assert r.recent_percentile_us(0, 100) == 150.0  # the whole ring, which wrapped twice
    assert r.recent_percentile_us(50, 30) == np.percentile(np.arange(220, 250), 50)


def test_recent_percentile_of_an_empty_ring_is_nan():
    assert np.isnan(RingRecorder(8).recent_percentile_us(99))
