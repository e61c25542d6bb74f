#!/usr/bin/env bash
# Emulated aarch64 smoke test: install the closedloop runtime offline into a venv inside an arm64
# Debian root filesystem and run `closedloop inspect` and `closedloop run --duration 1` there,
# every aarch64 binary executed by qemu-user (binfmt_misc). See docs/jetson.md, "Emulated aarch64
# smoke test", for what it shows and what it cannot (the Python there is Debian's, not JetPack's 3.10).
#
#   tools/aarch64_smoke.sh [--package DIR] [--bundle DIR] [--backend NAME]... [--cache DIR]
#
#   --package DIR  a folder from `closedloop package BUNDLE --target jetson-jp6 --out DIR`: its bundles
#                  are run, its constraints.txt pins the versions and its own closedloop wheel is used.
#                  Where its wheels are not for the root filesystem's Python, a wheelhouse of the same
#                  versions is fetched for that Python (said in a NOTE line).
#   --bundle DIR   a bundle to run (repeatable); default: the package's bundles/*, else a tiny MLP
#                  bundle exported here with the host's .venv (needs torch there)
#   --backend NAME backend(s) for `closedloop run` (repeatable; default: onnxruntime and numba)
#   --cache DIR    where the root filesystem and wheelhouses are kept
#                  (default $CLOSEDLOOP_AARCH64_CACHE or ~/.cache/closedloop/aarch64-rootfs)
#   --offline      never touch the network: the root filesystem and the wheelhouse must be cached
#   --fresh        a new venv even where the cached one has the same wheels
#
# Creating the root filesystem needs root, debootstrap, qemu-user-static and binfmt-support
# (apt-get install qemu-user-static binfmt-support debootstrap) and deb.debian.org; fetching
# wheels needs PyPI. Both are cached, so later runs are offline. Prints one PASS/FAIL line per
# check and `TIME <what> <seconds>` lines; exits 0 only if every check passed, 2 on bad use,
# 3 when this machine cannot run it (the reason is printed).
set -u -o pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${CLOSEDLOOP_AARCH64_CACHE:-$HOME/.cache/closedloop/aarch64-rootfs}
SUITE=${CLOSEDLOOP_AARCH64_SUITE:-bookworm}
MIRROR=${CLOSEDLOOP_AARCH64_MIRROR:-http://deb.debian.org/debian}
HOST_PY=${CLOSEDLOOP_HOST_PYTHON:-$REPO/.venv/bin/python}
PACKAGE="" OFFLINE=0 FRESH=0
BUNDLES=() BACKENDS=()
# The jetson-jp6 target's versions, used when no package (or no constraints file) says otherwise.
DEFAULT_PINS="numpy==2.2.6 onnxruntime==1.23.2 numba==0.68.1 llvmlite==0.50.0 pyserial==3.5 cryptography==50.0.2"

usage() { sed -n '7,25p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
need_arg() { [ $# -ge 2 ] && [ -n "$2" ] || { echo "aarch64_smoke: $1 needs a value" >&2; exit 2; }; }
while [ $# -gt 0 ]; do
    case "$1" in
        --package) need_arg "$@"; PACKAGE=$(realpath "$2"); shift 2 ;;
        --bundle) need_arg "$@"; BUNDLES+=("$(realpath "$2")"); shift 2 ;;
        --backend) need_arg "$@"; BACKENDS+=("$2"); shift 2 ;;
        --cache) need_arg "$@"; CACHE=$2; shift 2 ;;
        --offline) OFFLINE=1; shift ;;
        --fresh) FRESH=1; shift ;;
        -h|--help) usage ;;
        *) echo "aarch64_smoke: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
