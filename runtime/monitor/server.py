"""The browser monitor's server: a separate process that reads the session's step ring.

``closedloop run ... --monitor [HOST:]PORT`` starts this process before the loop. It
attaches to the session's ``StepRing`` by name, so the web server (aiohttp) never takes
the loop's GIL, and serves one page and its assets from the package (no CDN, no
network) plus a WebSocket that pushes what the ring holds at ``push_hz``. A browser
that is slow or gone loses updates (counted); the session never waits for it.

WebSocket messages (JSON text frames, server to browser; documented in docs/monitor.md):
``hello`` once (session info and the recent history), then ``steps`` (arrays of the new
records) and ``event`` (each session event, status updates included). The browser sends
nothing the server needs; anything it sends is ignored, malformed or not.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import math
import os
import select
import socket
import subprocess
import sys
import time
from importlib import resources
from typing import Any

import numpy as np

from closedloop.runtime.observe.ring import StepBatch, StepRing

#: Most step records per push; a faster session (a 1 kHz plant at 20 pushes/s sends 50) is decimated past this.
MAX_ROWS_PER_PUSH = 250
#: Pushes a browser may lag behind before the oldest are dropped for it.
CLIENT_QUEUE = 16
#: After the session's end, how long the server waits for its clients to take the last records and the close.
END_GRACE_S = 1.0
#: The largest message a client may send (bytes): the server ignores what clients send, and a larger message
#: closes that client's socket with code 1009 (message too big); the page sends none
MAX_CLIENT_MESSAGE = 4096
#: Messages a client may send in one second: the page sends none, and a client that floods the server (which would
#: take the CPU a session may need) is closed with code 1008 (policy violation)
MAX_CLIENT_MESSAGES_PER_S = 50


async def ignore_client(ws: Any) -> None:
    """Read what a client sends until it closes, acting on none of it; close a client that sends more than
    ``MAX_CLIENT_MESSAGES_PER_S`` messages in a second (1008)."""
    import time

    from aiohttp import WSMsgType

    window, count = time.monotonic(), 0
    async for msg in ws:
        if msg.type in (WSMsgType.ERROR, WSMsgType.CLOSE):
            return
        now = time.monotonic()
        if now - window >= 1.0:
            window, count = now, 0
        count += 1
        if count > MAX_CLIENT_MESSAGES_PER_S:
            await ws.close(code=1008, message=b"too many messages: this socket sends, the client does not")
            return


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only: a loopback address, or a name every address of which is one
    (``localhost``, a name /etc/hosts gives 127.0.0.1); a name that does not resolve is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        found = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return False
    return bool(found) and all(ipaddress.ip_address(str(a).split("%")[0]).is_loopback for a in found)


def authorised(request: Any, token: str | None) -> bool:
    """Whether a request may see the page: no token set, or its ``?token=`` equals it (constant-time compare)."""
    if token is None:
        return True
    return hmac.compare_digest(request.query.get("token", "").encode(), token.encode())


#: significant digits of the values the page gets (float32 holds about 7)
SIGNIFICANT_DIGITS = 6


def rounded_rows(a: np.ndarray, digits: int = SIGNIFICANT_DIGITS) -> list[list[float | None]]:
    """Rows of values rounded to ``digits`` significant digits (a 2e-7 estimate stays 2e-7, not 0), non-finite
    ones as null: short JSON that keeps every value's precision where the page can show it."""
    x = np.asarray(a, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        k = (digits - 1 - np.floor(np.log10(np.abs(x)))).astype(np.float64)
    k = np.nan_to_num(k, nan=0.0, posinf=0.0, neginf=0.0)
    exact = np.abs(k) <= 22  # powers of ten up to 1e22 are exact doubles; values beyond are kept as they are
    k = np.where(exact, k, 0.0)
    scale = 10.0 ** np.abs(k)  # scaled by an exact power both ways, each value is the double nearest its decimal
    out = np.where(k >= 0, np.round(x * scale) / scale, np.round(x / scale) * scale)
    out = np.where(exact, out, x)
    return [[None if not math.isfinite(v) else v for v in row] for row in out.tolist()]


def steps_message(batch: StepBatch, period_s: float, t0_ns: int) -> dict[str, Any]:
    """A ``steps`` message from a batch, decimated to ``MAX_ROWS_PER_PUSH`` rows (missed deadlines always kept)."""
    n = len(batch)
    late_ns = batch.lateness_ns
    lat_ns = batch.latency_ns
    missed = (lat_ns + np.maximum(late_ns, 0)) > period_s * 1e9
    if n > MAX_ROWS_PER_PUSH:
        keep = np.zeros(n, dtype=bool)
        keep[np.linspace(0, n - 1, MAX_ROWS_PER_PUSH).astype(int)] = True
        keep |= missed
        idx = np.flatnonzero(keep)
    else:
        idx = np.arange(n)

    def rows(a: np.ndarray) -> list[list[float | None]]:
        return rounded_rows(a[idx])  # NaN (nothing this step) -> null

    return {
        "type": "steps",
        "step": batch.step[idx].tolist(),
        "t_s": ((batch.t_ns[idx] - t0_ns) / 1e9).round(4).tolist(),
        "latency_us": (lat_ns[idx] / 1e3).round(1).tolist(),
        "lateness_us": (late_ns[idx] / 1e3).round(1).tolist(),
        "missed": missed[idx].astype(int).tolist(),
        "flags": batch.flags[idx].tolist(),
        "input_seq": batch.input_seq[idx].tolist(),
        "inputs": rows(batch.inputs),
        "outputs": rows(batch.outputs),
        "command": rows(batch.command),
        "state": rows(batch.state),
        "count": n,
        "lost": int(batch.lost),
    }


class _Client:
    def __init__(self, ws: Any):
        self.ws = ws
        self.queue: asyncio.Queue[str | None] = asyncio.Queue(CLIENT_QUEUE)
        self.dropped = 0
        self.done = asyncio.Event()  # set once the session's end was sent and the socket closed

    def offer(self, text: str | None) -> None:
        """Queue a message; ``None`` closes the socket after what is queued (the session ended)."""
        if self.queue.full():
            self.queue.get_nowait()
            self.dropped += 1
        self.queue.put_nowait(text)


class MonitorApp:
    """The aiohttp application over one ring (also used in-process by the tests of the page)."""

    def __init__(self, ring: StepRing, info: dict[str, Any], token: str | None, push_hz: float = 15.0,
                 parent_pid: int | None = None):
        self.ring = ring
        #: the session's process: when it is gone (killed before it could write session_end), the session has ended
        self.parent_pid = parent_pid
        self.info = info
        self.token = token
        self.push_s = 1.0 / push_hz
        self.period_s = 1.0 / float(info.get("rate_hz") or 1.0)
        self.t0_ns = int(info.get("t0_ns") or time.monotonic_ns())
        self.clients: set[_Client] = set()
        self.events: list[dict[str, Any]] = []  # the session's events but status updates, for late joiners
        self.last_status: dict[str, Any] | None = None  # the latest status update
        self.history: list[str] = []  # the last few steps messages, for late joiners
        self.pushes = 0
        self.ended = asyncio.Event()  # the session wrote session_end and every record before it was pushed

    async def index(self, request: Any) -> Any:
        from aiohttp import web

        if not authorised(request, self.token):
            return web.Response(status=403, text="this monitor needs ?token=... (printed by closedloop run)\n")
        return web.Response(text=_asset("index.html"), content_type="text/html")

    async def asset(self, request: Any) -> Any:
        from aiohttp import web

        name = request.match_info["name"]
        types = {"js": "application/javascript", "css": "text/css"}
        ext = name.rsplit(".", 1)[-1]
        if "/" in name or ext not in types:
            raise web.HTTPNotFound()
        try:
            return web.Response(text=_asset(name), content_type=types[ext])
        except FileNotFoundError:
            raise web.HTTPNotFound() from None

    async def state(self, request: Any) -> Any:
        from aiohttp import web

        if not authorised(request, self.token):
            return web.json_response({"error": "token required"}, status=403)
        return web.json_response({"info": self.info, "published": self.ring.published, "pushes": self.pushes,
                                  "clients": len(self.clients), "status": self.last_status,
                                  "events": self.events[-50:]})

    async def websocket(self, request: Any) -> Any:
        from aiohttp import web

        if not authorised(request, self.token):
            return web.Response(status=403, text="token required\n")
        ws = web.WebSocketResponse(heartbeat=10.0, max_msg_size=MAX_CLIENT_MESSAGE)
        await ws.prepare(request)
        client = _Client(ws)
        # the session's last 200 events (watchdog trips, reconnects...) and then its latest status
        hello = {"type": "hello", "info": self.info,
                 "events": self.events[-200:] + ([self.last_status] if self.last_status else [])}
        await ws.send_str(json.dumps(hello))
        for text in self.history:
            client.offer(text)
        if self.ended.is_set():
            client.offer(None)
        self.clients.add(client)
        sender = asyncio.ensure_future(self._send_loop(client))
        try:
            await ignore_client(ws)  # the page sends nothing we act on; a malformed message is simply ignored
        finally:
            self.clients.discard(client)
            sender.cancel()
        return ws

    async def _send_loop(self, client: _Client) -> None:
        try:
            while True:
                text = await client.queue.get()
                if text is None:  # the session ended: a normal close (1000), so a client can tell it from a crash
                    await client.ws.close(code=1000, message=b"session ended")
                    return
                await client.ws.send_str(text)
        except (ConnectionError, RuntimeError, asyncio.CancelledError):
            return
        finally:
            client.done.set()

    def _offer_all(self, text: str | None) -> None:
        for c in list(self.clients):
            c.offer(text)

    def _push_steps(self, cursor: int) -> int:
        batch, cursor = self.ring.read(cursor)
        if len(batch) or batch.lost:
            text = json.dumps(steps_message(batch, self.period_s, self.t0_ns) | {"push": self.pushes})
            self.history.append(text)
            del self.history[:-8]
            self._offer_all(text)
            self.pushes += 1
        return cursor

    async def pump(self) -> None:
        """Read the ring at push_hz and hand every client the new records and events.

        At ``session_end`` (the session's last event) the records published before it are pushed, then the
        event, and every socket is closed normally (code 1000); ``ended`` is then set."""
        cursor = max(0, self.ring.published - MAX_ROWS_PER_PUSH)
        ev_cursor = 0
        while True:
            events, ev_cursor, _ = self.ring.read_events(ev_cursor)
            end = None
            for ev in events:
                if ev.get("event") == "session_end":
                    end = ev
                    continue
                if ev.get("event") == "session_info":  # later pages get it in their hello
                    self.info.update({k: v for k, v in ev.items() if k not in ("event", "step")})
                if ev.get("event") == "status":  # several a second: only the latest is kept for late joiners
                    self.last_status = ev
                elif ev.get("event") != "typed":  # a page that joins later has the whole text from the last status
                    self.events.append(ev)
                if len(self.events) > 5000:
                    del self.events[:1000]
                self._offer_all(json.dumps({"type": "event", **ev}, default=str))
            cursor = self._push_steps(cursor)
            if end is None and self.parent_pid is not None and os.getppid() != self.parent_pid:
                # the session's process died without a word (SIGKILL, a crash): nothing more will come, and a
                # server left running would hold its port and the ring's memory for good
                end = {"event": "session_end", "step": -1, "reason": "the session's process is gone"}
            if end is not None:
                self.events.append(end)
                self._offer_all(json.dumps({"type": "event", **end}, default=str))
                self._offer_all(None)
                self.ended.set()
                return
            await asyncio.sleep(self.push_s)

    def make_app(self) -> Any:
        from aiohttp import web

        app = web.Application()
        app.router.add_get("/", self.index)
        app.router.add_get("/static/{name}", self.asset)
        app.router.add_get("/api/state", self.state)
        app.router.add_get("/ws", self.websocket)

        async def start_pump(app: Any) -> None:
            app["pump"] = asyncio.ensure_future(self.pump())

        async def stop_pump(app: Any) -> None:
            app["pump"].cancel()

        app.on_startup.append(start_pump)
        app.on_cleanup.append(stop_pump)
        return app


def _asset(name: str) -> str:
    return resources.files("closedloop.runtime.monitor").joinpath("assets").joinpath(name).read_text(encoding="utf-8")


def serve(ring_name: str, host: str, port: int, token: str | None, info: dict[str, Any], ready: Any,
          avoid_cpu: int | None = None, parent_pid: int | None = None) -> None:
    """Serve until the session ends; report ``("ok", bound_port)`` or ``("error", message)`` through ``ready(...)``.

    ``avoid_cpu``: the CPU a real-time loop is pinned to; this process leaves it to the loop (when another
    CPU is allowed). ``parent_pid``: the session's process; the server ends when it is no longer this one's
    parent (the session was killed before it could say it ended)."""
    try:
        from aiohttp import web
    except ImportError:
        ready(("error", "the monitor needs aiohttp: pip install 'closedloop[monitor]'"))
        return
    try:  # the loop and the device come first: this process yields the CPU to them when both want it
        os.nice(10)
    except OSError:
        pass
    if avoid_cpu is not None and hasattr(os, "sched_setaffinity"):
        others = os.sched_getaffinity(0) - {avoid_cpu}
        if others:  # a pinned loop's cache and core stay its own
            os.sched_setaffinity(0, others)
    ring = StepRing.attach(ring_name)
    app = MonitorApp(ring, info, token, parent_pid=parent_pid)

    async def main() -> None:
        runner = web.AppRunner(app.make_app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            ready(("error", f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another port "
                            "with --monitor HOST:PORT (0 picks a free one)"))
            await runner.cleanup()
            return
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        ready(("ok", bound))
        await app.ended.wait()  # the session ended: let each client get the last records and a normal close
        waits = [c.done.wait() for c in list(app.clients)]
        if waits:
            await asyncio.wait([asyncio.ensure_future(w) for w in waits], timeout=END_GRACE_S)
        await runner.cleanup()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    finally:
        ring.close()


def main() -> None:
    """``python -m closedloop.runtime.monitor RING HOST PORT``, the session info as JSON on stdin."""
    ring_name, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    request = json.loads(sys.stdin.readline())

    def ready(msg: tuple[str, Any]) -> None:
        sys.stdout.write(json.dumps(list(msg)) + "\n")
        sys.stdout.flush()

    serve(ring_name, host, port, request.get("token"), request["info"], ready, request.get("avoid_cpu"),
          request.get("parent"))


class MonitorProcess:
    """Starts the server process for a ring and stops it; ``url`` is what to open in a browser.

    The server is a fresh interpreter (``python -m``), not a multiprocessing child: nothing of the
    session's state, threads or ``__main__`` module is copied or re-run there.
    """

    def __init__(self, ring: StepRing, host: str, port: int, token: str | None, info: dict[str, Any],
                 start_timeout_s: float = 60.0, avoid_cpu: int | None = None):
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "closedloop.runtime.monitor", ring.name, host, str(port)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps({"token": token, "info": info, "avoid_cpu": avoid_cpu, "parent": os.getpid()},
                                          default=str) + "\n")
        self._proc.stdin.close()
        ready, _, _ = select.select([self._proc.stdout], [], [], start_timeout_s)
        line = self._proc.stdout.readline() if ready else ""
        if not line:
            self.stop()
            raise RuntimeError(f"the monitor did not start within {start_timeout_s:g} s (see the messages above)")
        status, value = json.loads(line)
        if status != "ok":
            self.stop()
            raise RuntimeError(value)
        self.host, self.port, self.token = host, int(value), token
        self.pid = self._proc.pid
        #: remote_url: for a monitor on every address (0.0.0.0, ::), the URL with this machine's name, for others
        self.url, self.remote_url = monitor_urls(host, self.port, token)

    def exit_code(self) -> int | None:
        """The server's exit status once it has ended (a crash, a kill), None while it serves."""
        return self._proc.poll()

    def stop(self) -> None:
        """After the session's ``session_end`` event the server ends by itself once its clients have the last
        records (at most about ``END_GRACE_S`` plus a push); it is terminated if it has not by then."""
        try:
            self._proc.wait(END_GRACE_S + 0.5)
        except subprocess.TimeoutExpired:
            pass
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)


def monitor_urls(host: str, port: int, token: str | None) -> tuple[str, str | None]:
    """The URL to open on this machine, and for a server on every address (0.0.0.0, ::) the one with this
    machine's host name for other machines (None otherwise); both carry the token."""
    query = f"?token={token}" if token else ""
    every = host in ("0.0.0.0", "::")
    shown = "127.0.0.1" if every else host
    shown = f"[{shown}]" if ":" in shown else shown
    return (f"http://{shown}:{port}/" + query,
            f"http://{socket.gethostname()}:{port}/" + query if every else None)


def parse_address(text: str) -> tuple[str, int]:
    """``PORT`` or ``HOST:PORT`` (``[::1]:PORT`` for IPv6) -> (host, port); a bare port binds 127.0.0.1."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text
    host = host.strip("[]") or "127.0.0.1"
    try:
        p = int(port)
    except ValueError:
        raise ValueError(f"--monitor {text!r}: expected PORT or HOST:PORT (e.g. 8765 or 127.0.0.1:8765)") from None
    if not 0 <= p <= 65535:
        raise ValueError(f"--monitor {text!r}: port {p} is outside 0..65535")
    return host, p


