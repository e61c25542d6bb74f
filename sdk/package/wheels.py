"""The wheelhouse of a package: the project's own wheel, and its runtime's wheels for the target.

Wheels come from pip (``pip download --only-binary=:all:`` with the target's platform tags, from
the index or from ``--find-links`` folders), or, for the host, from this interpreter's installed
distributions: each one is zipped back into a wheel from its RECORD (``--from-installed``, which
needs neither network nor a pip cache).
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

from .targets import PackageError, Target

# Without these the runtime runs bundles on ONNX Runtime only (--ort-only).
NUMBA_ONLY = ("numba", "llvmlite")
_SKIP_META = {"INSTALLER", "REQUESTED", "direct_url.json", "RECORD"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def project_root() -> Path | None:
    """The checkout closedloop runs from (pyproject.toml and setup.py beside the layer folders), if any."""
    import closedloop.sdk

    root = Path(closedloop.sdk.__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() and (root / "setup.py").is_file() else None


#: What of a checkout a wheel is built from (setup.py's packages and the files beside them); the rest (tests,
#: docs, bench, .venv, out/) stays behind, and the build's own build/ and *.egg-info are made in the copy
_SOURCE_IGNORE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "out",
                                        "tests", "bench", "docs", "examples", "tools", "*.pyc")


def build_project_wheel(out: Path) -> Path:
    """closedloop's own wheel (``pip wheel --no-deps``) from a copy of the checkout, or rebuilt from its installed
    files. The copy keeps the build's ``build/`` and ``*.egg-info`` out of the checkout."""
    root = project_root()
    if root is None:
        return repack(metadata.distribution("closedloop"), out)
    with tempfile.TemporaryDirectory(prefix="closedloop-wheel-") as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(root, src, ignore=_SOURCE_IGNORE, symlinks=True)
        # the zip members' times from the commit, not the clock: the same checkout packs the same bytes
        env = dict(os.environ, SOURCE_DATE_EPOCH=str(_source_epoch(root)))
        r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                            "-w", str(out), str(src)], capture_output=True, text=True, timeout=600, env=env)
    if r.returncode != 0:
        raise PackageError(f"pip wheel of the closedloop checkout {root} failed:\n{r.stderr[-2000:]}")
    (wheel,) = sorted(out.glob("closedloop-*.whl"))
    return wheel


#: The time a wheel's zip members carry where nothing better is known: zip's earliest (1980-01-01).
_ZIP_EPOCH = 315532800


def _source_epoch(root: Path) -> int:
    """``SOURCE_DATE_EPOCH`` for a checkout's wheel: its HEAD commit's time (the zip's earliest where there is none)."""
    try:
        r = subprocess.run(["git", "-C", str(root), "log", "-1", "--format=%ct"], capture_output=True, text=True,
                           timeout=30)
        return max(int(r.stdout.strip()), _ZIP_EPOCH) if r.returncode == 0 else _ZIP_EPOCH
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return _ZIP_EPOCH


def source_provenance() -> dict[str, object]:
    """Where the packaged closedloop comes from: its version and, for a git checkout, the commit and whether the
    tree had uncommitted changes (``dirty``), so a board can tell which code it runs."""
    out: dict[str, object] = {"version": metadata.version("closedloop")}
    root = project_root()
    if root is None or not (root / ".git").exists():
        return out | {"source": "installed"}

    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    commit, status = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    return out | {"source": "checkout", "git_commit": commit, "dirty": bool(status) if status is not None else None}


