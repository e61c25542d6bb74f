"""Windows over a stream: a device streaming single frames drives a model that takes the last T frames.

A bundle input with ``window = {length, hop, layout}`` is fed one frame at a time; the runtime
keeps the frames in a ring buffer and runs the model every ``hop`` frames once ``length`` frames
have arrived. Streaming gives exactly what the model gives on the same windows offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from closedloop.export import export_bundle
from closedloop.firmware_bridge import DecoderOutput, FrameParser
from closedloop.runtime import (
    BundleError,
    Model,
    RecordingReader,
    RecordType,
    SessionConfig,
    load_bundle,
    run_session,
)
from closedloop.runtime.integrity import seal_manifest
from closedloop.runtime.manifest import MANIFEST_NAME

CHANNELS, LENGTH = 4, 16


class TinyCNN(nn.Module):
    """(batch, channels, time) -> (batch, 3): Conv1d, ReLU, global average over time."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(CHANNELS, 6, kernel_size=3, padding=1)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).mean(dim=2))


class TimeMajor(nn.Module):
    """(batch, time, features) -> (batch, 2): a weighted sum over time, so the order of frames matters."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1, 1, LENGTH).view(1, LENGTH, 1))
        self.head = nn.Linear(CHANNELS, 2)

    def forward(self, x):
        return self.head((x * self.w).sum(dim=1))


def _with_window(path, window):
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    manifest["graphs"]["main"]["inputs"][0]["window"] = window
    (path / MANIFEST_NAME).write_text(json.dumps(seal_manifest(manifest)))
    return path


@pytest.fixture(scope="module")
def cnn_bundle(tmp_path_factory):
    torch.manual_seed(0)
    path = export_bundle(TinyCNN().eval(), tmp_path_factory.mktemp("w") / "cnn", kind="feedforward",
                         example_input=torch.zeros(1, CHANNELS, LENGTH), rate_hz=50.0, variants=(), tensorrt=False,
                         report=lambda s: None)
    return _with_window(path, {"length": LENGTH, "hop": 4, "layout": "channel_major"})


@pytest.fixture(scope="module")
def time_major_bundle(tmp_path_factory):
    torch.manual_seed(1)
    path = export_bundle(TimeMajor().eval(), tmp_path_factory.mktemp("w") / "tm", kind="feedforward",
                         example_input=torch.zeros(1, LENGTH, CHANNELS), rate_hz=50.0, variants=(), tensorrt=False,
                         report=lambda s: None)
    return _with_window(path, {"length": LENGTH, "hop": 1})


@pytest.mark.parametrize(("fixture", "layout"), [("cnn_bundle", "channel_major"), ("time_major_bundle", "time_major")])
def test_streaming_frames_equals_the_model_on_each_window_offline(request, fixture, layout):
    bundle = request.getfixturevalue(fixture)
    hop = load_bundle(bundle).graph().inputs[0].window.hop
    frames = np.random.default_rng(0).normal(size=(60, CHANNELS)).astype(np.float32)
    streamed = Model(bundle, backend="onnxruntime")
    outputs = [(i, y.copy()) for i, f in enumerate(frames) if (y := streamed.feed(f)) is not None]
    due = list(range(LENGTH - 1, len(frames), hop))
    assert [i for i, _ in outputs] == due
    offline = Model(bundle, backend="onnxruntime")
    for i, y in outputs:
        window = frames[i - LENGTH + 1 : i + 1]  # (time, features), oldest first
        x = window.T[None] if layout == "channel_major" else window[None]
        np.testing.assert_array_equal(y, offline.step(x))


class EEGNetStyle(nn.Module):
    """(batch, 1, channels, time) -> (batch, 3), the layout of EEGNet-style decoders: a temporal Conv2d, a depthwise
    spatial Conv2d over all channels, BatchNorm, ELU, average pooling over time, a linear read-out."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 4, (1, 5), padding=(0, 2), bias=False), nn.BatchNorm2d(4),
                                 nn.Conv2d(4, 8, (CHANNELS, 1), groups=4, bias=False), nn.BatchNorm2d(8), nn.ELU(),
                                 nn.AvgPool2d((1, 4)))
        self.head = nn.Linear(8 * (LENGTH // 4), 3)

    def forward(self, x):
        return self.head(self.net(x).flatten(1))


@pytest.fixture(scope="module")
def conv2d_bundle(tmp_path_factory):
    torch.manual_seed(2)
    module = EEGNetStyle()
    with torch.no_grad():  # BatchNorm statistics away from the identity, so a wrong frame order shows
        for bn in (module.net[1], module.net[3]):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
    module.eval()
    path = export_bundle(module, tmp_path_factory.mktemp("w") / "eegnet", kind="feedforward",
                         example_input=torch.zeros(1, 1, CHANNELS, LENGTH), rate_hz=50.0, variants=(), tensorrt=False,
                         windows={"x": {"length": LENGTH, "hop": 2, "layout": "channel_major"}}, report=lambda s: None)
    return module, path


@pytest.mark.parametrize("backend", ["onnxruntime", "numba"])
def test_a_window_over_several_feature_axes_streams_like_torch(conv2d_bundle, backend):
    # (batch, 1, channels, length): each frame is one value per channel; the window fills the last axis
    module, bundle = conv2d_bundle
    spec = load_bundle(bundle).graph().inputs[0]
    assert spec.frame_shape == (1, CHANNELS)
    frames = np.random.default_rng(3).normal(size=(40, CHANNELS)).astype(np.float32)
    streamed = Model(bundle, backend=backend)
    outputs = [(i, y.copy()) for i, f in enumerate(frames) if (y := streamed.feed(f)) is not None]
    assert [i for i, _ in outputs] == list(range(LENGTH - 1, len(frames), 2))
    for i, y in outputs:
        window = torch.from_numpy(frames[i - LENGTH + 1 : i + 1].T.copy()).view(1, 1, CHANNELS, LENGTH)
        with torch.no_grad():
            ref = module(window).numpy()
        np.testing.assert_allclose(y, ref, rtol=1e-3, atol=1e-4)  # the export's own parity tolerance


class OneChannel(nn.Module):
    """(batch, time) -> (batch, 2): one value per frame (an EMG envelope, one LFP channel), weighted over time."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(LENGTH, 2)

    def forward(self, x):
        return self.head(x)


@pytest.mark.parametrize("layout", ["time_major", "channel_major"])
def test_a_single_channel_window_streams_scalar_frames(tmp_path, layout):
    torch.manual_seed(4)
    module = OneChannel().eval()
    bundle = export_bundle(module, tmp_path / "one", kind="feedforward", example_input=torch.zeros(1, LENGTH),
                           rate_hz=50.0, variants=(), tensorrt=False, report=lambda s: None,
                           windows={"x": {"length": LENGTH, "hop": 3, "layout": layout}})
    assert load_bundle(bundle).graph().inputs[0].frame_shape == ()
    frames = np.random.default_rng(5).normal(size=40).astype(np.float32)
    m = Model(bundle, backend="onnxruntime")
    outputs = [(i, y.copy()) for i, f in enumerate(frames) if (y := m.feed(f)) is not None]
    assert [i for i, _ in outputs] == list(range(LENGTH - 1, len(frames), 3))
    for i, y in outputs:
        with torch.no_grad():
            ref = module(torch.from_numpy(frames[i - LENGTH + 1 : i + 1].copy())[None]).numpy()
        np.testing.assert_allclose(y, ref, rtol=1e-3, atol=1e-4)


def test_a_window_needs_fixed_sizes_past_the_batch(tmp_path, cnn_bundle):
    import shutil

    copy = shutil.copytree(cnn_bundle, tmp_path / "b")
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    manifest["graphs"]["main"]["inputs"][0]["shape"] = ["batch", "channels", LENGTH]
    (copy / MANIFEST_NAME).write_text(json.dumps(seal_manifest(manifest)))
    with pytest.raises(BundleError, match="batch on axis 0 and fixed sizes elsewhere"):
        load_bundle(copy)


def test_reset_empties_the_window(cnn_bundle):
    m = Model(cnn_bundle, backend="onnxruntime")
    frame = np.ones(CHANNELS, dtype=np.float32)
    assert [m.feed(frame) is not None for _ in range(LENGTH)][-1]
    m.reset()
    assert all(m.feed(frame) is None for _ in range(LENGTH - 1))


def test_a_frame_of_the_wrong_size_names_the_input_and_its_window(cnn_bundle):
    m = Model(cnn_bundle, backend="onnxruntime")
    with pytest.raises(ValueError, match=r"input 'x' \(channel_major window of 16 frames.*frame shape it takes is \(4,\)"):
        m.feed(np.zeros(5, dtype=np.float32))


def test_feed_on_a_model_without_a_window_says_to_use_step(mlp_bundle):
    with pytest.raises(ValueError, match="this model has none"):
        Model(mlp_bundle, backend="onnxruntime").feed(np.zeros(6, dtype=np.float32))


@pytest.mark.parametrize(("window", "message"), [
    ({"length": 8, "hop": 1, "layout": "channel_major"}, "axis 2 is 16, its window \\(channel_major\\) is 8 frames"),
    ({"length": 16, "hop": 4}, "axis 1 is 4, its window \\(time_major\\) is 16 frames; axis 2 is 16: the window is "
                               "channel_major"),  # the layout a user most often gets wrong: the hint says which
    ({"length": 16, "hop": 0}, "window hop must be a positive integer"),
    ({"length": 16, "layout": "sideways"}, "window layout 'sideways'"),
    ({"length": 16, "stride": 2}, "unknown window field"),
])
def test_a_window_that_does_not_fit_the_input_is_refused_at_load(tmp_path, cnn_bundle, window, message):
    import shutil

    copy = shutil.copytree(cnn_bundle, tmp_path / "b")
    _with_window(copy, window)
    with pytest.raises(BundleError, match=message):
        load_bundle(copy)


def test_a_headstage_streaming_single_frames_drives_the_windowed_cnn(cnn_bundle, tmp_path):
    record = tmp_path / "s.clrec"
    summary = run_session(cnn_bundle, SessionConfig(device=f"sim://headstage?channels={CHANNELS}&seed=2",
                                                    duration_s=1.5, status=False, backend="onnxruntime",
                                                    record=str(record)))
    assert summary.safe_commands_sent == 0 and summary.inputs_used >= 40
    parser = FrameParser()
    sent = [f.message for rec in RecordingReader(record).of_type(RecordType.TX) for f in parser.feed(rec.payload)
            if isinstance(f.message, DecoderOutput)]
    # one output every 4 frames once 16 have arrived (the closing safe command may add one)
    expected = (summary.inputs_used - LENGTH) // 4 + 1
    assert expected - 1 <= summary.commands_sent <= expected + 1
    assert len(sent) >= summary.commands_sent


def test_a_device_whose_frames_do_not_fit_the_window_is_refused_naming_both(cnn_bundle):
    from closedloop.runtime import DeviceMismatchError

    with pytest.raises(DeviceMismatchError, match=r"n_channels=5.*input 'x' takes a channel_major window of 16 frames of 4"):
        run_session(cnn_bundle, SessionConfig(device="sim://headstage?channels=5", duration_s=0.5, status=False,
                                              backend="onnxruntime"))


@pytest.mark.parametrize("layout", ["channel_major", "time_major"])
def test_a_window_exported_without_windows_is_refused_with_the_export_that_streams_it(tmp_path, layout):
    """A (batch, time, channels) or (batch, channels, time) input with no window takes a whole window per frame:
    the handshake's refusal says to export it with windows=, in the layout its shape has."""
    from closedloop.runtime import DeviceMismatchError

    module, shape = (TinyCNN(), (1, CHANNELS, LENGTH)) if layout == "channel_major" else (TimeMajor(), (1, LENGTH, CHANNELS))
    path = export_bundle(module.eval(), tmp_path / layout, kind="feedforward", example_input=torch.zeros(shape),
                         rate_hz=50.0, variants=(), tensorrt=False, report=lambda s: None)
    with pytest.raises(DeviceMismatchError, match=rf"n_channels={CHANNELS}, the bundle's input 'x' takes frames of "
                                                  rf"{CHANNELS * LENGTH} values.*if it is a window of {LENGTH} frames of "
                                                  rf"{CHANNELS} values, export it with windows=\{{'x': "
                                                  rf"Window\(length={LENGTH}, layout='{layout}'\)\}}"):
        run_session(path, SessionConfig(device=f"sim://headstage?channels={CHANNELS}", duration_s=0.5, status=False,
                                        backend="onnxruntime"))


def test_a_windowed_session_replays_to_the_same_outputs(cnn_bundle, tmp_path):
    from closedloop.runtime import replay_recording

    record = tmp_path / "w.clrec"
    summary = run_session(cnn_bundle, SessionConfig(device=f"sim://headstage?channels={CHANNELS}&seed=5",
                                                    duration_s=1.0, status=False, backend="onnxruntime",
                                                    record=str(record)))
    report = replay_recording(record, cnn_bundle, backend="onnxruntime")
    assert report.outputs_compared == summary.commands_sent and report.missing_inputs == 0
    assert report.max_abs_diff == 0.0 and report.outputs_not_due == 0
    # the same weights with a hop of 8: every other recorded output falls where its window is not due; those are
    # said as such, not as outputs whose input frame the recording lacks
    import shutil

    hop8 = _with_window(Path(shutil.copytree(cnn_bundle, tmp_path / "hop8")), {"length": LENGTH, "hop": 8,
                                                                               "layout": "channel_major"})
    other = replay_recording(record, hop8, backend="onnxruntime")
    assert other.missing_inputs == 0 and other.max_abs_diff == 0.0
    assert other.outputs_compared + other.outputs_not_due == report.outputs_compared
    assert abs(other.outputs_compared - other.outputs_not_due) <= 1
    assert f"{other.outputs_not_due} recorded outputs fall on input frames where this bundle's window was not due" \
        in other.format()


def test_inspect_shows_each_inputs_role_and_its_window(cnn_bundle, capsys):
    """What a user checks before a session: which input the device feeds, and the window the runtime keeps."""
    from closedloop.sdk.cli import main

    assert main(["inspect", str(cnn_bundle)]) == 0
    lines = capsys.readouterr().out.splitlines()
    x = next(line for line in lines if line.strip().startswith("in "))
    assert f"measurement, a window of the last {LENGTH} frames (channel_major), run every 4 frames" in x, x
    assert any(line.strip().startswith("out ") and line.rstrip().endswith("command") for line in lines), lines
