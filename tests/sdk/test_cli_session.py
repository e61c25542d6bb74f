"""The session commands end to end: run against an emulator with a recording, replay it,
convert it to NWB, summarise it; and `closedloop device` serving a real pty."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from closedloop.export import export_bundle
from closedloop.firmware_bridge import Hello, Link, NeuralFrame, open_pty_pair
from closedloop.sdk.cli import main
from closedloop.sdk.models import GRUDecoder

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def decoder_bundle(tmp_path_factory):
    torch.manual_seed(0)
    return export_bundle(
        GRUDecoder(12, 16, 1, 5).eval(), tmp_path_factory.mktemp("c") / "dec", kind="recurrent",
        example_input=torch.zeros(1, 12), rate_hz=50.0,
        extra={"session": {"input": "neural_frame", "command": "decoder_output"}},
        variants=(), tensorrt=False, report=lambda s: None,
    )


def test_run_record_replay_nwb(decoder_bundle, tmp_path, capsys):
    rec = tmp_path / "s.clrec"
    assert main(["run", str(decoder_bundle), "--device", "sim://headstage?channels=12&seed=2", "--duration", "1.2",
                 "--record", str(rec), "--backend", "numba", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "device headstage" in out and "recorded to" in out
    # the same bundle on another backend reproduces the recorded outputs within backend parity
    assert main(["replay", str(rec), "--bundle", str(decoder_bundle), "--backend", "onnxruntime",
                 "--tolerance", "1e-4"]) == 0
    assert "re-ran" in capsys.readouterr().out
    # by default on the session's own backend and variant, so the bundle that ran it reproduces it exactly
    assert main(["replay", str(rec), "--bundle", str(decoder_bundle), "--tolerance", "0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] == "numba" and report["variant"] == "fp32" and report["backend_note"] == ""
    assert report["outputs_compared"] > 40 and report["max_abs_diff"] == 0.0
    assert main(["recording", str(rec)]) == 0
    assert "OUTPUT" in capsys.readouterr().out
    nwb_path = tmp_path / "s.nwb"
    assert main(["export-nwb", str(rec), str(nwb_path)]) == 0
    from pynwb import NWBHDF5IO

    with NWBHDF5IO(str(nwb_path), "r") as io:
        f = io.read()
        spikes = f.acquisition["binned_spikes"]
        assert spikes.data.shape[1] == 12 and spikes.data.shape[0] >= 50
        assert np.all(np.diff(spikes.timestamps[:]) >= 0)  # host read times: frames read together share one
        outs = f.processing["closedloop"]["model_output"]
        assert outs.data.shape[1] == 5
        # one time axis: a frame is read before the output computed from it (host clock, first record = 0)
        assert 0 < spikes.timestamps[0] < outs.timestamps[0] < spikes.timestamps[-1] + 1
        device = f.acquisition["binned_spikes_device_clock"]  # the device's own clock, kept beside
        assert len(device.data) == spikes.data.shape[0] and np.all(np.diff(device.data[:]) > 0)
        np.testing.assert_allclose(np.diff(device.data[:]), 0.02, atol=1e-6)  # the emulator's 50 Hz bins
        notes = json.loads(f.notes)
        assert isinstance(notes["t0_host_ns"], int) and f.timestamps_reference_time == f.session_start_time
        # the DECODER_OUTPUTs sent, one per model output the session acted on (plus the closing safe one)
        decoded = f.processing["closedloop"]["decoder_outputs"]
        bins = decoded["bin_index"].data[:]
        assert len(bins) >= outs.data.shape[0] and len(decoded["text"].data[:]) == len(bins)
    # refuses to overwrite
    assert main(["export-nwb", str(rec), str(nwb_path)]) == 2
    # a bundle that reads another kind of input is refused, naming the recording's device and the bundle that ran
    # it (bad input, as a device that does not match a bundle at the handshake), not a silent 'nan' comparison
    torch.manual_seed(0)
    plant_reader = export_bundle(
        GRUDecoder(12, 16, 1, 5).eval(), tmp_path / "plant_reader", kind="recurrent",
        example_input=torch.zeros(1, 12), rate_hz=50.0, extra={"session": {"input": "plant_measurement"}},
        variants=(), tensorrt=False, report=lambda s: None)
    assert main(["replay", str(rec), "--bundle", str(plant_reader)]) == 2
    err = capsys.readouterr().err
    assert "its device does not fit bundle" in err and "replay it with the bundle that ran the session" in err


def test_a_recording_with_refused_frames_exports_plots_and_says_what_it_left_out(decoder_bundle, tmp_path, capsys,
                                                                                   caplog):
    """Frames of another size (a glitching device) are refused by the session; the recording of it still exports,
    plots and opens, leaving them out and saying so (they made every tool fail on a ragged array)."""
    rec = tmp_path / "g.clrec"
    assert main(["run", str(decoder_bundle), "--device", "sim://headstage?channels=12&seed=2&glitch=0.2",
                 "--duration", "1.2", "--record", str(rec), "--backend", "onnxruntime", "--quiet", "--json"]) == 0
    refused = json.loads(capsys.readouterr().out)["inputs_refused"]
    assert refused > 0
    nwb_path = tmp_path / "g.nwb"
    with caplog.at_level("WARNING"):
        assert main(["export-nwb", str(rec), str(nwb_path)]) == 0
    assert f"{refused} frame(s) of binned_spikes had another size" in caplog.text
    from pynwb import NWBHDF5IO

    with NWBHDF5IO(str(nwb_path), "r") as io:
        f = io.read()
        assert f.acquisition["binned_spikes"].data.shape[1] == 12
        notes = json.loads(f.notes)
        assert notes["frames_left_out"] == {"binned_spikes": refused}
        assert f.processing["closedloop"]["step_flags"].data.shape[0] > 0
        ident = f.identifier
    plot = tmp_path / "g.png"
    assert main(["recording", str(rec), "--plot", str(plot)]) == 0 and plot.stat().st_size > 10_000
    assert main(["recording", str(rec), "--plot", str(plot)]) == 2  # an existing file is not replaced...
    assert "already exists" in capsys.readouterr().err
    assert main(["recording", str(rec), "--plot", str(plot), "--overwrite"]) == 0  # ...unless asked
    # the recording itself is never the NWB file's path, --overwrite or not
    assert main(["export-nwb", str(rec), str(rec), "--overwrite"]) == 2
    assert "is the recording itself" in capsys.readouterr().err and rec.read_bytes().startswith(b"CLREC")
    # a copy under the same file name elsewhere is another session's file: another identifier
    other = tmp_path / "d2"
    other.mkdir()
    assert main(["run", str(decoder_bundle), "--device", "sim://headstage?channels=12&seed=3", "--duration", "0.3",
                 "--record", str(other / "g.clrec"), "--backend", "onnxruntime", "--quiet"]) == 0
    assert main(["export-nwb", str(other / "g.clrec"), str(other / "g.nwb")]) == 0
    with NWBHDF5IO(str(other / "g.nwb"), "r") as io:
        assert io.read().identifier != ident
    # a failed write (the path is a folder) leaves no partial file behind
    folder = tmp_path / "afolder"
    folder.mkdir()
    assert main(["export-nwb", str(rec), str(folder), "--overwrite"]) == 2
    assert not list(tmp_path.glob(".*.tmp.nwb"))


def test_replay_of_a_recording_without_outputs_compares_nothing_and_says_so(decoder_bundle, tmp_path, capsys):
    from closedloop.runtime.recording import MAGIC

    empty = tmp_path / "empty.clrec"
    empty.write_bytes(MAGIC)  # a session refused before it ran leaves no OUTPUT record
    assert main(["replay", str(empty), "--bundle", str(decoder_bundle), "--tolerance", "0"]) == 2
    assert "holds no model output to re-run" in capsys.readouterr().err


def test_device_command_serves_a_pty(tmp_path):
    host, dev = open_pty_pair()
    proc = subprocess.Popen(
        [sys.executable, "-m", "closedloop.sdk.cli", "device", "headstage", "--port", dev.path, "--channels", "7"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        link = Link(host)
        hello, frames = None, []
        for i in range(300):
            # The device may announce its HELLO before it has heard ours (ours can arrive before it
            # listens): keep saying HELLO until it streams.
            if not frames and i % 10 == 0:
                link.send(Hello(kind="host"))
            f = link.recv(0.05)
            if f is None:
                continue
            if isinstance(f.message, Hello):
                hello = f.message
            elif isinstance(f.message, NeuralFrame):
                frames.append(f.message)
                if len(frames) >= 5:
                    break
        assert hello is not None and hello.kind == "headstage" and hello.n_channels == 7
        assert [m.counts.size for m in frames] == [7] * 5
        assert [m.bin_index for m in frames] == list(range(frames[0].bin_index, frames[0].bin_index + 5))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        host.close()
        dev.close()


def test_replay_falls_back_and_says_so_where_the_sessions_backend_cannot_run(decoder_bundle):
    from closedloop.runtime import load_bundle
    from closedloop.runtime.replay import _replay_model

    b = load_bundle(decoder_bundle)
    model, note = _replay_model(b, {"backend": "no-such-backend", "variant": "int8w"}, "recorded", None)
    assert model.backend_name in ("onnxruntime", "numba") and (model.variant or "fp32") == "fp32"  # no int8w
    assert "variant int8w, which this bundle does not hold" in note
    assert "ran on no-such-backend, which cannot run here" in note and "rounding" in note
    model, note = _replay_model(b, {}, "recorded", None)
    assert "does not name the session's backend" in note
    with pytest.raises(ValueError, match="--variant bogus: bundle .* holds fp32"):  # a variant asked for by name
        _replay_model(b, {"backend": "numba"}, "recorded", "bogus")
    model, note = _replay_model(b, {"backend": "numba"}, "onnxruntime", None)  # asked for by name: as given
    assert model.backend_name == "onnxruntime" and note == ""


def test_a_recording_that_cannot_be_written_on_is_said_and_the_session_goes_on_to_its_end(decoder_bundle, tmp_path,
                                                                                           monkeypatch, capsys):
    """A full disk mid-session: the session keeps its device controlled to its end, says the recording stopped,
    prints its summary with recording_error and exits 1 (not a clean end: data were lost); the file keeps what was
    written, readable, and nothing piles up in memory meanwhile."""
    import errno
    import os

    from closedloop.runtime import RecordingReader
    from closedloop.runtime import recording as recording_module

    class FullDisk:  # the recording's os module: its writes fail with ENOSPC past 6,000 bytes, as a full disk's do
        written = 0

        def __getattr__(self, name):
            return getattr(os, name)

        def write(self, fd, data):
            room = 6_000 - self.written
            if room <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            n = os.write(fd, bytes(data)[:room])
            self.written += n
            return n

    monkeypatch.setattr(recording_module, "os", FullDisk())
    rec = tmp_path / "full.clrec"
    rc = main(["run", str(decoder_bundle), "--device", "sim://headstage?channels=12&seed=2", "--duration", "2.0",
               "--record", str(rec), "--backend", "onnxruntime", "--json"])
    out, err = capsys.readouterr()
    assert rc == 1, err[-2000:]
    summary = json.loads(out)
    assert summary["loop"]["stopped_by"] == "duration" and summary["commands_sent"] > 50
    assert summary["recording_error"].startswith("OSError: [Errno 28] No space left on device (6,000 bytes kept; ")
    assert "records, the SUMMARY among them, not written)" in summary["recording_error"]
    assert "warning: the recording stopped: OSError: [Errno 28] No space left on device; the session goes on" in err
    assert "closedloop run: error: the recording" in err
    reader = RecordingReader(rec)
    assert rec.stat().st_size == 6_000 and reader.meta and reader.summary is None


def test_a_session_whose_every_input_was_refused_says_the_model_never_acted(tmp_path, capsys):
    """Every measurement of the device not finite: the session sends only the safe command; run says so on stderr
    (its exit code stays 0: no safety rule stopped it, and the summary holds the counts)."""
    from closedloop.sdk.models import MLPPolicy

    torch.manual_seed(1)
    bundle = export_bundle(MLPPolicy(1, 1, (8,)).eval(), tmp_path / "ctl", kind="feedforward",
                           example_input=torch.zeros(1, 1), rate_hz=100.0, postprocess={"low": [-2.0], "high": [2.0]},
                           extra={"session": {"input": "plant_measurement", "command": "actuator_command"}},
                           variants=(), tensorrt=False, report=lambda s: None)
    rc = main(["run", str(bundle), "--device", "sim://plant?model=msd&rate=100&seed=1&nonfinite=1", "--duration", "1",
               "--backend", "onnxruntime", "--json"])
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert rc == 0 and summary["commands_sent"] == 0 and summary["nonfinite_inputs"] > 50
    assert "warning: the model never acted: every input frame was refused" in err
