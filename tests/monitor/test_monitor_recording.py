"""A recording in the monitor's page (closedloop monitor FILE) and as a figure (closedloop recording --plot)."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from closedloop.export import export_bundle
from closedloop.runtime import SessionConfig, run_session
from closedloop.runtime.recording_view import view_recording
from closedloop.sdk.models import MLPPolicy


@pytest.fixture(scope="module")
def plant_recording(tmp_path_factory):
    torch.manual_seed(1)
    root = tmp_path_factory.mktemp("monrec")
    bundle = export_bundle(
        MLPPolicy(1, 1, (8,)).eval(), root / "plant", kind="feedforward", example_input=torch.zeros(1, 1),
        rate_hz=200.0, name="plant-ctl", postprocess={"scale": [5.0], "offset": [3.0], "low": [-2.0], "high": [2.0]},
        extra={"session": {"input": "plant_measurement", "command": "actuator_command"}},
        variants=(), tensorrt=False, report=lambda s: None,
    )
    rec = root / "plant.clrec"
    s = run_session(bundle, SessionConfig(device="sim://plant?model=msd&rate=200&seed=5&silence_at=1.0&silence_s=0.6",
                                          duration_s=2.5, watchdog_s=0.15, status=False, backend="onnxruntime",
                                          record=str(rec)))
    return rec, s


def test_the_view_holds_each_steps_timing_the_inputs_commands_and_events(plant_recording):
    rec, s = plant_recording
    v = view_recording(rec)
    assert v.steps["step"].size == s.loop.steps
    assert np.all(v.steps["latency_us"] > 0) and np.all(np.diff(v.steps["t_s"]) > 0)
    assert len(v.inputs["plant_output_y"]) == s.inputs_used + s.inputs_skipped  # every measurement frame
    assert len(v.commands) == s.commands_sent + s.safe_commands_sent + s.commands_resent + s.stop_commands_sent
    safe_steps = int(((v.steps["flags"] & 4) != 0).sum())
    assert safe_steps > 0 and "watchdog" in [e["event"] for _, e in v.events]


def test_recording_plot_writes_a_png(plant_recording, tmp_path):
    rec, _ = plant_recording
    out = tmp_path / "session.png"
    r = subprocess.run([sys.executable, "-m", "closedloop.sdk.cli", "recording", str(rec), "--plot", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def _serve(rec, *args):
    """``closedloop monitor REC --port 0 ARGS...`` in a child process; its first stdout line is the URL."""
    return subprocess.Popen([sys.executable, "-m", "closedloop.sdk.cli", "monitor", str(rec), "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_monitor_shows_a_recording_with_a_time_slider(plant_recording, page, screenshot_dir):
    pytest.importorskip("aiohttp", reason="the monitor needs the [monitor] extra (aiohttp)")
    rec, s = plant_recording
    p = _serve(rec)
    try:
        line = p.stdout.readline()
        assert line.startswith("monitor: http://127.0.0.1:"), line + p.stderr.read()
        url = line.split()[1]
        page.goto(url)
        page.wait_for_function("() => monitorState.step > 0", timeout=30_000)
        at_end = page.evaluate("() => monitorState.step")
        assert at_end == int(view_recording(rec).steps["step"][-1])  # the slider starts at the end
        assert page.is_visible("#slider")
        # at the end, the session's own counts (every missed deadline, not those of the steps drawn), how long after
        # its step each command went out, and that the session ended (how, among the events)
        end = page.evaluate("() => ({missed: document.getElementById('missed').textContent,"
                            " cmd: document.getElementById('cmdp99').textContent,"
                            " state: document.getElementById('state').textContent,"
                            " events: monitorState.events.map((e) => [e.event, e.stopped_by])})")
        assert int(end["missed"]) == s.loop.missed_deadlines and end["cmd"].endswith(" us"), end
        assert end["state"] == "ended" and ["recording_end", "duration"] in end["events"], end
        page.evaluate("() => { const s = document.getElementById('slider'); s.value = '1.3'; "
                      "s.dispatchEvent(new Event('input')); }")  # inside the silence
        time.sleep(0.3)
        mid = page.evaluate("() => ({step: monitorState.step, state: document.getElementById('state').textContent,"
                            " watchdog: document.getElementById('watchdog').textContent,"
                            " missed: +document.getElementById('missed').textContent})")
        assert 0 < mid["step"] < at_end and mid["state"] == "SAFE" and mid["watchdog"] == "1"
        assert mid["missed"] <= int(end["missed"])
        # each input frame shown has beside it the output of the run that read it (the same frame sequence number),
        # and none where the loop skipped the frame for a newer one
        paired = page.evaluate("() => ({inp: monitorState.inp.length, seq: monitorState.inpSeq,"
                               " out: monitorState.inpOut})")
        v = view_recording(rec)
        by_seq = dict(zip(v.outputs.seq, v.outputs.values, strict=True))
        assert paired["inp"] > 20 and len(paired["seq"]) == len(paired["out"]) == paired["inp"], paired
        assert sum(s in by_seq for s in paired["seq"]) >= 0.5 * paired["inp"]  # most frames were read
        for s, out in zip(paired["seq"], paired["out"], strict=True):
            if s not in by_seq:
                assert out is None, (s, out)
            else:
                np.testing.assert_allclose(out, by_seq[s], rtol=1e-5)
        page.screenshot(path=str(screenshot_dir / "monitor_recording.png"))
    finally:
        p.terminate()
        p.communicate(timeout=10)


def test_a_recording_is_served_beyond_this_machine_only_with_public_and_its_token(plant_recording):
    pytest.importorskip("aiohttp", reason="the monitor needs the [monitor] extra (aiohttp)")
    import urllib.error
    import urllib.request

    rec, _ = plant_recording
    refused = _serve(rec, "--host", "0.0.0.0")
    out, err = refused.communicate(timeout=60)
    assert refused.returncode == 2 and out == ""
    assert "reachable from other machines" in err and "--public" in err

    p = _serve(rec, "--host", "0.0.0.0", "--public")
    try:
        line, remote = p.stdout.readline(), p.stdout.readline()
        # as a live session prints them: the URL for this machine, then the one other machines use
        assert line.startswith("monitor: http://127.0.0.1:") and "?token=" in line, line + p.stderr.read()
        assert remote.startswith("monitor from other machines: http://") and line.split("?token=")[1].split()[0] in remote
        url = line.split()[1]
        port, token = url.split(":")[2].split("/")[0], url.split("?token=")[1]
        base = f"http://127.0.0.1:{port}/"
        with pytest.raises(urllib.error.HTTPError) as no_token:
            urllib.request.urlopen(base, timeout=10)
        assert no_token.value.code == 403
        with pytest.raises(urllib.error.HTTPError) as wrong:
            urllib.request.urlopen(base + "ws?token=wrong", timeout=10)
        assert wrong.value.code == 403
        page = urllib.request.urlopen(base + "?token=" + token, timeout=10)
        assert page.status == 200 and b"<html" in page.read().lower()
    finally:
        p.terminate()
        _, err = p.communicate(timeout=10)
    assert "warning: serving" in err


def test_the_recordings_own_counts_as_a_live_session_gives_them():
    """Missed deadlines: steps over their period plus the periods skipped after them, counted from the start; a
    command's delay: from the start of the latest step that began before it."""
    from closedloop.runtime.monitor.recording_server import command_delays_us, missed_so_far

    steps = {"step": np.array([0, 1, 2, 5, 6]), "t_s": np.array([0.0, 0.01, 0.02, 0.05, 0.06]),
             "latency_us": np.array([100.0, 12_000.0, 100.0, 100.0, 100.0]),
             "lateness_us": np.array([0.0, 0.0, -50.0, 9_950.0, 0.0])}
    assert missed_so_far(steps, 10_000.0).tolist() == [0, 1, 1, 3 + 1, 4]  # step 1 overran; 3, 4 skipped; 5 late
    np.testing.assert_allclose(command_delays_us(steps, np.array([-0.001, 0.0003, 0.0551])), [np.nan, 300.0, 5100.0])


