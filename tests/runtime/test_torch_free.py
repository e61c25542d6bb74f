"""The deployed footprint: runtime and firmware_bridge import and run with torch absent."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A meta-path finder that makes any import of torch (or onnx, a training-only
# dependency) fail, as on a board where they are not installed.
BLOCKER = textwrap.dedent(
    """
    import sys
    class _Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "onnx", "onnxscript"):
                raise ImportError(f"blocked for this test: {name}")
            return None
    sys.meta_path.insert(0, _Block())
    """
)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCKER + textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_blocker_really_blocks_torch():
    r = _run("import torch")
    assert r.returncode != 0 and "blocked for this test" in r.stderr


def test_runtime_and_bridge_import_without_torch():
    r = _run(
        """
        import runtime, firmware_bridge
        import runtime.backends
        assert "torch" not in sys.modules and "onnx" not in sys.modules
        print(sorted(runtime.backend_report()))
        """
    )
    assert r.returncode == 0, r.stderr
    assert "onnxruntime" in r.stdout


def test_runtime_runs_a_bundle_without_torch(gru_bundle):
    r = _run(
        f"""
        import numpy as np
        from runtime import Model, LoopConfig, RealTimeLoop
        m = Model({str(gru_bundle)!r}, backend="onnxruntime")
        x = np.ones(m.spec.data_inputs[0].concrete_shape(1), np.float32)
        s = RealTimeLoop(LoopConfig(rate_hz=200, max_steps=20)).run(lambda k: m.step(x))
        assert s.steps == 20
        assert "torch" not in sys.modules
        print("ok")
        """
    )
    assert r.returncode == 0, r.stderr
    assert "ok" in r.stdout
