"""``closedloop package``: bundles and their runtime, as one folder to copy to a board and install offline.

The folder: ``bundles/`` (each verified first: checksums, and with ``trust`` a signature by one of those keys),
``trust/`` (those public keys), ``wheelhouse/`` (closedloop's wheel and every wheel the runtime needs on the target),
``requirements.lock`` (every wheel pinned with its sha256, what pip installs), ``constraints.txt`` (the target's
tested pins), ``install.sh`` (checks ``SHA256SUMS``, installs offline into a venv, then warms the Numba cache for
the bundles), ``closedloop.service`` (a systemd unit running ``closedloop run --rt``, with ``--trust`` when keys
were given), ``README.md``, ``manifest.json`` (the target, each wheel's sha256, the footprint) and ``SHA256SUMS``
(every other file's sha256, in ``sha256sum`` format).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shlex
import shutil
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from closedloop.common.atomic import atomic_directory

from .targets import PackageError, Target, get_target
from .wheels import (
    build_project_wheel,
    check_tags,
    installed_closure,
    pip_download,
    repack,
    source_provenance,
    wheel_requirements,
)


@dataclass
class PackageOptions:
    target: str = "host"
    extras: list[str] = field(default_factory=list)
    ort_only: bool = False
    find_links: list[str] = field(default_factory=list)
    no_index: bool = False
    from_installed: bool = False
    prefix: str = "/opt/closedloop"
    device: str = "/dev/ttyACM0"
    cpu: int = 1
    priority: int = 80
    user: str = "closedloop"
    overwrite: bool = False
    #: public key files or folders of ``*.pub`` files: each bundle must be signed by one, and the board's service
    #: runs with them (``--trust``); empty: bundles are checked for their checksums only
    trust: list[str] = field(default_factory=list)
    #: the values of inputs the device does not stream (a goal), by input name: the service's ``--input`` options
    inputs: dict[str, list[float]] = field(default_factory=dict)
    #: the service's ``--overrun`` policy and ``--watchdog-limit`` seconds (None: closedloop run's defaults)
    overrun: str | None = None
    watchdog_limit_s: float | None = None
    #: a lab's private key: SHA256SUMS is signed with it (``SHA256SUMS.sig``), so a board that already trusts the
    #: key installs this package as an upgrade (install.sh refuses an unsigned one there)
    sign_key: str | None = None


@dataclass
class PackageResult:
    out: Path
    target: str
    bundles: list[str]
    wheels: list[str]
    wheelhouse_bytes: int
    installed_bytes: int


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _unpacked_bytes(wheel: Path) -> int:
    with zipfile.ZipFile(wheel) as z:
        return sum(i.file_size for i in z.infolist())


# families whose session step is a Numba kernel of their own, not a graph on a backend
NUMBA_FAMILIES = {"observer": "the observer family's step (runtime/families/observer) is a Numba kernel"}


def _check_held_inputs(path: str, bundle, inputs: dict[str, list[float]]) -> None:
    """A bundle whose service could never start (an input with no value: `closedloop run` refuses it, and systemd
    would restart it in a loop) is refused here, saying how to give the value."""
    from closedloop.runtime.families.base import held_input_names, held_value_problem

    try:
        held = held_input_names(bundle.graph())
    except ValueError:
        return  # no measurement input: the family's own checks refuse such a graph
    unknown = sorted(set(inputs) - set(held))
    if unknown:
        raise PackageError(f"--input {', '.join(unknown)}: not an input bundle {path} (the service's) holds; it holds "
                           f"{held or 'none'} besides what the device streams")
    bad = [p for n, v in inputs.items() if (p := held_value_problem(n, v))]
    if bad:
        raise PackageError(f"--input: {'; '.join(bad)}")
    mapped = set((bundle.manifest.extra.get("session") or {}).get("inputs") or {})  # set by a message type
    missing = [n for n in held if n not in inputs and n not in mapped]
    if missing:
        raise PackageError(f"bundle {path} holds input(s) {missing} that the device does not stream, so its service "
                           "could not start without their values: give each with --input NAME=V1,V2,... (the "
                           "service's closedloop run gets it), or map a message type to it at export "
                           "(extra={'session': {'inputs': {NAME: 'plant_measurement'}}})")


_USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
_UNSAFE = re.compile(r"[\s'\"\\`]|[\x00-\x1f\x7f]")  # whitespace, quotes, backslash, control characters


def check_service_options(opts: PackageOptions, target: Target) -> None:
    """Refuse what would write a broken unit or install.sh (a device with a space became extra arguments of the
    service's command; a relative prefix, a negative CPU or a user name with a space are not valid there)."""
    if not opts.prefix.startswith("/") or _UNSAFE.search(opts.prefix) or any(c in opts.prefix for c in "%$"):
        raise PackageError(f"--prefix {opts.prefix!r}: give an absolute folder without spaces, quotes, % or $ "
                           "(the unit and install.sh name it), like /opt/closedloop")
    if not _USER.fullmatch(opts.user):
        raise PackageError(f"--user {opts.user!r}: give a plain user name (lower-case letters, digits, _ and -, "
                           "starting with a letter or _), like closedloop")
    cpus = (os.cpu_count() or 1) if not target.foreign else 1024
    if not 0 <= opts.cpu < cpus:
        raise PackageError(f"--cpu {opts.cpu}: give the number of a CPU of the board, 0 to {cpus - 1}"
                           + (" (this machine's)" if not target.foreign else ""))
    dev = opts.device
    if not dev or _UNSAFE.search(dev):
        raise PackageError(f"--device {dev!r}: give one device path or URL, without spaces or quotes (the service's "
                           "closedloop run opens it), like /dev/ttyACM0 or serial:///dev/ttyUSB0?baud=921600")
    if "://" not in dev and not dev.startswith("/"):
        raise PackageError(f"--device {dev!r}: give the device's absolute path (/dev/ttyACM0, a /dev/serial/by-id/ "
                           "link) or a URL (serial://, socket://, sim://NAME?...)")
    from closedloop.firmware_bridge.transports import registered_schemes
    from closedloop.firmware_bridge.transports.base import split_device_url

    scheme, name, raw = split_device_url(dev)
    if scheme not in registered_schemes():
        raise PackageError(f"--device {dev}: no transport for scheme {scheme!r}; known schemes: "
                           f"{', '.join(registered_schemes())} (docs/devices.md)")
    if scheme == "sim":
        from closedloop.sim.devices import device_params
        from closedloop.sim.devices.base import UnknownDeviceError
        from closedloop.sim.params import ParamError

        try:
            device_params(name.strip("/"), raw)
        except (ParamError, ValueError, UnknownDeviceError) as exc:
            raise PackageError(f"--device {dev}: {exc.args[0] if exc.args else exc}") from None
    if opts.overrun is not None and opts.overrun not in ("skip", "hold", "stop"):
        raise PackageError(f"--overrun {opts.overrun!r}: one of skip, hold, stop (closedloop run --help)")
    if opts.watchdog_limit_s is not None and not (opts.watchdog_limit_s > 0 and math.isfinite(opts.watchdog_limit_s)):
        raise PackageError(f"--watchdog-limit {opts.watchdog_limit_s}: give the seconds of silence after which the "
                           "service's session stops, more than 0")


def _unit_arg(value: str) -> str:
    """``value`` as one argument of a systemd ``ExecStart=`` line: ``%`` and ``$`` escaped (systemd expands
    specifiers and variables there), double-quoted unless it is plain (a path, a flag, a URL)."""
    escaped = value.replace("%", "%%").replace("$", "$$")
    if re.fullmatch(r"[A-Za-z0-9_./:=,+@?&%$-]+", value):
        return escaped
    return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _copy_bundles(paths: list[str], dest: Path, ort_only: bool = False, trust: list[str] | None = None,
                  inputs: dict[str, list[float]] | None = None) -> list[str]:
    from closedloop.runtime import load_bundle

    names: list[str] = []
    dest.mkdir(parents=True)
    for p in paths:
        src = Path(p)
        if not src.exists():
            raise PackageError(f"bundle {p} does not exist: give a bundle folder or zip (export_bundle or closedloop import-onnx writes one)")
        try:
            bundle = load_bundle(src, trust=trust or None)
        except ValueError as exc:
            raise PackageError(f"bundle {p} does not verify, so it is not packaged (closedloop inspect {p} says "
                               f"why):\n{exc}") from None
        if not names:  # the service runs the first bundle: its inputs must be given, and only its
            _check_held_inputs(p, bundle, inputs or {})
        family = bundle.manifest.family
        if ort_only and family in NUMBA_FAMILIES:
            raise PackageError(f"bundle {p} cannot run without Numba ({NUMBA_FAMILIES[family]}): leave out --ort-only")
        name = src.name
        if name in names:
            raise PackageError(f"two bundles are named {name!r}: rename one folder, bundles/ holds them by name")
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, dest / name)
        names.append(name)
    return names


