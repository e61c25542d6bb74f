"""Cross-session drift: it grows with the day gap, and each named component can be switched off alone."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from closedloop.sim.handwriting import DRIFT_COMPONENTS, HandwritingConfig, WritingConfig, generate_recording
from closedloop.sim.handwriting.population import session_channel_params

#: The channel parameter each component moves.
FIELD = {"tuning_rotation": "vel_angle", "gain": "log_gain", "baseline": "log_baseline", "noise": "noise_hz",
         "unit_turnover": "vel_depth"}
ALL_FIELDS = ("alive", "log_baseline", "vel_angle", "acc_angle", "vel_depth", "log_gain", "noise_hz")


def _cfg(**drift) -> HandwritingConfig:
    cfg = HandwritingConfig(seed=5, n_channels=64, trials_per_session=3,
                            writing=WritingConfig(words_per_sentence=(2, 3)))
    return dataclasses.replace(cfg, drift=dataclasses.replace(cfg.drift, **drift))


def _mean_rate_corr(cfg: HandwritingConfig) -> tuple[np.ndarray, np.ndarray]:
    rec = generate_recording(cfg)
    means = np.array([np.concatenate([t.spikes for t in s.trials]).mean(0) for s in rec])
    corr = np.corrcoef(np.log(means + 0.05))[0]
    return np.array(cfg.days), corr


def test_mean_rate_correlation_falls_with_day_gap():
    days, corr = _mean_rate_corr(_cfg())
    order = np.argsort(days)
    # Rank correlation between day gap and similarity to day 0 is strongly negative.
    ranks = np.argsort(np.argsort(corr[order][1:]))
    gap_ranks = np.arange(len(ranks))
    assert np.corrcoef(ranks, gap_ranks)[0, 1] < -0.8
    assert corr[1] > 0.9 and corr[-1] < corr[20] < corr[1]


def test_without_drift_sessions_differ_only_by_noise():
    days, corr = _mean_rate_corr(_cfg().ablate("all"))
    assert corr.min() > 0.9
    params = session_channel_params(_cfg(scale=0.0))
    for name in ALL_FIELDS:
        assert all(np.array_equal(getattr(p, name), getattr(params[0], name)) for p in params), name


@pytest.mark.parametrize("component", DRIFT_COMPONENTS)
def test_ablating_one_component_removes_it_and_leaves_the_others(component):
    full = session_channel_params(_cfg())
    ablated = session_channel_params(_cfg().ablate(component))
    field = FIELD[component]
    # The component moved its parameter in the full model ...
    assert not np.allclose(getattr(full[-1], field), getattr(full[0], field))
    # ... and, switched off, that parameter stays put (apart from units replaced by turnover).
    for p in ablated:
        same_unit = (p.vel_depth == ablated[0].vel_depth) & (p.alive == ablated[0].alive)
        if component == "unit_turnover":
            assert np.array_equal(p.alive, ablated[0].alive) and np.array_equal(p.vel_depth, ablated[0].vel_depth)
        else:
            assert np.array_equal(getattr(p, field)[same_unit], getattr(ablated[0], field)[same_unit])
    # Every other component's draws are untouched (independent random streams).
    others = {FIELD[c] for c in DRIFT_COMPONENTS if c != component} - {"vel_angle", "log_baseline", "vel_depth"}
    for f, a in zip(full, ablated, strict=True):
        for name in others:
            assert np.array_equal(getattr(f, name), getattr(a, name)), name


def test_only_turnover_replaces_and_loses_units():
    params = session_channel_params(_cfg(unit_turnover=0.004))
    replaced = (params[-1].vel_depth != params[0].vel_depth).mean()
    assert 0.3 < replaced < 0.9  # ~1 - exp(-0.004 * 509) events, 60% of them new units
    assert params[-1].alive.sum() != params[0].alive.sum() or replaced > 0


def test_drift_walks_scale_like_sqrt_days():
    params = session_channel_params(_cfg(scale=1.0))
    spread = [np.std(p.vel_angle - params[0].vel_angle) for p in params]
    assert spread[0] == 0 and spread[-1] > spread[5] > 0


def test_session_jumps_are_each_days_own_and_leave_the_default_data_alone():
    base = session_channel_params(_cfg())
    plain = session_channel_params(dataclasses.replace(_cfg(), drift=dataclasses.replace(
        _cfg().drift, session_rotation=0.0, session_gain=0.0, session_baseline=0.0)))
    for a, b in zip(base, plain, strict=True):
        for f in ALL_FIELDS:
            assert np.array_equal(getattr(a, f), getattr(b, f))
    jumped = session_channel_params(_cfg().with_session_jumps(rotation=0.4, gain=0.3, baseline=0.3))
    # the jump on each session: large against the slow walk, and not carried over (consecutive jumps uncorrelated)
    d = np.array([j.vel_angle - p.vel_angle for j, p in zip(jumped, base, strict=True)])
    assert 0.3 < d.std() < 0.5
    assert abs(np.corrcoef(d[1:-1].ravel(), d[2:].ravel())[0, 1]) < 0.1
    g = np.array([j.log_gain - p.log_gain for j, p in zip(jumped, base, strict=True)])
    assert 0.25 < g.std() < 0.45 and np.all(jumped[0].alive == base[0].alive)
    with pytest.raises(ValueError, match="session_gain must be >= 0"):
        session_channel_params(_cfg().with_session_jumps(gain=-0.1))
