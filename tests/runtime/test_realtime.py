"""Real-time settings (runtime/realtime.py, closedloop run --rt): what is granted is what the kernel reports,
refusals name the part and the fix, and everything is restored after the loop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from closedloop.runtime import RecordingReader, RecordType, SessionConfig, run_session
from closedloop.runtime.realtime import (
    EMULATOR_PRIORITY,
    RealtimeConfig,
    RealtimeError,
    apply_realtime,
    emulator_realtime,
    format_grant,
    realtime,
)

pytestmark = [pytest.mark.skipif(not hasattr(os, "sched_setscheduler"), reason="SCHED_FIFO needs Linux"),
              pytest.mark.timing]  # wall-clock bounds: make test runs this file alone, after the parallel part
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def _state():
    return os.sched_getscheduler(0), os.sched_getparam(0).sched_priority, os.sched_getaffinity(0)


@pytest.fixture(scope="module")
def plant_bundle(tmp_path_factory):
    import torch

    from closedloop.export import export_bundle
    from closedloop.sdk.models import MLPPolicy

    torch.manual_seed(1)
    return export_bundle(
        MLPPolicy(1, 1, (8,)).eval(), tmp_path_factory.mktemp("rt") / "plant", kind="feedforward",
        example_input=torch.zeros(1, 1), rate_hz=200.0, name="plant-ctl",
        postprocess={"low": [-2.0], "high": [2.0]},
        extra={"session": {"input": "plant_measurement", "command": "actuator_command"}},
        variants=(), tensorrt=False, report=lambda s: None,
    )


@pytest.mark.skipif(not IS_ROOT, reason="granting SCHED_FIFO needs root here")
def test_grant_is_what_the_kernel_reports_and_is_restored():
    before = _state()
    go, seen = threading.Event(), {}

    def earlier() -> None:  # started before: the settings are the calling thread's only (pid 0 is the thread)
        go.wait()
        seen["earlier"] = os.sched_getscheduler(0)

    t = threading.Thread(target=earlier)
    t.start()
    with realtime(RealtimeConfig(priority=10, cpu=0)) as grant:
        assert os.sched_getscheduler(0) == os.SCHED_FIFO and grant.policy == "SCHED_FIFO"
        assert os.sched_getparam(0).sched_priority == grant.priority == 10
        assert os.sched_getaffinity(0) == set(grant.cpus) == {0}
        assert grant.memory_locked and grant.thread_id == threading.get_native_id()
        go.set()
        t.join()
        later = threading.Thread(target=lambda: seen.setdefault("later", os.sched_getscheduler(0)))
        later.start()
        later.join()
    assert seen == {"earlier": os.SCHED_OTHER, "later": os.SCHED_FIFO}  # a thread started by the loop inherits
    assert _state() == before
    d = grant.to_dict()
    assert d["asked"] == {"policy": "SCHED_FIFO", "priority": 10, "cpu": 0, "lock_memory": True}
    assert d["granted"]["policy"] == "SCHED_FIFO" and d["granted"]["cpus"] == [0]


@pytest.mark.parametrize("cfg, part, words", [
    (RealtimeConfig(cpu=4096), "cpu", ["CPU 4096", "give --cpu one of them"]),
    (RealtimeConfig(priority=100, cpu=0), "scheduler", ["priority 100", "1 to 99", "--priority"]),
    (RealtimeConfig(priority=0), "scheduler", ["priority 0", "1 to 99"]),
])
def test_an_impossible_setting_is_refused_by_name_and_nothing_stays_applied(cfg, part, words):
    before = _state()
    with pytest.raises(RealtimeError) as err:
        apply_realtime(cfg)
    assert err.value.part == part
    for w in words:
        assert w in str(err.value), str(err.value)
    assert _state() == before  # the pinning applied before the refused priority is undone


@pytest.mark.skipif(not IS_ROOT, reason="drops to an unprivileged user to see the kernel refuse")
def test_an_unprivileged_process_is_refused_with_what_to_do():
    # a real refusal: a child drops to nobody, whose RLIMIT_RTPRIO is 0 and RLIMIT_MEMLOCK small
    code = ("import os\nfrom closedloop.runtime.realtime import RealtimeConfig, RealtimeError, apply_realtime\n"
            "os.setgid(65534); os.setuid(65534)\n"
            "for cfg in (RealtimeConfig(cpu=0), RealtimeConfig(lock_memory=False)):\n"
            "    try:\n        apply_realtime(cfg)\n        print('granted')\n"
            "    except RealtimeError as e:\n        print(e.part, '|', e, '|', sorted(os.sched_getaffinity(0)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stdout + out.stderr
    assert lines[0].startswith("memory_lock | --rt: locking memory (mlockall) was refused")
    assert lines[1].startswith("scheduler | --rt: SCHED_FIFO at priority 80 was refused")
    for line in lines:
        assert "setcap cap_sys_nice,cap_ipc_lock+ep" in line and "LimitRTPRIO=80" in line
        assert "LimitMEMLOCK=infinity" in line
        assert line.endswith(str(sorted(os.sched_getaffinity(0))))  # the pinning was undone


@pytest.mark.skipif(not IS_ROOT, reason="granting SCHED_FIFO needs root here")
def test_session_records_what_was_asked_and_granted(plant_bundle, tmp_path):
    before = _state()
    rec = tmp_path / "rt.clrec"
    cfg = SessionConfig(device="sim://plant?model=msd&rate=200&seed=1", duration_s=1.0, status=False,
                        backend="onnxruntime", record=str(rec), rt=True, rt_cpu=0, rt_priority=20)
    s = run_session(plant_bundle, cfg)
    assert _state() == before
    g = s.realtime["granted"]
    assert s.realtime["asked"] == {"policy": "SCHED_FIFO", "priority": 20, "cpu": 0, "lock_memory": True}
    assert g["policy"] == "SCHED_FIFO" and g["priority"] == 20 and g["cpus"] == [0]
    assert g["memory_locked"] and g["gc_frozen"] and g["thread_id"] == threading.get_native_id()
    assert "real time: SCHED_FIFO priority 20 on CPU 0, memory locked, gc frozen" in s.format()
    # the sim:// emulator stands for a device: its frames keep their clock whatever else runs on the machine
    emu = s.realtime["emulator"]
    assert emu["policy"] == "SCHED_FIFO" and emu["priority"] == EMULATOR_PRIORITY
    assert emu["cpus"] == (sorted(os.sched_getaffinity(0) - {0}) or sorted(os.sched_getaffinity(0)))
    assert f"the device emulator (pid {emu['pid']}) SCHED_FIFO priority {EMULATOR_PRIORITY}" in s.format()
    # an emulator that can only share the loop's CPU (a session pinned to it, as a unit's CPUAffinity= pins) says so
    assert ("the loop's too" in s.format()) == (0 in emu["cpus"])

    assert s.commands_sent > 0
    r = RecordingReader(rec)
    assert r.meta["config"]["rt"] is True and r.meta["config"]["rt_cpu"] == 0
    assert r.meta["config"]["rt_priority"] == 20
    events = [e.json() for e in r.of_type(RecordType.EVENT)]
    rt_events = [e for e in events if e["event"] == "realtime"]
    assert len(rt_events) == 1 and rt_events[0]["granted"] == g
    assert r.summary["realtime"] == s.realtime


@pytest.mark.skipif(not IS_ROOT, reason="granting SCHED_FIFO needs root here")
def test_a_device_emulator_runs_as_a_device_for_the_loop_only_and_a_refusal_keeps_it_going():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        before = os.sched_getscheduler(p.pid), os.sched_getparam(p.pid).sched_priority, os.sched_getaffinity(p.pid)
        loop_cpu = min(os.sched_getaffinity(0))
        with emulator_realtime(p.pid, loop_cpu) as got:
            assert os.sched_getscheduler(p.pid) == os.SCHED_FIFO
            assert got == {"pid": p.pid, "policy": "SCHED_FIFO", "priority": EMULATOR_PRIORITY,
                           "cpus": sorted(os.sched_getaffinity(p.pid))}
            if len(before[2]) > 1:
                assert loop_cpu not in os.sched_getaffinity(p.pid)  # never on the loop's CPU where there is another
        after = os.sched_getscheduler(p.pid), os.sched_getparam(p.pid).sched_priority, os.sched_getaffinity(p.pid)
        assert after == before
    finally:
        p.kill()
        p.wait()
    with emulator_realtime(p.pid, loop_cpu) as got:  # the process is gone: said, and nothing raises
        assert got["pid"] == p.pid and "refused" in got and "ProcessLookupError" in got["refused"]
    with emulator_realtime(None, loop_cpu) as got:  # a real device: nothing to schedule
        assert got == {}


def test_the_line_says_when_the_emulator_shares_the_loops_cpu():
    grant = {"granted": {"policy": "SCHED_FIFO", "priority": 80, "cpus": [1], "memory_locked": True,
                         "gc_frozen": True},
             "emulator": {"pid": 7, "policy": "SCHED_FIFO", "priority": 1, "cpus": [1]}}
    assert "on CPU 1 (the loop's too: the process may use no other CPU" in format_grant(grant)
    grant["emulator"]["cpus"] = [0]
    assert "the loop's too" not in format_grant(grant)

def test_session_without_rt_records_nothing_and_a_refusal_names_the_part(plant_bundle):
    base = dict(device="sim://plant?model=msd&rate=200&seed=2", duration_s=0.3, status=False, backend="onnxruntime")
    s = run_session(plant_bundle, SessionConfig(**base))
    assert s.realtime == {} and "real time" not in s.format()
    before = _state()
    with pytest.raises(RealtimeError, match="pinning the loop to CPU 4096 was refused") as err:
        run_session(plant_bundle, SessionConfig(**base, rt=True, rt_cpu=4096))
    assert err.value.part == "cpu" and _state() == before


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "closedloop.sdk.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.skipif(not IS_ROOT, reason="granting SCHED_FIFO needs root here")
def test_closedloop_run_rt_subprocess(plant_bundle):
    out = _cli("run", str(plant_bundle), "--rt", "--cpu", "0", "--duration", "1", "--backend", "onnxruntime")
    assert out.returncode == 0, out.stderr
    assert "real time: SCHED_FIFO priority 80 on CPU 0, memory locked, gc frozen" in out.stdout
    out = _cli("run", str(plant_bundle), "--rt", "--cpu", "0", "--priority", "30", "--duration", "0.5",
               "--backend", "onnxruntime", "--json")
    assert out.returncode == 0, out.stderr
    rt = json.loads(out.stdout)["realtime"]
    assert rt["granted"] == {**rt["granted"], "policy": "SCHED_FIFO", "priority": 30, "cpus": [0],
                             "memory_locked": True, "gc_frozen": True}
    out = _cli("run", str(plant_bundle), "--device", "sim://plant?model=msd&rate=200", "--rt", "--cpu", "0",
               "--duration", "0.5", "--backend", "onnxruntime", "--quiet")
    assert out.returncode == 0, out.stderr
    assert "real time: SCHED_FIFO priority 80 on CPU 0" in out.stdout


def test_closedloop_run_refusals_exit_2_with_the_reason(plant_bundle):
    out = _cli("run", str(plant_bundle), "--rt", "--priority", "100", "--duration", "0.2", "--backend", "onnxruntime")
    assert out.returncode == 2 and "SCHED_FIFO at priority 100 was refused" in out.stderr, out.stderr
    out = _cli("run", str(plant_bundle), "--cpu", "0", "--duration", "0.2")
    assert out.returncode == 2 and "add --rt" in out.stderr, out.stderr
