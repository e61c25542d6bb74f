"""End to end: the C example headstage (firmware_bridge/c/examples/headstage_example.c), built
with the host compiler, serves a pty; a closedloop session runs a decoder bundle against it.

The C program makes the pty itself (``pty`` argument), prints ``pty /dev/pts/N`` and serves
the master end; the session opens ``/dev/pts/N`` as it would a USB serial port.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from closedloop import firmware_bridge

C_DIR = Path(firmware_bridge.__file__).parent / "c"
# The example defines _XOPEN_SOURCE 600 itself (posix_openpt, clock_gettime, sigaction).
CFLAGS = ["-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic", "-O2"]
SUMMARY = re.compile(r"frames_sent=(\d+) decoder_outputs=(\d+) host_hellos=(\d+) rejected=(\d+) lost=(-?\d+)")

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="ptys and termios need a POSIX OS")


@pytest.fixture(scope="module")
def headstage_exe(cc: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    exe = tmp_path_factory.mktemp("c") / "headstage_example"
    subprocess.run([cc, *CFLAGS, f"-I{C_DIR}", str(C_DIR / "examples" / "headstage_example.c"),
                    str(C_DIR / "closedloop_proto.c"), "-o", str(exe)], check=True, capture_output=True, text=True)
    return exe


def _first_line(proc: subprocess.Popen, timeout_s: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, "the C device printed no pty path"
    return proc.stdout.readline()


def test_c_headstage_runs_a_session_end_to_end(headstage_exe: Path, tmp_path: Path, watchdog_rule) -> None:
    torch = pytest.importorskip("torch")
    from closedloop.export import export_bundle
    from closedloop.runtime import SessionConfig, run_session
    from closedloop.sdk.models import GRUDecoder

    torch.manual_seed(0)
    # a plain export (no session block): the bundle adopts the device's HELLO kind, headstage
    bundle = export_bundle(GRUDecoder(12, 16, 1, 5).eval(), tmp_path / "neural", kind="recurrent",
                           example_input=torch.zeros(1, 12), rate_hz=50.0, variants=(), tensorrt=False,
                           report=lambda s: None)
    # 12 channels; stream for up to 30 s: the test stops it with SIGTERM once the session is over
    proc = subprocess.Popen([str(headstage_exe), "pty", "12", "30"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = _first_line(proc, 5.0)
        assert line.startswith("pty /dev/"), line
        path = line.split()[1]
        cfg = SessionConfig(device=path, duration_s=3.0, status=False, backend="onnxruntime",
                            record=str(tmp_path / "s.clrec"))
        s = run_session(bundle, cfg)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    m = SUMMARY.search(out)
    assert m, out
    frames_sent, decoder_outputs, host_hellos, rejected, lost = map(int, m.groups())

    assert s.device["kind"] == "headstage" and s.device["n_channels"] == 12
    # ~150 frames in 3 s; a bundle reading neural frames runs on every one of them, in order
    assert s.frames_received > 100 and s.inputs_used > 100 and s.inputs_skipped == 0
    assert s.link["lost"] == 0 and s.link["crc_errors"] == 0 and s.link["malformed"] == 0
    assert s.disconnects == 0
    # a trip only on a real silence of the input: a loaded 2-core CI machine can starve the device process
    from closedloop.firmware_bridge import NeuralFrame

    watchdog_rule(cfg.record, cfg.watchdog_s, NeuralFrame, s.watchdog_trips)
    # the device heard every command the session sent: one per input used, plus safe ones, plus
    # the safe command at the end
    sent = s.commands_sent + s.safe_commands_sent + s.commands_resent
    assert abs(decoder_outputs - sent) <= 2, (out, s.commands_sent, s.safe_commands_sent, s.commands_resent)
    assert rejected == 0 and lost == 0 and host_hellos >= 1 and frames_sent >= s.inputs_used
    assert not os.path.exists(path)  # the pty went away with the device
