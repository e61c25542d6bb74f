"""Per-step hooks: the step ring and the observer hub (runtime/observe/)."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import numpy as np
import pytest

from closedloop.runtime.observe import (
    FLAG_ACTED,
    FLAG_COMMAND,
    FLAG_SAFE,
    ObserverHub,
    SessionObserver,
    StepRing,
)

pytestmark = pytest.mark.timing  # wall-clock bounds: make test runs this file alone, after the parallel part


@pytest.fixture
def ring():
    r = StepRing.create(n_in=3, n_out=2, n_cmd=1, capacity=16, event_capacity=4, event_slot=256)
    yield r
    r.close()


def _write(ring: StepRing, k: int, flags: int = FLAG_ACTED) -> None:
    ring.begin(k, 1000 * k)
    np.copyto(ring.input_row(), np.array([k, k + 1, k + 2], dtype=np.float32))
    ring.set_input_seq(100 + k)
    ring.set_output(np.array([0.5 * k, -k], dtype=np.float32))
    ring.set_command(np.array([k], dtype=np.float32))
    ring.add_flags(flags)
    ring.publish(latency_ns=10 * k, lateness_ns=k)


def test_a_reader_gets_every_record_in_order_with_its_values(ring):
    for k in range(5):
        _write(ring, k)
    batch, cursor = ring.read(0)
    assert cursor == 5 and batch.lost == 0
    np.testing.assert_array_equal(batch.step, np.arange(5))
    np.testing.assert_array_equal(batch.inputs[:, 1], np.arange(5) + 1)
    np.testing.assert_array_equal(batch.outputs[:, 1], -np.arange(5))
    np.testing.assert_array_equal(batch.latency_ns, 10 * np.arange(5))
    np.testing.assert_array_equal(batch.input_seq, 100 + np.arange(5))
    again, cursor2 = ring.read(cursor)
    assert len(again) == 0 and cursor2 == cursor


def test_a_reader_that_falls_behind_loses_the_oldest_and_counts_them(ring):
    for k in range(40):
        _write(ring, k)
    batch, cursor = ring.read(0)
    assert cursor == 40
    # 16 slots; the one after the newest record is the next the writer fills, so 15 are readable.
    assert len(batch) == 15 and batch.lost == 25
    np.testing.assert_array_equal(batch.step, np.arange(25, 40))


def test_a_record_not_written_is_nan_and_flags_mark_the_safe_command(ring):
    ring.begin(0, 0)
    ring.add_flags(FLAG_SAFE)
    ring.publish(5, 1)
    batch, _ = ring.read(0)
    assert np.isnan(batch.outputs).all() and np.isnan(batch.command).all()
    assert batch.flags[0] == FLAG_SAFE and batch.input_seq[0] == -1


def test_writing_a_step_allocates_nothing(bytes_allocated):
    ring = StepRing.create(n_in=3, n_out=2, n_cmd=1, capacity=16, event_capacity=4, event_slot=256, n_state=4)
    state = np.arange(4, dtype=np.float64)  # a family's state, float64 as the observer's estimate is
    frame = np.arange(3, dtype=np.float32)
    out = np.ones(1, dtype=np.float32)
    more = [(1, np.full(1, 2.0, dtype=np.float32))]  # a second data output after the first, as a session writes it
    cmd = np.ones(1, dtype=np.float32)
    k = [0]

    def one_step():
        ring.begin(k[0], 0)
        np.copyto(ring.input_row(), frame)
        ring.set_output(out)
        for offset, values in more:
            ring.set_output(values, offset)
        ring.set_state(state)
        ring.add_flags(FLAG_ACTED)
        ring.publish_run(k[0])
        ring.publish_command(cmd, k[0], FLAG_COMMAND)
        ring.publish(1, 1)
        k[0] += 1

    try:
        one_step()
        assert bytes_allocated(one_step, 2000) < 2048
    finally:
        ring.close()


def test_every_model_run_is_a_run_record_where_the_step_record_keeps_the_last(ring):
    """A step that ran the model on two frames (a decoder catching up) has one step record and two run records."""
    for k in range(4):
        ring.begin(k, 1000 * k)
        for j in range(2 if k == 2 else 1):
            ring.set_input_seq(10 * k + j)
            ring.set_output(np.array([k + 0.25 * j, -k], dtype=np.float32))
            ring.add_flags(FLAG_ACTED)
            ring.publish_run(1000 * k + 100 * (j + 1))
        ring.publish(1, 1)
    steps, _ = ring.read(0)
    runs, cursor = ring.read_runs(0)
    assert len(steps) == 4 and steps.outputs[2, 0] == 2.25 and steps.input_seq[2] == 21
    assert cursor == 5 and runs.lost == 0
    assert runs.step.tolist() == [0, 1, 2, 2, 3] and runs.input_seq.tolist() == [0, 10, 20, 21, 30]
    assert runs.outputs[:, 0].tolist() == [0.0, 1.0, 2.0, 2.25, 3.0] and runs.t_ns.tolist()[2:4] == [2100, 2200]
    for k in range(40):  # 16 run slots: the one being written is never read
        ring.begin(k, 0)
        ring.publish_run(k)
        ring.publish(1, 1)
    runs, cursor = ring.read_runs(cursor)
    assert len(runs) == 15 and runs.lost == 25 and runs.t_ns.tolist() == list(range(25, 40))


def test_every_command_sent_is_a_sent_record_where_the_step_record_keeps_the_last(ring):
    """A step that answered two frames (a decoder catching up) sent two commands: one step record (the last command,
    both flags) and a sent record each, with the time it went out; a reader further behind than S loses the oldest."""
    for k in range(4):
        ring.begin(k, 1000 * k)
        for j in range(2 if k == 2 else 1):
            ring.publish_command(np.array([k + 0.25 * j], dtype=np.float32), 1000 * k + 10 * (j + 1),
                                 FLAG_SAFE if k == 3 else FLAG_COMMAND)
        ring.publish(1, 1)
    steps, _ = ring.read(0)
    sent, cursor = ring.read_commands(0)
    assert steps.command[:, 0].tolist() == [0.0, 1.0, 2.25, 3.0] and steps.flags.tolist() == [2, 2, 2, 4]
    assert cursor == 5 and sent.lost == 0
    assert sent.step.tolist() == [0, 1, 2, 2, 3] and sent.command[:, 0].tolist() == [0.0, 1.0, 2.0, 2.25, 3.0]
    assert sent.t_ns.tolist() == [10, 1010, 2010, 2020, 3010] and sent.flags.tolist() == [2, 2, 2, 2, 4]
    for k in range(40):  # 16 sent slots: the one being written is never read
        ring.begin(k, 0)
        ring.publish_command(np.zeros(1, dtype=np.float32), k, FLAG_COMMAND)
        ring.publish(1, 1)
    sent, cursor = ring.read_commands(cursor)
    assert len(sent) == 15 and sent.lost == 25 and sent.t_ns.tolist() == list(range(25, 40))


def test_the_block_has_the_size_the_documented_layout_gives(ring):
    """docs/monitor.md: 8 * 16 + C * (48 + 4 * (n_in + n_out + n_cmd + n_state)) + R * (24 + 4 * n_out)
    + S * (24 + 4 * n_cmd) + E * slot; a sent record where the sent arrays are."""
    c, r, sc, e, slot = 16, 16, 16, 4, 256
    sent_at = 8 * 16 + c * (48 + 4 * (3 + 2 + 1)) + r * (24 + 4 * 2)
    events_at = sent_at + sc * (24 + 4 * 1)
    assert ring._shm.size >= events_at + e * slot
    ring.event({"event": "x", "step": 1})
    raw = bytes(ring._shm.buf[events_at:events_at + 64])
    n = int.from_bytes(raw[:4], "little")
    assert raw[4:4 + n] == b'{"event":"x","step":1}'
    ring.begin(7, 0)
    ring.publish_command(np.array([1.5], dtype=np.float32), 123, 4)
    words = np.ndarray((3 * sc,), dtype="<i8", buffer=ring._shm.buf, offset=sent_at)
    assert words[0] == 7 and words[sc] == 123 and words[2 * sc] == 4  # sent_step, sent_t_ns, sent_flags: slot 0
    assert np.ndarray((1,), dtype="<f4", buffer=ring._shm.buf, offset=sent_at + 24 * sc)[0] == 1.5
    header = np.ndarray((16,), dtype="<i8", buffer=ring._shm.buf)
    assert header[1] == 4 and header[10] == r and header[11] == 0 and header[12] == 0  # n_state 0
    assert header[13] == sc and header[14] == 1 and header[15] == 0
    del header, words


def test_a_family_state_goes_where_the_layout_says_and_reads_back_with_its_step():
    """docs/monitor.md: word 12 is n_state; state[C][n_state] float32 follows command[C][n_cmd]; NaN where the model
    did not run; a reader gets it beside the step's other values."""
    c, n_in, n_out, n_cmd, n_state = 8, 3, 2, 1, 4
    ring = StepRing.create(n_in=n_in, n_out=n_out, n_cmd=n_cmd, capacity=c, event_capacity=4, event_slot=256,
                           n_state=n_state)
    try:
        for k in range(3):
            ring.begin(k, 1000 * k)
            if k != 1:  # step 1 did not run the model
                ring.set_output(np.array([k, k], dtype=np.float32))
                ring.set_state(np.array([k, 10 * k, -k, 0.5], dtype=np.float64))  # float64, as the observer's is
                ring.add_flags(FLAG_ACTED)
            ring.publish(1, 1)
        header = np.ndarray((16,), dtype="<i8", buffer=ring._shm.buf)
        assert header[12] == n_state
        del header
        state_at = 8 * 16 + c * (48 + 4 * (n_in + n_out + n_cmd))
        raw = np.frombuffer(bytes(ring._shm.buf[state_at:state_at + 4 * c * n_state]), dtype="<f4").reshape(c, n_state)
        np.testing.assert_array_equal(raw[2], [2, 20, -2, 0.5])
        assert np.isnan(raw[1]).all()
        batch, _ = ring.read(0)
        assert batch.state.shape == (3, n_state)
        np.testing.assert_array_equal(batch.state[[0, 2]], [[0, 0, 0, 0.5], [2, 20, -2, 0.5]])
        assert np.isnan(batch.state[1]).all()
        events_at = state_at + 4 * c * n_state + c * (24 + 4 * n_out) + c * (24 + 4 * n_cmd)  # runs, sent: C each
        ring.event({"event": "x", "step": 1})
        n = int.from_bytes(bytes(ring._shm.buf[events_at:events_at + 4]), "little")
        assert bytes(ring._shm.buf[events_at + 4:events_at + 4 + n]) == b'{"event":"x","step":1}'
    finally:
        ring.close()


