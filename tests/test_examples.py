"""The examples a new user runs first, run as they would run them: each ends cleanly and checks its own result
(every example asserts its parity with torch or reads its summary), from a fresh output folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("script", "says"), [
    ("export_and_stream_decoder.py", "streamed vs offline (torch, whole sequence): max abs error"),
    ("run_policy_in_loop.py", "missed deadlines"),
    ("bring_your_own_model.py", "4. imported ONNX file on numba"),
    ("observer_own_plant.py", "estimated disturbance at the end"),
])
def test_an_example_runs_as_its_docstring_says(script, says, tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "examples" / script), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert says in done.stdout, done.stdout[-2000:]
