"""bci-train's recipe on a toy recording: the validation split, the scaling rule, early stopping that restores the best
checkpoint, the time budget, and progress a person can follow (bars on a terminal, lines in a log, nothing with -q)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from closedloop.runtime import load_bundle
from closedloop.sdk.bci import calibrate_bundle
from closedloop.sdk.bci.calibrate import CalibrationConfig
from closedloop.sdk.bci.data import collate, ctc_loss, fit_indices
from closedloop.sdk.bci.evaluate import HarnessConfig
from closedloop.sdk.bci.meta import MetaConfig
from closedloop.sdk.bci.nwb import load_falcon_h2, write_falcon_h2_dir
from closedloop.sdk.bci.progress import Progress, format_seconds
from closedloop.sdk.bci.recipe import (
    Recipe,
    data_size,
    end_mark_warning,
    scaled_train_config,
    split_validation,
    validation_examples,
)
from closedloop.sdk.bci.toy import toy_recording
from closedloop.sdk.bci.train import (
    STARTED_CER,
    BackboneConfig,
    PlateauCounter,
    TrainConfig,
    cosine_lr,
    plateau_check_step,
    train_backbone,
    validation_scores,
)
from closedloop.sdk.cli import main

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
    assert (small.backbone.n_hidden, small.backbone.n_layers, small.steps) == (64, 1, 2000)  # floors
    falcon_size = {"channels": 192, "sessions": 8, "trials": 160, "characters": 6000}
    falcon = scaled_train_config(base, falcon_size)
    assert (falcon.backbone.n_hidden, falcon.backbone.n_layers, falcon.steps) == (192, 1, 4000)  # 400 epochs
    assert scaled_train_config(base, falcon_size, min_steps=6000).steps == 6000  # a higher floor (Recipe.min_steps)
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
    # each plateau (`patience` evaluations without a lower CER, counted afresh after each reduction) halved the
    # learning rate, down to its floor (lr_final_fraction 0.05: 4 halvings), and the plateau after that ended the run
    assert len(log.lr_reductions) == 4 and log.final_lr == pytest.approx(TINY.lr / 16)
    marks = [0, *log.lr_reductions, log.steps_run]
    for a, b in zip(marks, marks[1:], strict=False):
        rows = [v for v in log.validation if a < v["step"] <= b]
        seen = [v for v in log.validation if v["step"] <= a]
        last_progress = -1
        for k, v in enumerate(rows):
            if not seen or v["CER"] < min(r["CER"] for r in seen):
                last_progress = k
            seen.append(v)
        stale_run = len(rows) - 1 - last_progress
        assert stale_run >= TINY.patience  # every reduction, and the end, came after a plateau
    assert log.converged is True and log.decay_step is None
    # with patience that never runs out the same run uses its ceiling, the last fifth a decay to the floor
    _, longer = train_backbone(train, replace(TINY, patience_from_cer=10.0, patience=1000), val)
    assert longer.stop_reason == "ceiling" and longer.steps_run == TINY.steps and not longer.lr_reductions
    assert longer.final_lr == pytest.approx(TINY.lr * TINY.lr_final_fraction)
    assert longer.converged is False  # the ceiling ended it before its rule was met
    assert longer.decay_step == 0.8 * TINY.steps  # its decay took the ceiling's last fifth
    restored = validation_scores(model, lambda x, b: model(x)[0], val)
    assert restored["CER"] == pytest.approx(best["CER"]) and restored["chars"] == best["chars"]
    # the validation loss is per character: the trials' CTC negative log-likelihoods over their characters
    with torch.no_grad():
        nll = sum(float(ctc_loss(model(b.x)[0], b, reduction="sum")) for b in (collate([e]) for e in val))
    assert restored["loss"] == pytest.approx(nll / sum(len(e.labels) for e in val), rel=1e-4)
    assert log.to_dict()["stop_reason"] == "patience" and log.to_dict()["steps_run"] == log.steps_run


def _writer(examples, drop_end: bool):
    """A forward pass whose greedy text is each example's sentence (less its last character with ``drop_end``)."""
    from closedloop.sdk.bci.charset import N_CLASSES, encode

    texts = iter([e.sentence[:-1] if drop_end else e.sentence for e in examples])

    def forward(x, batch):
        logits = torch.zeros(x.shape[0], x.shape[1], N_CLASSES)
        for k in range(x.shape[0]):
            labels = encode(next(texts))
            assert 2 * len(labels) <= x.shape[1]
            logits[k, 2 * np.arange(len(labels)), labels] = 20.0  # one frame per character, blanks between
            logits[k, 2 * np.arange(len(labels)) + 1, 0] = 20.0
            logits[k, 2 * len(labels):, 0] = 20.0
        return torch.log_softmax(logits, -1)

    return forward


