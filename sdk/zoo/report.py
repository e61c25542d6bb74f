"""Tables, plot and files of the zoo benchmark (``closedloop.sdk.zoo.benchmark``), and the host it ran on.

``format_zoo_table`` is what the benchmark prints and ``zoo.md`` holds: one line per model with p50/p99
on torch eager, ONNX Runtime and Numba (fp32) and the ratios numba/ORT and numba/torch at p99, then
the reduced-precision variants, the rows that could not run (with why), and the targets, MET or NOT MET.
"""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np

from closedloop.common.jsonout import write_json

METHODS = ("torch-eager", "onnxruntime", "numba")


def _cache_kib(level: str) -> int | None:
    """Size of this CPU's cache ``level`` ("L2", "L3") from sysfs, KiB (None where the OS does not say)."""
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    for idx in sorted(root.glob("index*")) if root.exists() else []:
        try:
            lvl = (idx / "level").read_text().strip()
            kind = (idx / "type").read_text().strip()
            size = (idx / "size").read_text().strip()
        except OSError:
            continue
        if f"L{lvl}" == level and kind in ("Unified", "Data"):
            if size.endswith("K"):
                return int(size[:-1])
            return int(size[:-1]) * 1024 if size.endswith("M") else int(size) // 1024
    return None


def host_kind() -> dict:
    """What kind of host this is, in the words the issue's targets use: vendor, vector width, L2 per core."""
    flags: set[str] = set()
    vendor, family, model = platform.machine(), "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "vendor_id":
                vendor = value
            elif key == "cpu family":
                family = value
            elif key == "model":
                model = value
            elif key == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    isa = "AVX-512" if "avx512f" in flags else ("AVX2" if "avx2" in flags else "no AVX2")
    l2, l3 = _cache_kib("L2"), _cache_kib("L3")
    name = {"GenuineIntel": "Intel", "AuthenticAMD": "AMD"}.get(vendor, vendor)
    # the model name a VM reports can be as bare as "AMD EPYC": family and model tell the generations apart
    generation = f" (family {family} model {model})" if family else ""
    l2_text = f", L2 {l2 / 1024:g} MiB per core" if l2 else ""
    return {"host_kind": f"{name} {isa}{generation}{l2_text}", "l2_kib": l2, "l3_kib": l3, "vector_isa": isa,
            "cpu_family": family, "cpu_model": model}


def _row(record: dict, method: str, variant: str = "fp32") -> dict | None:
    return next((r for r in record["rows"] if r["method"] == method and r["variant"] == variant
                 and r["status"] == "timed"), None)


def _pair(r: dict | None) -> str:
    return f"{r['p50_us']:9.1f} {r['p99_us']:8.1f}" if r else f"{'-':>9} {'-':>8}"


