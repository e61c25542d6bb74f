"""Synthetic handwriting recordings: determinism, shapes, FALCON splits and dates, sentences, config round trip."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest

from closedloop.sim.handwriting import (
    CHARSET,
    FALCON_H2_HELD_IN_DATES,
    FALCON_H2_HELD_OUT_DATES,
    VOCABULARY,
    HandwritingConfig,
    falcon_splits,
    generate_recording,
    generate_session,
    make_sentence,
)


@pytest.fixture(scope="module")
def tiny():
    return generate_recording(HandwritingConfig.tiny(seed=3))


def _same(a, b) -> bool:
    return all(x.sentence == y.sentence and np.array_equal(x.spikes, y.spikes)
               for x, y in zip(a.trials, b.trials, strict=True))


def test_same_seed_same_data_and_one_session_alone_matches(tiny):
    again = generate_recording(HandwritingConfig.tiny(seed=3))
    assert all(_same(a, b) for a, b in zip(tiny, again, strict=True))
    assert _same(generate_session(HandwritingConfig.tiny(seed=3), 3), tiny[3])


def test_different_seed_different_data(tiny):
    other = generate_recording(HandwritingConfig.tiny(seed=4))
    assert not any(_same(a, b) for a, b in zip(tiny, other, strict=True))


def test_shapes_dtypes_and_counts(tiny):
    for s in tiny:
        assert s.n_channels == 16 and len(s.trials) == 8
        for t in s.trials:
            assert t.spikes.dtype == np.uint8 and t.spikes.ndim == 2 and t.n_bins > 30
        counts = np.concatenate([t.spikes for t in s.trials])
        assert 0.05 < counts.mean() < 3.0  # 2.5-150 Hz per channel on average in 20 ms bins


def test_tiny_config_generates_in_under_a_second():
    start = time.perf_counter()
    generate_recording(HandwritingConfig.tiny(seed=11))
    assert time.perf_counter() - start < 1.0


def test_splits_days_and_names_follow_falcon(tiny):
    cfg = HandwritingConfig.tiny(seed=3)
    assert [s.split for s in tiny] == ["held_in"] * 3 + ["held_out"] * 2
    assert [s.name for s in tiny] == [d.replace("-", ".") for d in cfg.held_in_dates + cfg.held_out_dates]
    assert [s.day for s in tiny] == [0.0, 35.0, 286.0, 334.0, 509.0]
    for s in tiny:
        assert (s.calibration, s.evaluation) == falcon_splits(8, s.split == "held_out")
    assert tiny[3].calibration == [0, 1, 2] and tiny[3].evaluation == [5, 6, 7]
    assert tiny[0].calibration == [0, 1, 2, 3, 4]


def test_default_config_mirrors_falcon_h2():
    cfg = HandwritingConfig()
    assert cfg.n_channels == 192 and cfg.bin_s == 0.02 and cfg.n_sessions == 26
    assert cfg.held_in_dates == FALCON_H2_HELD_IN_DATES and len(FALCON_H2_HELD_IN_DATES) == 21
    assert cfg.held_out_dates == ("2023-04-17", "2023-05-31", "2023-06-28", "2023-08-16", "2023-10-09")
    assert FALCON_H2_HELD_OUT_DATES == cfg.held_out_dates
    days = cfg.days
    assert days[0] == 0 and days[20] == 286 and days[21] == 334 and days[-1] == 509
    assert days[21] - days[20] == 48  # the held-out days come after a gap


def test_sentences_use_charset_and_falcon_conventions(tiny):
    rng = np.random.default_rng(0)
    sentences = [make_sentence(rng) for _ in range(300)] + [t.sentence for s in tiny for t in s.trials]
    pattern = re.compile(r"^[a-z']+,?(>[a-z']+,?)*[~?]$")
    for text in sentences:
        assert set(text) <= set(CHARSET), text
        assert pattern.match(text) and not re.search(r",[~?]", text), text
        assert all(w.rstrip(",") in VOCABULARY for w in text[:-1].split(">"))
    lengths = [len(t.split(">")) for t in sentences[:300]]
    assert min(lengths) == 3 and max(lengths) == 9
    assert any("," in t for t in sentences) and any("'" in t for t in sentences)
    assert any(t.endswith("?") for t in sentences) and any(t.endswith("~") for t in sentences)
    assert len(VOCABULARY) >= 200


def test_config_json_round_trip_and_validation():
    cfg = HandwritingConfig.tiny(seed=9).ablate("gain")
    back = HandwritingConfig.from_json(cfg.to_json())
    assert back == cfg and isinstance(back.writing.words_per_sentence, tuple)
    with pytest.raises(ValueError, match="unknown field"):
        HandwritingConfig.from_dict({"seeed": 1})
    with pytest.raises(ValueError, match="must increase"):
        HandwritingConfig(held_in_dates=("2022-05-18", "2022-05-01"))
    with pytest.raises(ValueError, match="unknown drift component"):
        cfg.ablate("tuning")
    with pytest.raises(IndexError, match="outside 0..4"):
        generate_session(HandwritingConfig.tiny(), 5)


def test_kinematics_are_kept_on_request():
    s = generate_session(HandwritingConfig.tiny(seed=1), 0, with_kinematics=True)
    kin = s.meta["kinematics"]
    assert len(kin) == len(s.trials)
    for k, t in zip(kin, s.trials, strict=True):
        assert k.features.shape == (t.n_bins, 6) and len(k.char_onsets) == len(t.sentence)
        assert np.all(np.diff(k.char_onsets) > 0)
