"""The monitor page in a real browser, fed by a step ring written the way a session writes it."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from closedloop.runtime.observe import FLAG_ACTED, FLAG_COMMAND, FLAG_SAFE, StepRing

pytest.importorskip("aiohttp", reason="the monitor needs the [monitor] extra (aiohttp)")

from closedloop.runtime.monitor import MonitorProcess, parse_address  # noqa: E402

pytestmark = pytest.mark.timing  # wall-clock bounds: make test runs this file alone, after the parallel part


class FakeSession:
    """Writes step records and status events at 50 Hz like a decoder session; ``safe`` makes it go silent."""

    def __init__(self, ring: StepRing):
        self.ring = ring
        self.safe = False
        self.text = ""
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        rng = np.random.default_rng(1)
        k = 0
        while not self._stop.is_set():
            r = self.ring
            r.begin(k, time.monotonic_ns())
            if self.safe:
                r.add_flags(FLAG_SAFE)
            else:
                r.input_row()[:] = rng.poisson(2.0, r.n_in)
                r.set_output(rng.random(r.n_out).astype(np.float32))
                r.set_command(rng.random(r.n_cmd).astype(np.float32))
                r.add_flags(FLAG_ACTED | FLAG_COMMAND)
                if k % 5 == 0:
                    self.text += "abcdefghij "[(k // 5) % 11]
            r.publish(300_000, 20_000)
            if k % 10 == 0:
                r.event({"event": "status", "step": k, "state": "SAFE" if self.safe else "running",
                         "p99_us": 350.0, "command_p99_us": 212.4, "missed": 0, "lost": 0, "text": self.text, "chars": len(self.text),
                         "|r|": 4.7e-6, "u": 0.01234})
            k += 1
            time.sleep(0.02)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(2)


INFO = {"family": "bci", "bundle_name": "tiny-decoder", "rate_hz": 50.0, "backend": "numba",
        "device": {"kind": "headstage", "name": "sim"}}


@pytest.fixture
def monitored():
    ring = StepRing.create(n_in=16, n_out=4, n_cmd=4, capacity=1024)
    mon = MonitorProcess(ring, "127.0.0.1", 0, None, INFO | {"t0_ns": time.monotonic_ns()})
    try:
        with FakeSession(ring) as sess:
            yield mon, sess, ring
    finally:
        mon.stop()
        ring.close()


def _state(page) -> dict:
    return page.evaluate("() => ({step: monitorState.step, text: monitorState.text, state: document.getElementById('state').textContent,"
                         " events: monitorState.events.map(e => e.event), updates: monitorState.updates,"
                         " typed: document.getElementById('typed').textContent, ups: monitorState.ups})")


def test_the_page_shows_counters_rising_text_growing_and_safe_with_its_watchdog_event(monitored, page, screenshot_dir):
    mon, sess, ring = monitored
    page.goto(mon.url)
    page.wait_for_function("() => monitorState.step > 20", timeout=20_000)
    # the status line is redrawn every 100 ms: on a loaded machine the first steps can arrive before that redraw
    page.wait_for_function("() => document.getElementById('state').textContent === 'running'", timeout=5_000)
    first = _state(page)
    assert first["state"] == "running"
    assert page.text_content("#family") == "bci" and page.text_content("#bundle") == "tiny-decoder"
    time.sleep(1.5)
    second = _state(page)
    assert second["step"] > first["step"] + 30, (first, second)  # 50 Hz for 1.5 s
    assert len(second["typed"]) > len(first["typed"]) > 0
    assert second["ups"] >= 10, f"page updated {second['ups']} times in a second"
    # a family's live metrics: counts as they are, a small residual with its digits instead of 0
    metrics = page.text_content("#family-metrics")
    assert "|r| 0.0000047" in metrics and "u 0.012" in metrics and "chars " in metrics, metrics
    # the step's p99 and the command's (how soon it went out) in their own counters, not among the metrics
    assert page.text_content("#p99") == "350 us" and page.text_content("#cmdp99") == "212 us"
    assert "command_p99" not in metrics
    page.screenshot(path=str(screenshot_dir / "monitor_fake_running.png"))

    sess.safe = True
    ring.event({"event": "watchdog", "step": second["step"], "silent_s": 0.26, "other_frames": 0, "other_type": ""})
    page.wait_for_function("() => document.getElementById('state').textContent === 'SAFE'", timeout=10_000)
    page.wait_for_function("() => monitorState.events.some(e => e.event === 'watchdog')", timeout=10_000)
    page.wait_for_function("() => document.getElementById('watchdog').textContent === '1'", timeout=5_000)
    assert "watchdog" in page.text_content("#events")
    ring.event({"event": "reconnected", "step": second["step"] + 5})
    page.wait_for_function("() => document.getElementById('reconnects').textContent === '1'", timeout=10_000)
    page.screenshot(path=str(screenshot_dir / "monitor_fake_safe.png"))


def test_a_browser_that_reloads_gets_the_history_and_continues_and_a_lost_server_shows_reconnecting(monitored, page):
    mon, _, _ = monitored
    page.goto(mon.url)
    page.wait_for_function("() => monitorState.step > 5", timeout=20_000)
    page.reload()
    page.wait_for_function("() => monitorState.updates > 2 && monitorState.step > 5", timeout=20_000)
    # the server gone (not a session's end): the page says it lost its server and keeps retrying
    mon.stop()
    page.wait_for_function("() => document.getElementById('state').textContent === 'reconnecting'", timeout=10_000)


def test_a_page_whose_socket_never_opened_says_connecting_not_reconnecting(monitored, page):
    mon, _, _ = monitored
    page.route_web_socket("**/ws", lambda ws: ws.close())  # every attempt refused before it opens
    page.goto(mon.url)
    page.wait_for_function("() => document.getElementById('state').textContent === 'connecting'", timeout=5_000)
    time.sleep(2.2)  # two retries later, still never connected
    assert page.text_content("#state") == "connecting" and page.evaluate("() => monitorState.updates") == 0


def test_state_api_and_a_malformed_websocket_message_change_nothing(monitored, page):
    mon, _, _ = monitored
    page.goto(mon.url)
    page.wait_for_function("() => monitorState.updates > 2", timeout=20_000)
    page.evaluate("""() => { const ws = new WebSocket(`ws://${location.host}/ws`);
                             ws.onopen = () => { ws.send('{not json'); ws.send('x'.repeat(10000)); }; }""")
    time.sleep(0.5)
    before = _state(page)["updates"]
    time.sleep(0.6)
    assert _state(page)["updates"] > before  # the page's own socket still streams
    state = json.loads(urllib.request.urlopen(mon.url + "api/state", timeout=5).read())
    assert state["info"]["family"] == "bci" and state["published"] > 0
    assert state["status"]["event"] == "status"


def test_what_a_client_sends_is_ignored_within_the_documented_limits(monitored):
    """docs/monitor.md: a message under 4,096 bytes is ignored; one of 4,096 or more closes that socket with 1009; a
    client that sends more than 50 messages in a second is closed with 1008 (it would take the CPU a session needs);
    other clients stream on."""
    import asyncio

    import aiohttp

    mon, _, _ = monitored

    async def close_code(messages, pause_s=0.0):
        async with aiohttp.ClientSession() as http, http.ws_connect(mon.url + "ws") as ws:
            for m in messages:
                await ws.send_str(m)
                if pause_s:
                    await asyncio.sleep(pause_s)
            end = asyncio.get_running_loop().time() + 1.0  # a close comes within milliseconds; an open socket streams
            while not ws.closed and asyncio.get_running_loop().time() < end:
                try:
                    await asyncio.wait_for(ws.receive(), 0.5)
                except asyncio.TimeoutError:
                    break
            return ws.close_code if ws.closed else None

    async def all_cases():
        return (await close_code(["x" * 4095, "{not json"]), await close_code(["x" * 4096]),
                await close_code(["hi"] * 200), await close_code(["hi"] * 20, pause_s=0.06))

    got: list = []  # on a thread of its own: the browser tests' playwright holds an event loop on this one
    t = threading.Thread(target=lambda: got.extend(asyncio.run(all_cases())))
    t.start()
    t.join(60)
    small, big, flood, slow = got
    assert small is None and big == 1009 and flood == 1008 and slow is None, (small, big, flood, slow)


def test_a_non_loopback_monitor_needs_its_token():
    ring = StepRing.create(n_in=1, n_out=1, n_cmd=1, capacity=8)
    mon = MonitorProcess(ring, "127.0.0.1", 0, "s3cret-token", INFO)
    try:
        base = f"http://127.0.0.1:{mon.port}/"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(base, timeout=5)
        assert err.value.code == 403
        assert urllib.request.urlopen(base + "?token=s3cret-token", timeout=5).status == 200
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(base + "api/state?token=wrong", timeout=5)
    finally:
        mon.stop()
        ring.close()


def test_only_addresses_of_this_machine_alone_count_as_loopback(monkeypatch):
    """A host name is loopback only where every address it resolves to is (/etc/hosts naming the machine 127.0.0.1);
    an address other machines reach, or a name that does not resolve, is not, and then needs --monitor-public."""
    import socket

    from closedloop.runtime.monitor.server import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.0.0.2")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5")
    table = {"vm": ["127.0.0.1"], "both": ["127.0.0.1", "10.0.0.7"]}

    def resolve(host, port, *a, **k):
        if host not in table:
            raise socket.gaierror("unknown")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, 0)) for ip in table[host]]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    assert is_loopback("vm") and not is_loopback("both") and not is_loopback("no-such-host")


def test_a_port_in_use_is_a_clear_error():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    ring = StepRing.create(n_in=1, n_out=1, n_cmd=1, capacity=8)
    try:
        with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{port}.*choose another port"):
            MonitorProcess(ring, "127.0.0.1", port, None, INFO)
    finally:
        ring.close()
        s.close()


def test_monitor_addresses_parse_and_bad_ones_say_what_is_expected():
    assert parse_address("8765") == ("127.0.0.1", 8765)
    assert parse_address("0.0.0.0:9000") == ("0.0.0.0", 9000)
    assert parse_address("[::1]:9000") == ("::1", 9000)
    with pytest.raises(ValueError, match="expected PORT or HOST:PORT"):
        parse_address("localhost:http")
    with pytest.raises(ValueError, match="outside 0..65535"):
        parse_address("70000")


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux CPU affinity and at least 2 CPUs")
def test_the_monitor_process_keeps_off_a_pinned_loops_cpu():
    cpus = os.sched_getaffinity(0)
    loop_cpu = max(cpus)
    ring = StepRing.create(n_in=1, n_out=1, n_cmd=1, capacity=8)
    mon = MonitorProcess(ring, "127.0.0.1", 0, None, INFO, avoid_cpu=loop_cpu)
    plain = MonitorProcess(ring, "127.0.0.1", 0, None, INFO)
    try:
        assert os.sched_getaffinity(mon.pid) == cpus - {loop_cpu}
        assert os.sched_getaffinity(plain.pid) == cpus  # no pinned loop: no restriction
    finally:
        mon.stop()
        plain.stop()
        ring.close()


def test_values_reach_the_page_with_six_significant_digits_however_small():
    """An observer's estimate of 2.3e-7 rad must not arrive as 0; nothing this step is null, not NaN."""
    from closedloop.runtime.monitor.server import rounded_rows

    a = np.array([[2.3456789e-7, 0.1 + 0.2, 123456.789, np.nan, 0.0, -4.5e-12, 3.0000001, 7.0]], np.float32)
    got = rounded_rows(a)[0]
    assert got == [2.34568e-07, 0.3, 123457.0, None, 0.0, -4.5e-12, 3.0, 7.0]
    assert json.dumps(got) == "[2.34568e-07, 0.3, 123457.0, null, 0.0, -4.5e-12, 3.0, 7.0]"  # short, strict JSON


