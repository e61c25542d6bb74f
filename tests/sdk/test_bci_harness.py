"""Every method runs end-to-end through the one harness on tiny data; seeds aggregate into table, JSON and plot."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from closedloop.sdk.bci.baselines import METHODS, nearest_session_layer
from closedloop.sdk.bci.calibrate import CalibrationConfig
from closedloop.sdk.bci.evaluate import (
    DEFAULT_METHODS,
    HarnessConfig,
    build_lexicon,
    run_harness,
    train_models,
)
from closedloop.sdk.bci.meta import MetaConfig
from closedloop.sdk.bci.report import markdown_table, summarize, write_results
from closedloop.sdk.bci.toy import toy_recording
from closedloop.sdk.bci.train import BackboneConfig, TrainConfig

pytestmark = pytest.mark.uses_ray  # its benchmark runs start a local Ray instance (tests/conftest.py)


def tiny_harness(seed: int = 0, **kw) -> HarnessConfig:
    return HarnessConfig(
        train=TrainConfig(backbone=BackboneConfig(16, 1, 0.0), steps=30, batch_size=4, lr=1e-2),
        meta=MetaConfig(inner_steps=2, n_query=2, tasks_per_step=2, meta_steps=4),
        calibration=CalibrationConfig(steps=4, eval_every=2, folds=2),
        beam_width=4, seed=seed, device="cpu", progress=False, **kw,
    )


@pytest.fixture(scope="module")
def sessions():
    return toy_recording(n_channels=8, n_held_in=3, n_held_out=2, n_trials=8, seed=2)


@pytest.fixture(scope="module")
def runs(sessions):
    torch.set_num_threads(1)
    return [run_harness(sessions, tiny_harness(seed)) for seed in (0, 1)]


def test_every_registered_method_is_in_the_default_harness():
    assert set(DEFAULT_METHODS) == set(METHODS)


def test_every_method_returns_per_session_metrics_for_every_decoder(runs, sessions):
    held_out = [s.name for s in sessions if s.split == "held_out"]
    r = runs[0]
    assert set(r["methods"]) == set(DEFAULT_METHODS)
    for name, m in r["methods"].items():
        assert set(m["sessions"]) == set(held_out), name
        for s in held_out:
            for dec in ("greedy", "greedy_end", "beam"):
                score = m["sessions"][s][dec]
                assert 0 <= score["CER"] and 0 <= score["WER"] and score["n_trials"] == 3
            texts = m["sessions"][s]["texts"]
            # end-of-trial completion adds at most one character to what greedy decoding gives
            for g, ge in zip(texts["greedy"], texts["greedy_end"], strict=True):
                assert ge.startswith(g) and len(ge) - len(g) <= 1
        assert set(m["mean"]) == {"greedy", "greedy_end", "beam"}
        assert m["train_s"] > 0
    assert r["methods"]["zero_shot"]["calibrate_s"] == 0.0
    assert r["methods"]["two_stage"]["chosen"][held_out[0]]["optimizer"] == "meta"
    assert "start_layer" in r["methods"]["session_layers"]["chosen"][held_out[0]]
    assert [v["days_since_last_held_in"] for v in r["sessions"].values()] == [1.0, 2.0]


def test_drift_reference_reports_held_in_and_zero_shot_held_out(runs, sessions):
    ref = runs[0]["reference"]
    assert set(ref["held_in"]["sessions"]) == {s.name for s in sessions if s.split == "held_in"}
    assert set(ref["held_out_zero_shot"]["sessions"]) == {s.name for s in sessions if s.split == "held_out"}
    assert 0 <= ref["held_in"]["mean"]["greedy"]["CER"]


def test_results_aggregate_over_seeds_into_markdown_json_and_png(runs, tmp_path):
    summary = summarize(runs)
    assert summary["seeds"] == [0, 1]
    wer = summary["methods"]["two_stage"]["mean"]["beam"]["WER"]
    assert len(wer["values"]) == 2 and wer["mean"] == pytest.approx(np.mean(wer["values"]))
    md = markdown_table(summary)
    assert "| two_stage |" in md and "Drift reference" in md
    paths = write_results(summary, runs, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert data["summary"]["methods"].keys() == summary["methods"].keys()
    assert "backbone" in data["runs"][0]["loss_curves"]
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_runs_record_what_meta_learning_changed_and_the_steps_calibration_chose(runs):
    meta = runs[0]["meta"]
    # the tiny meta-training takes a few Adam steps on the initialisation: it leaves identity, but not by much
    assert 0 < meta["init_weight_offset_fro"] < 1
    lo, mid, hi = meta["step_weight_quantiles"]
    assert 0 < lo <= mid <= hi
    md = markdown_table(summarize(runs))
    assert "Meta-learned alignment per seed" in md
    steps = [c["steps"] for c in runs[0]["methods"]["two_stage"]["chosen"].values()]
    assert f"| two_stage | {min(steps)} |" in md


def test_paired_bootstrap_reproduces_the_falcon_figure_and_orders_methods(runs):
    from closedloop.sdk.bci.metrics import falcon_metrics
    from closedloop.sdk.bci.report import paired_bootstrap

    # every session keeps the decoded text of each trial, and the point figure is FALCON's mean over sessions
    p = paired_bootstrap(runs, "two_stage", "zero_shot", n_boot=200)
    expected = np.mean([r["methods"]["two_stage"]["mean"]["beam"]["WER"] for r in runs])
    assert p["wer"] == pytest.approx(expected)
    for score in runs[0]["methods"]["alignment"]["sessions"].values():
        texts = score["texts"]
        assert len(texts["reference"]) == len(texts["beam"]) == len(texts["greedy"]) == score["beam"]["n_trials"]
        assert falcon_metrics([texts["beam"]], [texts["reference"]])["WER"] == pytest.approx(score["beam"]["WER"])
    summary = summarize(runs)
    assert set(summary["paired"]) == set(DEFAULT_METHODS) - {"two_stage"}
    assert "| zero_shot | " in markdown_table(summary).split("Two-stage against each baseline")[1]
    # a method against itself: no difference in any resample
    same = paired_bootstrap(runs, "alignment", "alignment", n_boot=200)
    assert same["difference"] == 0 and same["difference_95"] == [0.0, 0.0] and same["p_better"] == 0.0


def test_paired_bootstrap_separates_a_clearly_better_method_from_a_tie():
    from closedloop.sdk.bci.report import paired_bootstrap

    refs = [f"the>cat>sat>on>mat>{i}~" for i in range(20)]

    def run(pred_a, pred_b):
        def block(preds):
            return {"sessions": {"s1": {"texts": {"reference": refs, "beam": preds}}}}
        return {"methods": {"a": block(pred_a), "b": block(pred_b)}}

    wrong_every_trial = [r.replace("cat", "dog") for r in refs]
    clear = paired_bootstrap([run(refs, wrong_every_trial)], "a", "b", n_boot=500)
    assert clear["wer"] == 0 and clear["wer_against"] == pytest.approx(1 / 7)
    assert clear["p_better"] == 1.0 and clear["difference_95"][1] < 0
    # one trial better and another worse: the interval straddles zero
    a = list(refs)
    a[0] = wrong_every_trial[0]
    b = list(refs)
    b[1] = wrong_every_trial[1]
    tie = paired_bootstrap([run(a, b)], "a", "b", n_boot=500)
    assert tie["difference"] == 0 and tie["difference_95"][0] < 0 < tie["difference_95"][1]
    assert 0.2 < tie["p_better"] < 0.8


def test_nearest_layer_by_day_is_the_latest_held_in_session(sessions):
    cfg = tiny_harness()
    cfg = cfg.seeded()
    models = train_models(sessions, cfg, {"session_layers"})
    s = [s for s in sessions if s.split == "held_out"][0]
    idx, info = nearest_session_layer(models.session_model, models.held_in_days, s, [], "day", torch.device("cpu"))
    assert models.session_model.session_names[idx] == "toy-02" and info["nearest_by"] == "day"


def test_lexicon_comes_from_trials_methods_may_learn_from(sessions):
    lex = build_lexicon(sessions)
    seen = {w.rstrip(",~?") for s in sessions for i in s.calibration + [j for j in range(len(s.trials))
            if s.split == "held_in" and j not in s.evaluation] for w in s.trials[i].sentence.split(">")}
    assert set(lex.words) == seen - {""}
    assert set(build_lexicon(sessions, extra_words=["zebra"]).words) == seen | {"zebra"} - {""}


def test_held_out_sessions_without_evaluation_trials_are_calibrated_not_scored(sessions):
    """Real FALCON H2 held-out files carry calibration trials only."""
    from dataclasses import replace

    from closedloop.sdk.bci.evaluate import adapt_held_out

    cfg = tiny_harness(methods=("zero_shot", "two_stage")).seeded()
    unscored = [replace(s, evaluation=[]) if s.split == "held_out" else s for s in sessions]
    with pytest.raises(ValueError, match="FalconBundleDecoder"):
        run_harness(unscored, replace(cfg, reference=False))
    models = train_models(unscored, cfg, {"backbone", "meta"})
    adapted = adapt_held_out(unscored, models, "two_stage", cfg)
    assert set(adapted) == {s.name for s in sessions if s.split == "held_out"}
    decoder, norm, info = adapted["toy-03"]
    assert decoder.backbone is models.backbone and norm.mean.shape == (8,) and info["optimizer"] == "meta"


def test_the_real_generators_tiny_recording_runs_through_the_harness():
    from closedloop.sim.handwriting import HandwritingConfig, generate_recording

    rec = generate_recording(HandwritingConfig.tiny(seed=4))
    r = run_harness(rec, tiny_harness(methods=("zero_shot", "alignment"), reference=False))
    assert set(r["methods"]) == {"zero_shot", "alignment"}
    assert all(np.isfinite(v["mean"]["beam"]["WER"]) for v in r["methods"].values())


def test_time_estimate_counts_each_per_session_layer_training_the_run_does(sessions):
    from dataclasses import replace

    from closedloop.sdk.bci.benchmark import BciBenchConfig, estimate_seconds

    bench = BciBenchConfig()  # session_layers on stage 1's recipe, the drift reference on its own, left out

    def training_s(**harness):
        cfg = replace(bench, harness=replace(bench.harness, **harness))
        return estimate_seconds(sessions, cfg, 1000.0)["per_seed_s"]["stage 1 + session layers"]

    default = training_s()
    without = training_s(methods=("zero_shot", "two_stage"))
    with_reference = training_s(reference=True)
    shared_reference = training_s(reference=True, reference_train=None)
    assert without == pytest.approx(default / 2)  # stage 1 alone: the two recipes have the same steps and batch
    assert with_reference == pytest.approx(1.5 * default)  # a second per-session-layer decoder
    assert shared_reference == pytest.approx(default)  # one decoder serves both
    # the reference alone, without the session_layers baseline: stage 1 and the reference
    assert training_s(reference=True, methods=("two_stage",)) == pytest.approx(default)


def test_the_benchmarks_tasks_on_two_workers_give_what_one_harness_call_gives(runs, sessions, tmp_path):
    """The benchmark splits each seed into training and scoring tasks shared out over worker processes:
    the results must be the ones run_harness computes in one call (each training seeds itself, and
    calibration draws no random numbers)."""
    import pickle

    from closedloop.sdk.bci.benchmark import run_seeds

    path = tmp_path / "data.pkl"
    path.write_bytes(pickle.dumps((sessions, [])))
    split = run_seeds(str(path), tiny_harness(), [0, 1], workers=2)
    for one, shared in zip(runs, split, strict=True):
        assert shared["seed"] == one["seed"] and list(shared["methods"]) == list(one["methods"])
        for m, v in one["methods"].items():
            for key in ("mean", "sessions", "chosen"):
                assert shared["methods"][m][key] == v[key], (m, key)
        assert shared["reference"] == one["reference"] and shared["meta"] == one["meta"]
        assert shared["config"] == one["config"]
        assert {k: log["loss"] for k, log in shared["logs"].items()} == {k: log["loss"] for k, log in one["logs"].items()}
        assert shared["wall_s"] >= max(m["train_s"] + m["calibrate_s"] for m in shared["methods"].values())
        assert shared["fast_ctc"]["batches"] > 0


def test_a_seed_splits_into_one_training_task_per_decoder_and_one_scoring_task_per_set_of_models():
    from closedloop.sdk.bci.benchmark import plan_seed

    plan = plan_seed(tiny_harness())  # the drift reference shares the session_layers decoder
    assert plan.train == {"backbone": {"backbone", "meta"}, "session_layers": {"session_layers"}}
    assert plan.score == ((("backbone",), ("zero_shot", "finetune", "alignment", "two_stage"), False),
                          (("session_layers",), ("session_layers",), True))
    separate = tiny_harness(reference_train=TrainConfig(steps=7), methods=("zero_shot",))
    plan = plan_seed(separate)  # the reference on a recipe of its own: a third decoder, scored on its own
    assert plan.train == {"backbone": {"backbone"}, "reference": {"reference"}}
    assert plan.score == ((("backbone",), ("zero_shot",), False), (("reference",), (), True))


def test_an_error_in_a_benchmark_worker_ends_the_run_with_that_error(sessions, tmp_path):
    """A task that fails in a worker process must stop the run and say why, not hang or lose the message."""
    import dataclasses
    import pickle

    from closedloop.sdk.bci.benchmark import run_seeds

    no_held_in = [dataclasses.replace(s, split="held_out") for s in sessions]
    path = tmp_path / "data.pkl"
    path.write_bytes(pickle.dumps((no_held_in, [])))
    with pytest.raises(ValueError, match="held-in"):
        run_seeds(str(path), tiny_harness(methods=("zero_shot",), reference=False), [0, 1], workers=2)


def test_a_rerun_continues_from_the_tasks_an_interrupted_run_stored(runs, sessions, tmp_path, monkeypatch):
    """bench_bci.py keeps each finished task; a rerun after a kill runs only what was not finished, and its
    results are those of an uninterrupted run. A changed configuration never reuses a stored task."""
    import dataclasses
    import hashlib
    import pickle

    from closedloop.sdk.bci import benchmark
    from closedloop.sdk.bci.benchmark import TaskStore, run_seeds
    from closedloop.sdk.grid import read_results

    data = pickle.dumps((sessions, []))
    path = tmp_path / "data.pkl"
    path.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    cfg = tiny_harness()
    folder = tmp_path / "cells"
    first = run_seeds(str(path), cfg, [0, 1], workers=1, store=TaskStore(folder, cfg.to_dict(), sha))
    records = read_results(folder / "cells.jsonl")
    assert sorted(r["kind"] for r in records.values()) == ["score"] * 4 + ["train"] * 4
    assert all((folder / r["file"]).is_file() for r in records.values())

    # a kill after seed 1's scoring started: its scoring results were never stored
    lines = (folder / "cells.jsonl").read_text().splitlines()
    kept = [ln for ln in lines if not (ln and '"kind": "score"' in ln and '"seed": 1' in ln)]
    assert len(kept) == len(lines) - 2
    (folder / "cells.jsonl").write_text("\n".join(kept) + "\n")
    ran: list[str] = []
    real_score = benchmark._score_task

    def score(*args):
        ran.append(f"score seed {args[2]}")
        return real_score(*args)

    def train(*args):
        raise AssertionError(f"training task {args[3]} of seed {args[2]} ran again")

    monkeypatch.setattr(benchmark, "_score_task", score)
    monkeypatch.setattr(benchmark, "_train_task", train)
    lines_out: list[str] = []
    again = run_seeds(str(path), cfg, [0, 1], workers=1, report=lines_out.append,
                      store=TaskStore(folder, cfg.to_dict(), sha))
    assert ran == ["score seed 1", "score seed 1"]
    assert any("6 of 8 tasks were stored by an earlier run" in ln for ln in lines_out), lines_out
    for a, b, one in zip(first, again, runs, strict=True):
        for m in one["methods"]:
            assert a["methods"][m]["mean"] == b["methods"][m]["mean"] == one["methods"][m]["mean"], m
        assert b["config"] == one["config"]

    # another configuration (or another recording) shares nothing with the stored tasks
    other = dataclasses.replace(cfg, beam_width=2)
    assert TaskStore(folder, other.to_dict(), sha).load("train", (0, "backbone", frozenset())) is None
    assert TaskStore(folder, cfg.to_dict(), "0" * 64).load("train", (0, "backbone", frozenset())) is None
    assert TaskStore(folder, cfg.to_dict(), sha).load("train", (0, "backbone", frozenset())) is not None
