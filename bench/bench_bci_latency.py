"""Per-bin streaming latency of the deployed handwriting decoder, in the runtime.

    python bench/bench_bci_latency.py            # about 2 minutes; writes bench/results/bci_latency/bci_latency.{json,md,png}

One bin is what a typing session does with each 20 ms frame: the frame's counts into
the input, per-channel normalisation (Numba), one step of the decoder graph (alignment
layer + GRU + readout), incremental greedy CTC (Numba). Timed back to back and paced at
50 Hz in the real-time loop (with its cache prewarm), on the Numba backend and ONNX
Runtime, for the benchmark's decoder size (192 -> 1 x 128 GRU) and a larger one
(2 x 256). Latency does not depend on the trained values, so the weights are the
initial ones. Target: p99 <= 1 ms including preprocessing and CTC.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from closedloop.sdk.bci.deploy import bench_bci_step_latency, export_bci_bundle
from closedloop.sdk.bci.models import AffineAlignment, AlignedDecoder, GRUBackbone

SIZES = {"1x128 (benchmark)": (128, 1), "2x256": (256, 2)}
RESULTS = "bench/results/bci_latency"


def markdown(doc: dict) -> str:
    m = doc.get("machine", {})
    worst = doc["worst_p99_us"]
    return ("# Per-bin streaming latency of the deployed handwriting decoder\n\n"
            f"Written by `{doc['command']}` on {m.get('cpus', '?')} CPUs ({m.get('platform', '?')}) in "
            f"{doc['wall_s']:.0f} s. One bin: normalisation, one decoder step, incremental greedy CTC; "
            "back to back, and paced at 50 Hz in the real-time loop.\n\n" + doc["table"] + "\n\n"
            f"Target p99 <= {doc['target_p99_us']:.0f} us: worst p99 {worst:.1f} us -> "
            f"{'met' if worst <= doc['target_p99_us'] else 'NOT met'}.\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bins", type=int, default=3000, help="bins back to back per backend")
    ap.add_argument("--paced-bins", type=int, default=1500, help="bins at 50 Hz per backend (30 s)")
    ap.add_argument("--out", default=RESULTS, help=f"results folder (default {RESULTS})")
    a = ap.parse_args()
    torch.manual_seed(0)
    results: dict = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for label, (hidden, layers) in SIZES.items():
            module = AlignedDecoder(AffineAlignment(192), GRUBackbone(192, hidden, layers)).eval()
            path = export_bci_bundle(module, Path(tmp) / label.split()[0], n_channels=192, mean=np.full(192, 0.3),
                                     std=np.full(192, 0.6), session_name="latency", variants=(), tensorrt=False,
                                     report=lambda s: None)
            results[label] = {
                "back_to_back": bench_bci_step_latency(path, n_bins=a.bins),
                "paced_50hz": bench_bci_step_latency(path, n_bins=a.paced_bins, paced=True),
            }
    rows = []
    for label, r in results.items():
        for mode, per in r.items():
            for backend, v in per.items():
                if "error" in v:
                    rows.append(f"| {label} | {mode} | {backend} | unavailable: {v['error'][:60]} | | |")
                else:
                    rows.append(f"| {label} | {mode} | {backend} | {v['p50_us']:.1f} | {v['p99_us']:.1f} | "
                                f"{v['max_us']:.1f} |")
    table = "| decoder | mode | backend | p50 us | p99 us | max us |\n| --- | --- | --- | --- | --- | --- |\n"
    table += "\n".join(rows)
    print(table)
    worst = max(v["p99_us"] for r in results.values() for per in r.values() for v in per.values() if "p99_us" in v)
    print(f"target p99 <= 1000 us: worst p99 {worst:.1f} us -> {'met' if worst <= 1000 else 'NOT met'}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"command": "python bench/bench_bci_latency.py", "results": results, "worst_p99_us": worst,
           "target_p99_us": 1000.0, "wall_s": time.perf_counter() - t0,
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                       "loadavg": os.getloadavg()}, "table": table}
    tmp_json = out / "bci_latency.json.tmp"
    tmp_json.write_text(json.dumps(doc, indent=2))
    os.replace(tmp_json, out / "bci_latency.json")
    (out / "bci_latency.md").write_text(markdown(doc))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    labels, p50, p99 = [], [], []
    for label, r in results.items():
        for mode, per in r.items():
            for backend, v in per.items():
                if "p99_us" in v:
                    labels.append(f"{label}\n{mode}\n{backend}")
                    p50.append(v["p50_us"])
                    p99.append(v["p99_us"])
    x = np.arange(len(labels))
    ax.bar(x - 0.2, p50, 0.4, label="p50")
    ax.bar(x + 0.2, p99, 0.4, label="p99")
    ax.axhline(1000, color="k", ls="--", lw=1, label="target p99 1 ms")
    ax.set_xticks(x, labels, fontsize=6)
    ax.set_ylabel("per-bin latency (us)")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "bci_latency.png", dpi=120)
    print(f"wrote {out / 'bci_latency.json'}, .md and .png")


if __name__ == "__main__":
    main()
