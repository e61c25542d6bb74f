"""closedloop doctor: every check runs here and says pass / warn / fail with a message; a machine without /sys,
/proc or /dev gets 'cannot tell', never a crash; --json is one JSON document; the jitter probe measures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from closedloop.runtime.doctor import CHECKS, FAIL, PASS, WARN, DoctorConfig, run_doctor

pytestmark = pytest.mark.timing  # wall-clock bounds: make test runs this file alone, after the parallel part

EXPECTED = {"cpu_governor", "isolated_cpus", "preempt_rt", "sched_fifo", "mlockall", "timer_slack", "swap",
            "serial_ports", "usb_latency_timer", "onnxruntime", "tensorrt", "numba_cache", "c_scanner",
            "loop_jitter"}


@pytest.fixture(scope="module")
def report():
    return run_doctor(DoctorConfig(jitter_s=0.5))


def test_every_check_runs_and_says_what_it_found(report):
    assert set(CHECKS) == EXPECTED
    assert [c.name for c in report.checks] == list(CHECKS)
    for c in report.checks:
        assert c.status in (PASS, WARN, FAIL), c
        assert c.message and c.title, c
        if c.status != PASS and not c.message.startswith("cannot tell"):
            assert c.fix, f"{c.name}: {c.status} without what to do"
        assert "cannot tell (" not in c.message or c.message.index("cannot tell (") == 0
    # a check that errors is reported as one, so no result is a Python traceback in disguise
    assert not any("Error:" in c.message for c in report.checks), report.format()


def test_jitter_probe_reports_numbers(report):
    j = next(c for c in report.checks if c.name == "loop_jitter")
    assert j.data["rate_hz"] == 1000.0 and j.data["steps"] > 100
    for key in ("lateness_p99_us", "lateness_max_us", "missed_deadlines", "missed_fraction"):
        assert isinstance(j.data[key], (int, float)), key
    assert "lateness p99" in j.message and "missed deadlines" in j.message


@pytest.mark.skipif(sys.platform != "linux", reason="the rights are tried on Linux")
def test_rights_are_tried_for_real_here(report):
    import os

    by = {c.name: c for c in report.checks}
    if os.geteuid() == 0:  # root here: the kernel grants both (a container that forbids them would say fail)
        assert by["sched_fifo"].status == PASS and "granted" in by["sched_fifo"].message
        assert by["mlockall"].status == PASS
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the probe's thread was its own


def test_a_machine_without_sys_proc_or_dev_gets_warn_not_a_crash(tmp_path):
    r = run_doctor(DoctorConfig(root=str(tmp_path), only=["cpu_governor", "isolated_cpus", "preempt_rt", "swap",
                                                           "timer_slack", "serial_ports", "usb_latency_timer"]))
    assert len(r.checks) == 7
    for c in r.checks:
        assert c.status == WARN and c.message.startswith("cannot tell ("), (c.name, c.message)


def test_a_fake_sys_tree_is_read(tmp_path):
    cpu = tmp_path / "sys/devices/system/cpu"
    for n, gov in ((0, "performance"), (1, "powersave")):
        (cpu / f"cpu{n}/cpufreq").mkdir(parents=True)
        (cpu / f"cpu{n}/cpufreq/scaling_governor").write_text(gov + "\n")
    (cpu / "isolated").write_text("1\n")
    dev = tmp_path / "sys/bus/usb-serial/devices/ttyUSB0"
    dev.mkdir(parents=True)
    (dev / "latency_timer").write_text("16\n")
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/swaps").write_text("Filename Type Size Used Priority\n/swapfile file 1024 0 -2\n")
    by = {c.name: c for c in run_doctor(DoctorConfig(root=str(tmp_path), only=[
        "cpu_governor", "isolated_cpus", "usb_latency_timer", "swap"])).checks}
    assert by["cpu_governor"].status == WARN and "cpu1 powersave" in by["cpu_governor"].message
    assert "cpupower frequency-set -g performance" in by["cpu_governor"].fix
    assert by["isolated_cpus"].status == PASS and "1" in by["isolated_cpus"].message
    assert by["usb_latency_timer"].status == WARN and "ttyUSB0 16 ms" in by["usb_latency_timer"].message
    assert "echo 1 | sudo tee /sys/bus/usb-serial/devices/ttyUSB0/latency_timer" in by["usb_latency_timer"].fix
    assert by["swap"].status == WARN and "/swapfile" in by["swap"].message


def test_a_check_that_raises_is_a_warn(monkeypatch):
    from closedloop.runtime import doctor

    def broken(cfg):
        raise OSError("no such thing")

    monkeypatch.setitem(doctor.CHECKS, "swap", ("swap", broken))
    r = run_doctor(DoctorConfig(only=["swap"]))
    assert r.checks[0].status == WARN and r.checks[0].message == "cannot tell (OSError: no such thing)"


def test_unknown_check_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown doctor check.*nope.*expected one of"):
        run_doctor(DoctorConfig(only=["nope"]))


def test_cli_json_is_one_document_and_the_exit_code_follows_failures():
    out = subprocess.run([sys.executable, "-m", "closedloop.sdk.cli", "doctor", "--json", "--jitter-seconds", "0.3"],
                         capture_output=True, text=True, timeout=120)
    doc = json.loads(out.stdout)  # nothing else on stdout
    assert {c["name"] for c in doc["checks"]} == EXPECTED
    assert out.returncode == (1 if doc["counts"]["fail"] else 0) and doc["ok"] == (not doc["counts"]["fail"])
    text = subprocess.run([sys.executable, "-m", "closedloop.sdk.cli", "doctor", "--check", "swap",
                           "--check", "preempt_rt"], capture_output=True, text=True, timeout=60)
    assert text.returncode in (0, 1) and "swap:" in text.stdout and "PREEMPT_RT kernel:" in text.stdout
    assert text.stdout.rstrip().splitlines()[-1].endswith("fail")


def test_the_c_scanner_check_finds_a_built_library_and_names_a_missing_one(tmp_path, monkeypatch):
    from closedloop.firmware_bridge.c_library import _build, _compiler, _library_name

    monkeypatch.setenv("CLOSEDLOOP_CACHE_DIR", str(tmp_path / "empty"))
    missing = run_doctor(DoctorConfig(only=["c_scanner"])).checks[0]
    assert missing.status == WARN and str(tmp_path / "empty") in missing.message and "CLOSEDLOOP_CACHE_DIR" in missing.fix
    if _compiler() is None:
        pytest.skip("no C compiler here: the built case is not checked")
    _build(_compiler(), tmp_path / "built", _library_name())
    monkeypatch.setenv("CLOSEDLOOP_CACHE_DIR", str(tmp_path / "built"))
    found = run_doctor(DoctorConfig(only=["c_scanner"])).checks[0]
    assert found.status == PASS and found.data["library"].startswith(str(tmp_path / "built"))


def test_a_cache_another_user_owns_says_to_check_as_that_user(tmp_path, monkeypatch):
    """The service's cache belongs to its user: doctor run by someone else finds it not writable, and says whose it
    is and how to check as that user (whose rights the service has), rather than a bare permission error."""
    from closedloop.runtime import doctor

    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setattr(doctor, "_owner", lambda folder: "closedloop")
    monkeypatch.setattr(doctor, "_owner_of_me", lambda: "alice")
    ok, why = doctor._writable(blocked / "cache")  # not a folder that can be made: an OSError, as a denied one is
    assert not ok and "it belongs to user closedloop: run doctor as that user (sudo -u closedloop" in why
    monkeypatch.setattr(doctor, "_owner_of_me", lambda: "closedloop")
    assert "belongs to" not in doctor._writable(blocked / "cache")[1]  # one's own folder: the error alone