def test_events_round_trip_and_overflow_is_counted(ring):
    for j in range(6):
        ring.event({"event": "watchdog", "step": j, "silent_s": 0.3})
    events, cursor, lost = ring.read_events(0)
    assert cursor == 6 and lost == 3  # 4 slots, the one being written is never read
    assert [e["step"] for e in events] == [3, 4, 5]
    ring.event({"event": "x", "step": 7, "blob": "y" * 1000})
    events, _, _ = ring.read_events(cursor)
    assert events == [{"event": "x", "step": 7, "truncated": True}]


def _child_reads(name, q):
    r = StepRing.attach(name)
    batch, cursor = r.read(0)
    q.put((cursor, batch.step.tolist(), batch.command[:, 0].tolist()))
    r.close()


def test_another_process_attaches_by_name_and_reads_the_same_records(ring):
    for k in range(3):
        _write(ring, k)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child_reads, args=(ring.name, q))
    p.start()
    cursor, steps, cmds = q.get(timeout=60)
    p.join(30)
    assert p.exitcode == 0
    assert cursor == 3 and steps == [0, 1, 2] and cmds == [0.0, 1.0, 2.0]
    _write(ring, 3)  # the writer's block survives the reader's exit
    assert ring.read(0)[0].step.tolist() == [0, 1, 2, 3]


