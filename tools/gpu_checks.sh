#!/usr/bin/env bash
# Everything GPU-bound in closedloop, in one go, on a machine with an NVIDIA GPU (issues 26 and 28).
#
#   bash tools/gpu_checks.sh                 # writes ${OUT:-bench/results/gpu}/
#   OUT=/tmp/gpu PYTHON=python3.12 bash tools/gpu_checks.sh
#
# Steps (each independent: one failing does not stop the others; each has its own time limit, and
# all of them together stop within GPU_CHECKS_BUDGET_S, default 480 s: a step that would start with
# under 20 s left is skipped, saying so). Most important first:
#   nvidia_smi     nvidia-smi and nvidia-smi -q
#   env            Python, torch (CUDA build, device), onnxruntime providers, numba, the backends here
#   bci_cuda       pytest tests/sdk/test_bci_cuda.py -v (the iBCI CUDA training path)
#   parity         an exported GRU and MLP bundle: torch CUDA vs torch CPU vs ONNX Runtime CPU vs Numba
#                  (and ort-cuda / ort-trt where they run), max abs error against 1e-4 (fp32, TF32 off)
#   ort_gpu        ONNX Runtime's CUDA / TensorRT providers: parity and p50/p99 latency, or why absent
#   bench_bci      bench/bench_bci.py --tiny --seeds 0 --jobs 1 --device cuda
#   train_speed    GRU decoder training step (forward + CTC + backward + Adam), GPU vs CPU
#   ort_gpu_tests  pytest tests/runtime/test_backend_ort_gpu.py -v
# Then a summary table (summary.md) of every step's status and time.
#
# No install is needed: the checkout goes on PYTHONPATH (closedloop/__init__.py maps the layer
# folders beside it into the closedloop namespace); modules that are missing are reported per step.
# Without a GPU (or with CUDA_VISIBLE_DEVICES=) the GPU steps are recorded as skipped, and the
# script ends in seconds with exit status 0. Exit status: the number of failed steps.
# GPU_CHECKS_DEVICE=cpu runs the GPU steps on the CPU instead: a check of this script on a machine without a GPU.
set -u

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 1
OUT="${OUT:-bench/results/gpu}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$REPO/.venv/bin/python" ]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON="$(command -v python3 || command -v python)"; fi
fi
WORK="$(mktemp -d "${TMPDIR:-/tmp}/closedloop-gpu-checks.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
SUMMARY="$OUT/summary.tsv"
printf 'step\tstatus\tseconds\tnote\n' > "$SUMMARY"
FAILED=0

# --- import path -------------------------------------------------------------------------------------
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 CLOSEDLOOP_TRT_CACHE="$WORK/trt-cache"
BUDGET_S="${GPU_CHECKS_BUDGET_S:-480}"
START_S=$(date +%s)
SHIMS=""
if ! "$PYTHON" -c "import serial" 2>/dev/null; then
    # pyserial is imported by the transports package that closedloop.runtime loads; no step here opens a
    # port, so a stand-in that refuses to open one lets the runtime import.
    mkdir -p "$WORK/shim/serial"
    cat > "$WORK/shim/serial/__init__.py" <<'EOF'
"""Stand-in for pyserial (absent on this machine): importable, refuses to open any port."""
class SerialException(OSError):
    pass
class SerialBase:
    pass
def _refuse(*a, **k):
    raise SerialException("pyserial is not installed here (tools/gpu_checks.sh stand-in)")
Serial = serial_for_url = _refuse
EOF
    export PYTHONPATH="$PYTHONPATH:$WORK/shim"
    SHIMS="pyserial absent: a stand-in that refuses to open ports is on the path"