def test_validation_counts_the_sentence_end_marks_and_a_decoder_that_leaves_them_off_is_warned_about(split):
    _, _, val_ex = split
    marked = sum(e.sentence[-1] in "~?" for e in val_ex)
    assert marked >= 3  # the toy sentences end with ~ or ?
    right = validation_scores(torch.nn.Identity(), _writer(val_ex, drop_end=False), val_ex)
    assert right["CER"] == 0 and (right["ends_missed"], right["ends_of"]) == (0, marked)
    assert end_mark_warning(right) is None
    no_end = validation_scores(torch.nn.Identity(), _writer(val_ex, drop_end=True), val_ex)
    assert (no_end["ends_missed"], no_end["ends_of"]) == (marked, marked) and no_end["CER"] > 0
    w = end_mark_warning(no_end)
    assert f"off {marked} of {marked} validation sentences" in w and "--budget 2" in w
    # half or fewer missed is a decoder that has learned the mark; a recording without marks is never warned about
    assert end_mark_warning({"ends_missed": 5, "ends_of": 10}) is None
    assert end_mark_warning({"ends_missed": 6, "ends_of": 10}) is not None
    assert end_mark_warning({"ends_missed": 0, "ends_of": 0}) is None
    # bci-train's warnings: a learned decoder without the mark is warned about; one that has not learned is not
    # (its NOT LEARNED error says more)
    from types import SimpleNamespace

    from closedloop.sdk.bci.recipe import RecipeFit

    log = SimpleNamespace(warning=lambda: None, converged=True)
    fit = RecipeFit(SimpleNamespace(logs={"backbone": log}), [], {}, [], None, {}, {}, no_end, [], 0.0, 0.0, None)
    assert fit.warnings() == [w]
    assert replace(fit, problems=["stage 1 emits no characters"]).warnings() == []
    # not learned and its time budget ended it: "a longer run may help" only where the validation loss still falls;
    # where it rose while training went on (nothing to learn: noise), more steps will not help, and it says so
    def log_of(losses):  # the CER came down at the last evaluation, after sitting at 100%
        cers = [1.0] * (len(losses) - 1) + [0.8]
        return SimpleNamespace(warning=lambda: None, converged=False, stop_reason="time_budget",
                               best_step=20 * len(losses), steps_run=20 * len(losses),
                               validation=[{"step": 20 * (i + 1), "loss": v, "CER": c}
                                           for i, (v, c) in enumerate(zip(losses, cers, strict=True))])

    unlearned = RecipeFit(SimpleNamespace(logs={"backbone": log_of([3.1, 3.2, 3.3, 3.5, 3.6, 3.9])}), [], {}, [],
                          None, {}, {}, no_end, ["stage 1: best validation greedy CER 100.0%"], 0.0, 0.0, None)
    (only,) = unlearned.warnings()
    assert "validation loss rose from 3.100 (step 20) to 3.900 (step 120)" in only and "will not help" in only
    # a loss that falls, or one with early ups and downs that is low again at the end, is still learning
    for losses in ([4.0, 3.8, 3.5, 3.3, 3.0, 2.8], [3.2, 3.0, 3.4, 3.1, 2.9, 2.95], [3.0, 3.3, 3.2]):
        (only,) = replace(unlearned, models=SimpleNamespace(logs={"backbone": log_of(losses)})).warnings()
        # not learned: the warning says so before it says "still improving"
        assert only.startswith("the decoder has NOT LEARNED (below), though stage 1 was still improving when its "
                               "time budget ended it"), losses