def _pem(public_raw: bytes) -> bytes:
    """An Ed25519 public key as PEM SubjectPublicKeyInfo: what closedloop and openssl (install.sh) both read."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    return Ed25519PublicKey.from_public_bytes(public_raw).public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def _public_raw_of_key(private_key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _public_raw_of_file(path: Path) -> bytes:
    from closedloop.runtime.signing import read_public_key

    return read_public_key(path).public_raw


def _copy_keys(trust: list[str], dest: Path) -> list[str]:
    """The trusted public keys (files, or the ``*.pub`` regular files of folders) written into ``dest`` as PEM."""
    from closedloop.runtime.signing import read_public_key

    names: list[str] = []
    for given in trust:
        p = Path(given)
        keys = sorted(k for k in p.glob("*.pub") if k.is_file()) if p.is_dir() else [p]
        for k in keys:
            name = k.name if k.suffix == ".pub" else k.stem + ".pub"  # the board reads trust/*.pub
            if name in names:
                raise PackageError(f"two trusted keys are named {name!r}: rename one, trust/ holds them by name")
            dest.mkdir(exist_ok=True)
            (dest / name).write_bytes(_pem(read_public_key(k).public_raw))  # an OpenSSH key too, for openssl
            names.append(name)
    return names


def _lock(wheels: list[Path]) -> str:
    """``requirements.lock``: every wheel of the wheelhouse, pinned, with its sha256: pip installs exactly these
    (``--require-hashes --no-deps``), refusing a wheel whose bytes changed."""
    from packaging.utils import parse_wheel_filename

    lines = ["# closedloop package: every wheel of wheelhouse/ with its sha256 (pip --require-hashes)"]
    for w in wheels:
        name, version, _b, _t = parse_wheel_filename(w.name)
        lines.append(f"{name}=={version} --hash=sha256:{_sha256(w)}")
    return "\n".join(lines) + "\n"


def _install_sh(target: Target, opts: PackageOptions, bundles: list[str], trusted: bool) -> str:
    q = shlex.quote
    # exactly the locked wheels (less WITHOUT's), each checked against its sha256; --isolated: no pip.conf or PIP_*
    # variables of the board take part
    pip = ('"$PREFIX/venv/bin/pip" install --isolated --no-index --find-links "$HERE/wheelhouse" --no-deps '
           '--require-hashes -r "$LOCK"\n')
    trust = ' --trust "$PREFIX/trust"' if trusted else ""
    keys = ('mkdir "$PREFIX/trust" && cp "$HERE"/trust/*.pub "$PREFIX/trust/"\n' if trusted else "")
    return f"""#!/bin/sh
