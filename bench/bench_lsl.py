"""Benchmark of lsl://: a 1 kHz, 192-channel LSL stream decoded live, LSL timestamp to command sent.

    python bench/bench_lsl.py              # ~40 s; writes bench/results/lsl/
    python bench/bench_lsl.py --quick      # seconds; writes lsl_quick.* (not committed)

An outlet in another process pushes 192 spike counts (int32) at 1 kHz (declared; it runs
``--source-ppm`` fast, as a real amplifier's clock differs from the host's, so over the run
its samples arrive at every phase of the session's 1 kHz loop), each stamped with
``pylsl.local_clock()`` as it is pushed, paced by sleep. First a bare
inlet in this process waits on the stream for ``--probe-s`` seconds: the LSL
transit alone (push to pulled). Then ``closedloop.runtime.run_session`` decodes the
stream through ``lsl://NAME`` with a small GRU bundle (192 -> 64 -> 8) at 1 kHz and
records it. From the recording, for every model output: the sample's LSL timestamp
(the frame's ``timestamp_us`` plus the inlet's time correction from STATUS(LSL_CLOCK)),
when the session read it (its RX record) and when the command went out (the TX record
just before the output's OUTPUT record: a step sends its command first, written right after the transport's
write), all on the LSL clock
(``time.monotonic`` + the offset measured here; the same clock on Linux). Legs:

- total: LSL timestamp -> command sent (the issue's measure);
- to read: LSL timestamp -> the session's read (LSL transit plus the wait for the next
  loop step, up to one period: the stream and the loop run at 1 kHz on unrelated phases);
- step: read -> command sent (parse, model, encode, write).

``--realtime`` runs the session and the source under SCHED_FIFO; ``--wake-on-input`` has the
session step as each sample arrives instead of on its 1 kHz clock (``lsl_wake*``). Prints a table and writes
``lsl.json`` and ``lsl.png`` (``lsl_rt*`` with ``--realtime``, ``lsl_quick*`` with ``--quick``) to
``--out`` (default ``bench/results/lsl``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results" / "lsl"
CHANNELS, RATE_HZ = 192, 1000.0


# ----------------------------------------------------------------------------- the source (another process)

def run_outlet(name: str, seconds: float, ppm: float) -> None:
    import pylsl

    outlet = pylsl.StreamOutlet(pylsl.StreamInfo(name, "Spikes", CHANNELS, RATE_HZ, "int32", f"{name}-src"))
    rng = np.random.default_rng(0)
    data = rng.poisson(0.4, size=(int(RATE_HZ * 10), CHANNELS)).astype(np.int32)  # 10 s, cycled
    outlet.wait_for_consumers(60.0)
    period = 1.0 / (RATE_HZ * (1 + ppm * 1e-6))  # declared 1 kHz; ppm off, so its phase sweeps the loop's
    t0 = time.perf_counter()
    k = 0
    while k < seconds * RATE_HZ:
        # sleep only (no spin): on a small machine a spinning source would take the session's core; the
        # timestamp is read at the push, so a late push shifts the sample, never the measured latency
        left = t0 + k * period - time.perf_counter()
        if left > 0:
            time.sleep(left)
        outlet.push_sample(data[k % len(data)], pylsl.local_clock())
        k += 1


def realtime(priority: int = 50) -> None:
    """SCHED_FIFO for this thread and the threads it starts from now on (liblsl's, numba's): Linux, as root."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
    except (AttributeError, PermissionError, OSError) as exc:
        raise SystemExit(f"--realtime needs Linux and the right to SCHED_FIFO (root or CAP_SYS_NICE): {exc}") from None


def start_outlet(name: str, seconds: float, ppm: float, rt: bool) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--outlet", name, "--outlet-seconds", str(seconds),
                             "--source-ppm", str(ppm)] + (["--realtime"] if rt else []),
                            stderr=subprocess.DEVNULL)


# ----------------------------------------------------------------------------- measurements