fi
if ! "$PYTHON" -c "import closedloop.runtime" 2>"$WORK/import.err"; then
    # A checkout whose package file does not map the layers itself: the installed layout (setup.py's
    # package_dir), built from symbolic links.
    mkdir -p "$WORK/pkg/closedloop"
    for f in "$REPO"/closedloop/*; do ln -s "$f" "$WORK/pkg/closedloop/"; done
    for layer in sdk runtime firmware_bridge export sim; do ln -sfn "$REPO/$layer" "$WORK/pkg/closedloop/$layer"; done
    export PYTHONPATH="$WORK/pkg:$PYTHONPATH"
fi

# --- steps -------------------------------------------------------------------------------------------
# step NAME LIMIT_S COMMAND...: runs COMMAND with its output in $OUT/NAME.log; the status is passed,
# failed (exit status N), timed out, or skipped (exit status 77, its last line the reason).
step() {
    local name="$1" limit="$2"; shift 2
    local log="$OUT/$name.log" t0 rc status note left
    left=$((BUDGET_S - ($(date +%s) - START_S)))
    if [ "$left" -lt 20 ]; then
        skip "$name" "no time left of the ${BUDGET_S}s budget (GPU_CHECKS_BUDGET_S)"; return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (limit ${limit}s)"
    t0=$(date +%s.%N)
    timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
    rc=$?
    local secs; secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')
    note="$(grep -v '^\s*$' "$log" | tail -n 1 | tr '\t' ' ' | cut -c1-160)"
    # pytest with every test skipped exits 0: that is a skip, not a pass
    if [ "$rc" = 0 ] && echo "$note" | grep -Eq '^=+ .*skipped' && ! echo "$note" | grep -q passed; then rc=77; fi
    case $rc in
        0) status=passed ;;
        77) status=skipped ;;
        124|137) status="timed out"; note="over ${limit}s; $note"; FAILED=$((FAILED + 1)) ;;
        *) status="failed ($rc)"; FAILED=$((FAILED + 1)) ;;
    esac
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$secs" "$note" >> "$SUMMARY"
    echo "   $status in ${secs}s: $note"
}

skip() {  # skip NAME REASON
    printf '%s\tskipped\t0.0\t%s\n' "$1" "$2" >> "$SUMMARY"
    echo "== $1: skipped: $2"
}

have_pytest() { "$PYTHON" -c "import pytest" 2>/dev/null; }

cat > "$WORK/gpu_probe.py" <<'EOF'
import sys
try:
    import torch
except ImportError as exc:
    print(f"no GPU usable: torch does not import ({exc})"); sys.exit(1)
if not torch.cuda.is_available():
    why = "a CPU-only torch build" if not torch.version.cuda else "torch.cuda.is_available() is False (no device visible; CUDA_VISIBLE_DEVICES=%r)" % __import__("os").environ.get("CUDA_VISIBLE_DEVICES")
    print(f"no GPU usable: {why}"); sys.exit(1)
print(f"GPU: {torch.cuda.get_device_name(0)} (torch {torch.__version__}, CUDA {torch.version.cuda})")
EOF

cat > "$WORK/env.py" <<'EOF'
import importlib, platform, sys
print(f"python {sys.version.split()[0]} on {platform.machine()} {platform.platform()}")
for m in ("numpy", "torch", "onnx", "onnxruntime", "numba", "serial", "pytest", "tensorrt"):
    try:
        mod = importlib.import_module(m)
        print(f"{m} {getattr(mod, '__version__', '?')} ({getattr(mod, '__file__', '')})")
    except Exception as exc:
        print(f"{m}: not importable ({exc})")
try:
    import torch
    print(f"torch CUDA build {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, available {torch.cuda.is_available()}")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print(f"device 0: {p.name}, {p.total_memory / 2**30:.0f} GiB, compute capability {p.major}.{p.minor}")
except Exception as exc:
    print(f"torch CUDA: {exc}")
try:
    import onnxruntime as ort
    print(f"onnxruntime providers: {ort.get_available_providers()}")
except Exception as exc:
    print(f"onnxruntime: {exc}")
import closedloop
from closedloop.runtime import backend_report
print(f"closedloop from {closedloop.__file__}")
for name, a in backend_report().items():
    print(f"backend {name}: {'available' if a else 'unavailable'}: {a.reason}")
EOF

cat > "$WORK/parity.py" <<'EOF'
"""torch CUDA vs torch CPU vs ONNX Runtime CPU vs Numba (and the ORT GPU backends) on exported bundles."""
import json, os, sys
import numpy as np
import torch
from closedloop.export import export_bundle
from closedloop.runtime import Model, backend_report, load_bundle
from closedloop.sdk.models import GRUDecoder, MLPPolicy

TOL = 1e-4  # fp32 everywhere (TF32 off): summation order only, as tests/runtime/test_backend_parity.py
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
out = os.environ["OUT"]
torch.manual_seed(0)
cases = {
    "gru": (GRUDecoder(n_inputs=12, n_hidden=64, n_layers=2, n_outputs=5).eval(), "recurrent", 12, 50.0),
    "mlp": (MLPPolicy(n_obs=6, n_actions=3, hidden=(64, 64)).eval(), "feedforward", 6, 1000.0),
}
rows, bad = [], 0
for name, (model, kind, n_in, rate) in cases.items():
    path = export_bundle(model, os.path.join(out, f"bundle_{name}"), kind=kind, example_input=torch.zeros(1, n_in),
                         rate_hz=rate, name=f"gpu-check-{name}", variants=(), overwrite=True, report=lambda s: None)
    xs = np.random.default_rng(1).standard_normal((200, n_in)).astype(np.float32)
    res = {}
    with torch.no_grad():
        # GPU_CHECKS_DEVICE=cpu: a check of this script without a GPU
        for label, dev in (("torch-cpu", "cpu"), ("torch-cuda", os.environ.get("GPU_CHECKS_DEVICE", "cuda"))):
            m = model.to(dev)
            x = torch.from_numpy(xs).to(dev)
            y = m(x[None])[0][0] if kind == "recurrent" else m(x)
            res[label] = y.cpu().numpy()
        model.to("cpu")
    b = load_bundle(path)
    for backend, a in backend_report(b.graph_path(), b.graph()).items():
        if backend == "tensorrt" or not a:
            print(f"{name}: backend {backend} not run: {a.reason}")
            continue
        m = Model(path, backend=backend, variant="fp32")
        res[backend] = np.stack([m.step(x[None]).copy()[0] for x in xs])
        m.close()
    ref = res["torch-cpu"]
    for k, v in res.items():
        if k == "torch-cpu":
            continue
        err = float(np.max(np.abs(v - ref)))
        ok = err <= TOL
        bad += not ok
        rows.append({"bundle": name, "against torch-cpu": k, "steps": len(xs), "max_abs_err": err, "tol": TOL, "ok": ok})
        print(f"{name}: {k:12s} vs torch-cpu over {len(xs)} steps: max abs err {err:.2e} (tol {TOL:g}) {'ok' if ok else 'FAIL'}")
json.dump(rows, open(os.path.join(out, "parity.json"), "w"), indent=1)
print(f"parity: {len(rows) - bad} of {len(rows)} comparisons within {TOL:g}")
sys.exit(1 if bad else 0)
EOF

cat > "$WORK/ort_gpu.py" <<'EOF'
"""ONNX Runtime's CUDA and TensorRT providers (ort-cuda, ort-trt): parity and latency, or why they are absent."""
import json, os, sys
import numpy as np
import torch
from closedloop.export import export_bundle
from closedloop.runtime import Model, load_bundle
from closedloop.runtime.backends import create_backend, get_backend_class, time_backend
from closedloop.sdk.models import GRUDecoder

out = os.environ["OUT"]
absent = {n: get_backend_class(n).availability() for n in ("ort-cuda", "ort-trt")}
if not any(absent.values()):
    for n, a in absent.items():
        print(f"{n} absent: {a.reason}")
    print("ONNX Runtime GPU providers absent: " + "; ".join(f"{n}: {a.reason.split(':')[0]}" for n, a in absent.items()))
    sys.exit(77)
torch.manual_seed(0)
model = GRUDecoder(n_inputs=12, n_hidden=64, n_layers=2, n_outputs=5).eval()
path = export_bundle(model, os.path.join(out, "bundle_ort_gpu"), kind="recurrent", example_input=torch.zeros(1, 12),
                     rate_hz=50.0, name="gpu-check-ort", variants=("fp16",), overwrite=True, report=lambda s: None)
b = load_bundle(path)
xs = np.random.default_rng(2).standard_normal((200, 12)).astype(np.float32)
rows, bad = {}, 0
ref = None
for n in ("onnxruntime", "numba", "ort-cuda", "ort-trt"):
    a = get_backend_class(n).availability()
    if not a:
        print(f"{n} absent: {a.reason}")
        continue
    try:
        m = Model(path, backend=n, variant="fp32")
        y = np.stack([m.step(x[None]).copy()[0] for x in xs])
        desc = m.backend.describe()
        m.close()
        be, _ = create_backend(n, b.graph_path(), b.graph())
        t = time_backend(be, steps=2000) / 1e3
        be.close()
    except Exception as exc:
        print(f"{n} refused or failed: {exc}")
        bad += n.startswith("ort-")
        continue
    ref = y if ref is None else ref
    err = float(np.max(np.abs(y - ref)))
    rows[n] = {"describe": desc, "max_abs_err_vs_onnxruntime": err, "p50_us": float(np.median(t)),
               "p99_us": float(np.percentile(t, 99))}
    ok = err <= 1e-4
    bad += not ok
    print(f"{n:12s} {desc}: max abs err {err:.2e} {'ok' if ok else 'FAIL'}; p50 {rows[n]['p50_us']:.1f} us, p99 {rows[n]['p99_us']:.1f} us")
m = Model(path, backend="auto")
print(f"auto chose {m.choice.chosen} (variant {m.choice.variant}); p99 us {m.choice.p99_us}; skipped {m.choice.skipped}")
rows["auto"] = {"chosen": m.choice.chosen, "p99_us": m.choice.p99_us, "skipped": m.choice.skipped}
m.close()
json.dump(rows, open(os.path.join(out, "ort_gpu.json"), "w"), indent=1)
sys.exit(1 if bad else 0)
EOF

cat > "$WORK/train_speed.py" <<'EOF'
"""GRU decoder training step (forward + CTC loss + backward + Adam) at the iBCI benchmark's default size: GPU vs CPU."""
import json, os, time
import torch
from closedloop.common.handwriting import N_CHANNELS
from closedloop.sdk.bci.benchmark import BciBenchConfig
from closedloop.sdk.bci.data import collate, ctc_loss, make_examples, session_normalization
from closedloop.sdk.bci.models import GRUBackbone
from closedloop.sdk.bci.toy import toy_recording

cfg = BciBenchConfig().harness.train
bc = cfg.backbone
s = toy_recording(n_channels=N_CHANNELS, n_held_in=1, n_held_out=1, n_trials=cfg.batch_size, bins_per_char=20, seed=0)[0]
ex = make_examples(s, list(range(cfg.batch_size)), session_normalization(s))


def steps_per_s(device: str, threads: int, n: int = 20) -> float:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    bb = GRUBackbone(N_CHANNELS, bc.n_hidden, bc.n_layers, dropout=bc.dropout).to(device).train()
    opt = torch.optim.Adam(bb.parameters(), lr=cfg.lr)
    batch = collate(ex, device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for i in range(n + 3):  # 3 warm-up steps: allocator, kernels, cuDNN plans
        if i == 3:
            sync(); t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        ctc_loss(bb(batch.x)[0], batch).backward()
        opt.step()
    sync()
    return n / (time.perf_counter() - t0)


bins = int(collate(ex, "cpu").x_lens.sum())
rows = {}
cores = os.cpu_count() or 1
gpu = os.environ.get("GPU_CHECKS_DEVICE", "cuda")  # cpu only to check this script's logic on a machine without one
for label, dev, th in (("cpu, 1 thread", "cpu", 1), (f"cpu, {cores} threads", "cpu", cores), ("cuda", gpu, 1)):
    rows[label] = steps_per_s(dev, th)
    print(f"{label:16s} {rows[label]:7.2f} steps/s")
print(f"model GRU {bc.n_layers}x{bc.n_hidden}, {N_CHANNELS} channels, batch {cfg.batch_size}, {bins} bins per batch")
json.dump({"model": f"GRU {bc.n_layers}x{bc.n_hidden}", "channels": N_CHANNELS, "batch": cfg.batch_size, "bins": bins,
           "steps_per_s": rows}, open(os.path.join(os.environ["OUT"], "train_speed.json"), "w"), indent=1)
best_cpu = max(v for k, v in rows.items() if k.startswith("cpu"))
print(f"cuda {rows['cuda'] / best_cpu:.2f}x the best CPU setting ({rows['cuda']:.2f} vs {best_cpu:.2f} steps/s)")
EOF
export OUT

# --- run ---------------------------------------------------------------------------------------------
echo "closedloop GPU checks: $REPO -> $OUT (python: $PYTHON)"
[ -n "$SHIMS" ] && echo "note: $SHIMS"
if command -v nvidia-smi >/dev/null 2>&1; then
    step nvidia_smi 30 bash -c 'nvidia-smi && nvidia-smi -q'
else
    skip nvidia_smi "nvidia-smi not found (no NVIDIA driver here)"
fi
step env 60 "$PYTHON" "$WORK/env.py"
if [ "${GPU_CHECKS_DEVICE:-cuda}" = cpu ]; then
    HAVE_GPU=1; GPU_LINE="GPU_CHECKS_DEVICE=cpu: the GPU steps run on the CPU (a check of this script, not of a GPU)"
elif GPU_LINE="$("$PYTHON" "$WORK/gpu_probe.py" 2>&1)"; then HAVE_GPU=1; else HAVE_GPU=0; fi
echo "$GPU_LINE"
if [ "$HAVE_GPU" = 1 ]; then
    if have_pytest; then
        step bci_cuda 180 "$PYTHON" -m pytest -p no:cacheprovider -o addopts="" -v -rs tests/sdk/test_bci_cuda.py
    else
        skip bci_cuda "pytest is not importable by $PYTHON"
    fi
    step parity 150 "$PYTHON" "$WORK/parity.py"
    step ort_gpu 90 "$PYTHON" "$WORK/ort_gpu.py"
    step bench_bci 180 "$PYTHON" bench/bench_bci.py --tiny --seeds 0 --jobs 1 --device "${GPU_CHECKS_DEVICE:-cuda}" --out "$OUT/bench_bci"
    step train_speed 90 "$PYTHON" "$WORK/train_speed.py"
    if have_pytest; then
        step ort_gpu_tests 90 "$PYTHON" -m pytest -p no:cacheprovider -o addopts="" -v -rs tests/runtime/test_backend_ort_gpu.py
    else
        skip ort_gpu_tests "pytest is not importable by $PYTHON"
    fi
else
    for s in bci_cuda parity ort_gpu bench_bci train_speed ort_gpu_tests; do skip "$s" "$GPU_LINE"; done
fi

# --- summary -----------------------------------------------------------------------------------------
{
    echo "# GPU checks ($(date -u +%Y-%m-%dT%H:%MZ), $(hostname))"
    echo
    echo "\`bash tools/gpu_checks.sh\` on: ${GPU_LINE}"
    [ -n "$SHIMS" ] && echo "Note: $SHIMS."
    echo
    echo "| step | status | seconds | last line of its log |"
    echo "|---|---|---|---|"
    tail -n +2 "$SUMMARY" | awk -F'\t' '{gsub(/\|/, "/", $4); printf "| %s | %s | %s | %s |\n", $1, $2, $3, $4}'
} > "$OUT/summary.md"
echo
cat "$OUT/summary.md"
exit "$FAILED"