# Offline install of closedloop for target {target.name}: {target.description}.
# A fresh venv in $CLOSEDLOOP_PREFIX (default {opts.prefix}) from ./wheelhouse only (no network), the
# bundles copied beside it, then the Numba cache ($NUMBA_CACHE_DIR, default /var/cache/closedloop)
# filled for them and the wire protocol's C scanner library built into $CLOSEDLOOP_CACHE_DIR (the
# same folder by default), so the service's first session compiles nothing. What the prefix held
# (venv, bundles, trust) is set aside first and put back if anything fails.
#   PYTHON=python3.X                 the interpreter of the venv (default python3)
#   SYSTEM_SITE_PACKAGES=1           a venv that sees the system's packages (JetPack's onnxruntime-gpu, tensorrt);
#                                    kept from the venv this install replaces where that one had it
#   WITHOUT="onnxruntime ..."        wheels of the package not to install (the system's are used instead)
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
# every file as packaged (SHA256SUMS; check SHA256SUMS itself against the digest the package command printed),
# and no file that SHA256SUMS does not list (a key added to trust/ would be trusted)
if ! (cd "$HERE" && sha256sum --quiet --strict -c SHA256SUMS); then
    echo "install.sh: the package's files do not match SHA256SUMS (changed or damaged since packaging): copy the" >&2
    echo "  package again from the machine that built it; nothing was installed." >&2
    exit 2
