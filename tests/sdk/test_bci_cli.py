"""``closedloop calibrate`` and ``closedloop evaluate`` on tiny NWB files, and the calibratable bundle they rely on.

A toy recording (:mod:`closedloop.sdk.bci.toy`) trains a tiny two-stage decoder (pooled backbone,
meta-learned alignment) in a second; it is exported as a calibratable bundle, a
held-out session is written in the FALCON H2 layout, and the commands run through
``closedloop.sdk.cli.main`` as a user would call them.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest
import torch

from closedloop.runtime import BundleError, load_bundle
from closedloop.runtime.families.bci import read_calibration_state
from closedloop.runtime.integrity import seal_manifest
from closedloop.sdk.bci import (
    calibrate_bundle,
    compare_evaluations,
    evaluate_bundle,
    format_comparison,
    format_evaluation,
)
from closedloop.sdk.bci.calibrate import CalibrationConfig
from closedloop.sdk.bci.data import Normalization, make_examples, session_normalization
from closedloop.sdk.bci.deploy import CALIBRATION_STATE_FILE, decoder_from_state, export_bci_bundle
from closedloop.sdk.bci.evaluate import decode_examples
from closedloop.sdk.bci.lexicon import pooled_bundle_defaults
from closedloop.sdk.bci.meta import MetaConfig, meta_train_alignment
from closedloop.sdk.bci.metrics import falcon_metrics
from closedloop.sdk.bci.models import AffineAlignment, AlignedDecoder
from closedloop.sdk.bci.nwb import write_falcon_h2, write_falcon_h2_dir
from closedloop.sdk.bci.toy import toy_recording
from closedloop.sdk.bci.train import BackboneConfig, TrainConfig, train_backbone
from closedloop.sdk.cli import main
from closedloop.sdk.models import GRUDecoder

pytest.importorskip("pynwb")

C = 8
DATES = ("2022-05-18", "2022-06-22", "2023-02-28", "2023-04-17", "2023-10-09")
# untuned: with a backbone this small, leave-one-sentence-out tuning may rightly choose 0 steps
CALIB = CalibrationConfig(steps=4, tune=False, device="cpu")


@pytest.fixture(scope="module")
def sessions():
    ss = toy_recording(n_channels=C, n_held_in=3, n_held_out=2, n_trials=8, seed=1)
    for s, d in zip(ss, DATES, strict=True):
        s.name, s.meta["date"] = d.replace("-", "."), d
        for t in s.trials:  # NWB holds integer counts
            t.spikes = t.spikes.astype(np.uint8)
    return ss


@pytest.fixture(scope="module")
def two_stage(sessions):
    torch.set_num_threads(1)
    backbone, _ = train_backbone(sessions, TrainConfig(backbone=BackboneConfig(16, 1, 0.0), steps=60, batch_size=4,
                                                       lr=1e-2, device="cpu", progress=False))
    meta, _ = meta_train_alignment(backbone, sessions, MetaConfig(inner_steps=2, n_query=2, tasks_per_step=2,
                                                                  meta_steps=4, device="cpu", progress=False))
    return backbone, meta


def _export(module, path, sessions, **kw):
    norm = session_normalization(sessions[2])
    return export_bci_bundle(module, path, n_channels=C, mean=norm.mean, std=norm.std, session_name="pooled",
                             std_floor=0.3, calibration_config=CALIB.to_dict(), variants=(), tensorrt=False,
                             report=lambda s: None, **kw)


@pytest.fixture(scope="module")
def bundle(two_stage, sessions, tmp_path_factory):
    backbone, meta = two_stage
    held_in = [s for s in sessions if s.split == "held_in"]
    return _export(AlignedDecoder(meta.new_alignment(), backbone), tmp_path_factory.mktemp("bci") / "pooled",
                   sessions, meta=meta, decoding=pooled_bundle_defaults(held_in)["decoding"])


@pytest.fixture(scope="module")
def held_out_file(sessions, tmp_path_factory):
    return write_falcon_h2(sessions[3], tmp_path_factory.mktemp("nwb") / "sub-SIM-held-out_ses-20230417.nwb")


@pytest.fixture(scope="module")
def calibrated(bundle, held_out_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("cal") / "calibrated"
    report = calibrate_bundle(bundle, held_out_file, n_sentences=3, out=out, report=lambda s: None)
    return out, report


def _graph_initializers(path):
    return load_bundle(path).onnx().initializers


def test_calibratable_bundle_carries_backbone_meta_state_and_its_checksum(bundle, two_stage):
    b = load_bundle(bundle)
    block = b.manifest.extra["bci"]["calibration_state"]
    assert block["file"] == CALIBRATION_STATE_FILE and block["meta"] is True and block["config"]["steps"] == 4
    data = (bundle / CALIBRATION_STATE_FILE).read_bytes()
    assert b.manifest.files[CALIBRATION_STATE_FILE]["sha256"] == hashlib.sha256(data).hexdigest()
    state = read_calibration_state(b)
    assert state["has_meta"] and state["inner_steps"] == 2 and state["n_channels"] == C and state["std_floor"] == 0.3
    backbone, meta = two_stage
    for k, v in backbone.state_dict().items():
        assert state[f"backbone.{k}"].tobytes() == v.numpy().tobytes()
    assert state["meta_form"] == "full"
    assert state["meta.log_step_weight"].tobytes() == meta.log_step["weight"].detach().numpy().tobytes()
    decoder, meta2 = decoder_from_state(state)
    assert torch.equal(meta2.init["weight"], meta.init["weight"]) and meta2.inner_steps == meta.inner_steps
    assert all(torch.equal(a, b) for a, b in zip(decoder.backbone.parameters(), backbone.parameters(), strict=True))


def test_a_lowrank_meta_state_travels_in_the_bundle_and_calibrates(two_stage, sessions, held_out_file, tmp_path):
    backbone, _ = two_stage
    meta, _ = meta_train_alignment(backbone, sessions, MetaConfig(inner_steps=2, n_query=2, tasks_per_step=2,
                                                                  meta_steps=3, form="lowrank", rank=3, device="cpu",
                                                                  progress=False))
    path = _export(AlignedDecoder(meta.new_alignment(), backbone), tmp_path / "lowrank", sessions, meta=meta)
    state = read_calibration_state(load_bundle(path))
    assert state["meta_form"] == "lowrank" and state["meta.init_u"].shape == (C, 3) and state["meta.init_v"].shape == (3, C)
    _, meta2 = decoder_from_state(state)
    assert meta2.form == "lowrank" and meta2.rank == 3
    assert all(torch.equal(meta2.init[k], meta.init[k]) and torch.equal(meta2.log_step[k], meta.log_step[k])
               for k in ("gain", "bias", "u", "v"))
    r = calibrate_bundle(path, held_out_file, out=tmp_path / "lowrank-cal", report=lambda s: None)
    assert r.backbone_identical and r.loss_after < r.loss_start
    assert read_calibration_state(load_bundle(tmp_path / "lowrank-cal"))["meta_form"] == "lowrank"
    # a lowrank state missing one of its arrays is refused by name
    with pytest.raises(BundleError, match="'meta.log_step_v' is missing"):
        load_bundle(_with_state(path, tmp_path / "broken", lambda a: a.pop("meta.log_step_v")))


def _with_state(bundle, dst, edit):
    """A copy of ``bundle`` whose state arrays went through ``edit`` (in place), checksum updated to match."""
    shutil.copytree(bundle, dst)
    with np.load(dst / CALIBRATION_STATE_FILE) as z:
        arrays = {k: z[k] for k in z.files}
    edit(arrays)
    np.savez(dst / CALIBRATION_STATE_FILE, **arrays)
    m = json.loads((dst / "manifest.json").read_text())
    m["files"][CALIBRATION_STATE_FILE]["sha256"] = hashlib.sha256((dst / CALIBRATION_STATE_FILE).read_bytes()).hexdigest()
    m["files"][CALIBRATION_STATE_FILE]["bytes"] = (dst / CALIBRATION_STATE_FILE).stat().st_size
    (dst / "manifest.json").write_text(json.dumps(seal_manifest(m)))
    return dst


def test_calibrate_writes_a_bundle_with_the_same_backbone_and_a_fitted_alignment(bundle, calibrated, sessions):
    out, report = calibrated
    new = load_bundle(out)
    bci = new.manifest.extra["bci"]
    assert bci["session"] == "2023.04.17" and bci["calibration"]["trials"] == [0, 1, 2]
    assert bci["calibration"]["method"] == "two_stage" and report.backbone_identical
    assert report.loss_after < report.loss_start
    # the graph's backbone initializers are bit-identical; only the alignment's changed
    old_init, new_init = _graph_initializers(bundle), _graph_initializers(out)
    assert old_init.keys() == new_init.keys()
    same = {k for k in old_init if old_init[k].tobytes() == new_init[k].tobytes()}
    assert {k for k in old_init if k.startswith(("module.backbone.", "onnx::GRU"))} <= same
    assert set(old_init) - same, "the alignment layer in the graph did not change"
    old_s, new_s = read_calibration_state(load_bundle(bundle)), read_calibration_state(new)
    for k in old_s:
        if k.startswith(("backbone.", "meta.")):
            assert old_s[k].tobytes() == new_s[k].tobytes(), k
    assert not np.allclose(new_s["alignment.weight"], np.eye(C))
    # normalisation from the three calibration sentences only
    norm = Normalization.from_trials(sessions[3].trials[:3], 0.3)
    np.testing.assert_allclose(new.manifest.preprocess["mean"], norm.mean, rtol=1e-6)
    # and the new bundle is calibratable in turn
    assert new_s["has_meta"] and bci["calibration_state"]["config"]["steps"] == 4


def test_calibrate_command_prints_what_it_did(bundle, held_out_file, tmp_path, capsys):
    out = tmp_path / "cli-calibrated"
    assert main(["calibrate", str(bundle), "--data", str(held_out_file), "--sentences", "3", "--out", str(out),
                 "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "meta-learned" in text and "backbone bit-identical: yes" in text and "calibration CTC loss" in text
    assert load_bundle(out).manifest.extra["bci"]["session"] == "2023.04.17"
    assert main(["calibrate", str(bundle), "--data", str(held_out_file), "--out", str(out)]) == 2  # exists
    out_text, err = capsys.readouterr()
    assert "already exists" in err and "calibrating on" not in out_text  # refused before the fit, not after


@pytest.mark.parametrize("flags", [[], ["-q"], ["--json"]])
def test_calibrates_warnings_go_to_stderr_whatever_the_flags_and_progress_only_without_q_or_json(monkeypatch, capsys,
                                                                                                   flags):
    import closedloop.sdk.bci.cli as bci_cli
    from closedloop.sdk.bci.workflow import CalibrationReport

    def fake(*args, report, **kwargs):
        report("fitting the alignment layer")
        report("warning: calibration made the greedy CER worse (10.0% -> 12.0% ...)")
        return CalibrationReport(bundle="O", source="B", data="F", session="s", trials=[0, 1, 2], method="meta",
                                 loss_given=1.0, loss_start=1.0, loss_after=1.2,
                                 warning="calibration made the greedy CER worse (10.0% -> 12.0% ...)")

    monkeypatch.setattr(bci_cli, "calibrate_bundle", fake)
    assert main(["calibrate", "B", "--data", "F", "--out", "O", *flags]) == 0
    out, err = capsys.readouterr()
    assert "warning: calibration made the greedy CER worse" in err
    assert ("fitting the alignment layer" in err) == (flags == [])
    assert "fitting the alignment layer" not in out
    if flags == ["--json"]:
        assert json.loads(out)["warning"].startswith("calibration made")
        assert json.loads(out)["unlearned"] is None  # "B" records no bci-train verdict


def test_a_bundle_trained_not_learned_is_named_so_by_calibrate_and_evaluate(bundle, held_out_file, tmp_path, capsys):
    """bci-train writes a decoder that has not learned (exit 1) and records that in the bundle; calibrate and
    evaluate of it then say so on stderr instead of treating it as a usable decoder."""
    from closedloop.sdk.bci.workflow import unlearned_warning

    dst = tmp_path / "unlearned"
    shutil.copytree(bundle, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m["provenance"]["recipe"] = {"learned": False, "problems": ["stage 1: best validation greedy CER 97.0%"]}
    (dst / "manifest.json").write_text(json.dumps(seal_manifest(m)))
    assert unlearned_warning(bundle) is None and unlearned_warning(tmp_path / "no-such-bundle") is None
    assert "NOT LEARNED (stage 1: best validation greedy CER 97.0%)" in unlearned_warning(dst)
    assert main(["evaluate", str(dst), "--data", str(held_out_file), "--json"]) == 0
    out, err = capsys.readouterr()
    json.loads(out)
    assert "warning:" in err and "NOT LEARNED" in err


def test_a_device_the_machine_lacks_is_refused_before_any_work(bundle, held_out_file, tmp_path, capsys):
    import torch

    from closedloop.sdk.bci.data import resolve_device

    with pytest.raises(ValueError, match="'mps'.*'cpu' or 'cuda'"):
        resolve_device("mps")
    with pytest.raises(ValueError, match="'gpu0' is not a device"):
        resolve_device("gpu0")
    missing = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    assert main(["calibrate", str(bundle), "--data", str(held_out_file), "--out", str(tmp_path / "c"),
                 "--device", missing]) == 2
    err = capsys.readouterr().err
    assert f"device {missing!r}" in err and ("no CUDA GPU" in err or "CUDA device(s)" in err)
    assert not (tmp_path / "c").exists()
    # bci-train refuses it before reading the data (the folder does not even exist)
    assert main(["bci-train", str(tmp_path / "no-such-folder"), "--out", str(tmp_path / "t"), "--device", missing]) == 2
    assert f"device {missing!r}" in capsys.readouterr().err


def test_tampered_or_inconsistent_state_is_refused(bundle, held_out_file, tmp_path):
    bad = tmp_path / "tampered"
    shutil.copytree(bundle, bad)
    data = bytearray((bad / CALIBRATION_STATE_FILE).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bad / CALIBRATION_STATE_FILE).write_bytes(bytes(data))
    with pytest.raises(BundleError, match=f"{CALIBRATION_STATE_FILE}: SHA-256"):
        load_bundle(bad)
    with pytest.raises(BundleError, match="tampering"):
        calibrate_bundle(bad, held_out_file, out=tmp_path / "never", report=lambda s: None)
    assert not (tmp_path / "never").exists()
    # a state file whose checksum was updated but whose arrays do not fit the graph
    odd = _with_state(bundle, tmp_path / "odd", lambda a: a.update({"alignment.weight": a["alignment.weight"][:, :-1]}))
    with pytest.raises(BundleError, match=r"'alignment.weight' is float32 \(8, 7\); expected float32 \(8, 8\)"):
        load_bundle(odd)


def test_without_meta_state_calibration_fits_from_identity(two_stage, sessions, held_out_file, tmp_path):
    backbone, _ = two_stage
    plain = _export(AlignedDecoder(AffineAlignment(C), backbone), tmp_path / "plain", sessions)
    assert read_calibration_state(load_bundle(plain))["has_meta"] is False
    r = calibrate_bundle(plain, held_out_file, out=tmp_path / "plain-cal", report=lambda s: None)
    assert "from identity" in r.method and "no meta" in r.method
    assert load_bundle(tmp_path / "plain-cal").manifest.extra["bci"]["calibration"]["method"] == "alignment"


def test_a_bundle_without_calibration_state_is_refused_clearly(sessions, held_out_file, tmp_path):
    plain = _export(GRUDecoder(C, 8, 1, 32), tmp_path / "gru", sessions)
    assert "calibration_state" not in load_bundle(plain).manifest.extra["bci"]
    with pytest.raises(ValueError, match="has no calibration state"):
        calibrate_bundle(plain, held_out_file, out=tmp_path / "x", report=lambda s: None)


def test_evaluate_scores_match_falcon_metrics_and_offline_decoding(calibrated, held_out_file, sessions, capsys):
    out, _ = calibrated
    assert main(["evaluate", str(out), "--data", str(held_out_file), "--json", "--beam", "--beam-width", "4"]) == 0
    r = json.loads(capsys.readouterr().out)
    row = r["sessions"]["2023.04.17"]
    refs = [sessions[3].trials[i].sentence for i in sessions[3].evaluation]
    assert row["references"] == refs and row["greedy"]["n_trials"] == len(refs) == 3
    for dec in ("greedy", "beam"):
        expect = falcon_metrics([row["predictions"][dec]], [refs])
        assert row[dec] == expect["per_session"][0]
        assert r["mean"][dec] == {"CER": expect["CER"], "WER": expect["WER"]}
    # the runtime's streaming text equals torch's offline greedy decoding of the same bundle
    b = load_bundle(out)
    decoder, _ = decoder_from_state(read_calibration_state(b))
    norm = Normalization(np.asarray(b.manifest.preprocess["mean"], np.float32),
                         np.asarray(b.manifest.preprocess["std"], np.float32))
    offline = decode_examples(decoder, make_examples(sessions[3], sessions[3].evaluation, norm), None, 0, 0.0,
                              torch.device("cpu"))["greedy"]
    assert row["predictions"]["greedy"] == offline
    assert main(["evaluate", str(out), "--data", str(held_out_file)]) == 0
    text = capsys.readouterr().out
    assert "greedy CER" in text and f"{row['greedy']['CER']:.2%}" in text
    assert r["calibrated_for"] == "2023.04.17" and r["other_sessions"] == [] and "note:" not in text


def test_bci_data_lists_the_sessions_as_the_commands_read_them(sessions, tmp_path, capsys):
    data = tmp_path / "data"
    write_falcon_h2_dir(sessions, data)
    assert main(["bci-data", str(data), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["sessions"]
    assert [r["name"] for r in rows] == [s.name for s in sessions]
    for r, s in zip(rows, sessions, strict=True):
        assert (r["split"], r["trials"], r["evaluation"], r["n_channels"]) == (
            s.split, len(s.trials), len(s.evaluation), s.n_channels)
        assert r["split_from"] == "name" and r["bins"] == sum(t.n_bins for t in s.trials) and r["files"]
    assert main(["bci-data", str(data)]) == 0
    text = capsys.readouterr().out
    assert f"{len(sessions)} sessions:" in text and sessions[0].name in text
    assert main(["bci-data", str(tmp_path / "nothing")]) == 2
    assert "no such file or folder" in capsys.readouterr().err


def test_a_calibration_named_by_the_lab_is_still_known_as_that_days(bundle, held_out_file, tmp_path):
    """calibrate --session mylab-day1 names the bundle's session; scoring the same day is no "other session"."""
    out = tmp_path / "named"
    calibrate_bundle(bundle, held_out_file, n_sentences=3, out=out, session_name="mylab-day1", report=lambda s: None)
    r = evaluate_bundle(out, held_out_file, backend="numba")
    assert r["calibrated_for"] == "mylab-day1" and r["other_sessions"] == []
    assert "note:" not in format_evaluation(r)