def test_attach_refuses_a_block_that_is_not_a_ring():
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(create=True, size=256)
    try:
        with pytest.raises(ValueError, match="not a closedloop step ring"):
            StepRing.attach(shm.name)
        header = np.ndarray((16,), dtype="<i8", buffer=shm.buf)
        header[0], header[1] = 0x434C4F4F50524E47, 3  # a ring of an older layout
        del header
        with pytest.raises(ValueError, match="is a step ring of layout 3; this closedloop reads layout 4"):
            StepRing.attach(shm.name)
    finally:
        shm.close()
        shm.unlink()


def test_a_sessions_observer_sees_session_info_and_each_commands_time_after_its_step(tmp_path):
    """docs/monitor.md: on_event gets session_info (the device's HELLO) first; a sent record's t_ns less its step
    record's t_ns is how long after its step began the command went out, the summary's command latency exactly."""
    import torch

    from closedloop.export import export_bundle
    from closedloop.runtime import SessionConfig, run_session
    from closedloop.sdk.models import MLPPolicy

    torch.manual_seed(1)
    bundle = export_bundle(MLPPolicy(1, 1, (8,)).eval(), tmp_path / "b", kind="feedforward",
                           example_input=torch.zeros(1, 1), rate_hz=200.0, postprocess={"low": [-2.0], "high": [2.0]},
                           extra={"session": {"input": "plant_measurement", "command": "actuator_command"}},
                           variants=(), tensorrt=False, report=lambda s: None)

    class Sent(SessionObserver):
        def __init__(self):
            self.events, self.step_t, self.delays = [], {}, []

        def on_event(self, event):
            self.events.append(event["event"])

        def on_steps(self, batch):
            self.step_t.update(zip(batch.step.tolist(), batch.t_ns.tolist(), strict=True))

        def on_commands(self, batch):
            self.delays += [(k, t) for k, t, f in zip(batch.step.tolist(), batch.t_ns.tolist(), batch.flags.tolist(),
                                                     strict=True) if f & FLAG_COMMAND]

    obs = Sent()
    s = run_session(bundle, SessionConfig(device="sim://plant?model=msd&rate=200&seed=2", duration_s=1.0, status=False,
                                          backend="onnxruntime", observers=[obs]))
    assert obs.events[0] == "session_info" and obs.events[-1] == "session_end"
    delays_us = [(t - obs.step_t[k]) / 1e3 for k, t in obs.delays]
    assert len(delays_us) == s.commands_sent > 100
    assert abs(max(delays_us) - s.command_latency_max_us) < 1e-3