def wheel_requirements(wheel: Path, extras: list[str], ort_only: bool) -> list[str]:
    """The project wheel's Requires-Dist for the chosen extras (less Numba with ``ort_only``)."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    known = {canonical(line.split(":", 1)[1].strip()) for line in text.splitlines()
             if line.startswith("Provides-Extra:")}
    unknown = [e for e in extras if canonical(e) not in known]
    if unknown:
        raise PackageError(f"unknown extra(s) {', '.join(unknown)}: closedloop's extras are {', '.join(sorted(known))}")
    reqs = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        wanted = req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ["", *extras])
        if wanted and not (ort_only and canonical(req.name) in NUMBA_ONLY):
            req.marker = None
            reqs.append(str(req))
    return reqs


def pip_download(reqs: list[str], target: Target, constraints: Path, out: Path,
                 find_links: list[str], no_index: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--quiet", "-d", str(out),
           "-c", str(constraints), *target.pip_args()]
    cmd += [a for f in find_links for a in ("--find-links", f)] + (["--no-index"] if no_index else [])
    r = subprocess.run(cmd + reqs, capture_output=True, text=True, timeout=1800)
    if r.returncode == 0:
        return
    missing = re.findall(r"No matching distribution found for ([^\s]+)", r.stderr)
    unreachable = re.search(r"(Could not fetch URL|Failed to establish a new connection|Temporary failure in name "
                            r"resolution|Network is unreachable|ProxyError|Max retries exceeded)", r.stderr)
    if unreachable or (no_index and not find_links):
        raise PackageError(f"pip could not reach a package index for target {target.name}"
                           + (f" ({unreachable.group(1)})" if unreachable else " (--no-index and no --find-links)")
                           + ": on a machine without one, give --find-links FOLDER (a folder of the target's wheels, "
                           "docs/jetson.md) with --no-index, or --target host --from-installed for this machine"
                           + f"\n{r.stderr[-1000:]}")
    if missing:
        tag = f"{target.abi}-{target.platforms[0]}" if target.foreign else "this interpreter's tags"
        raise PackageError(f"{missing[0]} has no wheel for target {target.name} ({tag} or an older compatible "
                           f"tag) under the target's pins (the package's constraints.txt): choose a version with such a wheel in "
                           f"the target's constraints, or leave out the extra that needs it"
                           + ("; offline (--no-index), give --find-links a folder that holds it" if no_index else ""))
    conflict = re.search(r"Cannot install (.+?) because", r.stderr)
    if conflict and no_index:  # offline, a wheel missing from the folders reads as a conflict to pip's resolver
        tag = f"{target.abi}-{target.platforms[0]}" if target.foreign else "this interpreter's tags"
        raise PackageError(f"pip found no set of wheels for target {target.name} ({tag}) in {', '.join(find_links)} "
                           f"that installs {conflict.group(1)}: a wheel of one of them (or of what it needs) for "
                           "that tag is missing from the folder, or the folder's version is outside the target's "
                           f"pins (the package's constraints.txt)\npip said:\n{r.stderr[-1000:]}")
    raise PackageError(f"pip download for target {target.name} failed:\n{r.stderr[-2000:]}")


def check_tags(wheels: list[Path], target: Target) -> None:
    """Refuse a wheel none of whose tags installs on the target, naming the package and its tag."""
    from packaging.utils import parse_wheel_filename

    ok = target.supported_tags()
    for w in wheels:
        name, version, _build, tags = parse_wheel_filename(w.name)
        if not {str(t) for t in tags} & ok:
            wanted = f"{target.abi}, {target.platforms[0]} or older" if target.foreign else "this interpreter"
            raise PackageError(f"{name} {version} has no build for target {target.name}: its wheel {w.name} is "
                               f"tagged {'.'.join(sorted(str(t) for t in tags))}, and the target needs {wanted}")


def installed_closure(reqs: list[str]) -> list[metadata.Distribution]:
    """The installed distributions ``reqs`` need here, with their own dependencies (markers evaluated)."""
    from packaging.requirements import Requirement

    seen: dict[str, metadata.Distribution] = {}
    todo = [(Requirement(r), ()) for r in reqs]
    while todo:
        req, extras = todo.pop()
        key = canonical(req.name)
        if key in seen:
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            raise PackageError(f"{req.name} is not installed here, so --from-installed cannot rebuild its wheel: "
                               f"install it, or package without --from-installed (pip fetches it)") from None
        seen[key] = dist
        for line in dist.requires or []:
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in ["", *req.extras]):
                todo.append((sub, tuple(sub.extras)))
    return list(seen.values())


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def repack(dist: metadata.Distribution, out: Path) -> Path:
    """Zip an installed distribution back into a wheel from its RECORD (stored, not compressed: fast)."""
    files = dist.files or []
    info = next((f for f in files if f.parts[0].endswith(".dist-info") and f.name == "WHEEL"), None)
    if info is None:
        raise PackageError(f"{dist.metadata['Name']} {dist.version} was not installed from a wheel (no RECORD/WHEEL),"
                           f" so it cannot be rebuilt: package without --from-installed")
    wheel_meta = Path(str(dist.locate_file(info))).read_text()
    tags = [line.split(":", 1)[1].strip() for line in wheel_meta.splitlines() if line.startswith("Tag:")]
    parts = [sorted({t.split("-")[i] for t in tags}) for i in range(3)]
    name = re.sub(r"[-_.]+", "_", dist.metadata["Name"])
    path = out / f"{name}-{dist.version}-{'-'.join('.'.join(p) for p in parts)}.whl"
    dist_info = info.parts[0]
    record = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for f in files:
            rel = f.as_posix()
            if rel.startswith("..") or "__pycache__" in f.parts or (f.parts[0] == dist_info and f.name in _SKIP_META):
                continue  # scripts outside site-packages (pip writes them again), byte code, install records
            src = Path(str(dist.locate_file(f)))
            if not src.is_file():
                continue
            data = src.read_bytes()
            z.writestr(zipfile.ZipInfo(rel, date_time=(1980, 1, 1, 0, 0, 0)), data)  # no clock: the same bytes again
            record.append(f"{rel},{_record_hash(data)},{len(data)}")
        record.append(f"{dist_info}/RECORD,,")
        z.writestr(zipfile.ZipInfo(f"{dist_info}/RECORD", date_time=(1980, 1, 1, 0, 0, 0)), "\n".join(record) + "\n")
    return path