def probe_transit(name: str, seconds: float) -> np.ndarray:
    """Push -> pulled by an inlet waiting in liblsl for each sample, microseconds: LSL's own share of the latency."""
    import pylsl

    found = pylsl.resolve_byprop("name", name, 1, 10.0)
    if not found:
        raise SystemExit(f"the benchmark's outlet {name!r} did not appear within 10 s")
    inlet = pylsl.StreamInlet(found[0], max_buflen=1)
    inlet.open_stream(timeout=10.0)
    corr = inlet.time_correction(timeout=5.0)
    inlet.flush()  # what queued while connecting is not transit
    out = []
    end = time.monotonic() + seconds
    buf = np.zeros((64, CHANNELS), dtype=np.int32)
    while time.monotonic() < end:
        # blocking in liblsl (the GIL and the core released) returns as soon as a sample is there; a busy poll
        # would take the core from liblsl's own receiving thread, under SCHED_FIFO above all
        _, ts = inlet.pull_chunk(timeout=0.1, max_samples=64, dest_obj=buf, min_samples=1, as_numpy=True)
        if len(ts):
            now = pylsl.local_clock()
            out.extend((now - (t + corr)) * 1e6 for t in ts)
    inlet.close_stream()
    return np.asarray(out)


def make_bundle(folder: Path) -> Path:
    import torch

    from closedloop.export import export_bundle
    from closedloop.sdk.models import GRUDecoder

    torch.manual_seed(0)
    return export_bundle(
        GRUDecoder(CHANNELS, 64, 1, 8).eval(), folder / "gru192", kind="recurrent",
        example_input=torch.zeros(1, CHANNELS), rate_hz=RATE_HZ, name="gru-192x64",
        extra={"session": {"input": "neural_frame", "command": "decoder_output"}},
        variants=(), tensorrt=False, report=lambda s: None,
    )


def latencies(record: Path, offset_s: float) -> dict[str, np.ndarray]:
    """Per model output: the legs in microseconds, from the recording."""
    from closedloop.firmware_bridge import DecoderOutput, FrameParser, NeuralFrame
    from closedloop.firmware_bridge.transports.lsl import STATUS_LSL_CLOCK
    from closedloop.runtime import RecordingReader, RecordType

    reader = RecordingReader(record)
    rx, tx = FrameParser(), FrameParser()
    corr = [json.loads(r.json()["text"])["time_correction_s"] for r in reader.of_type(RecordType.EVENT)
            if r.json().get("event") == "device_status" and r.json().get("code") == STATUS_LSL_CLOCK]
    correction = float(np.median(corr)) if corr else 0.0
    sample: dict[int, tuple[float, int]] = {}  # seq -> (LSL time of the sample, s; RX host_ns)
    # A step reads (RX), sends its command (TX) and then records the output it ran (OUTPUT, with the input's seq):
    # a command is paired with the OUTPUT that follows it before any further read; a refused step has no command.
    sent_ns: int | None = None
    total, to_read, step = [], [], []
    for rec in reader:
        if rec.type == RecordType.RX:
            sent_ns = None
            for f in rx.feed(rec.payload):
                if isinstance(f.message, NeuralFrame):
                    sample[f.seq] = (f.timestamp_us / 1e6 + correction, rec.host_ns)
        elif rec.type == RecordType.TX:
            if any(isinstance(f.message, DecoderOutput) for f in tx.feed(rec.payload)):
                sent_ns = rec.host_ns
        elif rec.type == RecordType.OUTPUT and sent_ns is not None:
            seq = rec.output()[1]
            if seq in sample:
                t_lsl, rx_ns = sample.pop(seq)
                total.append((sent_ns / 1e9 + offset_s - t_lsl) * 1e6)
                to_read.append((rx_ns / 1e9 + offset_s - t_lsl) * 1e6)
                step.append((sent_ns - rx_ns) / 1e3)
            sent_ns = None
    return {"total": np.asarray(total), "to_read": np.asarray(to_read), "step": np.asarray(step),
            "time_correction_s": np.asarray([correction])}


