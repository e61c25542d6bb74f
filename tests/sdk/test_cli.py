"""The closedloop CLI: inspect verifies and renders, run drives the loop, errors are clear."""

from __future__ import annotations

import json
import shutil

import pytest

from closedloop.sdk.cli import main


def test_inspect_prints_and_verifies(gru_bundle, capsys):
    assert main(["inspect", str(gru_bundle)]) == 0
    out = capsys.readouterr().out
    assert "family generic" in out and "state -> h_out" in out
    assert "parity vs" in out and "variant fp16" in out and "TensorRT parser" in out
    assert "verified" in out
    # each variant's own parser verdict: the dynamically quantized int8 graph is not TensorRT-parsable
    int8 = next(line for line in out.splitlines() if "variant int8" in line)
    assert "TensorRT parser: NOT compatible" in int8 and "MatMulInteger" in int8


def test_inspect_reports_tampering(gru_bundle, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(gru_bundle, bad)
    with open(bad / "main.onnx", "ab") as f:
        f.write(b"\x00")
    assert main(["inspect", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "REFUSED" in out and "file main.onnx:" in out and "changed after export" in out  # its size, here


def test_inspect_json(gru_bundle, capsys):
    assert main(["inspect", str(gru_bundle), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["problems"] == [] and d["manifest"]["family"] == "generic"


def test_backends_lists_availability(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "onnxruntime" in out and "numba" in out and "tensorrt" in out


def test_backends_say_the_same_thing_the_same_way(gru_bundle, capsys):
    """A script reads one form: an available backend's version, and with a bundle that it runs the graph."""
    assert main(["backends", "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert main(["backends", str(gru_bundle), "--json"]) == 0
    with_bundle = json.loads(capsys.readouterr().out)
    assert alone["onnxruntime"] == {"available": True, "reason": alone["onnxruntime"]["reason"]}
    assert alone["onnxruntime"]["reason"].startswith("onnxruntime ")
    for name, verdict in with_bundle.items():
        if verdict["available"]:
            assert verdict["reason"] == f"{alone[name]['reason']}; runs this graph", (name, verdict)
        else:
            assert verdict["reason"], name  # an unavailable backend always says why


def test_run_reports_summary(mlp_bundle, capsys):
    assert main(["run", str(mlp_bundle), "--duration", "0.3", "--backend", "numba", "--json"]) == 0
    out = capsys.readouterr().out
    d = json.loads(out[out.index("{"):])
    assert d["steps"] > 100 and d["stopped_by"] == "duration"


def test_record_without_a_device_is_refused_not_ignored(mlp_bundle, tmp_path, capsys):
    # there is nothing to record without a device; before, the flag was dropped and no file appeared
    assert main(["run", str(mlp_bundle), "--duration", "0.1", "--record", str(tmp_path / "s.clrec")]) == 2
    assert "--record needs --device" in capsys.readouterr().err
    assert not (tmp_path / "s.clrec").exists()


@pytest.mark.parametrize("flags", [["--rate", "0"], ["--duration", "0"], ["--rate", "-50", "--device", "loop://"],
                                   ["--duration", "nan", "--device", "loop://"], ["--watchdog", "0"]])
def test_run_refuses_a_rate_or_duration_that_is_not_positive(mlp_bundle, flags, capsys):
    """``--rate 0`` is a mistake, not "the bundle's rate"; ``--duration 0`` would run nothing and exit 0."""
    assert main(["run", str(mlp_bundle), *flags]) == 2
    err = capsys.readouterr().err
    assert f"{flags[0]} " in err and "must be a positive number" in err and "leave it out" in err


def test_a_session_config_refuses_a_rate_of_zero_rather_than_reading_it_as_the_default():
    from closedloop.runtime import LoopConfig, SessionConfig

    with pytest.raises(ValueError, match="rate_hz 0"):
        SessionConfig(device="loop://", rate_hz=0)
    with pytest.raises(ValueError, match="duration_s"):
        LoopConfig(rate_hz=50, duration_s=0)


def test_a_link_that_echoes_the_hosts_hello_is_not_taken_for_a_device(mlp_bundle, capsys):
    """loop:// sends back what it is sent: the session's own HELLO is not a device with 0 channels."""
    assert main(["run", str(mlp_bundle), "--device", "loop://", "--duration", "1"]) == 2
    err = capsys.readouterr().err
    assert "answered with a host's HELLO" in err and "sim://headstage" in err and "n_channels=0" not in err


def test_an_unexpected_exception_is_an_internal_error_exit_70_not_a_failed_check(monkeypatch, capsys):
    """A script must not read a crash as a failed check (1) or bad input (2)."""
    from closedloop.sdk import cli

    def boom(a):
        raise IndexError("index 1 is out of bounds for axis 0 with size 1")

    monkeypatch.setitem(cli._COMMANDS, "backends", (*cli._COMMANDS["backends"][:2], boom))
    assert main(["backends"]) == 70
    err = capsys.readouterr().err
    assert "Traceback" in err and "closedloop backends: internal error: IndexError: index 1" in err and "bug" in err


def test_missing_bundle_is_a_clear_error(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    assert "no such file or folder" in capsys.readouterr().err


def test_generate_data_writes_loadable_falcon_files(tmp_path, capsys):
    from closedloop.sdk.bci.nwb import load_falcon_h2_dir

    assert main(["generate-data", str(tmp_path / "d"), "--preset", "tiny", "--seed", "3"]) == 0
    sessions = load_falcon_h2_dir(tmp_path / "d")
    assert [s.split for s in sessions].count("held_out") == 2
    held_out = [s for s in sessions if s.split == "held_out"][0]
    assert len(held_out.calibration) == 3 and held_out.evaluation
    assert (tmp_path / "d" / "handwriting_config.json").exists()
    # the generator's words, for evaluate --beam --lexicon on a file with no calibration sentences of its own
    from closedloop.sim.handwriting import VOCABULARY

    words = (tmp_path / "d" / "vocabulary.txt").read_text().split()
    assert words == list(VOCABULARY)
    assert all(w.strip(",~?") in words for t in held_out.trials for w in t.sentence.split(">"))
    # a second recording into the same folder would leave the first one's files beside its own: refused,
    # and --overwrite replaces the folder as a whole
    before = sorted(p.name for p in (tmp_path / "d").iterdir())
    assert main(["generate-data", str(tmp_path / "d"), "--preset", "tiny", "--seed", "4"]) == 2
    assert "not empty" in capsys.readouterr().err and sorted(p.name for p in (tmp_path / "d").iterdir()) == before
    (tmp_path / "d" / "old-session.nwb").write_bytes(b"")
    assert main(["generate-data", str(tmp_path / "d"), "--preset", "tiny", "--seed", "4", "--overwrite"]) == 0
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == before  # the stray file went with the old folder
