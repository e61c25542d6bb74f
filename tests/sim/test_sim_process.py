"""Emulator processes: stopped and reaped on close, gone when the host dies, and runnable from the CLI."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from closedloop.firmware_bridge import (
    DecoderOutput,
    DeviceNotConnectedError,
    Hello,
    Link,
    NeuralFrame,
    Status,
    open_pty_pair,
)
from closedloop.firmware_bridge import open_transport as open_url
from closedloop.sim import StatusCode, cli_main

ROOT = Path(__file__).resolve().parents[2]


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _emulator_children() -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and b"-m\x00closedloop.sim\x00" in cmdline:
            kids.append(int(stat.parent.name))
    return kids


def test_close_stops_and_reaps_the_emulator():
    transport = open_url("sim://plant?model=msd")
    pid = transport.process.pid
    assert _running(pid) and pid in _emulator_children()
    transport.close()
    assert transport.process.returncode == 0  # SIGTERM: a clean stop
    assert not Path(f"/proc/{pid}").exists()  # reaped: no zombie
    assert _emulator_children() == []
    transport.close()  # twice is harmless


def test_forgotten_transport_is_cleaned_up_by_the_garbage_collector():
    transport = open_url("sim://headstage?channels=2")
    process = transport.process
    del transport
    gc.collect()
    assert process.poll() is not None and not _running(process.pid)


def test_emulator_exits_when_its_host_is_killed():
    code = ("import sys, time; from closedloop import sim; from closedloop.firmware_bridge import open_transport; "
            "t = open_transport('sim://headstage?channels=2'); print(t.process.pid, flush=True); time.sleep(60)")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    host = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env, cwd=ROOT)
    try:
        pid = int(host.stdout.readline())
        assert _running(pid)
        host.send_signal(signal.SIGKILL)
        host.wait(5)
        deadline = time.monotonic() + 6.0  # the emulator sees its pty vanish, retries 2 s, exits
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(pid), "emulator outlived its host (orphan)"
    finally:
        host.kill()
        host.wait()


def test_emulator_stops_without_reopening_when_its_host_closes_the_pty():
    transport = open_url("sim://headstage?channels=2")
    process = transport.process
    try:
        os.close(transport.fd)  # the master only: the pty is gone, its number free for the next one
        t0 = time.monotonic()
        code = process.wait(timeout=10.0)
        # it stops at once (exit 1, saying why) instead of reopening the path for reopen_s (2 s), which could
        # reach another host's new pty with the same number
        assert code == 1 and time.monotonic() - t0 < 1.5
        assert "closed its end" in transport.emulator_log()
    finally:
        transport.fd = -1  # already closed above
        transport.close()


def test_emulator_crash_closes_the_transport_with_the_reason(host):
    h = host("sim://headstage?channels=2")
    h.handshake()
    h.transport.process.send_signal(signal.SIGKILL)
    error = h.read_until_error(3.0)
    assert isinstance(error, DeviceNotConnectedError) and "exited with code -9" in str(error)
    assert not h.transport.is_open


def test_cli_serves_on_a_pty_path_and_prints_decoded_text_with_verbose():
    host_end, device_end = open_pty_pair()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "closedloop.sim", "headstage", "--port", device_end.path,
                             "--channels", "8", "--rate=100", "--verbose"], stderr=subprocess.PIPE, env=env, cwd=ROOT)
    try:
        link = Link(host_end)
        link.send(Hello(kind="host"))
        deadline = time.monotonic() + 10
        frame = None
        while time.monotonic() < deadline:
            frame = link.recv(0.5)
            if frame is not None and isinstance(frame.message, NeuralFrame):
                break
            link.send(Hello(kind="host"))  # the emulator may not have opened the port yet
        assert frame is not None and frame.message.n_channels == 8
        link.send(DecoderOutput(0, "hi there", np.zeros(0)))
        link.send(Status(int(StatusCode.REQUEST_REPORT)))
        while time.monotonic() < deadline:  # the REPORT comes after the DECODER_OUTPUT was handled
            frame = link.recv(0.5)
            if frame is not None and isinstance(frame.message, Status) and frame.message.code == StatusCode.REPORT:
                assert json.loads(frame.message.text)["decoded_text"] == "hi there"
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=5)
        host_end.close()
        device_end.close()
    assert proc.returncode == 0
    assert "hi there" in err.decode()


def test_cli_started_by_hand_says_it_serves_and_ctrl_c_exits_130():
    """A user who starts an emulator in a terminal sees that it is ready, and Ctrl-C ends it with the CLI's 130."""
    _host_end, device_end = open_pty_pair()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "closedloop.sim", "plant", "--port", device_end.path],
                            stderr=subprocess.PIPE, env=env, cwd=ROOT, text=True)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # blocks until the emulator has opened its port
        assert f"plant emulator serving on {device_end.path}" in line and "Ctrl-C" in line
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=5)
        _host_end.close()
        device_end.close()
    assert proc.returncode == 130


def test_cli_bad_arguments_exit_2(capsys):
    assert cli_main(["plant", "--port", "/dev/null", "--rate", "fast"]) == 2
    assert "rate='fast'" in capsys.readouterr().err
    assert cli_main(["plant", "--rate", "10"]) == 2
    assert "--port is required" in capsys.readouterr().err
    assert cli_main(["toaster", "--port", "/dev/null"]) == 2
    assert "known: headstage, panda, plant" in capsys.readouterr().err
    assert cli_main(["--list"]) == 0
    assert "headstage" in capsys.readouterr().out


def test_cli_on_a_missing_port_exits_2(capsys):
    assert cli_main(["plant", "--port", "/dev/does-not-exist"]) == 2  # bad input
    assert "cannot open /dev/does-not-exist" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["headstage", "plant"])
def test_cli_help_lists_parameters(name, capsys):
    assert cli_main([name, "--help"]) == 0
    out = capsys.readouterr().out
    assert "--rate" in out and "--drop" in out and "--disconnect_at" in out


def test_sim_url_opens_without_importing_the_simulators_first():
    """``sim://`` is found on first use (the closedloop.transports entry point), as a user's script expects."""
    code = ("import sys; from closedloop.firmware_bridge import open_transport; "
            "assert 'closedloop.sim' not in sys.modules; "
            "t = open_transport('sim://headstage?channels=2'); print(type(t).__name__); t.close()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "SimTransport"


def test_an_unknown_scheme_still_names_the_known_ones():
    from closedloop.firmware_bridge import UnknownTransportError, open_transport

    with pytest.raises(UnknownTransportError, match="known schemes:.*sim"):
        open_transport("nosuch://x")
