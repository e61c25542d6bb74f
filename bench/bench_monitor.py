"""What the browser monitor costs a live session, and how fast its page updates.

Two sessions against the emulators, each run in three ways, ``--repeats`` times (each repeat runs the
three in a fresh random order, so drift of the machine and order effects do not favour one):
without the monitor; with the monitor and a WebSocket client in another process that reads
every push (a browser on another machine: only the server's cost lands on the board; the stand-in client
runs here at nice 19, and under ``--rt`` off the loop's CPU, to keep its own cost out as far as one machine
can); with the monitor and a headless Chromium page on this machine (the page's drawing too; under ``--rt``
its processes run off the loop's CPU, as a user who opens the page on the board itself would start it with
``taskset``). Under ``--rt`` the sessions' emulators run as devices do (``SCHED_FIFO`` 1, off the loop's CPU:
docs/realtime.md):

- a certified flexible-joint observer at 1 kHz against ``sim://plant``;
- a 192-channel GRU decoder (2 x 256, random weights: latency does not depend on them)
  at 50 Hz against ``sim://headstage``.

Per run: the loop's p99 step latency and missed deadlines (from the session summary),
and with the page, its updates per second (the page's own counter) and the step records
it received. The comparison is paired: each repeat's ratio of p99 with the monitor to p99 without it
(runs minutes apart share the machine's state), summarised by the median ratio over repeats and its
percentile-bootstrap 95% interval (repeats resampled). Targets (issue 25): p99 ratio with/without
<= 1.1 (met: the interval's top is at most 1.1; not met: its bottom is above 1.1; otherwise the
repeats cannot tell), no more missed deadlines than the run-to-run spread without the monitor,
page >= 10 updates/s.

    python bench/bench_monitor.py                # 8 repeats x 10 s per condition (about 11 min)
    python bench/bench_monitor.py --rt           # the session under --rt (SCHED_FIFO, pinned to CPU 1)
    python bench/bench_monitor.py --quick        # 1 repeat x 3 s, writes nothing unless --out

Writes bench/results/monitor/{monitor.json, monitor.md, monitor.png}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from closedloop.runtime.timing import _cpu_name  # the CPU's model name, as the timing tables give it

ROOT = Path(__file__).resolve().parents[1]


def build_bundles(root: Path) -> dict[str, tuple[Path, str]]:
    import torch

    from closedloop.sdk.bci.deploy import export_bci_bundle
    from closedloop.sdk.models import GRUDecoder
    from closedloop.sdk.observer.neural import example_observer_bundle

    observer = example_observer_bundle(root / "observer")
    torch.manual_seed(1)
    decoder = export_bci_bundle(GRUDecoder(192, 256, 2, 32).eval(), root / "decoder", n_channels=192,
                                mean=np.full(192, 0.16), std=np.full(192, 0.4), session_name="bench",
                                variants=(), tensorrt=False, report=lambda s: None)
    return {"observer_1kHz": (Path(observer), "sim://plant?model=flexible-joint&rate=1000&seed=1"),
            "decoder_50Hz": (Path(decoder), "sim://headstage?channels=192&seed=3")}


# The stand-in client sets its own priority and CPUs: a preexec_fn would make subprocess fork the session's
# whole process (its memory locked under --rt) while the loop runs, and that stall is no remote client's cost.
_CLIENT = """
import asyncio, json, os, sys, aiohttp
os.nice(19)
if hasattr(os, "sched_setaffinity") and json.loads(sys.argv[2]):
    os.sched_setaffinity(0, json.loads(sys.argv[2]))
async def main():
    async with aiohttp.ClientSession() as s:
        async with s.ws_connect(sys.argv[1]) as ws:
            async for _ in ws:
                pass
asyncio.run(main())
"""


LOOP_CPU = 1  # the loop's CPU under --rt


def _off_the_loop_cpu(rt: bool) -> list[int]:
    """Under ``--rt``, the CPUs other than the loop's (empty: leave the affinity as it is)."""
    if not rt or not hasattr(os, "sched_getaffinity"):
        return []
    return sorted(os.sched_getaffinity(0) - {LOOP_CPU})


