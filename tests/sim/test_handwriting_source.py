"""The ``handwriting`` headstage source: streams a synthetic session's trials bin by bin with resting gaps."""

from __future__ import annotations

import numpy as np
import pytest

from closedloop.sim.devices import device_params
from closedloop.sim.handwriting import HandwritingConfig, generate_session
from closedloop.sim.sources import NEURAL_SOURCES, make_source


def test_registered_and_reachable_from_a_headstage_url():
    assert "handwriting" in NEURAL_SOURCES
    cls, params = device_params("headstage", {"source": "handwriting", "session": "21", "channels": "192"})
    assert params["session"] == 21 and params["channels"] == 192 and params["loop"] is True
    device = cls(params)
    device.start(0.0)
    frame = device.tick(0, 0.0)[0]
    assert frame.counts.shape == (192,)
    assert device.source.report()["split"] == "held_out" and device.source.report()["session"] == "2023.04.17"


def test_streams_the_sessions_trials_after_resting_gaps():
    src = make_source("handwriting", 16, 50.0, seed=2, session=3, preset="tiny", gap_s=0.5)
    session = generate_session(HandwritingConfig.tiny(seed=2), 3)
    gap = np.stack([src.next_bin() for _ in range(25)])
    assert gap.dtype == np.uint16 and src.current_sentence == ""
    for trial in session.trials[:2]:
        bins = []
        for _ in range(trial.n_bins):
            bins.append(src.next_bin())
            assert src.current_sentence == trial.sentence
        np.testing.assert_array_equal(np.stack(bins), trial.spikes)
        report = src.report()
        assert report["sentence"] == trial.sentence and report["bin_in_trial"] == trial.n_bins - 1
        for _ in range(25):
            src.next_bin()
        assert src.report()["in_trial"] is False


def test_loops_and_replays_after_reset():
    src = make_source("handwriting", 16, 50.0, seed=1, session=0, preset="tiny", gap_s=0.0, trials=2)
    session = generate_session(HandwritingConfig.tiny(seed=1), 0)
    n = session.trials[0].n_bins + session.trials[1].n_bins
    first = np.stack([src.next_bin() for _ in range(n)])
    wrapped = src.next_bin()
    np.testing.assert_array_equal(wrapped, session.trials[0].spikes[0])
    src.reset(1)
    np.testing.assert_array_equal(np.stack([src.next_bin() for _ in range(n)]), first)


def test_first_trial_starts_inside_the_session_with_the_same_data():
    src = make_source("handwriting", 16, 50.0, seed=2, session=4, preset="tiny", gap_s=0.0, first_trial=5)
    session = generate_session(HandwritingConfig.tiny(seed=2), 4)
    trial = session.trials[5]
    np.testing.assert_array_equal(np.stack([src.next_bin() for _ in range(trial.n_bins)]), trial.spikes)
    assert src.report()["trial"] == 5 and src.report()["sentence"] == trial.sentence
    with pytest.raises(ValueError, match=r"first_trial=8 but the session has 8 trials"):
        make_source("handwriting", 16, 50.0, session=4, preset="tiny", first_trial=8)


def test_session_out_of_range_is_refused_with_the_range():
    with pytest.raises(ValueError, match=r"session=7 is outside 0..4"):
        make_source("handwriting", 16, 50.0, session=7, preset="tiny")


def test_headstage_streams_the_trial_over_the_wire(host):
    from closedloop.firmware_bridge import NeuralFrame

    h = host("sim://headstage?source=handwriting&preset=tiny&channels=16&session=3&seed=2&gap_s=0")
    h.handshake()
    frames = [f.message for _, f in h.collect(0.8, NeuralFrame)]
    trial = generate_session(HandwritingConfig.tiny(seed=2), 3).trials[0]
    assert len(frames) > 10
    checked = 0
    for previous, frame in zip([None] + frames, frames, strict=False):
        if previous is not None and frame.bin_index != previous.bin_index + 1:
            break  # a skipped tick (loaded machine): the source position no longer equals bin_index
        if frame.bin_index < trial.n_bins:
            np.testing.assert_array_equal(frame.counts, trial.spikes[frame.bin_index])
            checked += 1
    assert checked >= 5