def test_evaluate_a_folder_scores_every_session_with_evaluation_trials(bundle, sessions, tmp_path):
    write_falcon_h2_dir(sessions, tmp_path / "data")
    r = evaluate_bundle(bundle, tmp_path / "data", backend="numba")
    assert list(r["sessions"]) == [s.name for s in sessions]  # held-in minival and held-out files alike
    cers = [v["greedy"]["CER"] for v in r["sessions"].values()]
    assert r["mean"]["greedy"]["CER"] == pytest.approx(np.mean(cers)) and r["skipped"] == []
    with pytest.raises(ValueError, match="no evaluation trials .* a calibration file .* is never scored; point --data"):
        evaluate_bundle(bundle, next((tmp_path / "data").glob("*held-out-calib/*.nwb")))
    # a bundle calibrated on one session scoring others says so (here the pooled bundle: its 'pooled' normalisation)
    assert r["calibrated_for"] == "pooled" and r["other_sessions"] == [s.name for s in sessions]
    assert "note: the bundle was calibrated on session pooled; " in format_evaluation(r)


def test_calibrating_on_more_sentences_than_the_file_has_says_what_to_do(bundle, held_out_file, tmp_path):
    with pytest.raises(ValueError, match=r"has (\d+) calibration trials; 20 needed .use --sentences \1 or fewer"):
        calibrate_bundle(bundle, held_out_file, n_sentences=20, out=tmp_path / "x", report=lambda s: None)


