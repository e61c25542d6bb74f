"""A signed session replays: with its key every recorded frame's tag is checked again, without it the frames
replay unchecked and the report says so, and a wrong key is refused by the CLI with what to do."""

from __future__ import annotations

import pytest
import torch

from closedloop.export import export_bundle
from closedloop.runtime import SessionConfig, replay_recording, run_session
from closedloop.sdk.cli import main
from closedloop.sdk.models import MLPPolicy

KEY = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"


@pytest.fixture(scope="module")
def signed_session(tmp_path_factory):
    d = tmp_path_factory.mktemp("signed_replay")
    torch.manual_seed(1)
    bundle = export_bundle(
        MLPPolicy(1, 1, (8,)).eval(), d / "ctl", kind="feedforward", example_input=torch.zeros(1, 1),
        rate_hz=100.0, name="ctl", postprocess={"low": [-2.0], "high": [2.0]},
        extra={"session": {"input": "plant_measurement", "command": "actuator_command"}},
        variants=(), tensorrt=False, report=lambda s: None,
    )
    cfg = SessionConfig(device=f"sim://plant?model=msd&rate=100&seed=1&key={KEY}", duration_s=1.0, status=False,
                        backend="onnxruntime", record=str(d / "signed.clrec"))
    summary = run_session(bundle, cfg)
    assert summary.inputs_used > 30
    return bundle, cfg.record, summary


def test_replay_with_the_key_checks_every_tag_and_reproduces(signed_session):
    bundle, record, summary = signed_session
    rep = replay_recording(record, bundle, backend="onnxruntime", key=KEY)
    assert rep.outputs_compared == summary.inputs_used and rep.missing_inputs == 0
    assert rep.max_abs_diff <= 1e-6 and rep.signed_frames_refused == 0
    assert "checked with the given key" in rep.format()


def test_replay_without_the_key_runs_unchecked_and_says_so(signed_session):
    bundle, record, summary = signed_session
    rep = replay_recording(record, bundle, backend="onnxruntime")
    assert rep.outputs_compared == summary.inputs_used and rep.max_abs_diff <= 1e-6
    assert "replayed without checking their tags" in rep.format()


def test_replay_with_a_wrong_key_is_refused(signed_session, capsys):
    bundle, record, _ = signed_session
    rc = main(["replay", str(record), "--bundle", str(bundle), "--backend", "onnxruntime", "--key", "ff" * 32])
    assert rc == 1
    err = capsys.readouterr().err
    assert "failed their signature check" in err and "give the key the session ran with" in err


def test_the_recording_never_holds_the_link_secret_given_in_the_url(signed_session):
    """The key in a sim:// URL is the link's secret: META's device_url and config keep the URL with key=***."""
    from closedloop.runtime import RecordingReader

    _, record, _ = signed_session
    raw = open(record, "rb").read()
    assert KEY.encode() not in raw
    meta = RecordingReader(record).meta
    assert meta["device_url"].endswith("&key=***") and meta["config"]["device"] == meta["device_url"]
    assert meta["device_url"].startswith("sim://plant?model=msd&rate=100&seed=1")


def test_the_view_the_figure_and_the_nwb_of_a_signed_session_hold_its_frames_and_say_they_are_unchecked(
        signed_session, tmp_path):
    """The recording's readers without a key (the view, --plot, export-nwb) read a signed link's frames with their
    tags unchecked, and say so, rather than drop every frame and command unsaid."""
    import pynwb

    from closedloop.runtime.recording_view import view_recording
    from closedloop.sdk.nwb_export import recording_to_nwb

    _, record, s = signed_session
    view = view_recording(record)
    assert len(view.inputs["plant_output_y"]) == s.inputs_used + s.inputs_skipped
    assert len(view.commands) == s.commands_sent + s.safe_commands_sent + s.commands_resent + s.stop_commands_sent
    dev, host = view.signed_unchecked
    assert dev >= s.frames_received and host >= len(view.commands)
    assert any("the link was signed" in p and "without checking their tags" in p for p in view.problems())
    with pynwb.NWBHDF5IO(str(recording_to_nwb(record, tmp_path / "signed.nwb")), "r") as io:
        nwb = io.read()
        assert nwb.acquisition["plant_output_y"].data.shape[0] == len(view.inputs["plant_output_y"])