def pct(a: np.ndarray) -> dict[str, float]:
    if not a.size:
        return {"n": 0}
    return {"n": int(a.size), "p1_us": round(float(np.percentile(a, 1)), 1),
            "p50_us": round(float(np.percentile(a, 50)), 1),
            "p99_us": round(float(np.percentile(a, 99)), 1), "p999_us": round(float(np.percentile(a, 99.9)), 1),
            "max_us": round(float(a.max()), 1), "mean_us": round(float(a.mean()), 1)}


def plot(legs: dict[str, np.ndarray], transit: np.ndarray, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    hi = max(float(np.percentile(legs["total"], 99.9)) * 1.2, 1200.0) if legs["total"].size else 1200.0
    bins = np.linspace(0, hi, 120)
    for key, label in (("total", "LSL timestamp -> command sent"), ("to_read", "LSL timestamp -> session read"),
                       ("step", "session read -> command sent")):
        ax.hist(np.clip(legs[key], 0, hi), bins=bins, histtype="step", label=label, density=True)
    ax.hist(np.clip(transit, 0, hi), bins=bins, histtype="step", label="LSL transit (bare inlet)",
            density=True, linestyle="--")
    ax.axvline(1000, color="k", lw=0.8, ls=":")
    ax.set_xlabel("microseconds")
    ax.set_ylabel("density")
    ax.set_title("1 kHz, 192-channel LSL stream decoded live")
    ax.legend(fontsize=8)
    ax = axes[1]
    if legs["total"].size:
        ax.plot(np.arange(legs["total"].size) / RATE_HZ, legs["total"], ",", alpha=0.6, label="total")
        ax.plot(np.arange(legs["step"].size) / RATE_HZ, legs["step"], ",", alpha=0.6, label="step")
    ax.axhline(1000, color="k", lw=0.8, ls=":")
    ax.set_xlabel("output index / 1000 (about seconds)")
    ax.set_ylabel("microseconds")
    ax.set_title("over the session")
    ax.legend(fontsize=8, markerscale=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="length of the live session")
    ap.add_argument("--probe-s", type=float, default=5.0, help="length of the bare-inlet transit probe")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--source-ppm", type=float, default=500.0,
                    help="the source runs this many ppm fast (its phase against the loop's sweeps every "
                         "1e6 / (ppm * 1000) s); 0: a fixed phase, whose luck decides the wait for the loop")
    ap.add_argument("--realtime", action="store_true",
                    help="run the session and the source under SCHED_FIFO (a board's real-time set-up), so other "
                         "work on the machine does not preempt them")
    ap.add_argument("--wake-on-input", action="store_true",
                    help="the session steps as each sample arrives (SessionConfig.wake_on_input) instead of on its "
                         "1 kHz clock; results go to lsl_wake*")
    ap.add_argument("--quick", action="store_true", help="3 s session, 1 s probe")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--outlet", help=argparse.SUPPRESS)
    ap.add_argument("--outlet-seconds", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.realtime:
        realtime()
    if args.outlet:
        run_outlet(args.outlet, args.outlet_seconds, args.source_ppm)
        return 0
    if args.quick:
        args.seconds, args.probe_s = 3.0, 1.0

    import pylsl

    from closedloop.runtime import SessionConfig, run_session
    from closedloop.runtime.observe.lsl_out import clock_offset_s

    load_before = list(os.getloadavg())  # other work on the machine shows in every leg: recorded with the run
    name = f"clbench-{uuid.uuid4().hex[:8]}"
    source = start_outlet(name, args.probe_s + args.seconds + 60.0, args.source_ppm, args.realtime)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            bundle = make_bundle(Path(tmp))
            print(f"LSL transit probe, {args.probe_s:g} s...", flush=True)
            transit = probe_transit(name, args.probe_s)
            offset, width = clock_offset_s(pylsl)
            rec = Path(tmp) / "lsl.clrec"
            print(f"session on lsl://{name} at 1 kHz for {args.seconds:g} s...", flush=True)
            summary = run_session(bundle, SessionConfig(device=f"lsl://{name}?timeout=10", duration_s=args.seconds,
                                                        record=str(rec), status=False, backend=args.backend,
                                                        wake_on_input=args.wake_on_input))
            legs = latencies(rec, offset)
    finally:
        source.terminate()
        source.wait(5)

    loop = summary.loop
    stats = {"total": pct(legs["total"]), "to_read": pct(legs["to_read"]), "step": pct(legs["step"]),
             "lsl_transit": pct(transit)}
    added_p99 = stats["lsl_transit"].get("p99_us", float("nan")) + stats["step"].get("p99_us", float("nan"))
    rows = [
        ("LSL timestamp -> command sent", stats["total"]),
        ("LSL timestamp -> session read", stats["to_read"]),
        ("session read -> command sent", stats["step"]),
        ("LSL transit (bare inlet)", stats["lsl_transit"]),
    ]
    print()
    print(f"{'leg':<32} {'n':>7} {'p50 us':>8} {'p99 us':>8} {'p99.9 us':>9} {'max us':>8}")
    for label, s in rows:
        print(f"{label:<32} {s.get('n', 0):>7} {s.get('p50_us', float('nan')):>8} {s.get('p99_us', float('nan')):>8} "
              f"{s.get('p999_us', float('nan')):>9} {s.get('max_us', float('nan')):>8}")
    print(f"loop: {loop.steps} steps, step latency p99 {loop.latency_p99_us:.0f} us, missed deadlines "
          f"{loop.missed_deadlines}; inputs used {summary.inputs_used}, skipped for newer {summary.inputs_skipped}; "
          f"backend {summary.backend}")
    print(f"added by LSL and the session (transit p99 + step p99): {added_p99:.0f} us")
    targets = {
        "total_p99_lt_1ms": bool(stats["total"].get("p99_us", 1e9) < 1000),
        "added_transit_plus_step_p99_lt_1ms": bool(added_p99 < 1000),
    }
    for k, met in targets.items():
        print(f"target {k}: {'MET' if met else 'NOT MET'}")

    stem = (("lsl_quick" if args.quick else "lsl") + ("_wake" if args.wake_on_input else "")
            + ("_rt" if args.realtime else ""))
    args.out.mkdir(parents=True, exist_ok=True)
    plot(legs, transit, args.out / f"{stem}.png")
    from closedloop.runtime.timing import _cpu_name  # the CPU's model name, as the timing tables give it

    record = {
        "command": "python " + " ".join(["bench/bench_lsl.py", *(argv if argv is not None else sys.argv[1:])]),
        "system": {"python": platform.python_version(), "machine": platform.machine(), "processor": _cpu_name(),
                   "cpu_count": os.cpu_count(),
                   "numpy": np.__version__, "pylsl": pylsl.__version__, "liblsl": pylsl.library_version(),
                   "load_average_before": load_before, "load_average_after": list(os.getloadavg())},
        "stream": {"channels": CHANNELS, "rate_hz": RATE_HZ, "format": "int32", "source_ppm": args.source_ppm},
        "session_s": args.seconds, "probe_s": args.probe_s, "realtime": args.realtime,
        "wake_on_input": args.wake_on_input,
        "clock_offset_lsl_minus_monotonic_s": offset, "clock_offset_read_width_s": width,
        "time_correction_s": float(legs["time_correction_s"][0]),
        "legs": stats, "added_p99_us": round(added_p99, 1),
        "loop": loop.to_dict(), "backend": summary.backend, "inputs_used": summary.inputs_used,
        "inputs_skipped": summary.inputs_skipped, "commands_sent": summary.commands_sent,
        "watchdog_trips": summary.watchdog_trips, "link": summary.link,
        "targets": targets,
    }
    (args.out / f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out / stem}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