@contextlib.contextmanager
def _children_off_the_loop_cpu(rt: bool):
    """Processes started inside run off the loop's CPU under ``--rt`` (they inherit this thread's CPUs)."""
    others = _off_the_loop_cpu(rt)
    if not others:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, others)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def one_run(bundle: Path, device: str, duration_s: float, mode: str, browser, rt: bool) -> dict:
    import subprocess

    from closedloop.runtime import Session, SessionConfig

    cfg = SessionConfig(device=device, duration_s=duration_s, status=False, backend="auto",
                        monitor=None if mode == "off" else "0", rt=rt, rt_cpu=1 if rt else None)
    s = Session(bundle, cfg)
    s.start()
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(summary=s.run()))
    t.start()
    page_stats = None
    if mode == "client":
        # stands in for a browser on another machine, whose CPU the board does not pay for: here at nice 19 and,
        # under --rt, off the loop's CPU, so that its own cost is as little of the measurement as one machine allows
        client = subprocess.Popen([sys.executable, "-c", _CLIENT, s.monitor_url.replace("http://", "ws://") + "ws",
                                   json.dumps(_off_the_loop_cpu(rt))])
        t.join()
        client.terminate()
        client.wait(10)
    elif mode == "browser":
        page = browser.new_page()
        page.goto(s.monitor_url)
        ups = []
        time.sleep(1.5)  # the page connects and fills
        while t.is_alive():
            ups.append(page.evaluate("() => monitorState.ups"))
            time.sleep(1.0)
        seen = page.evaluate("() => monitorState.stepsSeen")
        page.close()
        page_stats = {"updates_per_s_median": float(np.median(ups[:-1] or ups)), "updates_per_s_min":
                      float(min(ups[:-1] or ups)), "steps_seen": int(seen)}
    t.join()
    s.close()
    summary = out["summary"]
    loop = summary.loop
    return {"mode": mode, "rt": rt, "p99_us": loop.latency_p99_us, "p50_us": loop.latency_p50_us,
            "command_p99_us": summary.command_latency_p99_us, "command_p50_us": summary.command_latency_p50_us,
            "missed": loop.missed_deadlines, "steps": loop.steps, "backend": summary.backend,
            "page": page_stats}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0, help="seeds the order of the conditions in each repeat")
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rt", action="store_true", help="run the sessions with --rt --cpu 1 (SCHED_FIFO, mlockall)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.quick:
        a.repeats, a.duration = 1, 3.0
    out_dir = Path(a.out) if a.out else (None if a.quick else ROOT / "bench/results/monitor")
    from playwright.sync_api import sync_playwright

    from closedloop.runtime.monitor.browser import CHROMIUM_FLAGS, chromium_path

    results: dict = {"host": {"machine": platform.machine(), "processor": _cpu_name(), "python": platform.python_version(),
                              "load_before": os.getloadavg()},
                     "repeats": a.repeats, "duration_s": a.duration, "rt": a.rt, "order_seed": a.seed, "sessions": {}}
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        bundles = build_bundles(Path(tmp))
        with _children_off_the_loop_cpu(a.rt):  # the browser's processes, like the client, off the loop's CPU
            pw = stack.enter_context(sync_playwright())  # its driver starts the browser: both inherit the CPUs
            browser = pw.chromium.launch(executable_path=chromium_path(), headless=True, args=CHROMIUM_FLAGS)
        for name, (bundle, device) in bundles.items():
            one_run(bundle, device, 1.0, "off", None, a.rt)  # warm: compile caches, emulator start-up
            runs = []
            rng = np.random.default_rng(a.seed)
            for r in range(a.repeats):
                for mode in rng.permutation(MODES):
                    run = one_run(bundle, device, a.duration, str(mode), browser, a.rt) | {"repeat": r}
                    runs.append(run)
                    print(f"{name} repeat {r} {mode}: p99 {run['p99_us']:.0f} us, missed {run['missed']}"
                          + (f", page {run['page']['updates_per_s_median']:.0f} updates/s" if run["page"] else ""),
                          flush=True)
            results["sessions"][name] = {"runs": runs, **_compare(runs)}
        browser.close()
    text = _table(results)
    print(text)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        stem = "monitor_rt" if a.rt else "monitor"
        (out_dir / f"{stem}.json").write_text(json.dumps(results, indent=2))
        (out_dir / f"{stem}.md").write_text(text + "\n")
        _plot(results, out_dir / f"{stem}.png")
        print(f"wrote {out_dir}/{stem}.{{json,md,png}}")
    return 0


MODES = ("off", "client", "browser")
MIN_REPEATS = 5
_LABELS = {"off": "no monitor", "client": "monitor + remote client", "browser": "monitor + local Chromium"}


def paired_ratio(runs: list[dict], mode: str, n_boot: int = 10_000, seed: int = 0, key: str = "p99_us") -> dict:
    """Per repeat, ``key`` (the step's p99) with ``mode`` over the same without the monitor; their median and its
    bootstrap 95% interval."""
    by = {(r["repeat"], r["mode"]): r[key] for r in runs if r.get(key) is not None}
    ratios = np.array([by[(k, mode)] / by[(k, "off")] for k in sorted({r["repeat"] for r in runs})
                       if (k, mode) in by and (k, "off") in by])
    rng = np.random.default_rng(seed)
    boots = np.median(ratios[rng.integers(0, len(ratios), size=(n_boot, len(ratios)))], axis=1)
    lo, hi = (float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5)))
    verdict = "met" if hi <= 1.1 else "NOT MET" if lo > 1.1 else "undecided"
    if len(ratios) < MIN_REPEATS:  # a bootstrap of one or two pairs is no interval
        verdict = f"undecided: {len(ratios)} repeats, a verdict needs {MIN_REPEATS}"
    return {"ratios": ratios.tolist(), "median": float(np.median(ratios)), "ci95": [lo, hi], "verdict": verdict}


