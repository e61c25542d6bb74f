"""``closedloop recording FILE --plot out.png``: one figure that says how a session went.

A 2 x 2 grid: latency and lateness over time (missed deadlines marked), the latency
histogram against the deadline, the input stream (a heat map of neural channels, or the
measured traces, with an observer's prediction of each), and the commands sent with the
safe-command periods shaded and the events marked, with a decoder's typed text in the title.
A recording that holds the family's state (an observer's estimate, FAMILY_STATE records)
gets a third row: each group of it (states, disturbances) over time.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from closedloop.common.atomic import atomic_write_bytes
from closedloop.runtime.observe.ring import FLAG_SAFE
from closedloop.runtime.recording_view import RecordingView, view_recording

_EVENT_COLOURS = {"watchdog": "tab:red", "disconnected": "tab:red", "reconnected": "tab:green",
                  "input_resumed": "tab:green", "device_hello": "tab:purple", "nonfinite": "tab:orange"}


def plot_recording(recording: str | Path, out: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    v = view_recording(recording)
    rate = float(v.meta.get("rate_hz") or (v.summary or {}).get("loop", {}).get("rate_hz") or 0.0)
    period_us = 1e6 / rate if rate else None
    groups = [g for g in _state_groups(v) if g[0] != "predicted"]
    layout = [["timing", "histogram"], ["input", "commands"]] + [[f"state{i}"] * 2 for i in range(len(groups))]
    axes = plt.figure(figsize=(13, 8 + 2.6 * len(groups)), layout="constrained").subplot_mosaic(layout)
    fig = axes["timing"].figure
    _timing(axes["timing"], v, period_us)
    _histogram(axes["histogram"], v, period_us)
    _inputs(axes["input"], v)
    _commands(axes["commands"], v)
    for i, group in enumerate(groups):
        _state(axes[f"state{i}"], v, *group)
    device = str(v.meta.get("device_url", "?"))
    if len(device) > 90:  # a long URL (fault options) would run off both ends of the figure
        device = device[:87] + "..."
    title = (f"{v.meta.get('bundle_name') or v.meta.get('bundle', '?')} on {device} "
             f"({v.meta.get('family', '?')}, {rate:g} Hz, backend {v.meta.get('backend', '?')})")
    if v.text:  # a decoder that types (a generic decoder's DECODER_OUTPUTs carry values, no text)
        text = v.text
        title += "\ntyped: " + (text if len(text) <= 110 else "..." + text[-107:])
    fig.suptitle(title, fontsize=11)
    out = Path(out)
    buf = io.BytesIO()  # drawn in memory, then written atomically: a failure leaves no partial or stray file
    try:
        fig.savefig(buf, dpi=110, format=out.suffix[1:].lower() or "png")
    finally:
        plt.close(fig)
    return atomic_write_bytes(out, buf.getvalue())


def _no_steps(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"this recording holds no STEPS records\n(per-step timing): no {what}", ha="center",
            va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def _timing(ax, v: RecordingView, period_us: float | None) -> None:
    s = v.steps
    ax.set_title("latency and lateness per step")
    if not s["step"].size:
        _no_steps(ax, "timing")
        return
    ax.plot(s["t_s"], s["latency_us"], lw=0.7, label="latency")
    ax.plot(s["t_s"], s["lateness_us"], lw=0.7, label="lateness", alpha=0.8)
    if period_us:
        missed = s["latency_us"] + np.maximum(s["lateness_us"], 0) > period_us
        loop = (v.summary or {}).get("loop") or {}
        # the summary's missed deadlines also count the periods skipped after an overrun, which have no step
        total = loop.get("missed_deadlines")
        more = f"; {total} missed deadlines with the periods skipped" if total is not None and total != missed.sum() else ""
        if missed.any():
            ax.scatter(s["t_s"][missed], s["latency_us"][missed], s=12, color="tab:red", zorder=3,
                       label=f"step past its deadline ({int(missed.sum())}{more})")
        ax.axhline(period_us, color="0.5", ls="--", lw=0.8, label=f"period {period_us:.0f} us")
    ax.set_xlabel("host time (s)")
    ax.set_ylabel("us")
    ax.set_yscale("symlog", linthresh=10)
    ax.legend(loc="upper right", fontsize=8)


def _histogram(ax, v: RecordingView, period_us: float | None) -> None:
    lat = v.steps["latency_us"]
    ax.set_title("step latency distribution")
    if not lat.size:
        _no_steps(ax, "histogram")
        return
    hi = max(float(np.percentile(lat, 99.9)) * 1.2, 1.0)
    ax.hist(np.clip(lat, 0, hi), bins=80, color="tab:blue", alpha=0.8)
    for q, ls in ((50, "-"), (99, "--")):
        x = float(np.percentile(lat, q))
        ax.axvline(x, color="k", ls=ls, lw=0.9, label=f"p{q} {x:.0f} us")
    top = float(lat.max())
    if top <= hi:
        ax.axvline(top, color="tab:red", ls=":", lw=0.9, label=f"max {top:.0f} us")
    else:  # a stall far out would squeeze the distribution into one bar: the axis ends at p99.9 x 1.2, the rest said
        over = int((lat > hi).sum())
        ax.plot([], [], " ", label=f"max {top:.0f} us; {over} step{'s' if over != 1 else ''} past the axis, in its "
                                   "last bar")
    if period_us and period_us <= hi:
        ax.axvline(period_us, color="0.5", ls="--", lw=0.8, label="period")
    ax.set_xlim(0, hi)
    ax.set_xlabel("latency (us)")
    ax.set_ylabel("steps")
    ax.legend(fontsize=8)


def _gaps(t, values: np.ndarray, period_s: float | None) -> tuple[np.ndarray, np.ndarray]:
    """``t`` and ``values`` with a NaN row inserted wherever samples stop for more than 5 periods (or 0.1 s), so
    a silence is drawn as a gap, not as a straight line across it."""
    t = np.asarray(t, dtype=float)
    values = np.asarray(values, dtype=float)
    if t.size < 2:
        return t, values
    at = np.flatnonzero(np.diff(t) > max(5 * (period_s or 0.0), 0.1)) + 1
    if not at.size:
        return t, values
    return (np.insert(t, at, np.nan),
            np.insert(values, at, np.full((at.size,) + values.shape[1:], np.nan), axis=0))


def _period_s(v: RecordingView) -> float | None:
    rate = float(v.meta.get("rate_hz") or 0.0)
    return 1.0 / rate if rate else None


def _inputs(ax, v: RecordingView) -> None:
    if "binned_spikes" in v.inputs:
        s = v.inputs["binned_spikes"]
        counts = s.array()
        ax.set_title(f"neural input: {counts.shape[1]} channels x {counts.shape[0]} bins")
        t = np.asarray(s.t_host_s)
        im = ax.imshow(counts.T, aspect="auto", origin="lower", cmap="magma", interpolation="nearest",
                       extent=(t[0], t[-1] if t[-1] > t[0] else t[0] + 1, 0, counts.shape[1]))
        ax.figure.colorbar(im, ax=ax, label="counts per bin", fraction=0.04)
        ax.set_ylabel("channel")
    else:
        name = next((n for n in ("plant_output_y", "joint_positions") if n in v.inputs), None)
        if name is None:
            ax.set_title("input")
            ax.text(0.5, 0.5, "no input frames decoded", ha="center", va="center", transform=ax.transAxes)
            return
        s = v.inputs[name]
        vals = s.array()
        ax.set_title(f"input: {name} ({vals.shape[1]} value{'' if vals.shape[1] == 1 else 's'})")
        t_in, vals = _gaps(s.t_host_s, vals, _period_s(v))
        for j in range(min(vals.shape[1], 8)):
            ax.plot(t_in, vals[:, j], lw=0.8, label=f"{name}[{j}]")
        predicted = next((g for g in _state_groups(v) if g[0] == "predicted"), None)
        if predicted is not None and len(v.state):
            st = v.state.array()
            for j, (k, label) in enumerate(zip(predicted[1][:8], predicted[2][:8], strict=True)):
                ax.plot(v.state.t_host_s, st[:, k], lw=0.8, ls="--", color=f"C{j}", label=f"predicted {label}")
        elif v.outputs and v.meta.get("family") == "observer":  # a recording without the family's state
            out = v.outputs.array()
            for j in range(min(out.shape[1], 4)):
                ax.plot(v.outputs.t_host_s, out[:, j], lw=0.8, ls="--", label=f"correction N(r)[{j}]")
        ax.legend(fontsize=7, ncol=2, loc="upper right")
    ax.set_xlabel("host time (s)")


def _state_groups(v: RecordingView) -> list[tuple[str, list[int], list[str]]]:
    """META ``family_state`` labels (``GROUP/NAME``) as ``(group, columns, names)`` in label order."""
    groups: dict[str, tuple[list[int], list[str]]] = {}
    for k, label in enumerate(v.state_labels):
        group, _, name = label.rpartition("/")
        cols, names = groups.setdefault(group or "state", ([], []))
        cols.append(k)
        names.append(name)
    return [(g, cols, names) for g, (cols, names) in groups.items()]


def _state(ax, v: RecordingView, group: str, cols: list[int], names: list[str]) -> None:
    what = "the observer's estimate" if v.meta.get("family") == "observer" else "the family's state"
    ax.set_title(f"{what}: {group} ({len(cols)} value{'' if len(cols) == 1 else 's'}"
                 f"{', first 8 shown' if len(cols) > 8 else ''}), after each model run")
    st = v.state.array()
    if not len(st):
        ax.text(0.5, 0.5, "no FAMILY_STATE records", ha="center", va="center", transform=ax.transAxes)
        return
    for k, name in zip(cols[:8], names[:8], strict=True):
        ax.plot(v.state.t_host_s, st[:, k], lw=0.8, label=name)
    ax.legend(fontsize=7, ncol=4, loc="upper right")
    ax.set_xlabel("host time (s)")


def _commands(ax, v: RecordingView) -> None:
    ax.set_title("commands sent (shaded: safe command) and events")
    if len(v.commands) and not v.text:
        t_cmd, vals = _gaps(v.commands.t_host_s, v.commands.array(), _period_s(v))
        for j in range(min(vals.shape[1], 8)):
            ax.plot(t_cmd, vals[:, j], lw=0.8)
    elif v.text:  # a typing decoder: its text as it grew
        t = [x[0] for x in v.typed]
        ax.plot(t, np.cumsum([len(x[2]) for x in v.typed]), lw=1.0, label="characters typed")
        ax.legend(fontsize=8, loc="upper left")
    s = v.steps
    if s["step"].size:
        safe = (s["flags"] & FLAG_SAFE) != 0
        _shade(ax, s["t_s"], safe)
    # events: a dotted line each; past 40 of them (a long or faulty session) a tick each in a strip along the top,
    # so they do not hide the commands
    by_kind: dict[str, list[float]] = {}
    for t, ev in v.events:
        kind = str(ev.get("event"))
        if kind not in ("steps_lost",):
            by_kind.setdefault(kind, []).append(t)
    many = sum(len(ts) for ts in by_kind.values()) > 40
    for kind, ts in by_kind.items():
        colour = _EVENT_COLOURS.get(kind, "0.4")
        label = f"{kind} ({len(ts)})" if many else kind
        if many:
            ax.vlines(ts, 0.92, 1.0, transform=ax.get_xaxis_transform(), color=colour, lw=0.8, label=label)
        else:
            for i, t in enumerate(ts):
                ax.axvline(t, color=colour, lw=0.8, ls=":", label=label if i == 0 else None)
    if by_kind:
        ax.legend(fontsize=7, loc="lower right", ncol=2 if len(by_kind) > 6 else 1)
    ax.set_xlabel("host time (s)")


def _shade(ax, t: np.ndarray, mask: np.ndarray) -> None:
    if not mask.any():
        return
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    for a, b in zip(edges[::2], edges[1::2], strict=True):
        ax.axvspan(t[a], t[min(b, t.size - 1)], color="tab:red", alpha=0.15, lw=0)
