"""Missed deadlines of a 1 kHz observer session beside a busy process, with and without ``closedloop run --rt``.

A certified flexible-joint observer (built as tests/runtime/test_session_observer.py builds it: certify, then
export_observer_bundle) runs against ``sim://plant?model=flexible-joint&rate=1000`` through the CLI itself,
``closedloop run BUNDLE --device URL --duration S --json --quiet [--rt --cpu N]``, one subprocess per run, while a
busy-loop process (``while True: pass``) is pinned to CPU N, the CPU the ``--rt`` loop is pinned to: the worst
neighbour a loop can have, a task that never sleeps on its own core. Conditions, alternated in every repeat (the
order flips each repeat, so a drift in the machine's load falls on both):

- ``plain``: ``closedloop run`` with no real-time settings (SCHED_OTHER, the scheduler places the loop);
- ``rt``: ``--rt --cpu N``: SCHED_FIFO at priority 80, memory locked, the loop pinned beside the busy process;
- ``pinned``: the loop's thread pinned to CPU N, SCHED_OTHER (pinning alone): the same session through the Python
  API, ``os.sched_setaffinity(0, {N})`` between ``Session.start()`` and ``Session.run()`` as ``--rt`` pins it (so
  the emulator's process, started at the handshake, is not pinned in either).

Before the runs ``closedloop doctor``'s sched_fifo and mlockall checks say what the kernel permits here; where it
refuses SCHED_FIFO the ``rt`` condition is left out and the report says so (pinning is then measured alone).
Target (issue 26): missed deadlines with ``--rt`` >= 10x fewer than without, summed over the repeats.

    python bench/bench_rt.py                       # 5 repeats x 10 s per condition, busy process on CPU 1
    python bench/bench_rt.py --quick               # 1 repeat x 3 s, writes nothing unless --out

Writes bench/results/rt/{rt.json, rt.md, rt.png}.
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
from pathlib import Path

from closedloop.runtime.timing import _cpu_name  # the CPU model name, as the timing tables give it

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "sim://plant?model=flexible-joint&rate=1000&seed=1"
BUSY = "while True:\n    pass\n"
# the pinned condition: the session of `closedloop run --json`, its loop thread pinned as --rt would pin it
PINNED = """import json, os, sys
from closedloop.runtime import Session, SessionConfig
bundle, device, duration, backend, cpu = sys.argv[1:]
with Session(bundle, SessionConfig(device=device, duration_s=float(duration), backend=backend, status=False)) as s:
    s.start()
    os.sched_setaffinity(0, {int(cpu)})
    print(json.dumps(s.run().to_dict(), default=str))
