"""``closedloop monitor FILE.clrec``: a recording in the live monitor's page, with a time slider.

The page is the same; instead of a stream of ``steps`` messages it receives one
``recording`` message holding the decoded recording (``runtime.recording_view``):
per-step timing and flags, the input frames, the commands, the model outputs, the family's
state (an observer's estimate), the typed text and the events, each with host seconds. The page's slider picks the moment shown.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from closedloop.runtime.monitor.server import ignore_client, rounded_rows
from closedloop.runtime.recording_view import RecordingView, Series, view_recording

#: Rows per series sent to the page at most (longer series are decimated evenly).
MAX_ROWS = 20000


def _decimate(n: int) -> np.ndarray:
    return np.arange(n) if n <= MAX_ROWS else np.linspace(0, n - 1, MAX_ROWS).astype(int)


def _all_outputs(v: RecordingView) -> Series:
    """The model outputs of each step the model ran, every data output one after another (as a live session's
    observers get them): the OUTPUT series with each MORE_OUTPUT series appended, row by row."""
    if not v.more_outputs:
        return v.outputs
    n = min([len(v.outputs), *(len(s) for s in v.more_outputs.values())])  # a torn tail may cut one short
    out = Series()
    for i in range(n):
        out.add(v.outputs.t_host_s[i], float("nan"),
                np.concatenate([v.outputs.values[i], *(s.values[i] for s in v.more_outputs.values())]),
                v.outputs.seq[i])
    return out


def missed_so_far(steps: dict[str, np.ndarray], period_us: float) -> np.ndarray:
    """The loop's missed deadlines up to and including each step, as a live session counts them (its status's
    ``missed``): steps that overran their period, plus the periods skipped after them (step indices jump)."""
    step = np.asarray(steps["step"], dtype=np.int64)
    if not step.size:
        return np.zeros(0, dtype=np.int64)
    over = (np.asarray(steps["latency_us"]) + np.maximum(np.asarray(steps["lateness_us"]), 0.0)) > period_us
    skipped = np.maximum(np.diff(step, prepend=step[0]) - 1, 0)
    return np.cumsum(over.astype(np.int64) + skipped)


def command_delays_us(steps: dict[str, np.ndarray], command_t_s: np.ndarray) -> np.ndarray:
    """How long after its step began each command went out (the live status's ``command_p99_us`` is the p99 of
    these): a command's time less the start of the latest step that began at or before it (NaN before the first)."""
    t = np.asarray(steps["t_s"], dtype=float)
    c = np.asarray(command_t_s, dtype=float)
    if not t.size or not c.size:
        return np.full(c.size, np.nan)
    i = np.searchsorted(t, c, side="right") - 1
    return np.where(i >= 0, (c - t[np.maximum(i, 0)]) * 1e6, np.nan)


def recording_message(v: RecordingView) -> dict[str, Any]:
    s = v.steps
    idx = _decimate(s["step"].size)
    period_us = 1e6 / float(v.meta.get("rate_hz") or 1.0)
    msg: dict[str, Any] = {
        "type": "recording",
        "steps": {"step": s["step"][idx].tolist(), "t_s": s["t_s"][idx].round(4).tolist(),
                  "latency_us": s["latency_us"][idx].round(1).tolist(),
                  "lateness_us": s["lateness_us"][idx].round(1).tolist(), "flags": s["flags"][idx].tolist(),
                  "missed_total": missed_so_far(s, period_us)[idx].tolist()},
        "typed": [[round(t, 4), text] for t, _, text in v.typed if text],
        "events": [dict(ev, t_s=round(t, 4)) for t, ev in v.events],
        # how the session ended (its SUMMARY's loop.stopped_by; null: the file has no SUMMARY) and what a viewer
        # should know before trusting the file (RecordingView.problems: data dropped, a session that never ended)
        "stopped_by": ((v.summary or {}).get("loop") or {}).get("stopped_by") if v.summary else None,
        "problems": v.problems(),
    }
    name = next((n for n in ("binned_spikes", "plant_output_y", "joint_positions") if n in v.inputs), None)
    for key, series in (("inputs", v.inputs.get(name) if name else None), ("commands", v.commands),
                        ("outputs", _all_outputs(v)), ("state", v.state)):
        if series is None or not len(series):
            msg[key] = {"t_s": [], "rows": [], "seq": []}
            continue
        j = _decimate(len(series))
        msg[key] = {"t_s": np.round(np.asarray(series.t_host_s)[j], 4).tolist(), "rows": rounded_rows(series.array()[j]),
                    "seq": np.asarray(series.seq)[j].tolist()}
        if key == "commands":
            delays = command_delays_us(s, np.asarray(series.t_host_s))[j]
            msg[key]["delay_us"] = [None if not np.isfinite(d) else round(float(d), 1) for d in delays]
    times = [msg[k]["t_s"][-1] for k in ("inputs", "commands", "outputs") if msg[k]["t_s"]]
    times += msg["steps"]["t_s"][-1:]
    msg["duration_s"] = max(times) if times else 0.0
    return msg


