"""JSON for scripts: what ``--json`` prints, parseable by any strict JSON reader.

Python's ``json`` writes ``NaN`` and ``Infinity`` for non-finite floats, which are not JSON and which
strict parsers (``jq``, JavaScript's ``JSON.parse``, Go, Rust) refuse. A value that is not a finite
number here (a latency of a session that ran no step, a difference where nothing was compared) is
written as ``null``.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """``value`` with every non-finite float (``nan``, ``inf``, numpy's too) replaced by None, recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    if hasattr(value, "dtype") and hasattr(value, "tolist"):  # numpy scalars and arrays
        return finite(value.tolist())
    return value


def json_text(value: Any, indent: int | None = 2) -> str:
    """Strict JSON of ``value``: non-finite numbers as null, anything else JSON lacks as its ``str``."""
    return json.dumps(finite(value), indent=indent, default=str, allow_nan=False)  # numpy values: finite()


def write_json(path: Any, value: Any, indent: int | None = 1) -> Any:
    """Write ``value`` to ``path`` as strict JSON (non-finite numbers as null), atomically; return the path."""
    from .atomic import atomic_write_text

    return atomic_write_text(path, json_text(value, indent=indent) + "\n")


__all__ = ["finite", "json_text", "write_json"]