def test_a_falling_validation_loss_is_progress_while_the_cer_sits_still():
    # greedy CER on a small validation set can stay put for many evaluations while the network still learns
    counter = PlateauCounter(STARTED_CER, loss_progress=0.01)
    assert counter.update(0.30, 2.0)  # the first evaluation is the best so far: its weights are kept
    for k in range(1, 10):  # the CER sits still, the loss falls 2% an evaluation: no plateau, nothing new to keep
        assert not counter.update(0.30, 2.0 * 0.98 ** k) and counter.stale == 0
    for k in range(1, 4):  # a loss that falls by less than 1% is not progress
        counter.update(0.30, 2.0 * 0.98 ** 9 * 0.995 ** k)
    assert counter.stale == 3
    assert counter.update(0.29, 5.0) and counter.stale == 0  # a lower CER always is, whatever the loss
    cer_only = PlateauCounter(STARTED_CER, loss_progress=None)
    cer_only.update(0.30, 2.0)
    for k in range(1, 10):
        cer_only.update(0.30, 2.0 * 0.98 ** k)
    assert cer_only.stale == 9
    with pytest.raises(ValueError, match="loss_progress=1.5"):
        TrainConfig(loss_progress=1.5)
    unstarted = PlateauCounter(STARTED_CER, loss_progress=None)  # patience waits for a CER below STARTED_CER
    for _ in range(5):
        unstarted.update(0.95, 3.0)
    assert unstarted.stale == 0 and not unstarted.started


def test_the_learning_rate_decays_with_the_steps_or_the_time_whichever_runs_out_first():
    assert cosine_lr(0, 100, 1.0, 0.05) == pytest.approx(1.0)
    assert cosine_lr(50, 100, 1.0, 0.05) == pytest.approx(0.525)  # half-way by steps
    assert cosine_lr(10, 100, 1.0, 0.05, elapsed=0.5) == pytest.approx(0.525)  # half-way by time
    assert cosine_lr(90, 100, 1.0, 0.05, elapsed=0.5) == pytest.approx(cosine_lr(90, 100, 1.0, 0.05))
    assert cosine_lr(10, 100, 1.0, 0.05, elapsed=2.0) == pytest.approx(0.05)  # past the budget: the floor


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
    row = {"step": 10, "CER": 0.5, "WER": 0.8, "chars": 12, "loss": 1.25}
    log = io.StringIO()
    stage = Progress(stream=log, interval_s=0.0).stage("stage 1", 100)
    stage.step(1, 3.0)  # interval 0: a line every step
    stage.validated(10, row, row)
    stage.close()
    lines = log.getvalue().splitlines()
    assert lines[0].startswith("stage 1: step 1/100, loss 3.000") and "left" in lines[0]
    assert "val CER 50.0%" in lines[1] and "val loss 1.250" in lines[1] and "best 50.0%@10" in lines[1]
    slow = io.StringIO()
    stage = Progress(stream=slow).stage("s", 100)  # 10 s between lines, but every evaluation gets one
    for k in range(1, 5):
        stage.step(k, 1.0)
    stage.validated(4, row, row)
    stage.close()
    assert len(slow.getvalue().splitlines()) == 1
    blocked = io.StringIO()  # one step longer than the interval (the first compiles kernels): the clock still writes
    stage = Progress(stream=blocked, interval_s=0.2).stage("s", 100)
    time.sleep(0.7)
    stage.close()
    n = len(blocked.getvalue().splitlines())
    assert 1 <= n <= 4 and blocked.getvalue().startswith("s: step 0/100")
    time.sleep(0.3)
    assert len(blocked.getvalue().splitlines()) == n  # closed: no more lines
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


