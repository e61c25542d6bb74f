"""``closedloop validate``: a batch of emulator sessions with faults, judged, recordings kept only where needed."""

from __future__ import annotations

import json

import pytest

from closedloop.sdk.cli import main
from closedloop.sdk.grid.validate import session_url

HEADSTAGE = "sim://headstage?channels=12&seed=3"


def test_a_faulty_batch_reports_every_session_and_deletes_the_recordings_of_those_that_behaved(
        gru_bundle, tmp_path, capsys):
    out = tmp_path / "v"
    code = main(["validate", str(gru_bundle), "--device", HEADSTAGE, "--sessions", "2", "--duration", "2.5",
                 "--faults", "drops,corruption,resets", "--out", str(out), "--backend", "onnxruntime",
                 "--max-miss", "0.2", "--no-ray", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads((out / "validate.json").read_text())
    sessions = report["session_summaries"]
    assert [s["index"] for s in sessions] == [0, 1] and code == (1 if report["misbehaved"] else 0)
    assert len({s["device"] for s in sessions}) == 2  # each session its own seed
    for s in sessions:
        assert s["steps"] > 0 and s["recording_records"] > 0
        # the faults reached the link: frames lost to drops, rejected for corruption, a re-handshake after the reset
        assert s["link"]["lost"] > 0 and s["link"]["crc_errors"] + s["link"]["malformed"] > 0, s["link"]
        assert s["link"]["seq_resets"] >= 1
        assert s["recording_kept"] == bool(s["misbehaved"])
    kept = sorted(p.name for p in out.glob("*.clrec"))
    assert kept == sorted(f"session-{s['index']:04d}.clrec" for s in sessions if s["misbehaved"])
    assert len((out / "sessions.jsonl").read_text().splitlines()) == 2


def test_a_session_whose_device_goes_silent_for_good_misbehaves_keeps_its_recording_and_fails_the_batch(
        gru_bundle, tmp_path, capsys):
    out = tmp_path / "v"
    code = main(["validate", str(gru_bundle), "--device", HEADSTAGE + "&silence_at=0.2&silence_s=30", "--sessions",
                 "1", "--duration", "1", "--no-ray", "--out", str(out), "--backend", "onnxruntime"])
    text = capsys.readouterr().out
    assert code == 1
    assert "session 0 misbehaved: safe command in" in text and "session-0000.clrec" in text
    report = json.loads((out / "validate.json").read_text())
    assert report["success_rate"] == 0.0 and report["recordings_kept"] == [str(out / "session-0000.clrec")]
    assert (out / "session-0000.clrec").stat().st_size > 0


def test_a_rerun_reuses_its_sessions_saying_so_and_a_changed_or_broken_bundle_is_not_reused(gru_bundle, tmp_path,
                                                                                          capsys):
    import shutil

    bundle = shutil.copytree(gru_bundle, tmp_path / "b")
    out = tmp_path / "v"
    argv = ["validate", str(bundle), "--device", HEADSTAGE, "--sessions", "1", "--duration", "1", "--no-ray",
            "--out", str(out), "--backend", "onnxruntime", "--max-miss", "1", "--json"]
    main(argv)
    assert json.loads(capsys.readouterr().out)["reused"] == 0
    main(argv)
    assert json.loads(capsys.readouterr().out)["reused"] == 1  # the same bundle and settings: taken from the file
    (bundle / "main.onnx").write_bytes(b"garbage")  # a bundle that no longer verifies: bad input, before any session
    assert main(argv) == 2
    assert "main.onnx" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--faults", "drops,floods"], "--faults floods: unknown; choose from drops,corruption,silences,resets"),
    (["--device", "loop://"], "validate runs against emulators"),
    (["--sessions", "0"], "--sessions 0: expected 1 or more"),
])
def test_bad_input_is_refused_saying_what_to_give(gru_bundle, tmp_path, capsys, args, message):
    base = {"--device": HEADSTAGE, "--sessions": "1", "--duration": "1", "--no-ray": None}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    argv = ["validate", str(gru_bundle), "--out", str(tmp_path)] + [x for kv in base.items() for x in kv if x is not None]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_misbehaving_device_is_refused_frame_by_frame_and_asked_for_nonfinite_inputs_are_not_misbehaviour(
        observer_bundle, tmp_path, capsys):
    out = tmp_path / "v"
    code = main(["validate", str(observer_bundle), "--device", "sim://plant?model=flexible-joint&rate=1000",
                 "--sessions", "1", "--duration", "2", "--faults", "glitches,nonfinite", "--no-ray", "--out", str(out),
                 "--max-miss", "1", "--json"])
    report = json.loads(capsys.readouterr().out)
    (s,) = report["session_summaries"]
    assert "glitch=0.01" in s["device"] and "nonfinite=0.01" in s["device"]
    assert s["inputs_refused"] > 0 and s["nonfinite_inputs"] > 0  # each refused, and the session went on
    assert s["stopped_by"] == "duration"
    assert not any("non-finite" in why for why in s["misbehaved"])  # what was asked for is not a finding
    assert code == (1 if report["misbehaved"] else 0)
    # a headstage's counts are integers: asking it for non-finite values is bad input, said before the batch
    assert main(["validate", str(observer_bundle), "--device", "sim://headstage", "--sessions", "1", "--duration",
                 "1", "--faults", "nonfinite", "--no-ray", "--out", str(tmp_path / "h")]) == 2
    assert "nonfinite=0.01: this device's data are integers" in capsys.readouterr().err