def recording_info(v: RecordingView) -> dict[str, Any]:
    m = v.meta
    return {"family": m.get("family"), "bundle_name": m.get("bundle_name") or m.get("bundle"),
            "rate_hz": m.get("rate_hz"), "backend": m.get("backend"), "device": m.get("device"),
            "device_url": m.get("device_url"), "mode": "recording", "recording": str(v.path),
            "described": v.described, "has_steps": bool(v.steps["step"].size), "problems": v.problems(),
            "outputs": m.get("outputs") or [], "state": v.state_labels}


async def serve_recording(path: str | Path, host: str, port: int, ready: Any = print,
                          token: str | None = None) -> None:
    """Serve the page for one recording until cancelled; ``ready(url)`` once listening (``ready(url, remote_url)``
    on every address: the URL for this machine and the one with its host name, for others).

    With ``token`` the page and its WebSocket answer only a request carrying ``?token=...``
    (the URL given to ``ready`` carries it), as the live monitor does on a public address.
    """
    from aiohttp import web

    from .server import MAX_CLIENT_MESSAGE, _asset, authorised, monitor_urls

    view = view_recording(path)
    for problem in view.problems():  # on the terminal that started it, before the page shows what is left
        print(f"warning: {path}: {problem}", file=sys.stderr)
    info = recording_info(view)
    payload = json.dumps(recording_message(view), default=str)

    async def index(request: Any) -> Any:
        if not authorised(request, token):
            return web.Response(status=403, text="this page needs ?token=... (printed by closedloop monitor)\n")
        return web.Response(text=_asset("index.html"), content_type="text/html")

    async def asset(request: Any) -> Any:
        name = request.match_info["name"]
        types = {"js": "application/javascript", "css": "text/css"}
        ext = name.rsplit(".", 1)[-1]
        if "/" in name or ext not in types:
            raise web.HTTPNotFound()
        return web.Response(text=_asset(name), content_type=types[ext])

    async def websocket(request: Any) -> Any:
        if not authorised(request, token):
            return web.Response(status=403, text="token required\n")
        ws = web.WebSocketResponse(max_msg_size=MAX_CLIENT_MESSAGE)
        await ws.prepare(request)
        await ws.send_str(json.dumps({"type": "hello", "info": info, "events": []}, default=str))
        await ws.send_str(payload)
        await ignore_client(ws)  # nothing from the page is acted on
        return ws

    app = web.Application()
    app.router.add_get("/", index)
    app.router.add_get("/static/{name}", asset)
    app.router.add_get("/ws", websocket)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another with --port "
                      "(0 picks a free one)") from None
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url, remote = monitor_urls(host, bound, token)
    ready(url) if remote is None else ready(url, remote)
    try:
        while True:
            await asyncio.sleep(3600)
    finally:
        await runner.cleanup()
