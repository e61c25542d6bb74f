"""bci-train's recipe on a toy recording: the validation split, the scaling rule, early stopping that restores the best
checkpoint, the time budget, and progress a person can follow (bars on a terminal, lines in a log, nothing with -q)."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
import torch

from closedloop.sdk.bci.data import fit_indices
from closedloop.sdk.bci.progress import Progress, format_seconds
from closedloop.sdk.bci.recipe import (
    Recipe,
    data_size,
    scaled_train_config,
    split_validation,
    validation_examples,
)
from closedloop.sdk.bci.toy import toy_recording
from closedloop.sdk.bci.train import (
    BackboneConfig,
    TrainConfig,
    plateau_check_step,
    train_backbone,
    validation_scores,
)

TINY = TrainConfig(backbone=BackboneConfig(16, 1, 0.0), steps=200, batch_size=4, lr=1e-2, device="cpu",
                   progress=False, eval_every=2, patience=2)


@pytest.fixture(scope="module")
def sessions():
    torch.set_num_threads(1)
    return toy_recording(n_channels=8, n_held_in=3, n_held_out=2, n_trials=8, seed=1)


@pytest.fixture(scope="module")
def split(sessions):
    train, val = split_validation(sessions, 0.2, seed=0)
    return train, val, validation_examples(train, val, TINY.std_floor)


def test_validation_trials_are_withheld_from_training_per_session_and_seeded(sessions, split):
    train, val, examples = split
    held_in = [s for s in sessions if s.split == "held_in"]
    assert set(val) == {s.name for s in held_in}
    for s, t in zip(sessions, train, strict=True):
        if s.split == "held_out":
            assert t is s  # held-out sessions are untouched
            continue
        assert len(val[s.name]) == round(0.2 * len(fit_indices(s))) >= 1
        assert set(val[s.name]) <= set(fit_indices(s)) and not set(val[s.name]) & set(fit_indices(t))
    assert len(examples) == sum(len(v) for v in val.values())
    assert split_validation(sessions, 0.2, seed=0)[1] == val
    assert any(split_validation(sessions, 0.2, seed=s)[1] != val for s in (1, 2, 3))
    one = toy_recording(n_channels=8, n_held_in=1, n_held_out=1, n_trials=5, seed=2)  # 3 trials to learn from
    assert len(split_validation(one, 0.01)[1][one[0].name]) == 1  # at least one per session
    with pytest.raises(ValueError, match="between 0 and 1"):
        Recipe(validation_fraction=1.5)


def test_model_size_and_step_ceiling_scale_with_the_data_unless_set():
    base = TrainConfig(batch_size=16)
    small = scaled_train_config(base, {"channels": 8, "sessions": 3, "trials": 18, "characters": 138})
    assert (small.backbone.n_hidden, small.backbone.n_layers, small.steps) == (64, 1, 1000)  # floors
    falcon = scaled_train_config(base, {"channels": 192, "sessions": 8, "trials": 160, "characters": 6000})
    assert (falcon.backbone.n_hidden, falcon.backbone.n_layers, falcon.steps) == (192, 1, 2000)
    big = scaled_train_config(base, {"channels": 1000, "sessions": 40, "trials": 4000, "characters": 90_000})
    assert (big.backbone.n_hidden, big.backbone.n_layers, big.steps) == (512, 2, 20_000)  # ceilings
    kept = scaled_train_config(replace(base, steps=77), {"channels": 192, "sessions": 8, "trials": 160,
                                                         "characters": 6000}, keep=frozenset({"steps", "backbone"}))
    assert kept.steps == 77 and kept.backbone == base.backbone
    assert data_size(toy_recording(n_channels=8, n_held_in=2, n_held_out=1, n_trials=8))["sessions"] == 2


def test_early_stopping_ends_before_the_ceiling_and_restores_the_best_checkpoint(split):
    train, _, val = split
    # patience counted from the first evaluation (the toy does not learn in a few steps)
    model, log = train_backbone(train, replace(TINY, patience_from_cer=10.0), val)
    assert log.stop_reason == "patience" and log.steps_run < TINY.steps
    cers = [v["CER"] for v in log.validation]
    best = log.best()
    assert best["CER"] == min(cers) and log.best_step == log.validation[cers.index(min(cers))]["step"]
    assert len(log.validation) - 1 - cers.index(min(cers)) == TINY.patience  # stopped patience evaluations later
    restored = validation_scores(model, lambda x, b: model(x)[0], val)
    assert restored["CER"] == pytest.approx(best["CER"]) and restored["chars"] == best["chars"]
    assert log.to_dict()["stop_reason"] == "patience" and log.to_dict()["steps_run"] == log.steps_run


def test_the_time_budget_stops_training_and_without_validation_nothing_changes(split, sessions):
    train, _, val = split
    _, log = train_backbone(train, replace(TINY, time_budget_s=1e-3, patience=1000), val)
    assert log.stop_reason == "time_budget" and log.steps_run == 1 and log.validation[-1]["step"] == 1
    _, plain = train_backbone(sessions, replace(TINY, steps=5))
    assert plain.steps_run == 5 and plain.stop_reason == "ceiling" and plain.validation == []
    # with validation the plateau check moves to a quarter of the ceiling (the ceiling scales with the data)
    assert plateau_check_step(TrainConfig(steps=4000), validated=True) == 1000
    assert plateau_check_step(TrainConfig(steps=4000), validated=False) == 200
    assert plateau_check_step(TrainConfig(steps=150), validated=True) == 0


def test_progress_is_lines_in_a_log_a_bar_on_a_terminal_and_nothing_when_quiet():
    row = {"step": 10, "CER": 0.5, "WER": 0.8, "chars": 12}
    log = io.StringIO()
    stage = Progress(stream=log, interval_s=0.0).stage("stage 1", 100)
    stage.step(1, 3.0)  # interval 0: a line every step
    stage.validated(10, row, row)
    lines = log.getvalue().splitlines()
    assert lines[0].startswith("stage 1: step 1/100, loss 3.000") and "left" in lines[0]
    assert "val CER 50.0%" in lines[1] and "best 50.0%@10" in lines[1]
    slow = io.StringIO()
    stage = Progress(stream=slow).stage("s", 100)  # 10 s between lines, but every evaluation gets one
    for k in range(1, 5):
        stage.step(k, 1.0)
    stage.validated(4, row, row)
    assert len(slow.getvalue().splitlines()) == 1
    quiet = io.StringIO()
    stage = Progress(quiet=True, stream=quiet).stage("s", 10)
    stage.step(1, 1.0)
    stage.validated(1, row, row)
    stage.close("done")
    assert quiet.getvalue() == ""
    tty = io.StringIO()
    stage = Progress(stream=tty, tty=True).stage("stage 1", 10)
    for k in range(1, 11):
        stage.step(k, 2.0)
    stage.close()
    assert "stage 1" in tty.getvalue() and "10/10" in tty.getvalue()
    assert (format_seconds(42), format_seconds(75), format_seconds(3725), format_seconds(float("inf"))) == (
        "42s", "1m15s", "1h02m", "?")
