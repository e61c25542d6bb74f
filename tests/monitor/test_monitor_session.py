"""The monitor of live emulator sessions in a real browser, and what observers and recordings receive."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from closedloop.export import export_bundle
from closedloop.firmware_bridge import PlantMeasurement
from closedloop.runtime import (
    RecordingReader,
    RecordType,
    Session,
    SessionConfig,
    SessionError,
    SessionObserver,
    run_session,
)
from closedloop.runtime.recording_view import view_recording
from closedloop.sdk.models import MLPPolicy

pytestmark = pytest.mark.timing  # wall-clock bounds: make test runs this file alone, after the parallel part

pytest.importorskip("aiohttp", reason="the monitor needs the [monitor] extra (aiohttp)")
C = 12


@pytest.fixture(scope="module")
def plant_bundle(tmp_path_factory):
    torch.manual_seed(1)
    return export_bundle(
        MLPPolicy(1, 1, (8,)).eval(), tmp_path_factory.mktemp("mon") / "plant", kind="feedforward",
        example_input=torch.zeros(1, 1), rate_hz=200.0, name="plant-ctl",
        postprocess={"scale": [5.0], "offset": [3.0], "low": [-2.0], "high": [2.0]},
        extra={"session": {"input": "plant_measurement", "command": "actuator_command"}},
        variants=(), tensorrt=False, report=lambda s: None,
    )


class Background:
    """A session running on a thread, its monitor URL known once it started."""

    def __init__(self, bundle, out=None, **cfg):
        cfg.setdefault("status", False)
        cfg.setdefault("backend", "onnxruntime")
        self.session = Session(bundle, SessionConfig(**cfg), out=out)
        self.session.start()
        self.summary = None
        self.error: BaseException | None = None
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        try:
            self.summary = self.session.run()
        except BaseException as exc:  # noqa: BLE001  (reported by join)
            self.error = exc
        finally:
            self.session.close()

    def join(self, timeout=60):
        self._t.join(timeout)
        if self.error is not None:
            raise self.error
        return self.summary


def _page_state(page):
    return page.evaluate("() => ({step: monitorState.step, typed: document.getElementById('typed').textContent,"
                         " state: document.getElementById('state').textContent,"
                         " events: monitorState.events.map(e => e.event), ups: monitorState.ups})")


_LIT_PIXELS = """(id) => { const c = document.getElementById(id), d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
                  let n = 0; for (let i = 0; i < d.length; i += 4) if (d[i] + d[i + 1] + d[i + 2] > 0) n++; return n; }"""


def test_a_typing_session_shows_text_growing_and_steps_rising(typing_bundle, page, screenshot_dir, tmp_path):
    bg = Background(typing_bundle, device=f"sim://headstage?channels={C}&seed=3", duration_s=8.0, monitor="0",
                    record=str(tmp_path / "typing.clrec"))
    url = bg.session.monitor_url
    assert url and url.startswith("http://127.0.0.1:")
    page.goto(url)
    page.wait_for_function("() => monitorState.step > 50 && document.getElementById('typed').textContent.length > 0",
                           timeout=30_000)
    first = _page_state(page)
    time.sleep(2.5)
    second = _page_state(page)
    assert second["step"] > first["step"] + 80  # 50 Hz
    assert len(second["typed"]) >= len(first["typed"]) and second["typed"].startswith(first["typed"][:5])
    assert second["state"] == "running" and second["ups"] >= 10
    # the input, output and command panels get rows: the frame as read (12 channels), outputs, commands
    panels = page.evaluate("() => ({inp: monitorState.inp.length, width: (monitorState.inp[0] || []).length,"
                           " out: monitorState.out.length, cmd: monitorState.cmd.length, inpOut: monitorState.inpOut.length,"
                           " ran: monitorState.inpOut.filter((r) => r && r.some((v) => v !== null)).length})")
    assert panels["inp"] > 50 and panels["width"] == C and panels["out"] > 50 and panels["cmd"] > 50, panels
    # beside each frame the loop acted on, the outputs of that same step (what an observer's estimates are drawn from)
    assert panels["inpOut"] == panels["inp"] and panels["ran"] == panels["inp"], panels
    assert page.text_content("#family") == "bci_handwriting"
    # a text decoder sends no numbers: its output panel shows each run's class probabilities instead of an empty chart
    assert "each class's probability per model run (32 classes" in page.text_content("#command-legend")
    assert page.evaluate(_LIT_PIXELS, "command") > 1000
    page.screenshot(path=str(screenshot_dir / "monitor_bci.png"))
    bg.session.stop()  # what the page must show is shown: the session need not run its whole duration
    s = bg.join()
    # the page showed the session's own text: what it typed by the end starts with what the page showed
    assert s.family["text"].startswith(second["typed"][: min(len(second["typed"]), 10)])
    assert s.observers["StepRecorder"]["lost"] == 0
    view = view_recording(tmp_path / "typing.clrec")
    assert view.steps["step"].size == s.loop.steps  # every step's timing is in the recording
    assert np.all(np.diff(view.steps["step"]) > 0)


def test_a_silence_in_a_neural_stream_is_marked_on_the_heat_map(typing_bundle, page, screenshot_dir):
    """The heat map's columns are frames: a headstage that went silent for a while shows a pause there, with the
    time without frames, not the two sides drawn as if they touched."""
    bg = Background(typing_bundle, device=f"sim://headstage?channels={C}&seed=3&silence_at=1.5&silence_s=0.4",
                    duration_s=6.0, monitor="0")
    page.goto(bg.session.monitor_url)
    page.wait_for_function("() => { const m = /([0-9.]+) s without frames/.exec("
                           "document.getElementById('input-legend').textContent); return m && +m[1] >= 0.3; }",
                           timeout=30_000)
    legend = page.text_content("#input-legend")
    silent = float(legend.split(" s without frames")[0].split()[-1])
    assert "pause" in legend and silent <= 0.6, legend  # the 0.4 s silence (and a late step or two at most)
    orange = page.evaluate("""() => { const c = document.getElementById('input'), d = c.getContext('2d')
        .getImageData(0, 0, c.width, c.height).data; let n = 0;
        for (let i = 0; i < d.length; i += 4) if (d[i] === 255 && d[i + 1] === 159 && d[i + 2] === 28) n++; return n; }""")
    assert orange >= 2 * 20, orange  # a line at least 2 pixels wide down the map
    page.screenshot(path=str(screenshot_dir / "monitor_neural_break.png"))
    bg.session.stop()
    bg.join()


def test_the_page_shows_the_prompt_the_device_reports(typing_bundle, page):
    # the handwriting source reports the sentence it is playing; the session asks for REPORTs when monitored
    bg = Background(typing_bundle, device=f"sim://headstage?channels={C}&source=handwriting&session=1&seed=2",
                    duration_s=12.0, monitor="0")
    page.goto(bg.session.monitor_url)
    page.wait_for_function("() => monitorState.prompt.length > 3", timeout=30_000)
    page.wait_for_function("() => document.getElementById('prompt').textContent.startsWith('prompt: ')",
                           timeout=5_000)
    prompt = page.evaluate("() => monitorState.prompt")
    assert page.text_content("#prompt") == f"prompt: {prompt}"
    bg.session.stop()
    s = bg.join()
    assert s.inputs_used > 0


def test_a_silent_plant_shows_safe_and_the_watchdog_then_recovers(plant_bundle, page, screenshot_dir, tmp_path,
                                                                   watchdog_rule):
    rec = tmp_path / "silent.clrec"
    bg = Background(plant_bundle, device="sim://plant?model=msd&rate=200&seed=5&silence_at=1.5&silence_s=1.5",
                    duration_s=7.0, watchdog_s=0.15, monitor="127.0.0.1:0", record=str(rec))
    page.goto(bg.session.monitor_url)
    page.wait_for_function("() => monitorState.step > 100", timeout=30_000)
    page.wait_for_function("() => document.getElementById('state').textContent === 'SAFE'", timeout=15_000)
    page.wait_for_function("() => monitorState.events.some(e => e.event === 'watchdog')", timeout=10_000)
    page.wait_for_function("() => document.getElementById('watchdog').textContent === '1'", timeout=5_000)
    page.screenshot(path=str(screenshot_dir / "monitor_plant_safe.png"))
    page.wait_for_function("() => document.getElementById('state').textContent === 'running'", timeout=15_000)
    assert "input_resumed" in _page_state(page)["events"]
    bg.session.stop()
    s = bg.join()
    # the silence tripped it; a loaded machine that starves the emulator may trip it once more, each trip after a
    # real silence of at least watchdog_s (the recording's own times)
    assert s.watchdog_trips >= 1
    watchdog_rule(rec, 0.15, PlantMeasurement, s.watchdog_trips)


def test_a_reconnect_shows(plant_bundle, page):
    bg = Background(plant_bundle, device="sim://plant?model=msd&rate=200&seed=6&disconnect_at=1.2&disconnect_s=0.6",
                    duration_s=5.0, watchdog_s=0.15, monitor="0")
    page.goto(bg.session.monitor_url)
    page.wait_for_function("() => monitorState.events.some(e => e.event === 'reconnected')", timeout=30_000)
    page.wait_for_function("() => +document.getElementById('reconnects').textContent >= 1", timeout=5_000)
    assert "disconnected" in _page_state(page)["events"]
    bg.session.stop()
    assert bg.join().reconnects == 1


class Collect(SessionObserver):
    def __init__(self):
        self.steps, self.lost, self.acted, self.events, self.info, self.summary = [], 0, 0, [], None, None

    def on_start(self, info):
        self.info = info

    def on_steps(self, batch):
        self.steps += batch.step.tolist()
        self.lost += batch.lost
        self.acted += int((batch.flags & 1).sum())

    def on_event(self, event):
        self.events.append(event["event"])

    def on_stop(self, summary):
        self.summary = summary


def test_an_observer_gets_every_step_its_timing_and_the_summary(plant_bundle, tmp_path):
    obs = Collect()
    s = run_session(plant_bundle, SessionConfig(device="sim://plant?model=msd&rate=200&seed=5", duration_s=1.5,
                                                status=False, backend="onnxruntime", observers=[obs],
                                                record=str(tmp_path / "p.clrec")))
    assert obs.info["family"] and obs.info["rate_hz"] == 200.0
    assert obs.lost == 0 and len(obs.steps) == s.loop.steps and obs.steps == sorted(obs.steps)
    assert obs.acted == s.inputs_used
    assert obs.summary["commands_sent"] == s.commands_sent
    assert "status" in obs.events and s.observers["Collect"]["error"] is None
    r = RecordingReader(tmp_path / "p.clrec")
    assert r.records[-1].type == RecordType.SUMMARY  # the STEPS records came before it
    assert r.summary["observers"]["StepRecorder"]["lost"] == 0


def test_a_websocket_client_gets_every_record_to_the_last_step_then_the_end_and_a_normal_close(plant_bundle):
    """What a dashboard of a lab's own reads (docs/monitor.md): the records up to the session's last step, its
    ``session_end`` event last, and a close with code 1000, so the end of a session is told from a crash."""
    import asyncio

    import aiohttp

    bg = Background(plant_bundle, device="sim://plant?model=msd&rate=200&seed=4", duration_s=1.5, monitor="0")
    received: list[dict] = []
    close: list = []

    async def client():
        async with aiohttp.ClientSession() as http, http.ws_connect(bg.session.monitor_url + "ws") as ws:
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    received.append(msg.json())
            close.append(ws.close_code)

    reader = threading.Thread(target=lambda: asyncio.run(asyncio.wait_for(client(), 30)))  # its own event loop:
    reader.start()  # the browser tests' playwright holds one on this thread
    reader.join(40)
    summary = bg.join()
    assert close == [1000]
    assert received[0]["type"] == "hello"
    assert received[-1] == {"type": "event", "event": "session_end", "step": -1, "reason": "stopped by duration"}
    pushes = [m["push"] for m in received if m["type"] == "steps"]
    assert pushes == list(range(pushes[0], pushes[0] + len(pushes)))  # numbered: a client sees what it lost
    steps = [s for m in received if m["type"] == "steps" for s in m["step"]]
    assert steps[-1] == summary.loop.steps + summary.loop.skipped_periods - 1  # overruns skip step indices
    assert steps == sorted(steps) and len(steps) == summary.loop.steps


def test_a_session_that_never_started_ends_its_page_saying_why(plant_bundle):
    """A device that never answers: the monitor is up from before the handshake, and its session_end says the
    session did not start (a client tells it from a session that ran its course)."""
    import asyncio

    import aiohttp

    from closedloop.firmware_bridge import open_pty_pair

    board, port = open_pty_pair()  # nobody answers on the board's end
    session = Session(plant_bundle, SessionConfig(device=port.path, status=False, backend="onnxruntime",
                                                  monitor="0", handshake_timeout_s=3.0))
    failed: list = []

    def start() -> None:
        try:
            session.start()
        except SessionError as exc:
            failed.append(exc)

    starter = threading.Thread(target=start)
    starter.start()
    deadline = time.monotonic() + 20
    while session.monitor_url is None and time.monotonic() < deadline:
        time.sleep(0.02)
    received: list[dict] = []

    async def client():
        async with aiohttp.ClientSession() as http, http.ws_connect(session.monitor_url + "ws") as ws:
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    received.append(msg.json())

    try:  # the client on a thread of its own: the browser tests' playwright holds an event loop on this one
        reader = threading.Thread(target=lambda: asyncio.run(asyncio.wait_for(client(), 30)))
        reader.start()
        reader.join(40)
        starter.join(30)
    finally:
        session.close()
        board.close()
        port.close()
    end = received[-1]
    assert end["event"] == "session_end" and end["reason"].startswith("no session: SessionError: no Hello from")
    assert failed and "no Hello from" in str(failed[0])


def test_a_device_that_cannot_be_opened_ends_the_page_saying_why(plant_bundle, monkeypatch):
    """No device at the path (or an emulator URL it refuses): the session's session_end carries the reason, as for a
    device that never answers, not a bare end a client cannot tell from a session that ran its course."""
    from closedloop.runtime.observe.tap import SessionTap

    reasons: list = []
    close = SessionTap.close

    def spy(self, summary=None, reason=None):
        reasons.append(reason)
        return close(self, summary, reason)

    monkeypatch.setattr(SessionTap, "close", spy)
    for device in ("/dev/closedloop-no-such-port", "sim://headstage?channels=4&bogus=1"):
        reasons.clear()
        session = Session(plant_bundle, SessionConfig(device=device, status=False, backend="onnxruntime", monitor="0"))
        try:
            with pytest.raises((SessionError, ValueError, OSError)):
                session.start()
        finally:
            session.close()
        assert reasons and reasons[0] and reasons[0].startswith("no session: "), (device, reasons)


def test_a_monitor_server_that_dies_is_said_and_the_session_goes_on(plant_bundle):
    import io
    import os
    import signal

    out = io.StringIO()
    bg = Background(plant_bundle, device="sim://plant?model=msd&rate=200&seed=3", duration_s=2.0, monitor="0", out=out)
    time.sleep(0.5)
    os.kill(bg.session._tap.monitor.pid, signal.SIGKILL)
    s = bg.join()
    assert s.loop.stopped_by == "duration" and s.commands_sent > 100  # the session ran its course
    assert s.monitor_exit == -signal.SIGKILL
    assert "warning: the monitor's server" in out.getvalue() and "the session goes on without it" in out.getvalue()


def test_a_monitor_on_a_public_address_needs_the_flag(plant_bundle):
    with pytest.raises(SessionError, match="--monitor-public"):
        Session(plant_bundle, SessionConfig(device="sim://plant?model=msd&rate=200", status=False,
                                            backend="onnxruntime", monitor="0.0.0.0:0")).start()


def test_a_public_monitor_asks_for_its_token_and_prints_an_address_for_other_machines(plant_bundle):
    import io
    import socket
    import urllib.error
    import urllib.request

    out = io.StringIO()
    session = Session(plant_bundle, SessionConfig(device="sim://plant?model=msd&rate=200", status=False,
                                                  backend="onnxruntime", monitor="0.0.0.0:0", monitor_public=True),
                      out=out)
    try:
        session.start()
        url = session.monitor_url
        assert "?token=" in url and "reachable from other machines" in out.getvalue()
        remote = f"monitor from other machines: http://{socket.gethostname()}:{url.split(':')[2].split('/')[0]}/?token="
        assert remote in out.getvalue(), out.getvalue()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url.split("?")[0], timeout=10)
        assert refused.value.code == 403
        assert urllib.request.urlopen(url, timeout=10).status == 200
    finally:
        session.close()


class CommandAndEstimate(torch.nn.Module):
    """A controller that also reports a three-value estimate: two data outputs."""

    def __init__(self):
        super().__init__()
        self.body, self.u, self.estimate = torch.nn.Linear(1, 8), torch.nn.Linear(8, 1), torch.nn.Linear(8, 3)

    def forward(self, y):
        h = torch.tanh(self.body(y))
        return {"u": self.u(h), "estimate": self.estimate(h)}


def test_every_data_output_has_a_band_of_its_own_live_and_in_the_recording(page, recording_page, tmp_path,
                                                                            screenshot_dir):
    torch.manual_seed(2)
    bundle = export_bundle(CommandAndEstimate().eval(), tmp_path / "two", kind="feedforward",
                           example_input=torch.zeros(1, 1), rate_hz=200.0, postprocess={"low": [-2.0], "high": [2.0]},
                           extra={"session": {"input": "plant_measurement", "command": "actuator_command"}},
                           variants=(), tensorrt=False, report=lambda s: None)
    rec = tmp_path / "two.clrec"
    bg = Background(bundle, device="sim://plant?model=msd&rate=200&seed=7", duration_s=4.0, monitor="0", record=str(rec))
    page.goto(bg.session.monitor_url)
    page.wait_for_function("() => monitorState.out.length > 100 && !document.getElementById('outputs-box').hidden",
                           timeout=30_000)
    legend = page.text_content("#outputs-legend")
    assert "u (1 value), estimate (3 values)" in legend, legend
    assert page.evaluate("() => monitorState.out[monitorState.out.length - 1].length") == 4  # u, then the estimate
    page.screenshot(path=str(screenshot_dir / "monitor_outputs.png"))
    bg.session.stop()
    bg.join()
    with recording_page(rec, "() => monitorState.step > 0 && !document.getElementById('outputs-box').hidden"):
        assert "u (1 value), estimate (3 values)" in page.text_content("#outputs-legend")
        assert page.evaluate("() => monitorState.out[monitorState.out.length - 1].length") == 4


def test_an_observers_state_and_disturbance_estimate_and_its_predictions_are_on_the_page_live_and_recorded(
        observer_bundle, page, recording_page, tmp_path, screenshot_dir):
    """The page draws the observer's z_hat (a band for the plant's states, one for its disturbance) and, over each
    measurement, what the observer predicted for it; `closedloop monitor FILE` shows the same from the recording."""
    rec = tmp_path / "obs.clrec"
    bg = Background(observer_bundle, device="sim://plant?model=flexible-joint&rate=1000&seed=4", duration_s=4.0,
                    monitor="0", record=str(rec))
    page.goto(bg.session.monitor_url)
    page.wait_for_function("() => monitorState.st.length > 200 && !document.getElementById('state-panel').hidden",
                           timeout=30_000)

    def shown():
        return page.evaluate(
            "() => ({legend: document.getElementById('state-legend').textContent,"
            " title: document.getElementById('input-title').textContent,"
            " inputLegend: document.getElementById('input-legend').textContent,"
            " inp: monitorState.inp.length, inpSt: monitorState.inpSt.length,"
            " widths: [...new Set(monitorState.inpSt.map((r) => r.length))],"
            " gap: Math.max(...monitorState.inp.map((r, i) => Math.abs(r[0] - monitorState.inpSt[i][5]))),"
            " spread: Math.max(...monitorState.inp.map((r) => r[0])) - Math.min(...monitorState.inp.map((r) => r[0]))})")

    live = shown()
    assert "state (4 values), disturbance (1 value)" in live["legend"], live
    assert "prediction" in live["title"] and "predicted" in live["inputLegend"], live
    # each measurement drawn has the state of the step that read it: z_hat (5) then the predicted measurement (1)
    assert live["inp"] > 20 and live["inpSt"] == live["inp"] and live["widths"] == [6], live
    # the prediction tracks the measurement (a certified observer): their gap is small against the signal's swing
    assert live["gap"] < 0.5 * live["spread"] + 1e-3, live
    assert page.evaluate(_LIT_PIXELS, "family-state") > 500
    page.screenshot(path=str(screenshot_dir / "monitor_observer_estimate.png"))
    bg.session.stop()
    bg.join()
    with recording_page(rec, "() => monitorState.step > 0 && !document.getElementById('state-panel').hidden"):
        legend = page.text_content("#state-legend")
        assert "state (4 values), disturbance (1 value)" in legend, legend
        assert page.evaluate(_LIT_PIXELS, "family-state") > 500
        # beside each frame, the state of the run that read it (by frame sequence number); none for a frame the loop
        # skipped for a newer one or had not read when the recording ended
        paired = page.evaluate("() => ({seq: monitorState.inpSeq, st: monitorState.inpSt})")
        v = view_recording(rec)
        by_seq = dict(zip(v.state.seq, v.state.values, strict=True))
        assert len(paired["seq"]) == len(paired["st"]) > 20
        assert sum(s in by_seq for s in paired["seq"]) > 20
        for s, row in zip(paired["seq"], paired["st"], strict=True):
            if s not in by_seq:
                assert row == [], (s, row)
            else:
                np.testing.assert_allclose(row, by_seq[s], rtol=1e-5, atol=1e-12)
