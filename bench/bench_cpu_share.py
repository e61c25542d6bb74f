"""What work on another CPU costs the loop's step: the machine's side of the monitor's cost (issue 25).

The monitor's server and a page run off the loop's CPU (``--rt`` pins the loop; the server and the benchmark's
client keep off it), yet the monitor benchmark (``bench/bench_monitor.py``) measures a p99 ratio above 1 on small
machines. This asks how much of that any work on another CPU causes, whatever it is: the two model steps the monitor
benchmark runs (the certified observer's graph and the 192-channel 2 x 256 GRU decoder's, on the backend a session
picks), each timed alone on the loop's CPU under ``SCHED_FIFO`` (1,000 steps, a period's sleep between steps, as a
loop has), while the other CPU is

- ``idle``: nothing of ours runs there;
- ``spin``: a process spinning in Python (the execution units and the core's front end, as a busy interpreter);
- ``l1``: a small NumPy array updated in place (arithmetic in the L1 cache);
- ``stream``: 64 MB copied over and over (memory bandwidth and the shared last-level cache);
- ``json``: a monitor server's own work, step records encoded as JSON in a loop.

Each condition is run ``--rounds`` times, interleaved (idle, spin, ... then again), and reported as the median over
rounds of each round's p50 and p99, with each condition's p99 against idle's. Two CPUs that share one physical
core (SMT siblings, or a hypervisor's vCPUs on one core) slow each other under ``spin``; separate cores only under
``stream`` (shared cache and memory).

    python bench/bench_cpu_share.py --out bench/results/monitor/cpu_share_MACHINE   # about 3 minutes

Writes ``cpu_share.json`` and ``cpu_share.png`` in ``--out``.
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

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

LOOP_CPU = 1
LOADS = {
    "idle": None,
    "spin": "while True:\n    pass",
    "l1": "import numpy as np\na = np.ones(4000, np.float32)\nwhile True:\n    a *= 1.0000001",
    "stream": "import numpy as np\na = np.ones(16_000_000, np.float32)\nb = np.empty_like(a)\n"
              "while True:\n    np.copyto(b, a)",
    "json": "import json, numpy as np\nrows = np.random.default_rng(0).random((250, 192)).round(4).tolist()\n"
            "while True:\n    json.dumps({'type': 'steps', 'inputs': rows})",
}


def _model(bundle: Path):
    from closedloop.runtime import Model, load_bundle

    b = load_bundle(bundle)
    m = Model(b, backend="auto")
    m.prewarm()
    return m


def step_times(model, n: int, period_s: float) -> np.ndarray:
    spec = model.spec.data_inputs[0]
    x = np.random.default_rng(0).random(tuple(d if isinstance(d, int) else 1 for d in spec.shape)).astype(np.float32)
    out = np.empty(n)
    for i in range(n + 100):
        t0 = time.perf_counter_ns()
        model.step(x)
        t = time.perf_counter_ns() - t0
        if i >= 100:
            out[i - 100] = t / 1e3
        time.sleep(period_s)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for cpu_share.json and cpu_share.png")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=1000)
    a = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if LOOP_CPU not in cpus or len(cpus) < 2:
        print(f"needs CPUs 0 and {LOOP_CPU}; this process may use {cpus}", file=sys.stderr)
        return 2
    other = [c for c in cpus if c != LOOP_CPU]
    from bench_monitor import build_bundles

    tmp = Path(tempfile.mkdtemp(prefix="cpu-share-"))
    bundles = build_bundles(tmp)
    os.sched_setaffinity(0, {LOOP_CPU})
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(50))
        policy = "SCHED_FIFO 50"
    except PermissionError:
        policy = "SCHED_OTHER (SCHED_FIFO refused)"
    models = {"observer_1kHz": (_model(bundles["observer_1kHz"][0]), 0.001),
              "decoder_50Hz": (_model(bundles["decoder_50Hz"][0]), 0.002)}
    rows: dict[str, dict[str, list[tuple[float, float]]]] = {m: {k: [] for k in LOADS} for m in models}
    for rnd in range(a.rounds):
        for load, code in LOADS.items():
            p = None
            if code:  # on the other CPUs, at normal priority, as the monitor's server runs
                p = subprocess.Popen(["taskset", "-c", ",".join(map(str, other)), sys.executable, "-c", code])
                time.sleep(0.5)
            try:
                for name, (model, period) in models.items():
                    t = step_times(model, a.steps, period)
                    rows[name][load].append((float(np.percentile(t, 50)), float(np.percentile(t, 99))))
            finally:
                if p is not None:
                    p.kill()
                    p.wait()
            print(f"round {rnd} {load:6s} " + "  ".join(
                f"{n}: p50 {rows[n][load][-1][0]:.1f} p99 {rows[n][load][-1][1]:.1f} us" for n in models), flush=True)
    table = {}
    for name in models:
        base = float(np.median([r[1] for r in rows[name]["idle"]]))
        table[name] = {load: {"p50_us": float(np.median([r[0] for r in v])), "p99_us": float(np.median([r[1] for r in v])),
                              "p99_vs_idle": float(np.median([r[1] for r in v])) / base, "rounds": v}
                       for load, v in rows[name].items()}
    from closedloop.runtime.timing import _cpu_name

    result = {"machine": {"cpu": _cpu_name(), "cpus": len(cpus), "platform": platform.platform()},
              "loop_cpu": LOOP_CPU, "policy": policy, "steps": a.steps, "rounds": a.rounds,
              "backends": {n: m.backend_name for n, (m, _) in models.items()}, "results": table,
              "command": "python bench/bench_cpu_share.py " + " ".join(sys.argv[1:])}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "cpu_share.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{result['machine']['cpu']}, {len(cpus)} CPUs; loop on CPU {LOOP_CPU} under {policy}")
    print("| step | other CPU | p50 us | p99 us | p99 / idle |\n| --- | --- | --- | --- | --- |")
    for name, t in table.items():
        for load, r in t.items():
            print(f"| {name} ({result['backends'][name]}) | {load} | {r['p50_us']:.1f} | {r['p99_us']:.1f} | "
                  f"{r['p99_vs_idle']:.2f} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(models), figsize=(11, 4))
    for ax, (name, t) in zip(axes, table.items(), strict=True):
        loads = list(t)
        ax.bar(np.arange(len(loads)) - 0.2, [t[k]["p50_us"] for k in loads], 0.4, label="p50")
        ax.bar(np.arange(len(loads)) + 0.2, [t[k]["p99_us"] for k in loads], 0.4, label="p99")
        ax.set_xticks(range(len(loads)), loads)
        ax.set_title(f"{name} step ({result['backends'][name]})")
        ax.set_ylabel("step time, us")
        ax.legend()
    fig.suptitle(f"the loop's step on CPU {LOOP_CPU} while the other CPU does ... ({result['machine']['cpu']})")
    fig.tight_layout()
    fig.savefig(a.out / "cpu_share.png", dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
