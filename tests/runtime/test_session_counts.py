"""The session summary counts every command that went on the wire, the stop's safe command included."""

from __future__ import annotations

import pytest
import torch

from closedloop.export import export_bundle
from closedloop.firmware_bridge import ActuatorCommand, FrameParser
from closedloop.runtime import RecordingReader, RecordType, SessionConfig, run_session
from closedloop.sdk.models import MLPPolicy


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    torch.manual_seed(1)
    return export_bundle(
        MLPPolicy(1, 1, (8,)).eval(), tmp_path_factory.mktemp("counts") / "ctl", kind="feedforward",
        example_input=torch.zeros(1, 1), rate_hz=200.0, name="ctl", postprocess={"low": [-2.0], "high": [2.0]},
        extra={"session": {"input": "plant_measurement", "command": "actuator_command"}},
        variants=(), tensorrt=False, report=lambda s: None,
    )


def test_summary_command_counts_equal_the_commands_on_the_wire(bundle, tmp_path):
    # a silence makes the watchdog send safe commands too; the session ends with one more safe command
    cfg = SessionConfig(device="sim://plant?model=msd&rate=200&seed=4&silence_at=0.4&silence_s=0.4",
                        duration_s=1.5, watchdog_s=0.15, record=str(tmp_path / "c.clrec"), status=False,
                        backend="onnxruntime")
    s = run_session(bundle, cfg)
    parser = FrameParser()
    reader = RecordingReader(cfg.record)
    wire = [f.message for rec in reader.of_type(RecordType.TX) for f in parser.feed(rec.payload)
            if isinstance(f.message, ActuatorCommand)]
    assert s.safe_commands_sent > 1 and s.commands_sent > 50
    assert s.stop_commands_sent == 1
    assert s.commands_sent + s.safe_commands_sent + s.commands_resent + s.stop_commands_sent == len(wire)
    assert wire[-1].u[0] == 0.0  # the last one is the stop's safe command
    recorded = reader.summary
    assert (recorded["commands_sent"] + recorded["safe_commands_sent"] + recorded["commands_resent"]
            + recorded["stop_commands_sent"]) == len(wire)
