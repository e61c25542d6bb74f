"""First-run start of a packaged session, warmed Numba cache vs none; footprint; ORT-only latency cost.

    .venv/bin/python bench/bench_package.py [--work DIR]

Packages the example observer bundle for ``host`` (--from-installed), installs it with its
install.sh into a fresh venv offline (which warms the Numba cache), then times
``closedloop run BUNDLE --device sim://... --duration 0.5`` from process start to its end, twice
with the warmed cache and twice with an empty one (the first of those compiles). The session
runs 0.5 s, so start = wall - 0.5 s. Then the installed site-packages of the install.
Writes bench/results/package/package.json and package.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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
    env = {"PATH": "/usr/bin:/bin", "HOME": str(prefix), "NUMBA_CACHE_DIR": str(cache)}
    t0 = time.perf_counter()
    _sh([str(prefix / "venv" / "bin" / "closedloop"), "run", str(prefix / "bundles" / "observer"), "--device", DEVICE,
         "--duration", str(DURATION), "--quiet", "--json"], env=env)
    return time.perf_counter() - t0 - DURATION


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    a = ap.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="bench_package_"))
    work.mkdir(parents=True, exist_ok=True)
    from closedloop.runtime.timing import _cpu_name
    from closedloop.sdk.observer.neural import example_observer_bundle

    bundle = work / "observer"
    if not bundle.exists():
        example_observer_bundle(bundle)
    full, install_s = _install(bundle, work, ort_only=False)
    cold = work / "cache-cold"
    starts = {"warmed cache": [_start(full, work / "cache-warm") for _ in range(2)],
              "no cache": [_start(full, cold), _start(full, cold)]}
    rows = {"machine": f"{_cpu_name()}, {os.cpu_count()} CPUs (shared with other jobs)",
            "command": "bench/bench_package.py", "install_s": install_s, "start_s": starts,
            "first_over_warm_warmed": starts["warmed cache"][0] / starts["warmed cache"][1],
            "first_over_warm_cold": starts["no cache"][0] / starts["no cache"][1],
            "site_packages_mb": {"full": _site_mb(full)}}
    print(f"{'cache':<14} {'first start s':>14} {'second start s':>15} {'first/second':>13}")
    for k, (s1, s2) in starts.items():
        print(f"{k:<14} {s1:>14.2f} {s2:>15.2f} {s1 / s2:>13.2f}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "package.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(f"installed site-packages MB: {rows['site_packages_mb']}")
    (OUT / "package.json").write_text(json.dumps(rows, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3))
        labels = [f"{k}\n{n}" for k in starts for n in ("first", "second")]
        ax.bar(labels, [v for k in starts for v in starts[k]], color=["C0", "C0", "C3", "C3"])
        ax.set_ylabel("process start to session start (s)")
        ax.set_title("packaged observer session, host")
        fig.tight_layout()
        fig.savefig(OUT / "package.png", dpi=100)
    except ImportError:
        print("matplotlib not installed: no PNG")
    return 0


if __name__ == "__main__":
    sys.exit(main())