def test_bci_train_then_calibrate_from_the_shell(sessions, tmp_path, capsys):
    """The whole workflow a user types: NWB folder -> bci-train -> calibrate -> evaluate (with end-of-trial completion)."""
    data = tmp_path / "data"
    write_falcon_h2_dir(sessions, data)
    cfg = tmp_path / "harness.json"
    from closedloop.sdk.bci.evaluate import HarnessConfig

    HarnessConfig(train=TrainConfig(backbone=BackboneConfig(16, 1, 0.0), steps=20, batch_size=4, lr=1e-2),
                  meta=MetaConfig(inner_steps=2, n_query=2, tasks_per_step=2, meta_steps=3),
                  calibration=CALIB, progress=False).save(cfg)
    assert main(["bci-train", str(data), "--out", str(tmp_path / "pooled"), "--config", str(cfg),
                 "--device", "cpu", "--end-completion", "sentence-end", "--allow-unlearned"]) == 0
    assert load_bundle(tmp_path / "pooled").manifest.extra["bci"]["end_completion"] == {"sentence_end": "?~"}
    assert set(load_bundle(tmp_path / "pooled").manifest.provenance["recipe"]) == {"learned", "problems"}
    pooled_bci = load_bundle(tmp_path / "pooled").manifest.extra["bci"]
    assert pooled_bci["normalization"]["warmup_bins"] == 1000  # a new day, uncalibrated: its own first 20 s
    from closedloop.sdk.bci.toy import TOY_WORDS

    vocab = set(pooled_bci["decoding"]["vocabulary"])
    assert pooled_bci["decoding"]["sentence_end"] == "?~" and vocab and vocab <= set(TOY_WORDS)
    state = read_calibration_state(load_bundle(tmp_path / "pooled"))
    assert state["n_channels"] == C and state["has_meta"]  # the meta-learned init and step sizes travel in the bundle
    held_out = next(p for p in sorted(data.rglob("*.nwb")) if "held-out" in p.name or "held_out" in p.name)
    assert main(["calibrate", str(tmp_path / "pooled"), "--data", str(held_out), "--sentences", "3",
                 "--out", str(tmp_path / "cal")]) == 0
    assert load_bundle(tmp_path / "cal").manifest.extra["bci"]["end_completion"] == {"sentence_end": "?~"}  # kept
    assert "normalization" not in load_bundle(tmp_path / "cal").manifest.extra["bci"]  # its calibration statistics
    capsys.readouterr()
    assert main(["evaluate", str(tmp_path / "cal"), "--data", str(data), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["decoders"] == ["greedy", "greedy_end"] and result["end_completion"] == "?~"
    assert result["runtime_decoder"] == "greedy_end" and result["sentence_end"] == "?~"
    texts = [t for r in result["sessions"].values() for t in r["predictions"]["greedy_end"]]
    assert texts and all(t[-1:] in ("~", "?") for t in texts)  # every trial's text ends a sentence
    # held-in days (seen in training) and held-out ones (new days) are also averaged apart, as FALCON reports them
    splits = {r["split"] for r in result["sessions"].values()}
    assert splits == {"held_in", "held_out"} and set(result["mean_by_split"]) == splits
    for split, m in result["mean_by_split"].items():
        cers = [r["greedy"]["CER"] for r in result["sessions"].values() if r["split"] == split]
        assert m["greedy"]["CER"] == pytest.approx(np.mean(cers))
    # bad input: a folder with no held-in session is refused with what to do
    only_out = tmp_path / "only_out"
    only_out.mkdir()
    shutil.copy(held_out, only_out / held_out.name)
    assert main(["bci-train", str(only_out), "--out", str(tmp_path / "x"), "--config", str(cfg)]) == 2
    # an --out that exists is refused before the training (which the default budget makes up to 30 minutes)
    capsys.readouterr()
    curve = tmp_path / "pooled.curve.png"
    curve.unlink()
    assert main(["bci-train", str(data), "--out", str(tmp_path / "pooled"), "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--overwrite on the command line" in err
    assert not curve.exists()  # nothing was trained


def test_a_cue_that_breaks_the_sentence_end_rule_is_refused_before_any_training(sessions, tmp_path, monkeypatch):
    """--end-completion sentence-end needs every held-in sentence to end with '~' or '?': one that ends with ','
    (or with no mark) is named before training starts, not after both stages (30 minutes at the default budget)."""
    import copy

    import closedloop.sdk.bci.recipe as recipe
    from closedloop.sdk.bci.recipe import train_recipe

    odd = copy.deepcopy(sessions)
    held_in = next(s for s in odd if s.split == "held_in")
    held_in.trials[0].sentence = held_in.trials[0].sentence[:-1] + ","
    monkeypatch.setattr(recipe, "fit_recipe", lambda *a, **k: pytest.fail("trained before the cues were checked"))
    with pytest.raises(ValueError, match=r"sentence-end: 1 of the \d+ held-in sentences do not end with '~' or "
                                         r"'\?' \(e.g. \['.*,'\]\).*'plain' or 'off'"):
        train_recipe(odd, None, tmp_path / "never", end_completion="sentence-end")


def test_a_partial_config_changes_only_its_settings_over_the_tiny_or_default_base(tmp_path):
    from closedloop.sdk.bci import train_harness
    from closedloop.sdk.bci.benchmark import BciBenchConfig

    path = tmp_path / "lowrank.json"
    path.write_text(json.dumps({"meta": {"form": "lowrank", "rank": 4}}))
    tiny, base = BciBenchConfig.tiny().harness, BciBenchConfig().harness
    got = train_harness(path, tiny=True, seed=3, device="cpu")
    assert (got.meta.form, got.meta.rank) == ("lowrank", 4)
    assert got.train.steps == tiny.train.steps != base.train.steps  # --tiny holds alongside --config
    assert got.meta.meta_steps == tiny.meta.meta_steps and (got.seed, got.device) == (3, "cpu")
    assert train_harness(path).train.steps == base.train.steps
    path.write_text(json.dumps({"meta": {"no_such_setting": 1}}))
    with pytest.raises(ValueError, match="no_such_setting"):
        train_harness(path, tiny=True)


def test_evaluate_reports_three_decoders_and_the_same_beam_text_for_a_file_or_its_folder(calibrated, held_out_file,
                                                                                         sessions, tmp_path, capsys):
    out, _ = calibrated
    write_falcon_h2_dir(sessions[3:], tmp_path / "data")  # the day's calibration and evaluation files, and another day
    one = evaluate_bundle(out, held_out_file, beam=True, beam_width=4, backend="numba")
    folder = evaluate_bundle(out, tmp_path / "data", beam=True, beam_width=4, backend="numba")
    assert one["decoders"] == ["greedy", "greedy_end", "beam"]
    day = "2023.04.17"
    # the lexicon and sentence-end rule are the bundle's, whatever else --data holds
    assert folder["sessions"][day]["predictions"] == one["sessions"][day]["predictions"]
    assert one["lexicon"] == folder["lexicon"] and one["lexicon"]["mode"] == "closed"
    vocab = load_bundle(out).manifest.extra["bci"]["decoding"]["vocabulary"]
    calib_words = {w.strip(",~?") for i in sessions[3].calibration[:3] for w in sessions[3].trials[i].sentence.split(">")}
    assert calib_words <= set(vocab) and one["lexicon"]["words"] == len(vocab)  # calibration words joined the closed set
    assert one["sentence_end"] == "?~" and one["sentence_end_source"].startswith("bundle")
    for text in one["sessions"][day]["predictions"]["beam"]:  # every word it completed is a closed-lexicon word
        assert all(w.strip(",~?") in vocab for w in text.split(">")[:-1])
    # greedy_end is greedy plus at most one final character, which then ends the sentence
    for g, e in zip(one["sessions"][day]["predictions"]["greedy"], one["sessions"][day]["predictions"]["greedy_end"],
                    strict=True):
        assert e.startswith(g) and len(e) - len(g) <= 1 and (g[-1:] in ("?", "~") or e[-1:] in ("?", "~"))
    text = format_evaluation(one)
    assert "greedy CER" in text and "greedy_end CER" in text and "beam CER" in text
    assert "beam lexicon: closed" in text and "--lexicon open" in text


def test_evaluate_options_choose_the_lexicon_and_sentence_end(calibrated, held_out_file, tmp_path, capsys):
    out, _ = calibrated
    r = evaluate_bundle(out, held_out_file, beam=True, beam_width=4, sentence_end="?", backend="numba")
    preds = next(iter(r["sessions"].values()))["predictions"]
    assert all(t.endswith("?") for t in preds["greedy_end"]) and r["sentence_end_source"] == "--sentence-end"
    words = tmp_path / "words.txt"
    words.write_text("cat hat\nsat\n")
    r = evaluate_bundle(out, held_out_file, beam=True, beam_width=4, lexicon=words, sentence_end="none",
                        backend="numba")
    assert r["lexicon"]["mode"] == "file" and r["lexicon"]["words"] == 3 and r["sentence_end"] == ""
    for t in next(iter(r["sessions"].values()))["predictions"]["beam"]:
        assert {w.strip(",~?") for w in t.split(">")[:-1]} <= {"cat", "hat", "sat"}
    assert main(["evaluate", str(out), "--data", str(held_out_file), "--beam", "--sentence-end", "x"]) == 2
    assert "--sentence-end 'x'" in capsys.readouterr().err
    assert main(["evaluate", str(out), "--data", str(held_out_file), "--beam", "--lexicon", str(tmp_path / "no")]) == 2
    assert f"--lexicon {tmp_path / 'no'}: no such file" in capsys.readouterr().err


def test_evaluate_against_another_bundle_compares_them_trial_for_trial(calibrated, bundle, held_out_file, capsys):
    out, _ = calibrated
    assert main(["evaluate", str(out), "--data", str(held_out_file), "--against", str(bundle), "--backend", "numba",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)  # stdout is one JSON document: both evaluations and the comparison
    c = r["comparison"]
    assert (c["bundle"], c["against"], c["trials"]) == (str(out), str(bundle), 3)
    assert set(c["decoders"]) == {"greedy", "greedy_end"} == set(r["against"]["decoders"])
    for d, row in c["decoders"].items():
        for metric, v in row.items():  # the compared figures are each evaluation's own
            assert v["bundle"] == pytest.approx(r["mean"][d][metric])
            assert v["against"] == pytest.approx(r["against"]["mean"][d][metric])
            assert v["difference"] == pytest.approx(v["bundle"] - v["against"])
            if v["against"] > 0:
                assert v["ratio"] == pytest.approx(v["bundle"] / v["against"])
    # a bundle against itself: every replicate ties
    same = compare_evaluations(evaluate_bundle(out, held_out_file, backend="numba"),
                               evaluate_bundle(out, held_out_file, backend="numba"))
    assert same["decoders"]["greedy"]["CER"]["difference_95"] == [0.0, 0.0]
    assert same["decoders"]["greedy"]["CER"]["p_better"] == 0.0
    assert main(["evaluate", str(out), "--data", str(held_out_file), "--against", str(bundle), "--backend",
                 "numba"]) == 0
    text = capsys.readouterr().out
    assert f"{out} (A) against {bundle} (B): 3 evaluation trials in 1 session(s)" in text and "A / B [95%]" in text
    assert main(["evaluate", str(out), "--data", str(held_out_file), "--against", str(held_out_file)]) == 2


def _scored(name, predictions, references):
    return {"bundle": name, "data": "day.nwb", "decoders": ["greedy"],
            "sessions": {"2023.04.17": {"predictions": {"greedy": predictions}, "references": references}}}


def test_a_comparison_says_which_bundle_is_better_and_refuses_different_data():
    refs = [f"word{i}>and>more~" for i in range(30)]
    perfect = _scored("a", refs, refs)
    worse = _scored("b", [r[:-3] for r in refs], refs)  # three characters lost in every sentence
    c = compare_evaluations(perfect, worse)["decoders"]["greedy"]["CER"]
    assert c["bundle"] == 0.0 and c["against"] > 0.1 and c["ratio"] == 0.0 and c["ratio_95"] == [0.0, 0.0]
    assert c["p_better"] == 1.0 and c["difference_95"][1] < 0
    back = compare_evaluations(worse, perfect)
    assert back["decoders"]["greedy"]["CER"]["ratio"] is None  # over a zero error rate: no number, and JSON null
    assert "- (B is 0)" in format_comparison(back) and json.loads(json.dumps(back)) == back
    with pytest.raises(ValueError, match="not scored on the same sessions and sentences"):
        compare_evaluations(perfect, _scored("c", refs[:-1], refs[:-1]))


def test_evaluate_open_lexicon_uses_english_word_frequencies(calibrated, held_out_file):
    pytest.importorskip("wordfreq")
    from closedloop.sdk.bci.lexicon import open_vocabulary

    out, _ = calibrated
    r = evaluate_bundle(out, held_out_file, beam=True, beam_width=4, lexicon="open", open_words=3000, backend="numba")
    lex = r["lexicon"]
    assert lex["mode"] == "open" and lex["source"].startswith("wordfreq ") and lex["word_weight"] > 0
    vocab = open_vocabulary(3000)
    assert lex["words"] == len(vocab) > 2500 and vocab["the"] > vocab["cat"] > 0
    for t in next(iter(r["sessions"].values()))["predictions"]["beam"]:
        assert all(w.strip(",~?") in vocab for w in t.split(">")[:-1])


@pytest.mark.parametrize(("options", "message"), [
    ({"beam": True, "lexicon": "open", "open_words": 0}, r"--open-words 0: .* 1 or more"),
    ({"beam": True, "lexicon": "open", "open_words": -5}, r"--open-words -5: .* 1 or more"),
    ({"beam": True, "open_words": 100}, r"--open-words 100: it sizes the open vocabulary: give --beam --lexicon open"),
    ({"beam": True, "lexicon": "open", "word_weight": -1.0}, r"--word-weight -1: .* 0 \(none\) or more"),
])
def test_evaluate_refuses_decoding_options_that_mean_nothing(calibrated, held_out_file, options, message):
    """A vocabulary of 0 or -5 words ran silently (as 50,000 words, or 1), and --open-words without the open
    lexicon was ignored: each is refused, saying what the option is for."""
    with pytest.raises(ValueError, match=message):
        evaluate_bundle(calibrated[0], held_out_file, backend="numba", **options)


def _shifted(session, gain, baseline, name):
    """``session`` as another day whose counts have another gain and baseline (a new array's day)."""
    import copy

    s = copy.deepcopy(session)
    for t in s.trials:
        t.spikes = np.clip(np.rint(t.spikes * gain + baseline), 0, 255).astype(np.uint8)
    s.name, s.meta["date"] = name.replace("-", "."), name
    return s


@pytest.fixture(scope="module")
def learned():
    """A toy decoder that has learned something (greedy CER about 0.85 on a new day; ~5 s on 2 cores)."""
    torch.set_num_threads(1)
    ss = toy_recording(n_channels=C, n_held_in=3, n_held_out=1, n_trials=16, seed=1, drift=0.1)
    for s, d in zip(ss, DATES, strict=False):
        s.name, s.meta["date"] = d.replace("-", "."), d
    backbone, _ = train_backbone(ss, TrainConfig(backbone=BackboneConfig(32, 1, 0.0), steps=250, batch_size=8,
                                                 lr=3e-2, device="cpu", progress=False))
    return AlignedDecoder(AffineAlignment(C), backbone), ss


def test_a_pooled_bundle_on_a_new_day_normalises_with_that_days_own_first_bins(learned, tmp_path):
    """Zero-shot on a day with a shifted gain and baseline: the warm-up statistics beat the last held-in day's."""
    module, ss = learned
    day = _shifted(ss[3], 1.8, 2.0, "2023-04-17")
    day.evaluation = list(range(len(day.trials)))  # score every trial of the new day, zero-shot
    f = write_falcon_h2(day, tmp_path / "sub-SIM-held-out_ses-20230417.nwb")
    warm = _export(module, tmp_path / "warm", ss, warmup_bins=150)
    fixed = _export(module, tmp_path / "fixed", ss)  # the last held-in day's statistics
    r_warm = evaluate_bundle(warm, f, backend="numba")
    r_fixed = evaluate_bundle(fixed, f, backend="numba")
    assert r_warm["normalization"].startswith("each session's own: its first 150 bins")
    assert r_warm["mean"]["greedy"]["CER"] < 0.95 < r_fixed["mean"]["greedy"]["CER"]
    assert r_warm["other_sessions"] == [] and r_fixed["other_sessions"] == ["2023.04.17"]
    # the runtime's warm-up statistics are the day's first 150 bins' (evaluation order), then frozen
    from closedloop.runtime import Model, get_family

    b = load_bundle(warm)
    fam = get_family(b.manifest.family)(b, Model(b, backend="numba"))
    bins = np.concatenate([day.trials[i].spikes for i in day.evaluation]).astype(np.float64)
    for row in bins[:200]:
        fam.decode_bin(row)
    first = bins[:150]
    assert fam.warmed_up
    np.testing.assert_allclose(fam._mean, first.mean(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(1.0 / fam._inv_std, np.maximum(first.std(0), 0.3), rtol=1e-4)
    fam.restart_warmup()
    assert not fam.warmed_up
    fam.model.close()


# --- dead data, and what evaluate says about its options and its normalisation -------------------------------------


def _silenced(session, channels=None, name=None):
    """A copy of ``session`` with ``channels`` (None: all) at zero counts throughout."""
    import copy

    s = copy.deepcopy(session)
    for t in s.trials:
        t.spikes[:, slice(None) if channels is None else channels] = 0
    if name is not None:
        s.name, s.meta["date"] = name.replace("-", "."), name
    return s


def test_bci_data_flags_a_session_without_counts_and_counts_silent_channels(sessions, tmp_path, capsys):
    folder = tmp_path / "d"
    write_falcon_h2_dir([_silenced(sessions[0]), _silenced(sessions[1], [0, 3]), sessions[2]], folder)
    assert main(["bci-data", str(folder), "--json"]) == 0
    out, err = capsys.readouterr()
    rows = json.loads(out)["sessions"]
    assert [r["counts"] == 0 for r in rows] == [True, False, False]
    assert [r["silent_channels"] for r in rows] == [list(range(C)), [0, 3], []]
    assert {r["bin_ms"] for r in rows} == {20}
    assert "session 2022.05.18 (" in err and "holds no counts at all" in err
    assert "session 2022.06.22 (" in err and "2 of 8 channels are silent throughout (no count in any bin: channel(s) " \
                                             "0, 3)" in err
    assert main(["bci-data", str(folder)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert "bin ms" in table[0] and "silent" in table[0]
    assert table[1].endswith("NO COUNTS") and " ALL " in table[1] and "NO COUNTS" not in table[2]


def test_bci_train_refuses_a_held_in_session_without_counts_naming_its_file(sessions, tmp_path, capsys):
    folder = tmp_path / "d"
    paths = write_falcon_h2_dir([_silenced(sessions[0]), *sessions[1:]], folder)
    assert main(["bci-train", str(folder), "--out", str(tmp_path / "b"), "--tiny", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert str(paths[0]) in err and "1 held-in session(s) hold no counts at all" in err and "Traceback" not in err
    assert not (tmp_path / "b").exists()  # refused before any training


def test_bci_train_says_which_sessions_only_their_date_split(sessions, tmp_path, capsys):
    """A lab's file named without a split, recorded on a date that is one of FALCON H2's held-out days, is held out
    by that date: bci-train says so before anything else, naming the session and how to decide it."""
    folder = tmp_path / "d"
    write_falcon_h2_dir(sessions[:3], folder)
    write_falcon_h2(sessions[3], folder / "monkeyJ_rec3.nwb", metadata=False)  # its date: 2023.04.17, a held-out day
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("")  # an --out that exists: refused after the notes, before any training
    assert main(["bci-train", str(folder), "--out", str(tmp_path / "b"), "--tiny", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"1 of them split by their date alone, a day of FALCON H2's own lists ({sessions[3].name} held_out)" in err
    assert "name the split in the file name" in err


def test_calibrate_refuses_calibration_sentences_without_counts(bundle, sessions, tmp_path, capsys):
    f = write_falcon_h2(_silenced(sessions[3]), tmp_path / "sub-SIM-held-out_ses-20230417.nwb")
    assert main(["calibrate", str(bundle), "--data", str(f), "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert f"{f}: the 3 calibration sentence(s) (trials [0, 1, 2]) of session 2023.04.17 hold no counts at all" in err
    assert not (tmp_path / "c").exists()


def test_evaluate_warns_about_a_scored_session_without_counts(calibrated, sessions, tmp_path, capsys):
    out, _ = calibrated
    f = write_falcon_h2(_silenced(sessions[3]), tmp_path / "sub-SIM-held-out_ses-20230417.nwb")
    assert main(["evaluate", str(out), "--data", str(f)]) == 0
    assert "holds no counts at all" in capsys.readouterr().err
    live = _silenced(sessions[3])  # calibration trials with counts, evaluation trials without
    for i in live.calibration:
        live.trials[i].spikes[:] = sessions[3].trials[i].spikes
    f = write_falcon_h2(live, tmp_path / "sub-SIM-held-out_ses-20230418.nwb")
    r = evaluate_bundle(out, f, backend="numba")
    assert any("evaluation trial(s) hold no counts at all" in w and str(f) in w for w in r["warnings"])


def test_evaluate_says_a_lexicon_needs_the_beam(calibrated, held_out_file, capsys):
    out, _ = calibrated
    assert main(["evaluate", str(out), "--data", str(held_out_file), "--lexicon", "open"]) == 2
    assert "--lexicon open: the lexicon is the beam search's vocabulary" in capsys.readouterr().err


def test_zero_shot_normalisation_says_how_many_bins_a_short_session_gave(two_stage, sessions, held_out_file, tmp_path):
    backbone, meta = two_stage
    warm = _export(AlignedDecoder(meta.new_alignment(), backbone), tmp_path / "warm", sessions, meta=meta,
                   warmup_bins=100000)
    r = evaluate_bundle(warm, held_out_file, backend="numba")
    s = sessions[3]
    n = sum(s.trials[i].n_bins for i in s.evaluation)
    assert r["normalization_bins"] == {s.name: n}
    assert r["normalization"].endswith(f"session {s.name} has only {n} ({n * 0.02:.1f} s), all of them used")