def test_verbose_logging_says_what_ran_on_what_each_event_and_the_end(plant_bundle, caplog):
    """closedloop -v run: the session's start, its events and its end as INFO log messages (written by an observer
    on its own thread); without INFO enabled, no such observer is attached."""
    import logging

    from closedloop.runtime import SessionConfig, run_session

    url = "sim://plant?model=msd&rate=200&seed=2&disconnect_at=0.3&disconnect_s=0.4"
    cfg = SessionConfig(device=url, duration_s=1.2, status=False, backend="onnxruntime")
    with caplog.at_level(logging.INFO, logger="closedloop.session"):
        s = run_session(plant_bundle, cfg)
    said = [r.getMessage() for r in caplog.records if r.name == "closedloop.session"]
    assert said[0] == "backend onnxruntime (fp32)"
    assert any(m.startswith(f"session: bundle {plant_bundle}") and "device sim://plant?model=msd" in m for m in said)
    assert any(m.startswith("device: {") and '"kind": "plant"' in m for m in said), said
    assert any(": disconnected {" in m for m in said) and any(": reconnected" in m for m in said), said
    assert said[-1].startswith("session ended (duration): ") and f"{s.commands_sent} commands sent" in said[-1]
    assert "EventLog" in s.observers
    caplog.clear()
    quiet = run_session(plant_bundle, SessionConfig(device="sim://plant?model=msd&rate=200&seed=2", duration_s=0.3,
                                                    status=False, backend="onnxruntime"))
    assert "EventLog" not in quiet.observers


