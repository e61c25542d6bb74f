"""Stage 1 learns, stage 2 meta-learns step sizes, calibration touches only the alignment layer."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from closedloop.sdk.bci.augment import DriftAugmentation, time_mask
from closedloop.sdk.bci.baselines import mean_calibration_loss
from closedloop.sdk.bci.calibrate import CalibrationConfig, calibrate_session, trials_to_examples
from closedloop.sdk.bci.data import Normalization, session_normalization
from closedloop.sdk.bci.meta import MetaConfig, meta_train_alignment
from closedloop.sdk.bci.models import AffineAlignment, AlignedDecoder, alignment_params, compose_alignment
from closedloop.sdk.bci.toy import toy_recording
from closedloop.sdk.bci.train import BackboneConfig, TrainConfig, train_backbone

TINY_TRAIN = TrainConfig(backbone=BackboneConfig(16, 1, 0.0), steps=60, batch_size=4, lr=1e-2, device="cpu",
                         progress=False)
TINY_META = MetaConfig(inner_steps=2, n_query=2, tasks_per_step=2, meta_steps=6, device="cpu", progress=False)


@pytest.fixture(scope="module")
def sessions():
    return toy_recording(n_channels=8, n_held_in=3, n_held_out=2, n_trials=8, seed=1)


@pytest.fixture(scope="module")
def trained(sessions):
    torch.set_num_threads(1)
    return train_backbone(sessions, TINY_TRAIN)


def test_stage1_reduces_ctc_loss(trained):
    backbone, log = trained
    assert len(log.loss) == TINY_TRAIN.steps and log.wall_s > 0 and log.device == "cpu"
    assert np.mean(log.loss[-10:]) < 0.7 * np.mean(log.loss[:10])
    assert not backbone.training


def test_training_is_reproducible_from_its_seed(sessions):
    cfg = TrainConfig.from_json(TINY_TRAIN.to_json())
    cfg.steps = 5
    a, la = train_backbone(sessions, cfg)
    b, lb = train_backbone(sessions, cfg)
    assert la.loss == lb.loss
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_config_json_round_trip_keeps_nested_dataclasses():
    cfg = MetaConfig(drift=DriftAugmentation(mixing_std=0.7), inner_steps=3)
    back = MetaConfig.from_json(cfg.to_json())
    assert back == cfg and isinstance(back.drift, DriftAugmentation)
    with pytest.raises(ValueError, match="unknown field"):
        TrainConfig.from_dict({"stepz": 3})


def test_session_layer_and_reference_decoders_train_with_their_own_recipes_and_survive_json(sessions):

    from closedloop.sdk.bci.baselines import reference_layer
    from closedloop.sdk.bci.evaluate import HarnessConfig, build_lexicon, drift_reference, train_models

    plain = replace(TINY_TRAIN, steps=4, augmentation=DriftAugmentation())
    frozen = replace(TINY_TRAIN, steps=3, lr=5e-3)
    h = HarnessConfig(train=replace(TINY_TRAIN, steps=6), session_train=plain, reference_train=frozen, seed=3,
                      device="cpu", progress=False, beam_width=0).seeded()
    back = HarnessConfig.from_json(h.to_json())
    assert back == h and isinstance(back.session_train, TrainConfig) and back.session_train.seed == 3
    assert isinstance(back.reference_train, TrainConfig) and back.reference_train.seed == 3
    models = train_models(sessions, h, {"backbone", "session_layers", "reference"})
    assert [len(models.logs[k].loss) for k in ("backbone", "session_layers", "reference")] == [6, 4, 3]
    # the drift reference decodes with its own decoder, not the session_layers baseline's
    held_out = next(s for s in sessions if s.split == "held_out")
    assert reference_layer(models, held_out).backbone is models.reference_model.backbone
    assert models.reference_model.backbone is not models.session_model.backbone
    ref = drift_reference(sessions, models, h, build_lexicon(sessions))
    assert set(ref["held_out_zero_shot"]["sessions"]) == {s.name for s in sessions if s.split == "held_out"}
    # unset: session_layers uses stage 1's recipe, the reference session_layers', and they share one decoder
    unset = HarnessConfig(train=replace(TINY_TRAIN, steps=5), device="cpu", progress=False).seeded()
    assert unset.session_train is None and unset.session_recipe() is unset.train
    assert unset.reference_recipe() is unset.train and not unset.reference_is_separate()
    assert HarnessConfig.from_json(unset.to_json()).reference_train is None
    shared = train_models(sessions, unset, {"reference"})
    assert shared.reference_model is None and len(shared.logs["session_layers"].loss) == 5
    assert reference_layer(shared, held_out).backbone is shared.session_model.backbone


def test_meta_learning_runs_and_learns_step_sizes_without_touching_the_backbone(sessions, trained):
    backbone, _ = trained
    before = [p.detach().clone() for p in backbone.parameters()]
    meta, log = meta_train_alignment(backbone, sessions, TINY_META)
    assert len(log.loss) == TINY_META.meta_steps and np.all(np.isfinite(log.loss))
    alpha = meta.step_sizes()
    aw, ab = alpha["weight"], alpha["bias"]
    assert aw.shape == (8, 8) and ab.shape == (8,)
    assert torch.all(aw > 0) and not torch.allclose(aw, torch.full_like(aw, TINY_META.init_step_size))
    assert all(torch.equal(p, q) for p, q in zip(before, backbone.parameters(), strict=True))
    assert all(p.requires_grad for p in backbone.parameters())  # restored after freezing


def test_second_order_meta_learning_runs(sessions, trained):
    backbone, _ = trained
    cfg = MetaConfig.from_dict({**TINY_META.to_dict(), "second_order": True, "meta_steps": 2})
    meta, log = meta_train_alignment(backbone, sessions, cfg)
    assert len(log.loss) == 2 and np.all(np.isfinite(log.loss))


@pytest.mark.parametrize("optimizer", ["adam", "meta"])
def test_calibration_fits_only_the_alignment_backbone_bit_identical(sessions, trained, optimizer):
    backbone, _ = trained
    meta = meta_train_alignment(backbone, sessions, TINY_META)[0] if optimizer == "meta" else None
    held_out = [s for s in sessions if s.split == "held_out"][0]
    calib = [held_out.trials[i] for i in held_out.calibration]
    start = AlignedDecoder(meta.new_alignment() if meta else AffineAlignment(8), backbone)
    before = {k: v.detach().clone() for k, v in backbone.state_dict().items()}
    start_align = [p.detach().clone() for p in start.alignment.parameters()]
    cfg = CalibrationConfig(optimizer=optimizer, steps=6, eval_every=2, device="cpu")
    res = calibrate_session(start, calib, cfg, meta=meta)
    after = backbone.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert res.model.backbone is backbone
    assert all(torch.equal(p, q) for p, q in zip(start_align, start.alignment.parameters(), strict=True))
    assert res.chosen["optimizer"] == optimizer and 0 <= res.chosen["steps"] <= (6 if optimizer == "adam" else 4)
    assert res.validation["mean_loss"]  # leave-one-sentence-out curves were recorded
    # untuned, a fixed number of steps always moves the layer
    fixed = calibrate_session(start, calib, CalibrationConfig(optimizer=optimizer, steps=3, tune=False,
                                                              meta_max_steps=3, device="cpu"), meta=meta)
    assert not torch.equal(fixed.model.alignment.weight, start.alignment.weight)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # normalisation came from the three calibration sentences only
    ref = Normalization.from_trials(calib)
    np.testing.assert_array_equal(res.normalization.mean, ref.mean)


def test_lowrank_alignment_starts_at_identity_and_its_fit_is_a_plain_affine_map(sessions, trained):
    p = alignment_params("lowrank", 8, 3, seed=4)
    w, b = compose_alignment(p)
    assert torch.equal(w, torch.eye(8)) and torch.equal(b, torch.zeros(8)) and p["u"].shape == (8, 3)
    torch.testing.assert_close(p["v"] @ p["v"].T, torch.eye(3), atol=1e-5, rtol=0)  # orthonormal directions
    with pytest.raises(ValueError, match="rank"):
        alignment_params("lowrank", 8, 0)
    with pytest.raises(ValueError, match="not one of"):
        MetaConfig(form="diagonal")
    # Adam on (g, b, U, V): the result is diag(g) + U V, it left identity and lowered the calibration loss
    backbone, _ = trained
    held_out = [s for s in sessions if s.split == "held_out"][0]
    calib = [held_out.trials[i] for i in held_out.calibration]
    start = AlignedDecoder(AffineAlignment(8), backbone)
    cfg = CalibrationConfig(steps=20, lr=3e-2, tune=False, device="cpu")
    res = calibrate_session(start, calib, cfg, start=p)
    ex = trials_to_examples(calib, res.normalization)
    loss = [mean_calibration_loss(m, ex, torch.device("cpu")) for m in (start, res.model)]
    assert loss[1] < loss[0] and not torch.equal(res.model.alignment.weight, torch.eye(8))
    # off the diagonal the map is U V, of rank 3: its off-diagonal 4 x 4 block is singular
    sv = torch.linalg.svdvals(res.model.alignment.weight.detach()[:4, 4:])
    assert sv[0] > 1e-3 and sv[3] < 1e-5 * sv[0]


def test_held_out_normalisation_uses_only_calibration_trials(sessions):
    s = [s for s in sessions if s.split == "held_out"][0]
    norm = session_normalization(s)
    x = np.concatenate([s.trials[i].spikes for i in s.calibration])
    np.testing.assert_allclose(norm.mean, x.mean(0), rtol=1e-6)
    assert np.all(norm.std >= 0.3 - 1e-7)


def test_drift_augmentation_per_batch_shares_one_drift_and_time_mask_zeroes_a_span():
    g = torch.Generator().manual_seed(0)
    x = torch.ones(2, 6, 4)
    y = DriftAugmentation(gain_std=0.5, offset_std=0.5)(x, g, per="batch")
    torch.testing.assert_close(y[0], y[1])
    z = DriftAugmentation(gain_std=0.5, offset_std=0.5)(x, g, per="trial")
    assert not torch.allclose(z[0], z[1])
    m = time_mask(x, 3, torch.Generator().manual_seed(1))
    assert m.shape == x.shape and set(m.unique().tolist()) <= {0.0, 1.0}



def test_fresh_unit_drift_replaces_channels_with_standardised_mixtures_of_the_population():
    g = torch.Generator().manual_seed(0)
    latent = torch.randn(3, 200, 2, generator=g)  # a 2-d neural state behind 12 channels
    x = latent @ torch.randn(2, 12, generator=g)
    y = DriftAugmentation(fresh_p=0.5)(x, g, per="batch")
    changed = (y != x).any(dim=(0, 1))
    assert 0 < int(changed.sum()) < 12  # some channels got a new unit, the others are untouched
    fresh = y[..., changed].reshape(-1, int(changed.sum()))
    torch.testing.assert_close(fresh.std(0), torch.ones(int(changed.sum())), atol=1e-4, rtol=0)
    # a new unit is tuned to the same neural state: the latent explains it exactly, with a new tuning
    flat = latent.reshape(-1, 2)
    fit = torch.linalg.lstsq(torch.cat([flat, torch.ones(len(flat), 1)], 1), fresh).solution
    resid = fresh - torch.cat([flat, torch.ones(len(flat), 1)], 1) @ fit
    assert float(resid.abs().max()) < 1e-3
    # per trial, two copies of one trial get different new units
    same = x[:1].repeat(2, 1, 1)
    z = DriftAugmentation(fresh_p=0.5)(same, torch.Generator().manual_seed(1), per="trial")
    assert not torch.allclose(z[0], z[1])

def test_twice_differentiable_ctc_matches_torch():
    import torch.nn.functional as F

    from closedloop.sdk.bci.ctc import ctc_nll

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 12, 32, generator=g).requires_grad_()
    logp = logits.log_softmax(-1)
    targets = torch.tensor([3, 3, 5, 7, 1, 2, 2, 2, 9])  # repeats need a blank between them
    tl, il = torch.tensor([3, 2, 4]), torch.tensor([12, 9, 11])
    ref = F.ctc_loss(logits.log_softmax(-1).transpose(0, 1), targets, il, tl, reduction="none")
    ours = ctc_nll(logp, targets, il, tl)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-5)
    # torch's CTC gradient is only right through the log-softmax, so compare gradients of the logits
    (g1,) = torch.autograd.grad(ours.sum(), logits, create_graph=True)
    (g_ref,) = torch.autograd.grad(ref.sum(), logits)
    torch.testing.assert_close(g1, g_ref, atol=1e-4, rtol=1e-4)
    (g2,) = torch.autograd.grad((g1 * torch.randn_like(g1)).sum(), logits)  # a second derivative exists
    assert torch.isfinite(g2).all()


def test_override_replaces_a_nested_setting_by_its_dotted_path_and_refuses_unknown_names():
    from closedloop.common.config import override
    from closedloop.sdk.bci.evaluate import HarnessConfig

    h = HarnessConfig()
    h2 = override(override(h, "meta.drift.fresh_p=0.1"), "calibration.tune=false")
    assert h2.meta.drift.fresh_p == 0.1 and h2.calibration.tune is False and h.meta.drift.fresh_p == 0.0
    assert override(h, "device=cpu").device == "cpu" and override(h, "train.steps=7").train.steps == 7
    with pytest.raises(ValueError, match="no setting 'fresh' in DriftAugmentation"):
        override(h, "meta.drift.fresh=0.1")
    with pytest.raises(ValueError, match="SECTION.FIELD=VALUE"):
        override(h, "meta.inner_steps")


def test_plateau_check_reads_the_loss_curve():
    from closedloop.sdk.bci.train import on_plateau

    flat = [20.0] * 10 + [3.0] * 190
    falling = [20.0] * 10 + list(np.linspace(3.0, 0.5, 190))
    assert on_plateau(flat, 200, 0.8) and not on_plateau(falling, 200, 0.8)
    assert not on_plateau(flat[:150], 200, 0.8)  # too short to judge
    assert not on_plateau(flat, 0, 0.8)  # off
    assert not on_plateau(flat + [0.5] * 50, 200, 0.8, at=250)  # left it later


def test_with_validation_the_restart_kept_is_the_run_with_the_best_validation_cer(monkeypatch):
    """A restart can end worse than the run it replaced (a first run at 75.0% validation CER, just not below the
    started threshold, then 81.2%): the better run is kept, and the warning says what the restarts were about."""
    import closedloop.sdk.bci.train as train
    from closedloop.sdk.bci.train import TrainingLog, fit_ctc_restarting

    cers = iter([0.75, 0.812])

    def fake_fit(module, forward, examples, config, what, scales, seed, stop_on_plateau, validation, progress,
                 deadline):
        cer = next(cers)
        return TrainingLog(what=what, seed=seed, loss=[3.0, 0.43], wall_s=10.0, on_plateau=True, best_step=2,
                           validation=[{"step": 2, "CER": cer, "WER": 1.0, "chars": 40}])

    monkeypatch.setattr(train, "fit_ctc", fake_fit)
    built = []
    config = TrainConfig(backbone=BackboneConfig(16, 1, 0.0), steps=10, max_restarts=1, seed=3, progress=False)
    module, log = fit_ctc_restarting(lambda: (built.append(torch.nn.Linear(1, 1)) or built[-1], None, None), [],
                                     config, "stage 1: pooled backbone", validation=["v"])
    assert module is built[0] and log.seed == 3 and log.best()["CER"] == 0.75
    assert [r["seed"] for r in log.restarts] == [1003]
    assert "validation greedy CER never came below 75%" in log.warning()  # every restart used, still on it
    log.on_plateau = False  # the message of a run that left the plateau after restarts
    assert ("restarted 1 time(s) because no validation greedy CER had come below 75% after 2 steps (10 s in the "
            "other run(s)); kept seed 3, the run with the best validation CER (75.0%)") in log.warning()
    # bci-train's summary and closing text count the run not kept, its time too
    from closedloop.sdk.bci.recipe import RecipeResult, _other_run

    other = [_other_run(r) for r in log.restarts]
    assert other == [{"seed": 1003, "steps": 2, "wall_s": 10.0, "best_val_CER": 0.812}]
    s1 = {"steps_run": 2, "ceiling": 10, "stop_reason": "plateau", "best_val_CER": 0.75, "best_val_WER": 1.0,
          "best_step": 2, "wall_s": 10.0, "other_runs": other, "other_runs_wall_s": 10.0}
    text = RecipeResult("b", "c", {"stage1": s1, "stage2": {"steps": 0, "val_CER": None, "val_WER": None, "wall_s": 0},
                                   "model": {"n_hidden": 16, "n_layers": 1}, "validation": {"trials": 3},
                                   "wall_s": 20.0}).format()
    assert "(and 10s in 1 other run(s), not kept: seed 1003, 2 steps, best validation CER 81.2%)" in text


def test_a_run_stuck_on_the_ctc_plateau_restarts_from_new_seeds_and_says_so(sessions):
    # every channel silenced: nothing to learn from the input, so the loss can only sit on the plateau
    blind = TrainConfig(backbone=BackboneConfig(16, 1, 0.0), steps=110, batch_size=4, lr=1e-2, device="cpu",
                        progress=False, augmentation=DriftAugmentation(dropout_p=1.0), plateau_steps=100,
                        max_restarts=1, seed=3)
    _, log = train_backbone(sessions, blind)
    assert [r["seed"] for r in log.restarts] == [3] and len(log.restarts[0]["loss"]) == 100
    assert log.seed == 1003 and len(log.loss) == 110 and log.on_plateau
    assert "never left the CTC plateau" in log.warning()
    _, once = train_backbone(sessions, replace(blind, max_restarts=0))
    assert once.restarts == [] and once.seed == 3 and once.on_plateau  # no restart left: flagged, kept
    assert once.loss[:100] == log.restarts[0]["loss"]  # the abandoned run is the configured one
    with pytest.raises(ValueError, match="plateau_steps"):
        replace(blind, plateau_steps=50)
