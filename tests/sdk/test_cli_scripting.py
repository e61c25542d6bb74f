"""The CLI as a script sees it: --version, exit codes, --json on stdout only, quiet broken pipes, usage per subcommand."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

CLI = [sys.executable, "-m", "closedloop.sdk.cli"]


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def test_version_prints_the_installed_version():
    from importlib import metadata

    r = _run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"closedloop {metadata.version('closedloop')}"


def test_a_subcommands_bad_flag_shows_that_subcommands_usage(mlp_bundle):
    r = _run("inspect", str(mlp_bundle), "--no-such-flag")
    assert r.returncode == 2
    assert "usage: closedloop inspect" in r.stderr and "--no-such-flag" in r.stderr


def test_an_unknown_flag_before_the_command_is_named(capsys):
    from closedloop.sdk.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--frob", "inspect", "B"])
    assert e.value.code == 2 and "unrecognized arguments: --frob" in capsys.readouterr().err


def test_v_and_q_work_before_or_after_the_command():
    from closedloop.sdk.cli import build_parser, verbosity

    parser = build_parser()
    for argv, verbose, quiet in ((["-q", "inspect", "B"], 0, True), (["inspect", "B", "-q"], 0, True),
                                 (["-vv", "run", "B"], 2, False), (["run", "B", "-v"], 1, False),
                                 (["inspect", "B"], 0, False),
                                 # given in both places, the one after the command counts (docs/cli.md)
                                 (["-q", "run", "B", "-v"], 1, False), (["-vv", "inspect", "B", "-q"], 0, True)):
        args, extra = parser.parse_known_args(argv)
        assert (*verbosity(args), extra) == (verbose, quiet, []), argv


def test_a_synthetic_run_of_a_window_over_channels_and_time_runs(tmp_path):
    """No --device on an EEGNet-style bundle, input (batch, 1, channels, time): each synthetic frame is the
    channels' values in a row, as a device's frame is (it was (1, channels) and stopped the run)."""
    import torch
    from torch import nn

    from closedloop.export import Window, export_bundle

    net = nn.Sequential(nn.Conv2d(1, 2, (1, 5)), nn.Conv2d(2, 2, (4, 1)), nn.Flatten(), nn.Linear(2 * 12, 3)).eval()
    export_bundle(net, tmp_path / "eeg", kind="feedforward", example_input=torch.zeros(1, 1, 4, 16), rate_hz=50.0,
                  windows={"x": Window(length=16, hop=4, layout="channel_major")}, variants=(), tensorrt=False,
                  report=lambda s: None)
    r = _run("run", str(tmp_path / "eeg"), "--backend", "numba", "--duration", "0.4", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["steps"] > 10


def test_every_argument_of_every_command_says_what_it_is_in_help():
    import argparse

    from closedloop.sdk.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    silent = [f"{name} {act.option_strings or act.dest}" for name, p in sub.choices.items() for act in p._actions
              if not act.help and act.dest != "help"]
    assert len(sub.choices) >= 20 and silent == []


@pytest.mark.parametrize("args", [("inspect", "{b}", "--json"), ("backends", "{b}", "--json")])
def test_json_commands_print_only_json_on_stdout(mlp_bundle, args):
    r = _run(*(a.format(b=mlp_bundle) for a in args))
    assert r.returncode == 0, r.stderr
    json.loads(r.stdout)  # the whole of stdout is one JSON document


def test_a_synthetic_run_with_json_keeps_its_log_lines_off_stdout(mlp_bundle):
    r = _run("run", str(mlp_bundle), "--backend", "onnxruntime", "--duration", "0.3", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["stopped_by"] == "duration" and summary["steps"] > 0
    assert "synthetic frames" in r.stderr


def test_an_overrun_stop_is_a_safety_stop_exit_1(mlp_bundle):
    # A 1 MHz loop cannot keep a deadline: with --overrun stop the loop ends at the first overrun.
    r = _run("run", str(mlp_bundle), "--backend", "onnxruntime", "--rate", "1000000", "--overrun", "stop",
             "--duration", "2", "--json")
    assert r.returncode == 1, r.stderr
    assert json.loads(r.stdout)["stopped_by"] == "overrun"


@pytest.mark.parametrize("sig,code,stopped_by", [(signal.SIGINT, 130, "interrupt"), (signal.SIGTERM, 0, "terminated")],
                         ids=["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_ends_a_run_cleanly(mlp_bundle, sig, code, stopped_by):
    """Ctrl-C exits 130; SIGTERM (``kill PID``, ``systemctl stop`` of the packaged service) is the normal stop, 0.
    Either way the loop ends after its step and prints its summary (the safe command: tests/runtime/test_session.py)."""
    p = subprocess.Popen([*CLI, "run", str(mlp_bundle), "--backend", "onnxruntime", "--duration", "60", "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    seen = ""
    while "synthetic frames" not in seen and time.monotonic() < deadline:  # the loop is running
        line = p.stderr.readline()
        if not line:
            break
        seen += line
    time.sleep(0.5)
    p.send_signal(sig)
    out, err = p.communicate(timeout=60)
    assert p.returncode == code, seen + err
    summary = json.loads(out)  # the summary still comes out
    assert summary["stopped_by"] == stopped_by, summary


def test_a_closed_pipe_is_quiet(mlp_bundle):
    # The reader is gone before the command writes (it closes its end at once; the command needs a
    # second to start): every write meets EPIPE, as under `closedloop inspect B | head -0`.
    p = subprocess.Popen([*CLI, "inspect", str(mlp_bundle), "--json"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err


def _silent_device():
    """A TCP device that accepts the connection and never says HELLO: the session stays in its handshake."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    return server, f"socket://127.0.0.1:{server.getsockname()[1]}"


