"""A device that restarts behind an open port (a USB-serial adapter stays present while its board reboots).

The board comes back at seq 0 and says HELLO once a second until a host answers: the session must
re-handshake (answer it, restart its sequence tracking, check the device against the bundle again,
record it) and act on the stream again within a second, and replay must reset where the session did.
A board that comes back as another device is refused as at the first handshake.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from closedloop.export import export_bundle
from closedloop.firmware_bridge import (
    ActuatorCommand,
    FrameParser,
    Hello,
    Link,
    PlantMeasurement,
)
from closedloop.runtime import (
    DeviceMismatchError,
    RecordingReader,
    RecordType,
    SessionConfig,
    replay_recording,
    run_session,
)
from closedloop.sdk.models import GRUDecoder

pytestmark = pytest.mark.timing  # wall-clock bounds: make test runs this file alone, after the parallel part

RATE_HZ = 100.0


class GRUController(GRUDecoder):
    """A recurrent controller: a command in [-1, 1] (never exactly the safe 0), not log-probabilities."""

    def forward(self, seq: torch.Tensor, h: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        y, h = self.gru(seq, h)
        return torch.tanh(self.readout(y)), h

    def step(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, h = self.gru(x.unsqueeze(1), h)
        return torch.tanh(self.readout(y[:, 0])), h


@pytest.fixture(scope="module")
def recurrent_plant_bundle(tmp_path_factory):
    # recurrent, so a replay that reset its state anywhere else than the session did would not reproduce it
    torch.manual_seed(3)
    return export_bundle(
        GRUController(1, 8, 1, 1).eval(), tmp_path_factory.mktemp("reset") / "gru-ctl", kind="recurrent",
        example_input=torch.zeros(1, 1), rate_hz=RATE_HZ, name="gru-ctl",
        postprocess={"scale": [1.0], "low": [-2.0], "high": [2.0]},
        extra={"session": {"input": "plant_measurement", "command": "actuator_command"}},
        variants=(), tensorrt=False, report=lambda s: None,
    )


def _tx(path, kind):
    p = FrameParser()
    return [(rec.host_ns, f.message) for rec in RecordingReader(path).of_type(RecordType.TX)
            for f in p.feed(rec.payload) if isinstance(f.message, kind)]


def test_a_device_reset_mid_session_is_re_handshaken_and_streams_again(recurrent_plant_bundle, tmp_path):
    cfg = SessionConfig(device=f"sim://plant?model=msd&rate={RATE_HZ:g}&seed=7&reset_at=0.6&reset_s=0.3",
                        duration_s=3.0, record=str(tmp_path / "reset.clrec"), status=False, backend="onnxruntime")
    s = run_session(recurrent_plant_bundle, cfg)
    reader = RecordingReader(cfg.record)
    events = [(rec.host_ns, rec.json()) for rec in reader.of_type(RecordType.EVENT)]
    again = [(t, e) for t, e in events if e["event"] == "rehandshake"]
    assert again, [e["event"] for _, e in events]
    t_hello, first = again[0]
    assert first["seq"] == 0 and first["silent_s"] >= 0.3  # the restarted board's first frame, after its reset
    checked = [e for t, e in events if e["event"] == "device_hello" and t <= t_hello][-1]
    assert checked["device"]["kind"] == "plant" and not checked["problems"] and not checked["answer"]
    assert s.link["seq_resets"] >= 1
    # the host answered it at once, and the device streamed again: inputs used within 1 s of the HELLO
    hellos_sent = [t for t, m in _tx(cfg.record, Hello) if m.kind == "host" and t >= t_hello]
    assert hellos_sent and (hellos_sent[0] - t_hello) / 1e9 < 0.1
    used_after = [rec.host_ns for rec in reader.of_type(RecordType.OUTPUT) if rec.host_ns > t_hello]
    assert used_after and (used_after[0] - t_hello) / 1e9 < 1.0, (used_after[:1], t_hello)
    recovered = used_after[0]
    assert len(used_after) >= 0.5 * RATE_HZ * (reader.summary["loop"]["wall_s"] - 2.0)  # and kept acting
    # after the recovery the session acts on the stream: safe commands (u = 0) are the exception, not the
    # rule (the last one is the stop's; a loaded machine may starve the emulator into a watchdog trip)
    after = [m.u[0] for t, m in _tx(cfg.record, ActuatorCommand) if t > recovered]
    safe = sum(1 for u in after if u == 0.0)
    assert len(after) > 50 and safe <= 0.2 * len(after), (safe, len(after))
    # replay resets the recurrent state where the session did and reproduces every output
    rep = replay_recording(cfg.record, recurrent_plant_bundle, backend="onnxruntime")
    assert rep.outputs_compared == s.inputs_used and rep.missing_inputs == 0
    assert rep.max_abs_diff <= 1e-6


def _board(port, first: Hello, again: Hello, stop: threading.Event, reset_after_s: float) -> None:
    """A board that streams as ``first`` for ``reset_after_s``, then reboots and announces itself as ``again``
    once a second."""
    link = Link(port, role="device")
    start, hello, streaming, k, next_announce = None, first, False, 0, 0.0
    while not stop.is_set():
        now = time.monotonic()
        if hello is first and start is not None and now - start > reset_after_s:
            link = Link(port, role="device")  # rebooted: seq 0, no host history
            hello, streaming, next_announce = again, False, now
        for f in link.poll():
            if isinstance(f.message, Hello):
                link.send(hello)
                streaming = True
                start = now if start is None else start
        if not streaming and now >= next_announce:
            link.send(hello)
            next_announce = now + 1.0
        if streaming:
            link.send(PlantMeasurement(y=[0.01 * k], u=[0.0]))
            k += 1
        time.sleep(1 / RATE_HZ)


@pytest.mark.parametrize("kind,n_channels,expect", [
    ("plant", 2, "streams frames of n_channels=2"),
    ("acme-plant", 1, "kind changed from 'plant' to 'acme-plant'"),
])
def test_a_device_that_comes_back_as_another_is_refused(recurrent_plant_bundle, tmp_path, kind, n_channels,
                                                         expect, pty_board):
    limits = dict(rate_hz=RATE_HZ, command_low=np.array([-5.0]), command_high=np.array([5.0]))
    first = Hello(kind="plant", name="board", n_channels=1, **limits)
    again = Hello(kind=kind, name="board", n_channels=n_channels, **limits)
    port = pty_board(lambda end, stop: _board(end, first, again, stop, 0.5))
    cfg = SessionConfig(device=port, duration_s=3.0, record=str(tmp_path / "other.clrec"), status=False,
                        backend="onnxruntime")
    with pytest.raises(DeviceMismatchError) as e:
        run_session(recurrent_plant_bundle, cfg)
    msg = str(e.value)
    # the refusal names the port, the bundle, and each problem with both values
    assert f"device at {port} does not match bundle" in msg and expect in msg, msg
    # the exception carries the session's summary (what `closedloop run --json` prints before exit 1)
    assert e.value.summary.error.startswith("DeviceChangedError: ") and e.value.summary.inputs_used > 0
    assert e.value.summary.loop.stopped_by == "device_changed"  # a safety stop, named as one
    assert "give --record another path" not in msg  # that advice is for a session refused before it ran
    reader = RecordingReader(cfg.record)
    # the first handshake passed (META is written after it) and the session acted on the first board
    assert reader.meta["device"]["kind"] == "plant" and reader.meta["device"]["n_channels"] == 1
    assert list(reader.of_type(RecordType.OUTPUT))
    events = [(rec.host_ns, rec.json()) for rec in reader.of_type(RecordType.EVENT)]
    refused = [(t, ev) for t, ev in events if ev["event"] == "device_hello" and ev["problems"]]
    assert refused and refused[0][1]["device"]["kind"] == kind
    t_refused = refused[0][0]
    assert not [m for t, m in _tx(cfg.record, Hello) if t > t_refused]  # not answered: it must not stream
    last = _tx(cfg.record, ActuatorCommand)[-1]
    assert last[0] > t_refused and last[1].u[0] == 0.0  # the safe command went out on the way out
    # and the recording still ends with a SUMMARY that says why the session stopped
    assert reader.summary["loop"]["stopped_by"] == "device_changed" and reader.summary["stop_commands_sent"] == 1
    assert reader.summary["error"].startswith("DeviceChangedError: ") and expect in reader.summary["error"]
    assert reader.summary["inputs_used"] == len(list(reader.of_type(RecordType.OUTPUT)))
