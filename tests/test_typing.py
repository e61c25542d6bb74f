"""The deployed layers type-check: mypy passes on closedloop.runtime and closedloop.firmware_bridge.

The options are pyproject.toml's ``[tool.mypy]``; ``tools/typecheck.py`` maps the layer folders
to their ``closedloop.*`` names for mypy (``make lint`` runs the same script).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                    reason="mypy is not installed (it comes with the dev extra: pip install -e '.[dev]')")
def test_mypy_passes_on_runtime_and_firmware_bridge() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "typecheck.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"mypy found problems (python tools/typecheck.py):\n{proc.stdout}{proc.stderr}"