def _start_run_in_handshake(bundle, device: str) -> tuple[subprocess.Popen, int]:
    """``closedloop run --monitor 0`` against ``device``; returns the process and the monitor's port once it serves."""
    p = subprocess.Popen([*CLI, "run", str(bundle), "--backend", "onnxruntime", "--device", device, "--duration", "5",
                          "--handshake-timeout", "60", "--monitor", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stderr.readline()  # "monitor: URL", on stderr (stdout is the summary's), before the device is opened
    assert line.startswith("monitor: http://127.0.0.1:"), line + p.stderr.read()
    return p, int(line.split(":")[3].split("/")[0])


def _port_closes(port: int, within_s: float) -> bool:
    import socket

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        except OSError:
            return True
        time.sleep(0.1)
    return False


def test_sigterm_during_the_handshake_closes_everything_and_ends_by_the_signal(mlp_bundle):
    """Before the loop runs (a device that never answers), SIGTERM unwinds: the monitor's server stops and frees its
    port, a message says why, and the process then ends by SIGTERM itself, as a supervisor expects."""
    server, device = _silent_device()
    with server:
        p, port = _start_run_in_handshake(mlp_bundle, device)
        time.sleep(0.5)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    assert p.returncode == -signal.SIGTERM, err
    assert "closedloop run: terminated (SIGTERM)" in err and "Traceback" not in err, err
    assert _port_closes(port, within_s=1.0)  # closed by the unwinding, not left to the server's own watch


def test_a_killed_session_leaves_no_monitor_behind(mlp_bundle):
    """SIGKILL gives the session no chance to stop its monitor: the server sees its parent gone and exits."""
    server, device = _silent_device()
    with server:
        p, port = _start_run_in_handshake(mlp_bundle, device)
        p.kill()
        p.communicate(timeout=60)
        assert _port_closes(port, within_s=10.0)


def test_values_a_script_might_produce_are_bad_input_not_tracebacks(tmp_path, capsys):
    """Found by a scripting pass over every command: each was a traceback (exit 1 or 70), a crash after the work, or
    a number that cannot mean anything taken as given. Each is exit 2 now, saying what was wrong."""
    from closedloop.sdk.cli import main

    assert main(["-v", "device", "--list"]) == 0  # -v before a command that parses its own arguments
    capsys.readouterr()
    assert main(["-q", "device", "headstage", "--port", ""]) == 2
    assert "closedloop device: error: '' names no port" in capsys.readouterr().err
    assert main(["doctor", "--jitter-seconds", "inf"]) == 2
    assert "--jitter-seconds inf" in capsys.readouterr().err
    import torch

    from closedloop.export import export_bundle
    from closedloop.sdk.models import MLPPolicy

    plant = export_bundle(MLPPolicy(1, 1, (8,)).eval(), tmp_path / "plant", kind="feedforward",
                          example_input=torch.zeros(1, 1), rate_hz=50.0, postprocess={"low": [-2.0], "high": [2.0]},
                          extra={"session": {"input": "plant_measurement", "command": "actuator_command"}},
                          variants=(), tensorrt=False, report=lambda s: None)
    rec = tmp_path / "s.clrec"
    assert main(["run", str(plant), "--device", "sim://plant?model=msd&rate=50", "--duration", "0.5",
                 "--record", str(rec), "--quiet"]) == 0
    capsys.readouterr()
    for tol in ("nan", "-1"):
        assert main(["replay", str(rec), "--bundle", str(plant), "--tolerance", tol]) == 2
        assert f"--tolerance {tol}" in capsys.readouterr().err.replace("nan", "nan")
    assert main(["recording", str(rec), "--plot", str(rec), "--overwrite"]) == 2
    assert "is the recording itself" in capsys.readouterr().err and rec.read_bytes().startswith(b"CLREC")
    for flag, value, said in (("--max-miss", "nan", "--max-miss nan"), ("--max-safe", "2", "--max-safe 2"),
                              ("--backend", "bogus", "--backend 'bogus': unknown")):
        assert main(["validate", str(plant), "--device", "sim://plant?model=msd&rate=50", "--sessions", "1",
                     "--duration", "1", "--no-ray", "--out", str(tmp_path / "v"), flag, value]) == 2, flag
        assert said in capsys.readouterr().err, flag


def test_an_empty_string_is_refused_not_read_as_the_current_folder_or_no_device(mlp_bundle):
    """A script's unset variable gives "": `inspect ""` inspected the current folder, `run --device ""` ran on
    synthetic frames, `rl-train --out ""` wrote into the current folder."""
    for args in (["inspect", ""], ["run", str(mlp_bundle), "--device", "", "--duration", "0.2"]):
        r = _run(*args)
        assert r.returncode == 2 and "given as an empty string" in r.stderr, (args, r.stderr)
        assert f"usage: closedloop {args[0]}" in r.stderr
