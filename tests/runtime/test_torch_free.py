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
        from closedloop import runtime, firmware_bridge
        import closedloop.runtime.backends
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
        from closedloop.runtime import Model, LoopConfig, RealTimeLoop
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


# Everything outside the deployed footprint (numpy, numba, onnxruntime, pyserial): the training extras.
_TRAINING = ("torch", "onnx", "onnxscript", "pynwb", "hdmf", "matplotlib", "tqdm", "scipy", "cvxpy", "clarabel",
             "scs", "pybullet", "gymnasium", "stable_baselines3", "falcon_challenge")


def test_the_closedloop_command_runs_a_session_without_the_training_extras(gru_bundle, tmp_path):
    # `pip install .` on a board: the CLI must run, inspect and replay; training commands say what they need
    blocker = BLOCKER.replace('("torch", "onnx", "onnxscript")', repr(_TRAINING)).replace(
        'raise ImportError(f"blocked for this test: {name}")',
        'raise ModuleNotFoundError(f"blocked for this test: {name}", name=name.split(".")[0])')
    rec = tmp_path / "s.clrec"
    code = blocker + textwrap.dedent(
        f"""
        from closedloop.sdk.cli import main
        argv = {{"inspect": ["inspect", {str(gru_bundle)!r}],
                 "run": ["run", {str(gru_bundle)!r}, "--device", "sim://headstage?channels=12", "--duration", "1",
                         "--record", {str(rec)!r}, "--quiet", "--backend", "numba"],
                 "replay": ["replay", {str(rec)!r}, "--bundle", {str(gru_bundle)!r}, "--tolerance", "1e-4"],
                 "train": ["bci-train", "data", "--out", {str(tmp_path / "m")!r}, "--tiny"],
                 "rl": ["rl-train", "--task", "push"]}}[sys.argv[1]]
        code = main(argv)
        assert not any(m.split(".")[0] in {_TRAINING!r} for m in sys.modules), sorted(sys.modules)
        sys.exit(code)
        """
    )

    def cli(what: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code, what], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)

    for what in ("inspect", "run", "replay"):
        r = cli(what)
        assert r.returncode == 0, (what, r.stderr[-2000:])
    assert "re-ran" in r.stdout
    for what, name in (("train", "bci-train"), ("rl", "rl-train")):
        r = cli(what)
        assert r.returncode == 2 and f"closedloop {name}" in r.stderr and "needs torch, which is not installed" in r.stderr