def test_a_port_outside_the_range_is_bad_input(plant_recording, capsys):
    from closedloop.sdk.cli import main

    rec, _ = plant_recording
    for port in ("70000", "-1"):
        assert main(["monitor", str(rec), "--port", port]) == 2
        err = capsys.readouterr().err
        assert f"--port {port} is outside 0..65535" in err and "Traceback" not in err


def test_a_generic_decoders_outputs_are_its_commands_in_the_view_and_the_figure(tmp_path):
    """A generic decoder sends DECODER_OUTPUTs with values and no text: the view's commands are those values (its
    figure draws them, under a title without 'typed:'), not a flat 'characters typed' line."""
    from closedloop.sdk.models import GRUDecoder
    from closedloop.sdk.recording_plot import plot_recording

    torch.manual_seed(0)
    bundle = export_bundle(
        GRUDecoder(12, 8, 1, 5).eval(), tmp_path / "dec", kind="recurrent", example_input=torch.zeros(1, 12),
        rate_hz=50.0, extra={"session": {"input": "neural_frame", "command": "decoder_output"}},
        variants=(), tensorrt=False, report=lambda s: None,
    )
    rec = tmp_path / "dec.clrec"
    s = run_session(bundle, SessionConfig(device="sim://headstage?channels=12&seed=2", duration_s=1.0, status=False,
                                          backend="onnxruntime", record=str(rec)))
    v = view_recording(rec)
    # every command sent is in the view: the model's, and the safe ones (a watchdog trip on a loaded host) and at stop
    sent = s.commands_sent + s.safe_commands_sent + s.commands_resent + s.stop_commands_sent
    assert v.text == "" and len(v.commands) == sent and s.commands_sent > 10
    assert v.commands.array().shape[1] == 5
    out = plot_recording(rec, tmp_path / "dec.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
