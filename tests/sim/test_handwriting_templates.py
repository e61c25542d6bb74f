"""Character pen templates: every character has one, moves the pen, and time warping keeps the path."""

from __future__ import annotations

import numpy as np
import pytest

from closedloop.sim.handwriting import (
    CHAR_STROKES,
    CHARSET,
    WritingConfig,
    char_path,
    char_velocity,
    trial_kinematics,
)


@pytest.mark.parametrize("ch", list(CHARSET))
def test_every_character_has_a_template_with_real_motion(ch):
    assert ch in CHAR_STROKES
    path = char_path(ch)
    length = np.linalg.norm(np.diff(path, axis=0), axis=1).sum()
    assert length > 0.4, f"{ch!r} hardly moves the pen"
    v = char_velocity(ch, 25, 0.02)
    assert np.isfinite(v).all() and np.abs(v).max() > 0.5
    # Bin velocities integrate to the template's displacement, whatever the warp.
    for warp in (-0.3, 0.0, 0.3):
        np.testing.assert_allclose(char_velocity(ch, 25, 0.02, warp).sum(0) * 0.02, path[-1] - path[0], atol=1e-9)


def test_characters_are_distinguishable_by_pen_velocity():
    profiles = {c: char_velocity(c, 30, 0.02).ravel() for c in CHARSET}
    for a in CHARSET:
        for b in CHARSET:
            if a < b:
                assert not np.allclose(profiles[a], profiles[b], atol=0.2), (a, b)


def test_warp_changes_timing_not_shape():
    straight, warped = char_velocity("s", 40, 0.02), char_velocity("s", 40, 0.02, 0.3)
    assert not np.allclose(straight, warped)
    with pytest.raises(ValueError, match="monotone"):
        char_velocity("s", 40, 0.02, 1.2)


def test_trial_has_idle_edges_writing_and_a_space_pause():
    cfg = WritingConfig()
    kin = trial_kinematics("hi>yo~", cfg, 0.02, np.random.default_rng(0))
    f = kin.features
    first, last = kin.char_onsets[0], kin.char_onsets[-1]
    assert first >= 18 and np.allclose(f[: first - 3, :5], 0) and f[: first - 3, 5].max() < 1e-9
    assert f[first + 2:last, 5].min() > 0.99  # writing envelope on during the sentence
    assert np.allclose(f[-8:, :5], 0)          # post-trial idle
    speed = f[:, 4]
    assert speed[first:].max() > 2.0
    # Slower trials last longer: duration scales with the per-trial speed draw.
    slow = trial_kinematics("hi>yo~", WritingConfig(char_base_s=0.5), 0.02, np.random.default_rng(0))
    assert slow.features.shape[0] > f.shape[0]