fi
listed=$(cd "$HERE" && sed -n 's/^[0-9a-f]*  //p' SHA256SUMS | LC_ALL=C sort)
added=$(cd "$HERE" && find . ! -type d ! -path ./SHA256SUMS ! -path ./SHA256SUMS.sig | LC_ALL=C sort | while IFS= read -r f; do
    printf '%s\n' "$listed" | grep -qxF -- "$f" || printf '  %s\n' "$f"; done)
if [ -n "$added" ]; then
    echo "install.sh: the package holds files that SHA256SUMS does not list (added since packaging):" >&2
    printf '%s\n' "$added" >&2
    echo "  copy the package again from the machine that built it; nothing was installed." >&2
    exit 2
fi
PREFIX=${{CLOSEDLOOP_PREFIX:-{opts.prefix}}}
# a board that already trusts keys (its install's, or $CLOSEDLOOP_TRUST's) installs only a package whose SHA256SUMS
# one of them signed (closedloop package --sign KEY): an upgrade cannot come from anyone else
TRUSTED=${{CLOSEDLOOP_TRUST:-$PREFIX/trust}}
if ls "$TRUSTED"/*.pub >/dev/null 2>&1; then
    if [ ! -f "$HERE/SHA256SUMS.sig" ]; then
        echo "install.sh: this board trusts the keys in $TRUSTED, and this package is not signed: package it with" >&2
        echo "  --sign KEY (a private key whose .pub is there); nothing was installed." >&2
        exit 2
    fi
    if ! command -v openssl >/dev/null 2>&1; then
        echo "install.sh: checking the package's signature needs openssl (3.0 or later); nothing was installed." >&2
        exit 2
    fi
    signer=""
    for k in "$TRUSTED"/*.pub; do
        if openssl pkeyutl -verify -pubin -inkey "$k" -rawin -in "$HERE/SHA256SUMS" -sigfile "$HERE/SHA256SUMS.sig" \
            >/dev/null 2>&1; then signer=$k; break; fi
    done
    if [ -z "$signer" ]; then
        echo "install.sh: SHA256SUMS.sig is not a signature of this package's SHA256SUMS by a key in $TRUSTED;" >&2
        echo "  nothing was installed." >&2
        exit 2
    fi
    echo "package signed by $signer"
    if ! ls "$HERE"/trust/*.pub >/dev/null 2>&1; then
        echo "install.sh: this board trusts keys ($TRUSTED), and this package has none (built without --trust): its" >&2
        echo "  service would run bundles no one signed. Package with --trust; to stop checking on purpose, remove" >&2
        echo "  $TRUSTED first. Nothing was installed." >&2
        exit 2
    fi
elif [ -f "$HERE/SHA256SUMS.sig" ]; then
    echo "install.sh: no key on this board yet ($TRUSTED): the signature is not checked; check SHA256SUMS's digest"
    echo "  against the one closedloop package printed. Later packages must be signed by a key this one installs."
fi
PYTHON=${{PYTHON:-python3}}
export NUMBA_CACHE_DIR=${{NUMBA_CACHE_DIR:-/var/cache/closedloop}}
export CLOSEDLOOP_CACHE_DIR=${{CLOSEDLOOP_CACHE_DIR:-$NUMBA_CACHE_DIR}}
machine=$(uname -m)
if [ "$machine" != "{target.machine}" ]; then
    echo "install.sh: this package is for {target.machine} (target {target.name}); this machine is $machine." >&2
    echo "  Package again with --target host on this machine, or copy the package to a {target.machine} board." >&2
    exit 2
fi
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "install.sh: no $PYTHON here: install Python {target.python_version}, or set PYTHON to its path; nothing was installed." >&2
    exit 2
fi
have=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$have" != "{target.python_version}" ]; then
    echo "install.sh: this package is for Python {target.python_version} (target {target.name}); $PYTHON is $have." >&2
    echo "  Set PYTHON=python{target.python_version}, or package again with --target host on this machine." >&2
    exit 2
fi
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet closedloop 2>/dev/null; then
    echo "install.sh: the closedloop service is running: stop it first (sudo systemctl stop closedloop), then run" >&2
    echo "  install.sh again; nothing was installed." >&2
    exit 2
fi
SITE=""
if [ "${{SYSTEM_SITE_PACKAGES:-0}}" = 1 ] || grep -qs '^include-system-site-packages *= *true' "$PREFIX/venv/pyvenv.cfg"; then
    SITE=--system-site-packages
fi
mkdir -p "$PREFIX" "$NUMBA_CACHE_DIR" "$CLOSEDLOOP_CACHE_DIR"
LOCK=$(mktemp)
cp "$HERE/requirements.lock" "$LOCK"
for name in ${{WITHOUT:-}}; do
    grep -qi "^$name==" "$LOCK" || {{ echo "install.sh: WITHOUT names $name, which the package does not hold" >&2; rm -f "$LOCK"; exit 2; }}
    grep -vi "^$name==" "$LOCK" > "$LOCK.tmp" && mv "$LOCK.tmp" "$LOCK"
done
# what the prefix held, set aside until the new install has passed its checks, then removed; put back on failure
OLD="$PREFIX/.replaced"
rm -rf "$OLD" && mkdir "$OLD"
for d in venv bundles trust; do if [ -e "$PREFIX/$d" ]; then mv "$PREFIX/$d" "$OLD/$d"; fi; done
installed=0
finish() {{
    rm -f "$LOCK"
    if [ "$installed" = 1 ]; then rm -rf "$OLD"; return; fi
    rm -rf "$PREFIX/venv" "$PREFIX/bundles" "$PREFIX/trust"
    for d in venv bundles trust; do if [ -e "$OLD/$d" ]; then mv "$OLD/$d" "$PREFIX/$d"; fi; done
    rm -rf "$OLD"
    echo "install.sh: the install failed (above); $PREFIX holds what it held before." >&2
}}
trap finish EXIT
trap 'exit 130' INT TERM
"$PYTHON" -m venv $SITE "$PREFIX/venv"
{pip}{keys}mkdir "$PREFIX/bundles"
cp -R "$HERE/bundles/." "$PREFIX/bundles/"
"$PREFIX/venv/bin/python" -m closedloop.sdk.package.warm{trust} {' '.join(f'"$PREFIX/bundles/{b}"' for b in bundles)}
if id {q(opts.user)} >/dev/null 2>&1; then chown -R {q(opts.user)} "$NUMBA_CACHE_DIR" "$CLOSEDLOOP_CACHE_DIR" 2>/dev/null || true; fi
installed=1
echo "installed closedloop in $PREFIX/venv; bundles in $PREFIX/bundles; Numba cache in $NUMBA_CACHE_DIR; C library cache in $CLOSEDLOOP_CACHE_DIR"
"""


def _unit(opts: PackageOptions, bundle: str, trusted: bool) -> str:
    args = [f"{opts.prefix}/bundles/{bundle}", "--device", opts.device, "--rt", "--cpu", str(opts.cpu),
            "--priority", str(opts.priority), "--quiet"]
    if trusted:
        args += ["--trust", f"{opts.prefix}/trust"]
    for name, values in sorted(opts.inputs.items()):
        args += ["--input", f"{name}={','.join(repr(float(v)) for v in values)}"]
    if opts.overrun is not None:
        args += ["--overrun", opts.overrun]
    if opts.watchdog_limit_s is not None:
        args += ["--watchdog-limit", repr(float(opts.watchdog_limit_s))]
    run = f"{opts.prefix}/venv/bin/closedloop run " + " ".join(_unit_arg(a) for a in args)
    return f"""[Unit]
Description=closedloop session: {bundle} on {opts.device.replace("%", "%%")}
# retried without limit (a device not there yet at boot, a crash); a session a safety rule stopped is not: below
StartLimitIntervalSec=0

[Service]
Type=simple
User={opts.user}
SupplementaryGroups=dialout
ExecStart={run}
Restart=on-failure
RestartSec=5
# exit 1: a safety rule stopped the session (overrun policy stop, device changed, watchdog limit, unrepairable
# weights: docs/cli.md). A person looks before it runs again: systemctl restart closedloop
RestartPreventExitStatus=1
# real time: the loop's thread on CPU {opts.cpu} under SCHED_FIFO {opts.priority}, memory locked (closedloop run --rt asks
# for them; these limits let it). No CPUSchedulingPolicy=: that would put every thread of the service, the monitor's
# and the recorder's included, under SCHED_FIFO (docs/realtime.md)
CPUAffinity={opts.cpu}
LimitMEMLOCK=infinity
LimitRTPRIO={opts.priority}
AmbientCapabilities=CAP_SYS_NICE CAP_IPC_LOCK
# the Numba kernels and the C frame scanner install.sh built; systemd keeps the folder writable by the service's user
CacheDirectory=closedloop
Environment=NUMBA_CACHE_DIR=/var/cache/closedloop
Environment=CLOSEDLOOP_CACHE_DIR=/var/cache/closedloop

[Install]
WantedBy=multi-user.target
"""


def emulator_url(bundle: str | Path) -> str | None:
    """The emulator URL a bundle runs against as it is (its family's device, at its rate), or None where the bundle
    does not say enough (a plain export reading a plant: which plant model is the user's)."""
    from closedloop.runtime import load_bundle

    m = load_bundle(bundle).manifest
    rate, extra = f"{m.rate_hz:g}", m.extra
    if m.family == "observer":
        system = extra.get("observer", {}).get("system")
        return f"sim://plant?model={system}&rate={rate}&seed=1" if system else None
    if m.family == "policy":
        task = extra.get("policy", {}).get("task")
        return f"sim://panda?task={task}&rate={rate}" if task else None
    if m.family == "bci_handwriting":
        n = extra.get("bci", {}).get("n_channels")
        return f"sim://headstage?source=handwriting&channels={n}&rate={rate}" if n else None
    if extra.get("session", {}).get("input") == "neural_frame":
        shape = next(iter(m.graphs.values())).inputs[0].shape
        n = shape[-1] if shape and isinstance(shape[-1], int) else None
        return f"sim://headstage?channels={n}&rate={rate}" if n else None
    return None


def _readme(target: Target, opts: PackageOptions, bundles: list[str], installed_mb: float,
            emulator: str | None, keys: list[str]) -> str:
    first = f"{opts.prefix}/bundles/{bundles[0]}"
    cache = "NUMBA_CACHE_DIR=/var/cache/closedloop CLOSEDLOOP_CACHE_DIR=/var/cache/closedloop"
    run_check = (f"{cache} {opts.prefix}/venv/bin/closedloop run {first} --device '{emulator}' --duration 2   "
                 "# against an emulator" if emulator else
                 f"{cache} {opts.prefix}/venv/bin/closedloop run {first} --device URL --duration 2   # your device, "
                 "or an emulator that streams what the bundle reads (closedloop device --list)")
    return f"""# closedloop for {target.name}

{target.description}. Built by `closedloop package --target {target.name}`{' --ort-only' if opts.ort_only else ''}.
Bundles: {', '.join(bundles)}. Installed size of the wheels: {installed_mb:.0f} MB{' (ONNX Runtime only, no Numba)' if opts.ort_only else ''}.

On the board (Python {target.python_version}; no network needed):

    sudo useradd --system --no-create-home --groups dialout {opts.user}   # once; the service runs as this user
    sudo ./install.sh                      # venv in {opts.prefix}/venv, bundles in {opts.prefix}/bundles, Numba cache warmed
    sudo -u {opts.user} env {cache} {opts.prefix}/venv/bin/closedloop doctor   # ready for a real-time session, as the service's user?
    {opts.prefix}/venv/bin/closedloop inspect {opts.prefix}/bundles/{bundles[0]}
    sudo -u {opts.user} env {run_check}
    sudo cp closedloop.service /etc/systemd/system/ && sudo systemctl daemon-reload
    sudo systemctl enable --now closedloop && journalctl -u closedloop -f

A newer package: `sudo systemctl stop closedloop`, `sudo ./install.sh` from the new package (a fresh venv;
what {opts.prefix} held is put back if anything fails), copy its `closedloop.service` again, `sudo systemctl
daemon-reload && sudo systemctl start closedloop`. To remove: `sudo systemctl disable --now closedloop`, then
delete /etc/systemd/system/closedloop.service, {opts.prefix} and /var/cache/closedloop.

The service: systemd starts it again 5 s after it fails (a device not there yet at boot, a crash), without limit,
but not after exit 1, a session a safety rule stopped (docs/cli.md): a person looks, then `sudo systemctl restart
closedloop`.

The cache variables point the commands at the kernels `install.sh` compiled (the service sets them too);
without them a session compiles its kernels afresh into the user's own cache first (about a minute on a board).
`install.sh` reads `CLOSEDLOOP_PREFIX`, `PYTHON` and `NUMBA_CACHE_DIR` from the environment; the unit
runs `{bundles[0]}` on `{opts.device}` with `--rt --cpu {opts.cpu} --priority {opts.priority}` and reads the
Numba cache from /var/cache/closedloop: edit it if you change these. `manifest.json` lists every wheel
with its sha256.

Integrity: `install.sh` first checks every file against `SHA256SUMS` and refuses a package that changed or holds a
file it does not list; check `SHA256SUMS` itself first (`sha256sum SHA256SUMS`) against the digest `closedloop
package` printed. A board whose install trusts keys ({opts.prefix}/trust) installs only a package signed by one of
them (`SHA256SUMS.sig`: `closedloop package --sign KEY`); this package is {"signed" if opts.sign_key else "not signed"}. pip installs
exactly the wheels of `requirements.lock`, each against its sha256, ignoring the board's pip settings, and a
re-install replaces what an earlier package installed.
{"Signatures: each bundle was verified against the trusted keys in trust/ (" + ", ".join(keys) + "), which "
 "install.sh copies to " + opts.prefix + "/trust; the service runs with --trust " + opts.prefix + "/trust, so a "
 "bundle that no trusted key signed is refused. Run other commands with the same --trust." if keys else
 "Signatures: none checked. This package was built without --trust: the service runs its bundles after "
 "their checksums, without a signature check. Package with --trust LAB.pub for a board that must run only "
 "signed bundles."}
"""


def package(bundles: list[str], out: str | Path, opts: PackageOptions, report=print) -> PackageResult:
    """Build the package folder ``out`` for ``opts.target``; raise ``PackageError`` saying what to change."""
    target = get_target(opts.target)
    if not bundles:
        raise PackageError("no bundle given: closedloop package BUNDLE... --target TARGET --out DIR")
    if opts.from_installed and target.foreign:
        raise PackageError(f"--from-installed rebuilds wheels from this machine's packages, which do not run on "
                           f"{target.name}: leave it out (pip fetches the target's wheels)")
    check_service_options(opts, target)
    if opts.sign_key is not None:
        from closedloop.runtime.signing import SigningError, read_private_key

        try:
            read_private_key(opts.sign_key)
        except SigningError as exc:
            raise PackageError(f"--sign: {exc}") from None
    if opts.trust:  # each key must read as a public key before any bundle is checked against them
        from closedloop.runtime.signing import SigningError, as_trusted_keys

        try:
            as_trusted_keys(opts.trust)
        except (SigningError, OSError, ValueError) as exc:
            raise PackageError(f"--trust: {exc}") from None
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not opts.overwrite:
        raise PackageError(f"{out} exists and is not empty: give a new --out folder, or --overwrite")
    # built in a temporary sibling and renamed into place: a refused bundle or a failed download leaves nothing
    with atomic_directory(out, overwrite=out.exists()) as work:
        result = _build(work, bundles, target, opts, report)
    result.out = out
    report(f"wrote {out}: {result.wheelhouse_bytes / 1e6:.0f} MB of wheels, {result.installed_bytes / 1e6:.0f} MB "
           f"installed; on the board: ./install.sh (README.md)")
    return result


def _build(work: Path, bundles: list[str], target: Target, opts: PackageOptions, report) -> PackageResult:
    names = _copy_bundles(bundles, work / "bundles", opts.ort_only, opts.trust, opts.inputs)
    keys = _copy_keys(opts.trust, work / "trust")
    report(f"bundles: {', '.join(names)} (" + (f"verified: checksums, and each signed by one of the {len(keys)} "
                                               "trusted keys"
                                               if keys else "checksums verified; signatures not checked: no --trust, "
                                               "so the service will not check them either") + ")")
    house = work / "wheelhouse"
    house.mkdir()
    own = build_project_wheel(house)
    reqs = wheel_requirements(own, opts.extras, opts.ort_only)
    (work / "constraints.txt").write_text(target.constraints_text())
    if opts.from_installed:
        for dist in installed_closure(reqs):
            repack(dist, house)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            dl = Path(tmp)
            pip_download(reqs, target, work / "constraints.txt", dl, opts.find_links, opts.no_index)
            for w in dl.glob("*.whl"):
                shutil.move(str(w), house / w.name)
    wheels = sorted(house.glob("*.whl"))
    check_tags(wheels, target)
    report(f"wheelhouse: {len(wheels)} wheels for {target.name}")
    if target.foreign is False:  # the host's constraints: exactly the wheels packaged
        from packaging.utils import parse_wheel_filename

        pins = sorted(f"{n}=={v}" for n, v, _b, _t in map(lambda w: parse_wheel_filename(w.name), wheels)
                      if n != "closedloop")
        (work / "constraints.txt").write_text(f"# host ({target.description}): the wheels in wheelhouse/\n"
                                             + "\n".join(pins) + "\n")
    spec = "closedloop" + (f"[{','.join(opts.extras)}]" if opts.extras else "")
    (work / "requirements.lock").write_text(_lock(wheels))
    sh = work / "install.sh"
    sh.write_text(_install_sh(target, opts, names, bool(keys)))
    sh.chmod(0o755)
    (work / "closedloop.service").write_text(_unit(opts, names[0], bool(keys)))
    rows = [{"file": w.name, "sha256": _sha256(w), "bytes": w.stat().st_size, "installed_bytes": _unpacked_bytes(w)}
            for w in wheels]
    result = PackageResult(work, target.name, names, [w.name for w in wheels], sum(r["bytes"] for r in rows),
                           sum(r["installed_bytes"] for r in rows))
    (work / "README.md").write_text(_readme(target, opts, names, result.installed_bytes / 1e6,
                                            emulator_url(work / "bundles" / names[0]), keys))
    manifest = {
        "target": target.name, "description": target.description, "python_version": target.python_version,
        "machine": target.machine, "glibc": target.glibc, "platforms": list(target.platforms),
        "ort_only": opts.ort_only, "extras": opts.extras, "install": spec if not opts.ort_only else reqs,
        "bundles": names, "trusted_keys": keys, "wheels": rows,
        # which closedloop code the wheel holds: version, and for a checkout its commit and uncommitted changes
        "closedloop": source_provenance(),
        "footprint": {"wheelhouse_bytes": result.wheelhouse_bytes, "installed_bytes": result.installed_bytes},
    }
    (work / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    sums = _sha256sums(work)
    (work / "SHA256SUMS").write_text(sums)
    report(f"SHA256SUMS sha256 {hashlib.sha256(sums.encode()).hexdigest()}: check it on the board before install.sh")
    if opts.sign_key is not None:
        _sign_sums(work, opts.sign_key, keys, report)
    return result


def _sign_sums(work: Path, key_file: str, keys: list[str], report) -> None:
    """``SHA256SUMS.sig``: the raw 64-byte Ed25519 signature of SHA256SUMS's bytes (``openssl pkeyutl -verify
    -rawin`` checks it), for a board whose trusted keys hold the key's public half."""
    from closedloop.runtime.signing import key_id, read_private_key

    key = read_private_key(key_file)
    (work / "SHA256SUMS.sig").write_bytes(key.sign((work / "SHA256SUMS").read_bytes()))
    kid = key_id(_public_raw_of_key(key))
    shipped = [n for n in keys if key_id(_public_raw_of_file(work / "trust" / n)) == kid]
    report(f"SHA256SUMS signed with key {kid}" + (f" (trust/{shipped[0]}: a board this package installs takes "
                                                  "later packages signed with it)" if shipped else
                                                  "; its public key is not among --trust: a board this package "
                                                  "installs will refuse later packages signed with it"))


def _sha256sums(root: Path) -> str:
    """Every regular file under ``root`` (but SHA256SUMS) as ``sha256sum`` writes it: ``HEX  ./PATH`` lines."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != "SHA256SUMS")
    return "".join(f"{_sha256(p)}  ./{p.relative_to(root).as_posix()}\n" for p in files)