[ ${#BACKENDS[@]} -gt 0 ] || BACKENDS=(onnxruntime numba)

FAILED=0
pass() { echo "PASS $*"; }
fail() { echo "FAIL $*"; FAILED=1; }
cannot() { echo "CANNOT $*"; exit 3; }
now() { date +%s.%N; }
elapsed() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(now)"; }

# ---- the host: qemu-user for aarch64, registered with binfmt_misc so chroot can exec arm64 binaries
[ "$(uname -m)" = aarch64 ] && NATIVE=1 || NATIVE=0
if [ $NATIVE = 0 ]; then
    command -v qemu-aarch64-static >/dev/null \
        || cannot "no qemu-aarch64-static: apt-get install qemu-user-static binfmt-support"
    if [ ! -e /proc/sys/fs/binfmt_misc/status ]; then
        mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc 2>/dev/null \
            || cannot "binfmt_misc is not mounted and cannot be (mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc: needs root on a kernel with binfmt_misc)"
    fi
    if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
        command -v update-binfmts >/dev/null && update-binfmts --enable qemu-aarch64 >/dev/null 2>&1
        [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] \
            || cannot "qemu-aarch64 is not registered with binfmt_misc (apt-get install binfmt-support; update-binfmts --enable qemu-aarch64)"
    fi
    grep -q '^flags:.*F' /proc/sys/fs/binfmt_misc/qemu-aarch64 \
        || cannot "qemu-aarch64's binfmt entry lacks the F (fix-binary) flag, so it cannot run inside a chroot; Debian's qemu-user-static registers it with F"
    echo "HOST qemu: $(qemu-aarch64-static --version | head -1)"
fi
[ "$(id -u)" = 0 ] || cannot "chroot needs root (run as root or under sudo)"

# ---- the arm64 root filesystem (cached)
ROOTFS=$CACHE/$SUITE-arm64
if [ ! -x "$ROOTFS/usr/bin/python3" ] || [ ! -e "$ROOTFS/.complete" ]; then
    [ $OFFLINE = 0 ] || cannot "--offline, and no cached root filesystem at $ROOTFS"
    command -v debootstrap >/dev/null || cannot "no debootstrap: apt-get install debootstrap"
    rm -rf "$ROOTFS.partial"; mkdir -p "$CACHE"
    echo "creating $ROOTFS (debootstrap $SUITE arm64 from $MIRROR; a few minutes)"
    t0=$(now)
    if debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv,ca-certificates \
            "$SUITE" "$ROOTFS.partial" "$MIRROR" > "$CACHE/debootstrap.log" 2>&1; then
        rm -rf "$ROOTFS"; mv "$ROOTFS.partial" "$ROOTFS"; touch "$ROOTFS/.complete"
        echo "TIME rootfs_create $(elapsed "$t0")"
    else
        tail -5 "$CACHE/debootstrap.log"
        cannot "debootstrap of $SUITE arm64 failed (log: $CACHE/debootstrap.log)"
    fi
fi

MOUNTS=()
cleanup() {
    local i
    for ((i=${#MOUNTS[@]}-1; i>=0; i--)); do umount -l "${MOUNTS[$i]}" 2>/dev/null; done
}
trap cleanup EXIT
mkdir -p "$ROOTFS/proc" "$ROOTFS/dev/pts" "$ROOTFS/dev/shm"
mount -t proc proc "$ROOTFS/proc" && MOUNTS+=("$ROOTFS/proc")
mkdir -p "$ROOTFS/sys"
# /sys too: ONNX Runtime's cpuinfo reads /sys/devices/system/cpu/{possible,present}, and without them
# its first warning is logged before its logger exists (std::terminate, SIGABRT)
mount --bind /sys "$ROOTFS/sys" && MOUNTS+=("$ROOTFS/sys")
mount --bind /dev "$ROOTFS/dev" && MOUNTS+=("$ROOTFS/dev")
mount --bind /dev/pts "$ROOTFS/dev/pts" && MOUNTS+=("$ROOTFS/dev/pts")
mount -t tmpfs tmpfs "$ROOTFS/dev/shm" && MOUNTS+=("$ROOTFS/dev/shm")
in_root() { chroot "$ROOTFS" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root LANG=C.UTF-8 \
    NUMBA_CACHE_DIR=/opt/smoke/numba-cache "$@"; }

ARCH=$(in_root /usr/bin/python3 -c "import platform; print(platform.machine())") \
    || cannot "the arm64 python3 in $ROOTFS does not start under qemu"
PYVER=$(in_root /usr/bin/python3 -c "import sys; print('%d.%d' % sys.version_info[:2])")
GLIBC=$(in_root /usr/bin/python3 -c "import platform; print(platform.libc_ver()[1])")
echo "ROOTFS $ROOTFS: Debian $SUITE, $ARCH, Python $PYVER, glibc $GLIBC"
[ "$ARCH" = aarch64 ] && pass "rootfs python3 runs as aarch64" || fail "rootfs python3 reports $ARCH, not aarch64"
PYTAG=cp${PYVER/./}

# ---- the wheelhouse for the root filesystem's Python
PINS=$DEFAULT_PINS
if [ -n "$PACKAGE" ]; then
    [ -d "$PACKAGE" ] || { echo "aarch64_smoke: --package $PACKAGE is not a folder" >&2; exit 2; }
    if [ -f "$PACKAGE/constraints.txt" ]; then
        PINS=$(grep -Eio '^(numpy|onnxruntime|numba|llvmlite|pyserial|cryptography)==[^ ;#]+' "$PACKAGE/constraints.txt" | tr '\n' ' ')
        [ -n "$PINS" ] || PINS=$DEFAULT_PINS
    fi
    if [ ${#BUNDLES[@]} = 0 ]; then
        for b in "$PACKAGE"/bundles/*/; do [ -f "$b/manifest.json" ] && BUNDLES+=("${b%/}"); done
    fi
fi
WH=""
if [ -n "$PACKAGE" ] && ls "$PACKAGE"/wheelhouse/numpy-*-"$PYTAG"-*aarch64*.whl >/dev/null 2>&1; then
    WH=$PACKAGE/wheelhouse   # the package's own wheels fit this Python: install exactly those
    echo "WHEELHOUSE $WH (the package's own)"
else
    [ -n "$PACKAGE" ] && echo "NOTE the package's wheels are not for $PYTAG aarch64; fetching the same versions for $PYTAG: $PINS"
    WH=$CACHE/wheelhouse-$PYTAG-$(echo "$PINS" | md5sum | cut -c1-8)
    if [ ! -e "$WH/.complete" ]; then
        [ $OFFLINE = 0 ] || cannot "--offline, and no cached wheelhouse at $WH"
        rm -rf "$WH"; mkdir -p "$WH"
        # shellcheck disable=SC2086
        "$HOST_PY" -m pip download -q --only-binary=:all: --implementation cp --python-version "$PYVER" \
            --platform manylinux2014_aarch64 --platform manylinux_2_17_aarch64 --platform manylinux_2_28_aarch64 \
            -d "$WH" $PINS > "$CACHE/pip-download.log" 2>&1 \
            || { tail -5 "$CACHE/pip-download.log"; cannot "pip download of $PINS for $PYTAG aarch64 failed"; }
        touch "$WH/.complete"
    fi
    echo "WHEELHOUSE $WH"
fi
# the project's own wheel: the package's if it has one, else built from this checkout
OWN=""
[ -n "$PACKAGE" ] && OWN=$(ls "$PACKAGE"/wheelhouse/closedloop-*.whl 2>/dev/null | head -1)
if [ -z "$OWN" ]; then
    OWNDIR=$(mktemp -d); "$HOST_PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OWNDIR" "$REPO" >/dev/null 2>&1 \
        || "$HOST_PY" -m pip wheel -q --no-deps -w "$OWNDIR" "$REPO" >/dev/null \
        || cannot "pip wheel of $REPO failed"
    OWN=$(ls "$OWNDIR"/closedloop-*.whl | head -1)
fi
echo "WHEEL $(basename "$OWN")"

# ---- the bundles
if [ ${#BUNDLES[@]} = 0 ]; then
    B=$CACHE/bundles/tiny-mlp
    if [ ! -f "$B/manifest.json" ]; then
        "$HOST_PY" - "$B" <<'EOF' || cannot "no --bundle given and exporting a tiny one here failed (needs torch in $HOST_PY)"
import sys, torch
from closedloop.export import export_bundle
from closedloop.sdk.models import MLPPolicy
torch.manual_seed(0)
export_bundle(MLPPolicy(n_obs=16, n_actions=3, hidden=(32, 32)).eval(), sys.argv[1], kind="feedforward",
              example_input=torch.zeros(1, 16), rate_hz=200.0, name="aarch64-smoke-mlp", variants=(),
              report=lambda s: None)
EOF
    fi
    BUNDLES=("$B")
fi

# ---- install offline into a venv inside the root filesystem
# A venv whose third-party wheels are the same as last time is kept (pip install under emulation
# takes minutes) and only the closedloop wheel is reinstalled; --fresh always starts anew.
S=$ROOTFS/opt/smoke
KEY=$( (cd "$WH" && sha256sum ./*.whl | grep -v ' ./closedloop-'; echo "$PINS") | sha256sum | cut -c1-16)
if [ $FRESH = 0 ] && [ -x "$S/venv/bin/closedloop" ] && [ "$(cat "$S/venv.key" 2>/dev/null)" = "$KEY" ]; then
    REUSE=1
else
    REUSE=0; rm -rf "$S"
fi
rm -rf "$S/wheelhouse" "$S/bundles" "$S/numba-cache"; mkdir -p "$S/wheelhouse" "$S/bundles" "$S/numba-cache"
cp "$WH"/*.whl "$OWN" "$S/wheelhouse/"
printf '%s\n' $PINS > "$S/constraints.txt"
for b in "${BUNDLES[@]}"; do cp -r "$b" "$S/bundles/"; done
t0=$(now)
if [ $REUSE = 1 ]; then
    if in_root /opt/smoke/venv/bin/pip install -q --no-index --no-deps --force-reinstall \
            "/opt/smoke/wheelhouse/$(basename "$OWN")" > "$S/install.log" 2>&1; then
        echo "TIME reinstall_closedloop $(elapsed "$t0")"
        pass "venv kept (same wheels as last time), closedloop wheel reinstalled offline (aarch64, Python $PYVER)"
    else
        tail -8 "$S/install.log"; fail "offline reinstall of closedloop (log: $S/install.log)"; exit 1
    fi
elif in_root /usr/bin/python3 -m venv /opt/smoke/venv > "$S/install.log" 2>&1 \
        && in_root /opt/smoke/venv/bin/pip install --no-index --find-links /opt/smoke/wheelhouse \
           -c /opt/smoke/constraints.txt closedloop >> "$S/install.log" 2>&1; then
    echo "$KEY" > "$S/venv.key"
    echo "TIME install $(elapsed "$t0")"
    pass "offline install of closedloop into a venv (aarch64, Python $PYVER)"
else
    tail -8 "$S/install.log"; fail "offline install (log: $S/install.log)"
    exit 1
fi
in_root /opt/smoke/venv/bin/pip list --format=freeze 2>/dev/null | grep -Ei '^(closedloop|numpy|onnxruntime|numba|llvmlite)=' | tr '\n' ' '; echo

# ---- inspect and run each bundle
CL=/opt/smoke/venv/bin/closedloop
for b in "${BUNDLES[@]}"; do
    name=$(basename "$b"); rb=/opt/smoke/bundles/$name
    t0=$(now)
    if in_root "$CL" inspect "$rb" --json > "$S/inspect-$name.json" 2> "$S/inspect-$name.err" \
            && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); sys.exit(1 if d['problems'] else 0)" "$S/inspect-$name.json"; then
        echo "TIME inspect[$name] $(elapsed "$t0")"; pass "closedloop inspect $name (no problems)"
    else
        tail -5 "$S/inspect-$name.err"; fail "closedloop inspect $name"
    fi
    device=$(python3 - "$b/manifest.json" <<'EOF'
import json, sys
m = json.load(open(sys.argv[1]))
g = m["graphs"][next(iter(m["graphs"]))]
x = next(i for i in g["inputs"] if not i.get("state"))
print(f"sim://headstage?channels={x['shape'][-1]}&rate={m['rate_hz']:g}")
EOF
)
    for backend in "${BACKENDS[@]}"; do
        t0=$(now)
        out=$S/run-$name-$backend
        in_root "$CL" run "$rb" --device "$device" --duration 1 --backend "$backend" --json > "$out.json" 2> "$out.err"
        rc=$?
        if [ $rc = 0 ]; then
            t=$(elapsed "$t0")
            summary=$(python3 - "$out.json" <<'EOF'
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.index("{"):])
ok = d["stopped_by"] == "duration" and d["steps"] > 0 and d["error"] is None
print(("ok" if ok else "bad"), f"steps={d['steps']} stopped_by={d['stopped_by']} backend={d['backend']}",
      f"setup_s={d['setup_s']:.2f} latency_p50_us={d['latency_p50_us']:.0f} latency_p99_us={d['latency_p99_us']:.0f}",
      f"missed_fraction={d['missed_fraction']:.2f}")
EOF
)
            echo "TIME run[$name,$backend] $t"
            case "$summary" in
                ok*) pass "closedloop run $name --device $device --duration 1 --backend $backend: ${summary#ok }" ;;
                *) fail "closedloop run $name --backend $backend: ${summary#bad }" ;;
            esac
        else
            tail -5 "$out.err"; fail "closedloop run $name --backend $backend (exit $rc; log: $out.err)"
        fi
    done
done
[ $FAILED = 0 ] && echo "PASS all" || echo "FAIL some checks (logs under $S)"
exit $FAILED
