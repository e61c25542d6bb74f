"""``closedloop bench BUNDLE``: time bundles on this machine, write the results as JSON and draw them.

The timing itself is ``closedloop.runtime.timing`` (deployed footprint, no torch); this
module runs it over several bundles with one measurement of the machine's roofline,
writes the JSON record, and draws the latency distributions with matplotlib, which is
imported only when a plot is asked for (a board may not have it).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from closedloop.common.atomic import atomic_write_text
from closedloop.runtime import load_bundle
from closedloop.runtime.timing import (
    MODE_LABELS,
    MODES,
    BenchConfig,
    BundleBench,
    MachineRoofline,
    bench_bundle,
    requested_pairs,
)


def bench_bundles(
    bundles: Sequence[str | Path], cfg: BenchConfig | None = None, report: Callable[[str], None] = print
) -> list[BundleBench]:
    """Time each bundle (``closedloop.runtime.timing.bench_bundle``), measuring the machine's roofline once.

    Every bundle is loaded and every backend and variant name checked before anything is timed.
    """
    cfg = cfg or BenchConfig()
    loaded = [load_bundle(b) for b in bundles]
    for b in loaded:
        requested_pairs(b, cfg)
    report("measuring this machine's single-core peak ...")
    machine = MachineRoofline()
    machine.peak()
    return [bench_bundle(b, cfg, machine=machine, report=report) for b in loaded]


def write_bench_json(benches: Sequence[BundleBench], path: str | Path) -> Path:
    """Write the results (every row, skipped ones with their reason) as one JSON document, atomically."""
    doc = {"machine": benches[0].machine if benches else {}, "bundles": [b.to_dict() for b in benches]}
    return atomic_write_text(path, json.dumps(doc, indent=2, allow_nan=False) + "\n")


def plot_bench(benches: Sequence[BundleBench], path: str | Path) -> Path:
    """Draw each bundle's step-latency distributions, one panel per mode, with its deadline and floor."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("--plot needs matplotlib, which is not installed: pip install matplotlib",
                          name="matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(benches), len(MODES), figsize=(6 * len(MODES), 3.8 * len(benches)), squeeze=False)
    for row_axes, bench in zip(axes, benches, strict=True):
        timed = bench.timed()
        for ax, mode in zip(row_axes, MODES, strict=True):
            runs = [(f"{r['backend']} {r['variant']}", bench.samples[(r["backend"], r["variant"], mode)] / 1e3)
                    for r in timed if (r["backend"], r["variant"], mode) in bench.samples]
            if not runs:
                ax.set_axis_off()
                continue
            every = np.concatenate([us for _, us in runs])
            lo, hi = max(float(every.min()), 0.1), max(float(every.max()), bench.deadline_us) * 1.1
            bins = np.logspace(np.log10(lo), np.log10(hi), 60)
            for label, us in runs:
                ax.hist(us, bins=bins, histtype="step", label=label)
            floor_key = "floor_cold_us" if mode == "paced_cold" else "floor_us"
            ax.axvline(min(r[floor_key] for r in timed), color="0.4", ls="--", lw=0.8, label="floor")
            ax.axvline(bench.deadline_us, color="k", lw=1.2, label=f"deadline {bench.deadline_us:g} us")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("step latency (us)")
            ax.set_title(f"{bench.name or Path(bench.bundle).name}: {MODE_LABELS[mode]}")
            ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