def test_with_trust_only_a_bundle_signed_by_a_trusted_key_is_validated(gru_bundle, tmp_path, capsys):
    import shutil

    bundle = shutil.copytree(gru_bundle, tmp_path / "b")
    assert main(["keygen", str(tmp_path / "lab")]) == 0
    argv = ["validate", str(bundle), "--device", HEADSTAGE, "--sessions", "1", "--duration", "1", "--no-ray",
            "--backend", "onnxruntime", "--max-miss", "1", "--trust", str(tmp_path / "lab.pub"), "--json"]
    assert main(argv + ["--out", str(tmp_path / "v1")]) == 2  # not signed: refused before any session
    assert "signed" in capsys.readouterr().err and not (tmp_path / "v1" / "sessions.jsonl").exists()
    assert main(["sign", str(bundle), "--key", str(tmp_path / "lab.key")]) == 0
    capsys.readouterr()
    main(argv + ["--out", str(tmp_path / "v2")])
    (s,) = json.loads(capsys.readouterr().out)["session_summaries"]
    assert s["steps"] > 0


@pytest.mark.parametrize("device", ["sim://headstage?channels=16", "sim://plant?model=msd"])
def test_a_device_the_bundle_does_not_fit_is_bad_input_said_once_before_the_batch(gru_bundle, tmp_path, capsys,
                                                                                 device):
    out = tmp_path / "v"
    code = main(["validate", str(gru_bundle), "--device", device, "--sessions", "3", "--duration", "1", "--no-ray",
                 "--out", str(out), "--backend", "onnxruntime"])
    err = capsys.readouterr().err
    assert code == 2 and "does not match bundle" in err, err  # the reasons, as closedloop run gives them
    assert not (out / "sessions.jsonl").exists()  # no session ran


def test_session_urls_get_their_own_seed_and_the_faults_without_overriding_what_the_url_gives():
    url = session_url("sim://plant?model=msd&drop=0.5", ("drops", "resets"), 2.0, 4)
    assert url == "sim://plant?model=msd&drop=0.5&seed=4&reset_at=0.6&reset_s=0.2"


def test_a_session_run_again_keeps_the_unfinished_attempts_recording_beside_its_own(gru_bundle, tmp_path, capsys):
    """A session whose earlier attempt never finished (its worker killed, the driver stopped) left its recording:
    the next attempt keeps it as .attemptN and records afresh, rather than failing on a file it may not
    overwrite."""
    out = tmp_path / "v"
    out.mkdir()
    (out / "session-0000.clrec").write_bytes(b"CLREC\x00\x01\x02")  # what a killed attempt leaves
    code = main(["validate", str(gru_bundle), "--device", HEADSTAGE, "--sessions", "1", "--duration", "1",
                 "--no-ray", "--out", str(out), "--backend", "onnxruntime", "--max-miss", "1", "--keep-all", "--json"])
    (s,) = json.loads(capsys.readouterr().out)["session_summaries"]
    assert code == 0 and s["steps"] > 0 and not s["misbehaved"]
    assert (out / "session-0000.clrec.attempt1").read_bytes() == b"CLREC\x00\x01\x02"
    assert (out / "session-0000.clrec").stat().st_size > 100


@pytest.mark.parametrize("sig, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_during_an_in_process_session_ends_the_batch_not_only_that_session(gru_bundle, tmp_path, sig, code):
    """With --no-ray the sessions run in the driver's process, whose loop takes Ctrl-C and SIGTERM to end itself
    cleanly; the batch ends with it (it went on to the next session), and a rerun picks it up."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "v"
    p = subprocess.Popen([sys.executable, "-m", "closedloop.sdk.cli", "validate", str(gru_bundle), "--device", HEADSTAGE,
                          "--sessions", "4", "--duration", "4", "--no-ray", "--out", str(out), "--backend",
                          "onnxruntime"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (out / "session-0000.clrec").exists():
        time.sleep(0.1)
    time.sleep(1.5)  # inside the first session's loop
    t0 = time.monotonic()
    p.send_signal(getattr(signal, sig))
    p.communicate(timeout=60)
    assert p.returncode == code and time.monotonic() - t0 < 10  # not three more sessions of 4 s
    assert not (out / "sessions.jsonl").read_text().strip()  # the interrupted session has no record: a rerun runs it
