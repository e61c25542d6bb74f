"""What a bundle records about how it was made.

``export_provenance`` gathers the facts a person needs to reproduce an export or
explain a difference: closedloop's version and git commit, the versions of torch,
onnx, onnxruntime and numpy, Python and the platform, and the UTC time. They go
under ``provenance["export"]``; the caller's own record (training config, data
set, seeds) sits beside it, at the top level of ``provenance``.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ExportError

_REPO = Path(__file__).resolve().parent.parent


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _module_version(name: str) -> str | None:
    try:
        return str(__import__(name).__version__)
    except (ImportError, AttributeError):
        return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(_REPO), *args], capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def export_provenance(settings: dict[str, Any] | None = None,
                      exporter: str = "torch.onnx.export(dynamo=False)") -> dict[str, Any]:
    """Versions, platform, git commit and time of this export (plus the export ``settings``); ``exporter`` says what
    wrote the graph."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain") if commit else None
    return {
        "closedloop": _dist_version("closedloop") or "unknown (not installed as a package)",
        "git_commit": commit,
        "git_dirty": bool(status) if status is not None else None,
        "torch": _dist_version("torch"),  # read, not imported: an imported ONNX file needs no torch
        "onnx": _module_version("onnx"),
        "onnxruntime": _module_version("onnxruntime"),
        "numpy": np.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "exported_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "exporter": exporter,
        "settings": settings or {},
    }


def jsonable(value: Any, where: str) -> Any:
    """``value`` with numpy arrays and scalars turned into lists and numbers; refuse what JSON cannot hold."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise ExportError(f"{where}: keys must be strings for JSON, got {bad[:3]}")
        return {k: jsonable(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, float) and value != value:
        raise ExportError(f"{where} is NaN, which JSON cannot hold; use None")
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ExportError(f"{where} = {value!r} cannot be written to JSON ({exc}); pass numbers, strings, lists or dicts") from exc
    return value