# --- bci-train and calibrate from the shell -----------------------------------------------------------------------

DATES = ("2022-05-18", "2022-06-22", "2023-02-28", "2023-04-17", "2023-10-09")
CALIB = CalibrationConfig(steps=4, tune=False, device="cpu")


@pytest.fixture(scope="module")
def nwb_sessions():
    pytest.importorskip("pynwb")
    ss = toy_recording(n_channels=8, n_held_in=3, n_held_out=2, n_trials=8, seed=1)
    for s, d in zip(ss, DATES, strict=True):
        s.name, s.meta["date"] = d.replace("-", "."), d
        for t in s.trials:  # NWB holds integer counts
            t.spikes = t.spikes.astype(np.uint8)
    return ss


@pytest.fixture(scope="module")
def data(nwb_sessions, tmp_path_factory):
    folder = tmp_path_factory.mktemp("nwb") / "data"
    write_falcon_h2_dir(nwb_sessions, folder)
    return folder


def _tiny_harness(path, steps=6):
    HarnessConfig(train=TrainConfig(backbone=BackboneConfig(16, 1, 0.0), steps=steps, batch_size=4, lr=1e-2),
                  meta=MetaConfig(inner_steps=2, n_query=2, tasks_per_step=2, meta_steps=2),
                  calibration=CALIB, progress=False).save(path)
    return path


@pytest.fixture(scope="module")
def trained_bundle(data, tmp_path_factory):
    """bci-train --json --allow-unlearned on the toy folder: (exit code, summary, stderr, bundle path)."""
    tmp = tmp_path_factory.mktemp("train")
    cfg = _tiny_harness(tmp / "h.json")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["bci-train", str(data), "--config", str(cfg), "--device", "cpu", "--eval-every", "2",
                     "--out", str(tmp / "pooled"), "--json", "--allow-unlearned"])
    return code, json.loads(out.getvalue()), err.getvalue(), tmp / "pooled"


def test_bci_train_json_summary_progress_lines_and_curve(trained_bundle):
    code, summary, err, bundle = trained_bundle
    assert code == 0  # --allow-unlearned: exit 0 although 6 steps learn nothing
    assert "stage 1: pooled backbone: step 2/6" in err  # not a terminal: plain progress lines on stderr
    assert "held-in)" in err and "nothing names their split" not in err  # every file's name gives its split
    assert "NOT LEARNED: stage 1 (pooled backbone)" in err and "above the 40% threshold" in err
    assert summary["learned"] is False and summary["problems"] and summary["threshold_CER"] == 0.4
    s1 = summary["stage1"]
    assert s1["ceiling"] == 6 and 1 <= s1["steps_run"] <= 6 and s1["stop_reason"] in ("ceiling", "patience")
    assert [v["step"] for v in s1["validation"]] == [2, 4, 6][:len(s1["validation"])]
    assert s1["best_val_CER"] == min(v["CER"] for v in s1["validation"])
    assert summary["model"] == {"n_hidden": 16, "n_layers": 1, "scaled": True}  # --config's backbone is kept
    assert summary["validation"]["trials"] == sum(summary["validation"]["per_session"].values()) >= 3
    assert summary["stage2"]["steps"] == 2 and 0 <= summary["stage2"]["val_CER"]
    ends = summary["stage2"]["val_end_marks"]  # 6 steps write no end mark; NOT LEARNED says it, not a warning too
    assert ends["of"] >= 3 and ends["missed"] == ends["of"]
    assert "sentence-end mark" not in err and not any("sentence-end mark" in w for w in summary["warnings"])
    curve = bundle.parent / "pooled.curve.png"
    assert summary["curve"] == str(curve) and curve.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert load_bundle(bundle).manifest.provenance["validation"]["fraction"] == 0.1
    # the verdict travels with the bundle: inspect shows it, and a live session says it before it runs
    from closedloop.runtime import Session, SessionConfig
    from closedloop.sdk.inspect_bundle import inspect_bundle

    text, ok = inspect_bundle(str(bundle))
    assert ok and "NOT LEARNED: the training that wrote it ended without learning" in text
    said = io.StringIO()
    Session(bundle, SessionConfig(device="sim://headstage", status=False), out=said)
    assert "was written NOT LEARNED by its training" in said.getvalue()