class _Collect(SessionObserver):
    def __init__(self, delay_s: float = 0.0):
        self.steps: list[int] = []
        self.lost = 0
        self.events: list[dict] = []
        self.started = self.stopped = None
        self.delay_s = delay_s

    def on_start(self, info):
        self.started = info

    def on_steps(self, batch):
        self.steps += batch.step.tolist()
        self.lost += batch.lost
        time.sleep(self.delay_s)

    def on_event(self, event):
        self.events.append(event)

    def on_stop(self, summary):
        self.stopped = summary


def test_a_slow_observer_loses_records_and_never_delays_the_writer_or_a_fast_one():
    # The fast observer has ~0.2 s of slack (2048 records at ~10 kHz); the slow one sleeps 0.5 s per batch.
    ring = StepRing.create(n_in=3, n_out=2, n_cmd=1, capacity=2048)
    fast, slow = _Collect(), _Collect(delay_s=0.5)
    hub = ObserverHub(ring, [fast, slow], interval_s=0.005)
    hub.start({"family": "test"})
    t0 = time.perf_counter()
    n = 10000
    took = np.empty(n)
    for k in range(n):
        t = time.perf_counter()
        _write(ring, k)
        took[k] = time.perf_counter() - t
        if k % 20 == 0:
            time.sleep(0.002)  # a 10 kHz-ish producer with pauses, as a loop would be
    ring.event({"event": "watchdog", "step": n - 1})
    report = hub.stop({"steps": n})
    elapsed = time.perf_counter() - t0
    ring.close()
    assert fast.started == {"family": "test"} and fast.stopped == {"steps": n}
    # Fast: every record, in order. Slow: fewer, the rest counted as lost, never duplicated.
    assert fast.steps == list(range(n)) and fast.lost == 0
    assert len(slow.steps) + slow.lost == n and slow.lost > 0
    assert slow.steps == sorted(set(slow.steps))
    assert report["_Collect"]["error"] is None
    assert [e["event"] for e in fast.events] == ["watchdog"]
    # The writer never waited for the slow observer: a record costs microseconds, and no write took anywhere near
    # the slow observer's 0.5 s sleeps (the bound leaves room for a loaded machine's preemption: 55 ms was seen
    # with another test process beside this one on 2 cores)
    assert np.median(took) < 1e-3, f"a record's median write took {np.median(took) * 1e3:.2f} ms"
    assert took.max() < 0.25, f"a record took {took.max() * 1e3:.1f} ms to write"
    assert elapsed < 15.0


def test_an_observer_that_raises_is_detached_with_a_warning(capsys):
    class Broken(SessionObserver):
        def on_steps(self, batch):
            raise RuntimeError("bug in user code")

    ring = StepRing.create(n_in=1, n_out=1, n_cmd=1, capacity=8)
    hub = ObserverHub(ring, [Broken()], interval_s=0.001)
    hub.start({})
    _write_1 = threading.Event()
    ring.begin(0, 0)
    ring.publish(1, 1)
    _write_1.wait(0.05)
    report = hub.stop({})
    ring.close()
    assert "bug in user code" in report["Broken"]["error"]
    assert "session observer Broken failed and was detached" in capsys.readouterr().err


def test_an_object_with_only_the_methods_it_needs_observes_and_two_of_one_class_are_reported_apart():
    class Duck:  # not a SessionObserver: only what it needs
        def __init__(self):
            self.steps = []

        def on_steps(self, batch):
            self.steps += batch.step.tolist()

    class Broken(SessionObserver):
        def on_steps(self, batch):
            raise RuntimeError("this one broke")

    duck, good, bad = Duck(), _Collect(), Broken()
    ring = StepRing.create(n_in=1, n_out=1, n_cmd=1, capacity=64)
    hub = ObserverHub(ring, [duck, good, Broken(), bad], interval_s=0.001)
    hub.start({"family": "test"})
    for k in range(10):
        ring.begin(k, 0)
        ring.publish(1, 1)
    ring.event({"event": "watchdog", "step": 9})
    report = hub.stop({"steps": 10})
    ring.close()
    assert duck.steps == list(range(10)) and report["Duck"]["error"] is None
    assert good.steps == list(range(10))
    # the second Broken has its own entry: neither hides the other
    assert set(report) == {"Duck", "_Collect", "Broken", "Broken#2"}
    assert all("this one broke" in report[n]["error"] for n in ("Broken", "Broken#2"))