def format_zoo_table(results: dict) -> str:
    m = results["machine"]
    lines = [
        f"zoo, full size: per-step latency (us), batch 1, one thread, back to back; {m.get('processor', '?')} "
        f"({m.get('host_kind', '?')}), peak {m.get('single_core_peak_gflops', 0):.0f} GFLOP/s on one core",
        f"{'model':12} {'torch p50':>9} {'p99':>8} {'ORT p50':>9} {'p99':>8} {'numba p50':>9} {'p99':>8} "
        f"{'numba/ORT':>9} {'numba/torch':>11} {'floor':>7}",
    ]
    skipped: list[str] = []
    for name, rec in results["models"].items():
        te, ort, nb = (_row(rec, k) for k in METHODS)
        r_ort = f"{nb['p99_us'] / ort['p99_us']:9.2f}" if nb and ort else f"{'-':>9}"
        r_te = f"{nb['p99_us'] / te['p99_us']:11.2f}" if nb and te else f"{'-':>11}"
        floor = f"{nb['floor_us']:7.1f}" if nb else f"{'-':>7}"
        lines.append(f"{name:12} {_pair(te)} {_pair(ort)} {_pair(nb)} {r_ort} {r_te} {floor}")
        skipped += [f"  {name}: {r['method']}/{r['variant']}: {r['reason']}" for r in rec["rows"] if r["status"] != "timed"]
    lines.append("(ratios at p99, below 1 when numba is faster; floor: the numba step's FLOPs at peak or fp32 weights "
                 "at cache bandwidth; a windowed model's step is one run on a full window)")
    lines.append("")
    lines.append("variants (error vs fp32 from the export; p50/p99 us where a backend runs them):")
    lines.append(f"{'model':12} {'variant':8} {'max abs':>9} {'within':>6} {'ORT p50':>9} {'p99':>8} {'numba p50':>9} {'p99':>8} "
                 f"{'numba/torch':>11}")
    for name, rec in results["models"].items():
        te = _row(rec, "torch-eager")
        for v, info in rec["variants"].items():
            ma = info.get("max_abs")
            nb = _row(rec, "numba", v)
            ratio = f"{nb['p99_us'] / te['p99_us']:11.2f}" if nb and te else f"{'-':>11}"
            lines.append(f"{name:12} {v:8} {ma if ma is None else f'{ma:9.2e}':>9} "
                         f"{'yes' if info.get('within_tolerance') else 'NO':>6} "
                         f"{_pair(_row(rec, 'onnxruntime', v))} {_pair(nb)} {ratio}")
    lines.append("(fp16w, int8w: weights stored in float16 / int8 with a scale per row, float32 arithmetic; "
                 "fp16, int8: ONNX Runtime's float16 graph and dynamic quantization)")
    if skipped:
        lines.append("")
        lines.append("not timed here, and why:")
        lines += skipped
    lines.append("")
    lines += [f"[{'MET' if t['met'] else 'NOT MET'}] {t['target']}: {t['value']}" for t in results.get("targets", [])]
    return "\n".join(lines)


def markdown(results: dict) -> str:
    cfg = results["config"]
    return ("# Zoo: full-size models on torch eager, ONNX Runtime and Numba\n\n"
            f"Written by `python bench/bench_zoo.py{' --quick' if 'quick' in cfg['name'] else ''}` in "
            f"{results['wall_s']:.0f} s: {cfg['steps']} steps per method in {cfg['rounds']} interleaved rounds, "
            f"torch {results['torch']}, Python {results['machine'].get('python')}, "
            f"{results['machine'].get('cpu_count')} CPU(s) visible.\n\n```\n" + format_zoo_table(results) + "\n```\n")


def plot(results: dict, samples: dict[str, np.ndarray], path: Path) -> None:
    """p50 bars with p99 whiskers per model and method (fp32), log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["models"])
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(names)), 4))
    width = 0.8 / len(METHODS)
    for j, method in enumerate(METHODS):
        p50, lo, hi = [], [], []
        for name in names:
            ns = samples.get(f"{name}/{method}/fp32")
            us = ns / 1e3 if ns is not None else np.array([np.nan])
            med, p99 = float(np.percentile(us, 50)), float(np.percentile(us, 99))
            p50.append(med)
            lo.append(0.0)
            hi.append(p99 - med)
        x = np.arange(len(names)) + (j - 1) * width
        ax.bar(x, p50, width, yerr=[lo, hi], capsize=3, label=f"{method} (bar p50, whisker p99)")
    ax.set_xticks(np.arange(len(names)), names)
    ax.set_yscale("log")
    ax.set_ylabel("step latency (us)")
    ax.set_title(f"zoo, full size, batch 1, one thread ({results['machine'].get('host_kind', '')})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_zoo_results(results: dict, samples: dict[str, np.ndarray], out: Path, name: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.json", out / f"{name}.md", out / f"{name}.png"]
    write_json(paths[0], results, indent=2)
    paths[1].write_text(markdown(results))
    plot(results, samples, paths[2])
    return paths