def test_bci_train_that_has_not_learned_exits_1_and_quiet_shows_only_the_error(data, tmp_path, capsys):
    cfg = _tiny_harness(tmp_path / "h.json", steps=2)
    assert main(["-q", "bci-train", str(data), "--config", str(cfg), "--device", "cpu",
                 "--out", str(tmp_path / "a")]) == 1
    out, err = capsys.readouterr()
    assert "pooled backbone: step" not in err and "validation:" not in err  # no progress with -q
    assert "NOT LEARNED" in err and "--allow-unlearned" in err  # errors still show, with what to do
    assert main(["bci-train", str(data), "--config", str(cfg), "--out", str(tmp_path / "b"), "--steps", "0"]) == 2
    assert "--steps 0" in capsys.readouterr().err
    assert main(["bci-train", str(data), "--config", str(cfg), "--out", str(tmp_path / "c"), "--budget", "0"]) == 2
    assert "budget 0" in capsys.readouterr().err


def test_bci_train_budget_multiplies_the_ceiling_and_the_patience(data, tmp_path, capsys):
    cfg = _tiny_harness(tmp_path / "h.json", steps=2)
    assert main(["bci-train", str(data), "--config", str(cfg), "--device", "cpu", "--out", str(tmp_path / "a"),
                 "--json", "--allow-unlearned", "--budget", "2"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["budget"] == 2 and summary["stage1"]["ceiling"] == 4 and summary["stage1"]["patience"] == 12
    assert summary["time_budget_s"] == 3600
    # the patience's floor in steps (evaluations every 10 steps here): 200 steps are 20 evaluations, not doubled
    assert main(["bci-train", str(data), "--config", str(cfg), "--device", "cpu", "--out", str(tmp_path / "b"),
                 "--json", "--allow-unlearned", "--budget", "2", "--min-patience-steps", "200"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["stage1"]["eval_every"], summary["stage1"]["patience"]) == (10, 20)


@pytest.fixture(scope="module")
def held_out_file(data):
    return next(p for p in sorted(data.rglob("*.nwb")) if "held-out" in p.name or "held_out" in p.name)


def test_calibrate_reports_greedy_cer_before_and_after(trained_bundle, held_out_file, tmp_path):
    bundle = trained_bundle[3]
    r = calibrate_bundle(bundle, held_out_file, n_sentences=3, out=tmp_path / "c", report=lambda s: None)
    assert r.scored_on == "held_out" and r.scored_trials and not set(r.scored_trials) & set(r.trials)
    assert r.cer_given >= 0 and r.cer_after >= 0
    assert (f"before (the given bundle's alignment with this session's normalisation from the calibration "
            f"sentences: not the bundle uncalibrated as a live session runs it) {r.cer_given:.1%}, after "
            f"{r.cer_after:.1%}") in r.format() and "(not fitted)" in r.format()
    assert (r.warning is not None) == (r.cer_after > r.cer_given)
    n = len(load_falcon_h2(held_out_file, n_calibration=100).calibration)
    fitted = calibrate_bundle(bundle, held_out_file, n_sentences=n, out=tmp_path / "all", report=lambda s: None)
    assert fitted.scored_on == "fitted" and fitted.scored_trials == fitted.trials
    assert "the fitted trials" in fitted.format()


def test_calibration_that_makes_it_worse_is_warned_about(trained_bundle, held_out_file, tmp_path, monkeypatch):
    from closedloop.sdk.bci import train

    real, calls = train.validation_scores, []

    def worse_after(module, forward, examples, device="cpu"):  # the second scoring is the calibrated decoder's
        row = real(module, forward, examples, device)
        calls.append(row)
        return row if len(calls) == 1 else {**row, "CER": calls[0]["CER"] + 0.5}

    monkeypatch.setattr(train, "validation_scores", worse_after)
    lines = []
    r = calibrate_bundle(trained_bundle[3], held_out_file, n_sentences=3, out=tmp_path / "w", report=lines.append)
    assert r.cer_after == pytest.approx(r.cer_given + 0.5)
    assert r.warning and "made the greedy CER worse" in r.warning
    assert re.search(r"on \d+ (held-out calibration|fitted) trials: \d+ -> \d+ character errors of \d+", r.warning)
    assert any(line.startswith("warning: calibration made the greedy CER worse") for line in lines)
    assert "warning: calibration made" in r.format()


def test_a_larger_budget_multiplies_the_ceiling_the_time_budget_and_the_patience(sessions):
    from closedloop.sdk.bci.recipe import fit_recipe

    harness = HarnessConfig(train=replace(TINY, steps=5, patience=2), calibration=CALIB, progress=False,
                            meta=MetaConfig(inner_steps=1, n_query=1, tasks_per_step=1, meta_steps=1, progress=False))
    one = fit_recipe(sessions, harness, recipe=Recipe(scale=False, patience=2, time_budget_s=60, eval_every=0),
                     progress=Progress(quiet=True))
    four = fit_recipe(sessions, harness, recipe=Recipe(scale=False, patience=2, time_budget_s=60, budget=4),
                      progress=Progress(quiet=True))
    assert (one.harness.train.steps, four.harness.train.steps) == (5, 20)
    assert (one.harness.train.patience, four.harness.train.patience) == (2, 8)
    assert one.harness.train.eval_every == four.harness.train.eval_every == 10  # the same validation spacing
    assert four.summary(Recipe(budget=4, time_budget_s=60))["time_budget_s"] == 240
    assert four.models.logs["backbone"].steps_run == 20 and one.models.logs["backbone"].steps_run == 5
    with pytest.raises(ValueError, match="budget 0"):
        Recipe(budget=0)


def test_the_patience_has_a_floor_in_steps_that_the_budget_does_not_multiply(sessions):
    from closedloop.sdk.bci.recipe import plan_recipe

    harness = HarnessConfig(train=replace(TINY, steps=400), calibration=CALIB, progress=False)

    def patience(**settings) -> int:
        plan = plan_recipe(sessions, harness, Recipe(scale=False, patience=2, eval_every=10, **settings))
        assert plan.harness.train.patience == plan.patience  # what stage 1 (and a baseline) counts
        return plan.patience

    assert patience() == 2  # no floor: 2 evaluations, 20 steps
    assert patience(min_patience_steps=55) == 6  # evaluations 10 steps apart: 6 cover the 55-step floor
    assert patience(min_patience_steps=15) == 2  # a floor below the patience changes nothing
    assert patience(min_patience_steps=55, budget=4) == 8  # 4x the evaluations; the floor is not multiplied
    assert patience(min_patience_steps=200, budget=4) == 20
    with pytest.raises(ValueError, match="min_patience_steps -1"):
        Recipe(min_patience_steps=-1)


def test_both_stages_report_progress_and_the_baseline_plan_matches_the_recipes(sessions):
    from closedloop.sdk.bci.recipe import fit_recipe, plan_recipe

    harness = HarnessConfig(train=replace(TINY, steps=4, patience=2), calibration=CALIB, progress=False,
                            meta=MetaConfig(inner_steps=1, n_query=1, tasks_per_step=1, meta_steps=3, progress=False))
    log = io.StringIO()
    recipe = Recipe(scale=False, patience=2, time_budget_s=60)
    fit = fit_recipe(sessions, harness, recipe=recipe, progress=Progress(stream=log, interval_s=0.0))
    lines = log.getvalue().splitlines()
    # stage 2 takes minutes at full size: it reports its meta-steps too, not only its start and end
    assert any(line.startswith("stage 1: pooled backbone: step 1/4") for line in lines)
    assert [line.split(",")[0] for line in lines if line.startswith("stage 2: meta-learning: step")] == [
        "stage 2: meta-learning: step 1/3", "stage 2: meta-learning: step 2/3", "stage 2: meta-learning: step 3/3"]
    plan = plan_recipe(sessions, harness, recipe)
    assert plan.validation == fit.validation and plan.harness.train == fit.harness.train
    assert [s.name for s in plan.train_sessions] == [s.name for s in fit.train_sessions]
    assert plan.deadline == pytest.approx(plan.t0 + 60)


def test_the_time_budget_covers_both_stages(sessions):
    """Stage 1 stops at its share of the budget and stage 2 at the budget's end: a user's --time-budget is the
    training's length, not stage 1's alone."""
    from closedloop.sdk.bci.recipe import fit_recipe, still_improving

    harness = HarnessConfig(train=replace(TINY, steps=100_000, patience=1000), calibration=CALIB, progress=False,
                            meta=MetaConfig(inner_steps=1, n_query=1, tasks_per_step=1, meta_steps=100_000,
                                            progress=False))
    budget = 4.0
    fit = fit_recipe(sessions, harness, recipe=Recipe(scale=False, patience=1000, time_budget_s=budget),
                     progress=Progress(quiet=True))
    log, meta_log = fit.models.logs["backbone"], fit.models.logs["meta"]
    assert log.stop_reason == "time_budget" and meta_log.stop_reason == "time_budget"
    assert 1 <= len(meta_log.loss) < 100_000
    # stage 1 ended near 90% of the budget (its last step and validation pass late), stage 2 used the rest
    assert log.wall_s < 0.9 * budget + 1.5
    assert fit.wall_s < budget + 3.0  # the budget, plus the last step and stage 2's validation pass
    summary = fit.summary(Recipe(time_budget_s=budget))
    assert summary["stage2"]["stop_reason"] == "time_budget"
    # the learning rate decayed with the time used, not with the far ceiling's steps: a run stopped by its budget
    # ends annealed (lr * lr_final_fraction at the end of stage 1's share)
    assert log.final_lr == summary["stage1"]["final_lr"] < 0.15 * TINY.lr
    # stopped by its budget with patience far from met (whether it was still improving: the test below)
    assert log.converged is False and summary["stage1"]["still_improving"] == still_improving(log)
    with pytest.raises(ValueError, match="stage2_share"):
        Recipe(stage2_share=1.0)


def test_a_run_is_still_improving_only_if_it_improved_on_its_first_evaluation():
    """A run stopped by its budget or ceiling before its patience ran out is "still improving" (a longer run may fit
    better) only where its best evaluation came after its first: one whose first evaluation stayed its best (942%
    CER at step 1, the best of a run that never learned) is not, and no warning says a longer run may help."""
    from closedloop.sdk.bci.recipe import still_improving
    from closedloop.sdk.bci.train import TrainingLog

    rows = [{"step": s, "CER": c} for s, c in ((50, 0.9), (100, 0.6), (150, 0.4))]
    assert still_improving(TrainingLog(validation=rows, best_step=150, converged=False, stop_reason="time_budget"))
    flat = [rows[0], {"step": 100, "CER": 0.95}, {"step": 150, "CER": 0.93}]
    assert not still_improving(TrainingLog(validation=flat, best_step=50, converged=False, stop_reason="ceiling"))
    assert not still_improving(TrainingLog(validation=rows[:1], best_step=50, converged=False))  # one evaluation
    assert not still_improving(TrainingLog(validation=rows, best_step=150, converged=True))  # patience met


def test_a_restart_cut_off_by_the_time_budget_is_what_stop_reason_says(split, monkeypatch):
    """The first run fails the plateau check (no validation CER below 75% by its check step) and restarts; the time
    budget ends the restart at once. The run kept is the first (its CER is lower), but what ended the training is the
    time budget: stop_reason says so, and run_stop_reason says the plateau-restart rule ended the run kept (it used to
    say "ceiling", a limit neither run reached)."""
    from types import SimpleNamespace

    from closedloop.sdk.bci import train as train_mod
    from closedloop.sdk.bci.recipe import still_improving, stop_text

    train, _, val_ex = split
    real, jump = time.perf_counter, [0.0]
    monkeypatch.setattr(train_mod.time, "perf_counter", lambda: real() + jump[0])
    monkeypatch.setattr(train_mod, "validation_scores", lambda *a, **k: {  # never learns; the restart scores worse
        "CER": 0.99 if jump[0] else 0.9, "WER": 1.0, "chars": 3, "loss": 3.0, "ends_missed": 0, "ends_of": 0})

    def restart(attempt, seed, why):
        jump[0] = 1e6  # the budget runs out as the restart begins

    progress = SimpleNamespace(step=lambda *a: None, validated=lambda *a: None, restart=restart)
    config = replace(TINY, steps=400, plateau_steps=100, eval_every=20, max_restarts=1, patience=6)
    _, log = train_backbone(train, config, val_ex, progress, deadline=real() + 3600)
    assert log.seed == 0 and log.steps_run == 100 and [r["seed"] for r in log.restarts] == [1000]
    assert (log.stop_reason, log.run_stop_reason) == ("time_budget", "plateau_restart")
    assert log.to_dict()["run_stop_reason"] == "plateau_restart"
    assert not still_improving(log)
    text = stop_text(log.stop_reason, log.run_stop_reason, log.restarts)
    assert text.startswith("stopped by the time budget in its last restart from seed 1000 (not kept); the run kept")
    assert "ended by the plateau-restart rule" in text
    assert stop_text("ceiling", "ceiling", []) == "stopped by the step ceiling"


def test_a_run_whose_cer_sat_still_after_an_early_best_is_not_still_improving():
    """The outside report: best validation CER 92.9% at step 20 of 60, flat after; no "still improving" for it."""
    from closedloop.sdk.bci.recipe import still_improving
    from closedloop.sdk.bci.train import TrainingLog

    flat = [{"step": s, "CER": c} for s, c in ((10, 0.95), (20, 0.929), (30, 0.93), (40, 0.93), (50, 0.93), (60, 0.93))]
    assert not still_improving(TrainingLog(validation=flat, best_step=20, converged=False, stop_reason="time_budget"))
    # best at the last evaluation but by a hair (under a percentage point): not coming down meaningfully
    hair = flat[:5] + [{"step": 60, "CER": 0.925}]
    assert not still_improving(TrainingLog(validation=hair, best_step=60, converged=False, stop_reason="ceiling"))
    falling = flat[:5] + [{"step": 60, "CER": 0.80}]
    assert still_improving(TrainingLog(validation=falling, best_step=60, converged=False, stop_reason="ceiling"))


def test_the_bar_shows_on_a_terminal_that_reports_no_size(monkeypatch):
    """A pseudo-terminal under `script` reports 0 x 0: tqdm then drew nothing; the bar gets a fixed size instead."""
    import os

    monkeypatch.setattr(os, "get_terminal_size", lambda fd: os.terminal_size((0, 0)))

    class Tty(io.StringIO):
        def isatty(self):
            return True

        def fileno(self):
            return 2

    out = Tty()
    stage = Progress(stream=out).stage("stage 1", 10)
    for k in range(1, 11):
        stage.step(k, 2.0)
    stage.close()
    assert "stage 1" in out.getvalue() and "10/10" in out.getvalue()


@pytest.mark.parametrize("field, value, said", [("budget", float("inf"), "budget inf"),
                                                ("time_budget_s", float("nan"), "time budget nan"),
                                                ("eval_every", -5, "eval_every -5"),
                                                ("unlearned_cer", float("nan"), "unlearned_cer nan")])
def test_recipe_settings_that_cannot_mean_anything_are_refused(field, value, said):
    """--budget inf ended bci-train in an OverflowError (exit 70); a NaN budget printed 'time budget ?' and ran."""
    from closedloop.sdk.bci.recipe import Recipe

    with pytest.raises(ValueError, match=said):
        Recipe(**{field: value})
