"""First-run start of a packaged session, warmed Numba cache vs none; footprint; ORT-only latency cost.

    .venv/bin/python bench/bench_package.py [--work DIR]

Packages the example observer bundle for ``host`` (--from-installed), installs it with its
install.sh into a fresh venv offline (which warms the Numba cache), then times
``closedloop run BUNDLE --device sim://... --duration 0.5`` from process start to its end, in the
service's environment (``NUMBA_CACHE_DIR`` and ``CLOSEDLOOP_CACHE_DIR`` on one folder). Each of
``--trials`` pairs starts from a fresh copy of the cache install.sh filled (the first start a
board's service would make) and starts again on it (warm); the target compares the medians.
Then one pair on an empty cache (the first of those compiles). The session runs 0.5 s, so
start = wall - 0.5 s. Then the installed site-packages of the install.
Writes bench/results/package/package.json and package.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "package"
DEVICE = "sim://plant?model=flexible-joint&rate=1000&seed=1"
DURATION = 0.5


def _sh(cmd: list[str], env: dict | None = None, timeout: float = 1800) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd="/")
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return r


def _install(bundle: Path, work: Path, ort_only: bool) -> tuple[Path, float]:
    tag = "ort" if ort_only else "full"
    out, prefix = work / f"pkg-{tag}", work / f"opt-{tag}"
    _sh([sys.executable, "-m", "closedloop.sdk.cli", "package", str(bundle), "--target", "host", "--out", str(out),
         "--from-installed", "--overwrite", "--prefix", str(prefix), *(["--ort-only"] if ort_only else [])])
    env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "CLOSEDLOOP_PREFIX": str(prefix), "PYTHON": sys.executable,
           "NUMBA_CACHE_DIR": str(work / "cache-warm"), "PIP_CONFIG_FILE": os.devnull}
    t0 = time.perf_counter()
    _sh([str(out / "install.sh")], env=env)
    return prefix, time.perf_counter() - t0


def _site_mb(prefix: Path) -> float:
    site = next((prefix / "venv" / "lib").glob("python3*/site-packages"))
    return sum(f.stat().st_size for f in site.rglob("*") if f.is_file()) / 1e6


def _start(prefix: Path, cache: Path) -> float:
    # the service's environment: both caches in one folder, as the unit sets them
    env = {"PATH": "/usr/bin:/bin", "HOME": str(prefix), "NUMBA_CACHE_DIR": str(cache),
           "CLOSEDLOOP_CACHE_DIR": str(cache)}
    t0 = time.perf_counter()
    _sh([str(prefix / "venv" / "bin" / "closedloop"), "run", str(prefix / "bundles" / "observer"), "--device", DEVICE,
         "--duration", str(DURATION), "--quiet", "--json"], env=env)
    return time.perf_counter() - t0 - DURATION


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--trials", type=int, default=5, help="first/second start pairs from the installed cache (default 5)")
    ap.add_argument("--skip-cold", action="store_true", help="leave out the empty-cache pair (it compiles: minutes)")
    a = ap.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="bench_package_"))
    work.mkdir(parents=True, exist_ok=True)
    from closedloop.runtime.timing import _cpu_name
    from closedloop.sdk.observer.neural import example_observer_bundle

    bundle = work / "observer"
    if not bundle.exists():
        example_observer_bundle(bundle)
    full, install_s = _install(bundle, work, ort_only=False)
    installed = work / "cache-warm"
    # each trial starts from exactly what install.sh left: a fresh copy of its cache, then a second start on it
    pairs = []
    for i in range(a.trials):
        cache = work / f"cache-trial{i}"
        shutil.rmtree(cache, ignore_errors=True)
        shutil.copytree(installed, cache)
        pairs.append((_start(full, cache), _start(full, cache)))
    first, second = (float(np.median([p[j] for p in pairs])) for j in (0, 1))
    cold_pair = None
    if not a.skip_cold:
        cold = work / "cache-cold"
        shutil.rmtree(cold, ignore_errors=True)
        cold_pair = (_start(full, cold), _start(full, cold))
    rows = {"machine": f"{_cpu_name()}, {os.cpu_count()} CPUs", "load_average_1min": os.getloadavg()[0],
            "command": "bench/bench_package.py", "install_s": install_s,
            "start_s": {"installed cache, first and second start per trial": pairs,
                        "no cache, first and second start": cold_pair},
            "median_first_s": first, "median_second_s": second, "first_over_warm_warmed": first / second,
            "first_over_warm_cold": cold_pair[0] / cold_pair[1] if cold_pair else None,
            "target_first_over_warm": 1.2, "met": first / second <= 1.2,
            "site_packages_mb": {"full": _site_mb(full)}}
    print(f"{'cache':<22} {'first start s':>14} {'second start s':>15} {'first/second':>13}")
    for i, (s1, s2) in enumerate(pairs):
        print(f"{'installed, trial ' + str(i):<22} {s1:>14.2f} {s2:>15.2f} {s1 / s2:>13.2f}")
    print(f"{'installed, median':<22} {first:>14.2f} {second:>15.2f} {first / second:>13.2f}"
          f"   target <= 1.2: {'met' if rows['met'] else 'NOT MET'}")
    if cold_pair:
        print(f"{'no cache':<22} {cold_pair[0]:>14.2f} {cold_pair[1]:>15.2f} {cold_pair[0] / cold_pair[1]:>13.2f}")
    print(f"installed site-packages MB: {rows['site_packages_mb']}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "package.json").write_text(json.dumps(rows, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.2))
        x = np.arange(len(pairs))
        ax.bar(x - 0.2, [p[0] for p in pairs], 0.4, label="first start (cache as installed)", color="C0")
        ax.bar(x + 0.2, [p[1] for p in pairs], 0.4, label="second start", color="C2")
        ax.axhline(1.2 * second, color="k", ls="--", lw=1, label="1.2 x median second start")
        ax.set_xticks(x, [f"trial {i}" for i in x])
        ax.set_ylabel("process start to session start (s)")
        ax.set_title(f"packaged observer session, host ({_cpu_name()})", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        fig.savefig(OUT / "package.png", dpi=100)
    except ImportError:
        print("matplotlib not installed: no PNG")
    return 0


if __name__ == "__main__":
    sys.exit(main())