def test_a_page_that_joins_late_gets_the_sessions_events_and_its_latest_status_not_only_status_updates():
    """A long session sends a status update several times a second: a page that joins after 300 of them still gets
    the watchdog trip from before them, and the latest status; the server keeps the latest status only."""
    import asyncio

    import aiohttp

    ring = StepRing.create(n_in=4, n_out=2, n_cmd=2, capacity=64)
    mon = MonitorProcess(ring, "127.0.0.1", 0, None, INFO | {"t0_ns": time.monotonic_ns()})
    try:
        ring.event({"event": "watchdog", "step": 3, "silent_s": 0.3})
        for k in range(300):
            ring.event({"event": "status", "step": 10 + k, "state": "running", "text": "", "chars": 0})
            if k % 50 == 0:
                time.sleep(0.1)  # the server reads the ring's events as they come, as in a session
        time.sleep(0.5)

        async def hello():
            async with aiohttp.ClientSession() as http, http.ws_connect(mon.url + "ws") as ws:
                return json.loads((await ws.receive()).data)

        got: list = []
        t = threading.Thread(target=lambda: got.append(asyncio.run(hello())))
        t.start()
        t.join(30)
        events = got[0]["events"]
        assert [e["event"] for e in events] == ["watchdog", "status"], [e["event"] for e in events][:5]
        assert events[-1]["step"] == 309
        state = json.loads(urllib.request.urlopen(mon.url + "api/state", timeout=5).read())
        assert state["status"]["step"] == 309 and [e["event"] for e in state["events"]] == ["watchdog"]
    finally:
        mon.stop()
        ring.close()