def _compare(runs: list[dict]) -> dict:
    by = {m: [r for r in runs if r["mode"] == m] for m in MODES}
    p99 = {m: float(np.median([r["p99_us"] for r in rs])) for m, rs in by.items()}
    missed = {m: [r["missed"] for r in rs] for m, rs in by.items()}
    noise = max(missed["off"]) - min(missed["off"])
    ups = [r["page"]["updates_per_s_min"] for r in by["browser"]]
    off = np.array([r["p99_us"] for r in by["off"]])
    out: dict = {"p99_us": p99, "missed": missed, "missed_noise": int(noise),
                 "p99_off_spread": [float(off.min()), float(off.max())],
                 "page_updates_per_s_min": float(min(ups)), "targets": {}}
    for m in ("client", "browser"):
        pr = paired_ratio(runs, m)
        out[f"p99_ratio_{m}"] = pr["median"]
        out[f"p99_ratio_{m}_paired"] = pr
        out["targets"][f"{m}: p99 ratio <= 1.1 (median {pr['median']:.2f}, 95% [{pr['ci95'][0]:.2f}, "
                       f"{pr['ci95'][1]:.2f}])"] = pr["verdict"]
        out["targets"][f"{m}: missed within the no-monitor spread"] = bool(max(missed[m]) <= max(missed["off"]) + noise)
    out["targets"]["browser: page >= 10 updates/s"] = bool(min(ups) >= 10)
    if all(r.get("command_p99_us") is not None for r in runs):  # what the device waits for (no target of its own)
        out["command_p99_us"] = {m: float(np.median([r["command_p99_us"] for r in rs])) for m, rs in by.items()}
        for m in ("client", "browser"):
            out[f"command_p99_ratio_{m}_paired"] = paired_ratio(runs, m, key="command_p99_us")
    return out


def _table(results: dict) -> str:
    lines = [f"monitor cost: {results['repeats']} repeats x {results['duration_s']:g} s per condition on "
             f"{results['host']['processor']} ({results['host']['machine']})"
             + (", sessions under --rt --cpu 1" if results.get("rt") else ""), "",
             "| session | p99 (us, median of runs): none / remote client / local Chromium | paired p99 ratio, "
             "remote client [95%] | paired p99 ratio, local Chromium [95%] | missed: none / client / Chromium | "
             "page updates/s (min) |", "| --- | --- | --- | --- | --- | --- |"]
    for name, s in results["sessions"].items():
        p, m = s["p99_us"], s["missed"]
        pc, pb = s.get("p99_ratio_client_paired"), s.get("p99_ratio_browser_paired")

        def fmt(pr, plain):
            return f"{plain:.2f}x" if pr is None else f"{pr['median']:.2f}x [{pr['ci95'][0]:.2f}, {pr['ci95'][1]:.2f}]"

        lines.append(f"| {name} | {p['off']:.0f} / {p['client']:.0f} / {p['browser']:.0f} | "
                     f"{fmt(pc, s['p99_ratio_client'])} | {fmt(pb, s['p99_ratio_browser'])} | {m['off']} / "
                     f"{m['client']} / {m['browser']} | {s['page_updates_per_s_min']:.0f} |")
    if all("command_p99_us" in s for s in results["sessions"].values()):
        lines += ["", "Command latency (how long after its step began each command went out; the step's p99 above "
                  "also counts what the step records after it):", "",
                  "| session | command p99 (us, median of runs): none / remote client / local Chromium | paired ratio, "
                  "remote client [95%] | paired ratio, local Chromium [95%] |", "| --- | --- | --- | --- |"]
        for name, s in results["sessions"].items():
            c, cc, cb = s["command_p99_us"], s["command_p99_ratio_client_paired"], s["command_p99_ratio_browser_paired"]
            lines.append(f"| {name} | {c['off']:.0f} / {c['client']:.0f} / {c['browser']:.0f} | {cc['median']:.2f}x "
                         f"[{cc['ci95'][0]:.2f}, {cc['ci95'][1]:.2f}] | {cb['median']:.2f}x [{cb['ci95'][0]:.2f}, "
                         f"{cb['ci95'][1]:.2f}] |")
    lines.append("")
    for name, s in results["sessions"].items():
        for target, met in s["targets"].items():
            verdict = met if isinstance(met, str) else ("met" if met else "NOT MET")
            lines.append(f"[{verdict}] {name}, {target}")
    return "\n".join(lines)


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results["sessions"]), figsize=(6 * len(results["sessions"]), 4), squeeze=False)
    for ax, (name, s) in zip(axes[0], results["sessions"].items(), strict=True):
        for i, mode in enumerate(MODES):
            vals = [r["p99_us"] for r in s["runs"] if r["mode"] == mode]
            ax.scatter([i] * len(vals), vals, s=30)
        ax.set_xticks(range(len(MODES)), [_LABELS[m] for m in MODES], fontsize=8)
        ax.set_ylabel("p99 step latency (us)")
        ax.set_title(name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