def test_session_settings_are_checked_when_given_naming_what_to_give():
    from closedloop.runtime import SessionConfig
    from closedloop.runtime.errors import BackendUnavailableError

    with pytest.raises(ValueError, match=r"overrun 'bogus': expected one of skip, hold, stop"):
        SessionConfig(device="sim://headstage", overrun="bogus")
    with pytest.raises(BackendUnavailableError, match=r"unknown backend 'bogus'; known backends: .*numba"):
        SessionConfig(device="sim://headstage", backend="bogus")
    with pytest.raises(ValueError, match=r"SessionConfig.device '': give the device's URL"):
        SessionConfig(device="")
    with pytest.raises(TypeError, match=r"holds the class _Collect, not an object of it: give _Collect\(...\)"):
        SessionConfig(device="sim://headstage", observers=[_Collect])
    with pytest.raises(TypeError, match=r"SessionConfig.observers .*: give a list of SessionObserver objects"):
        SessionConfig(device="sim://headstage", observers=_Collect())
    with pytest.raises(TypeError, match=r"SessionConfig.trust 'lab.pub': give a list of public key files"):
        SessionConfig(device="sim://headstage", trust="lab.pub")
    # None is the default, as the refusal of 0 says
    with pytest.raises(ValueError, match=r"watchdog_s 0: must be a positive number of seconds \(None: the default\)"):
        SessionConfig(device="sim://headstage", watchdog_s=0)
    cfg = SessionConfig(device="sim://headstage", watchdog_s=None, handshake_timeout_s=None)
    assert (cfg.watchdog_s, cfg.handshake_timeout_s) == (0.25, 10.0)


@pytest.fixture(scope="module")
def plant_bundle(tmp_path_factory):
    import torch

    from closedloop.export import export_bundle
    from closedloop.sdk.models import MLPPolicy

    torch.manual_seed(1)
    return export_bundle(
        MLPPolicy(1, 1, (8,)).eval(), tmp_path_factory.mktemp("plugin") / "plant", kind="feedforward",
        example_input=torch.zeros(1, 1), rate_hz=200.0, postprocess={"low": [-2.0], "high": [2.0]},
        extra={"session": {"input": "plant_measurement", "command": "actuator_command"}},
        variants=(), tensorrt=False, report=lambda s: None)


def test_a_plug_in_familys_state_reaches_observers_and_labels_must_match_its_values(plant_bundle, monkeypatch,
                                                                                     acted_inputs):
    """docs/families.md: a plug-in publishes what it computes outside the graph by overriding state_vector and
    state_labels; observers get it in each step's ``state`` and its labels in ``info["state"]``."""
    from closedloop.runtime import Session, SessionConfig, SessionError, run_session
    from closedloop.runtime.families.generic.plugin import GenericFamily

    # a plug-in that publishes its model output, doubled, as its state
    def state_vector(self):
        buf = self.__dict__.setdefault("_doubled", np.zeros(1))
        np.multiply(self.model.output.reshape(-1), 2.0, out=buf)
        return buf

    monkeypatch.setattr(GenericFamily, "state_vector", property(state_vector))
    monkeypatch.setattr(GenericFamily, "state_labels", lambda self: ["doubled/u"])
    seen = acted_inputs
    run_session(plant_bundle, SessionConfig(device="sim://plant?model=msd&rate=200&seed=3", duration_s=0.6,
                                            status=False, backend="onnxruntime", observers=[seen]))
    assert seen.labels == ["doubled/u"] and len(seen.state) > 20
    np.testing.assert_allclose(np.array(seen.state), 2 * np.array(seen.outputs), rtol=1e-6)
    monkeypatch.setattr(GenericFamily, "state_labels", lambda self: ["doubled/u", "doubled/v"])
    with pytest.raises(SessionError, match="names 2 state values but publishes 1"):
        Session(plant_bundle, SessionConfig(device="sim://plant?model=msd&rate=200", status=False))