"""


def build_bundle(root: Path) -> Path:
    from closedloop.sdk.observer.neural import example_observer_bundle

    return example_observer_bundle(root / "fj")


def run_cmd(bundle: Path, condition: str, cpu: int, duration_s: float, backend: str) -> list[str]:
    cmd = [sys.executable, "-m", "closedloop.sdk.cli", "run", str(bundle), "--device", DEVICE, "--duration",
           f"{duration_s:g}", "--backend", backend, "--json", "--quiet"]
    if condition == "rt":
        cmd += ["--rt", "--cpu", str(cpu)]
    if condition == "pinned":
        cmd = [sys.executable, "-c", PINNED, str(bundle), DEVICE, f"{duration_s:g}", backend, str(cpu)]
    return cmd


def one_run(bundle: Path, condition: str, cpu: int, duration_s: float, backend: str) -> dict:
    busy = subprocess.Popen([sys.executable, "-c", BUSY], preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    try:
        time.sleep(0.2)  # the busy process is running before the session starts
        load0 = os.getloadavg()
        cmd = run_cmd(bundle, condition, cpu, duration_s, backend)
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=duration_s + 120)
        load1 = os.getloadavg()
    finally:
        busy.kill()
        busy.wait()
    if out.returncode != 0:
        raise SystemExit(f"{condition}: {' '.join(cmd)} exited {out.returncode}:\n{out.stderr[-2000:]}")
    s = json.loads(out.stdout)
    loop = s["loop"]
    return {"condition": condition, "missed": loop["missed_deadlines"], "missed_fraction": loop["missed_fraction"],
            "periods": loop["steps"] + loop["skipped_periods"], "lateness_p99_us": loop["lateness_p99_us"],
            "lateness_max_us": loop["lateness_max_us"], "latency_p99_us": loop["latency_p99_us"],
            "commands_sent": s["commands_sent"], "watchdog_trips": s["watchdog_trips"], "backend": s["backend"],
            "realtime": s.get("realtime") or {}, "loadavg_before": load0, "loadavg_after": load1,
            "command": _shown(cmd, bundle)}


def _shown(cmd: list[str], bundle: Path) -> str:
    """The command as a person types it: ``closedloop`` for the interpreter and module, BUNDLE for the bundle."""
    if cmd[1] == "-c":
        return (f"python -c PINNED BUNDLE '{DEVICE}' {cmd[5]} {cmd[6]} {cmd[7]}  (PINNED: Session.start(), "
                "os.sched_setaffinity(0, {CPU}), Session.run(), the summary as JSON)")
    words = ["closedloop", *cmd[3:]]
    return " ".join("BUNDLE" if w == str(bundle) else f"'{w}'" if "&" in w else w for w in words)


def permitted() -> dict:
    from closedloop.runtime.doctor import DoctorConfig, run_doctor

    report = run_doctor(DoctorConfig(only=["sched_fifo", "mlockall", "preempt_rt", "isolated_cpus"]))
    return {c.name: {"status": c.status, "message": c.message} for c in report.checks}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per session")
    ap.add_argument("--cpu", type=int, default=1, help="the CPU of the busy process and of the pinned loop")
    ap.add_argument("--backend", default="numba")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.quick:
        a.repeats, a.duration = 1, 3.0
    out_dir = Path(a.out) if a.out else (None if a.quick else ROOT / "bench/results/rt")
    rights = permitted()
    fifo = rights["sched_fifo"]["status"] == "pass"
    conditions = ["plain", "rt", "pinned"] if fifo else ["plain", "pinned"]
    t_start = time.time()
    results: dict = {
        "host": {"machine": platform.machine(), "processor": _cpu_name(), "cpus": os.cpu_count(),
                 "kernel": platform.release(), "python": platform.python_version(), "uid": os.getuid(),
                 "uptime_before": _uptime()},
        "permitted": rights, "sched_fifo_permitted": fifo, "conditions": conditions, "repeats": a.repeats,
        "duration_s": a.duration, "busy_cpu": a.cpu, "backend": a.backend, "device": DEVICE,
        "busy_process": f"python -c 'while True: pass' pinned to CPU {a.cpu} (sched_setaffinity)", "runs": [],
    }
    if not fifo:
        print(f"SCHED_FIFO is not permitted here ({rights['sched_fifo']['message']}): measuring pinning alone",
              flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        bundle = build_bundle(Path(tmp))
        one_run(bundle, "plain", a.cpu, 1.0, a.backend)  # warm: numba's cache, the emulator's imports
        for r in range(a.repeats):
            order = conditions if r % 2 == 0 else conditions[::-1]
            for cond in order:
                run = one_run(bundle, cond, a.cpu, a.duration, a.backend)
                run["repeat"] = r
                results["runs"].append(run)
                print(f"repeat {r} {cond:<6}: missed {run['missed']:>5} of {run['periods']} "
                      f"({100 * run['missed_fraction']:.2f}%), lateness p99 {run['lateness_p99_us']:.0f} us, "
                      f"max {run['lateness_max_us']:.0f} us, load {run['loadavg_before'][0]:.2f}", flush=True)
    results["uptime_after"] = _uptime()
    results["wall_s"] = time.time() - t_start
    results["totals"] = _totals(results)
    text = _table(results)
    print(text)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "rt.json").write_text(json.dumps(results, indent=2))
        (out_dir / "rt.md").write_text(text + "\n")
        _plot(results, out_dir / "rt.png")
        print(f"wrote {out_dir}/rt.{{json,md,png}}")
    return 0


def _totals(results: dict) -> dict:
    tot: dict = {}
    for cond in results["conditions"]:
        runs = [r for r in results["runs"] if r["condition"] == cond]
        missed = sum(r["missed"] for r in runs)
        periods = sum(r["periods"] for r in runs)
        tot[cond] = {"missed": missed, "periods": periods, "missed_fraction": missed / periods if periods else 0.0,
                     "missed_per_run": [r["missed"] for r in runs],
                     "lateness_p99_us_median": sorted(r["lateness_p99_us"] for r in runs)[len(runs) // 2]}
    best = "rt" if "rt" in tot else "pinned"
    ratio = tot["plain"]["missed"] / tot[best]["missed"] if tot[best]["missed"] else float("inf")
    tot["ratio_plain_over_" + best] = ratio
    tot["target_10x_met"] = bool(ratio >= 10)
    return tot


def _table(results: dict) -> str:
    t = results["totals"]
    host = results["host"]
    lines = [f"1 kHz flexible-joint observer session beside a busy process pinned to CPU {results['busy_cpu']}: "
             f"{results['repeats']} repeats x {results['duration_s']:g} s per condition, alternated; backend "
             f"{results['backend']}; {host['processor']} ({host['cpus']} CPUs), kernel {host['kernel']}, "
             f"uid {host['uid']}",
             f"uptime before: {host['uptime_before']}", f"uptime after: {results['uptime_after']}", "",
             "What the kernel permits here (closedloop doctor):"]
    for name, c in results["permitted"].items():
        lines.append(f"- {name}: {c['status']}: {c['message']}")
    lines += ["", "| condition | missed (sum) | periods | missed % | missed per run | lateness p99 (median, us) |",
              "| --- | --- | --- | --- | --- | --- |"]
    for cond in results["conditions"]:
        c = t[cond]
        lines.append(f"| {cond} | {c['missed']} | {c['periods']} | {100 * c['missed_fraction']:.3f} | "
                     f"{c['missed_per_run']} | {c['lateness_p99_us_median']:.1f} |")
    key = next(k for k in t if k.startswith("ratio_"))
    lines += ["", f"{key}: {t[key]:.1f}x -> target (>= 10x fewer missed with --rt): "
                  f"{'met' if t['target_10x_met'] else 'NOT MET'}"]
    if not results["sched_fifo_permitted"]:
        lines.append("SCHED_FIFO was not permitted here: the comparison is pinning alone")
    lines += ["", "Commands (one per run; the busy process is started first):"]
    seen = set()
    for r in results["runs"]:
        if r["condition"] not in seen:
            seen.add(r["condition"])
            lines.append(f"- {r['condition']}: `{r['command']}`")
    return "\n".join(lines)


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conds = results["conditions"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colours = {"plain": "tab:red", "rt": "tab:green", "pinned": "tab:blue"}
    for i, cond in enumerate(conds):
        runs = [r for r in results["runs"] if r["condition"] == cond]
        axes[0].scatter([i] * len(runs), [max(r["missed"], 0.5) for r in runs], color=colours[cond], s=30)
        axes[1].scatter([i] * len(runs), [r["lateness_p99_us"] for r in runs], color=colours[cond], s=30)
    for ax, label in ((axes[0], "missed deadlines per run (0 drawn at 0.5)"), (axes[1], "lateness p99 (us)")):
        ax.set_xticks(range(len(conds)), conds)
        ax.set_yscale("log")
        ax.set_ylabel(label)
    key = next(k for k in results["totals"] if k.startswith("ratio_"))
    fig.suptitle(f"1 kHz observer beside a busy process on CPU {results['busy_cpu']}: {key} "
                 f"{results['totals'][key]:.1f}x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


if __name__ == "__main__":
    sys.exit(main())
