"""The installed package, as `pip install .` leaves it in a fresh virtualenv.

The wheel maps the five layer folders into one ``closedloop`` namespace: no bare ``runtime``
or ``sim`` lands in site-packages. The deployed footprint (no torch, onnx, scipy, pybullet or
cvxpy) must import, answer ``closedloop --help``, and open an emulator through ``sim://``.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAINING_ONLY = ("torch", "onnx", "onnxscript", "scipy", "pybullet", "cvxpy", "pynwb", "matplotlib",
                 "stable_baselines3", "gymnasium")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                        "-w", str(out), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (path,) = out.glob("closedloop-*.whl")
    return path


@pytest.fixture(scope="module")
def fresh_venv(wheel, tmp_path_factory) -> Path:
    """A new virtualenv with the wheel installed; the runtime's dependencies come from this
    interpreter's site-packages, and every training-only package is made to fail on import."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    r = subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # numpy, numba, onnxruntime, pyserial from here; a .pth line adds the folder without running its own .pth
    # files, so the editable install of the checkout stays out of the fresh venv
    (site / "zz_runtime_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    (site / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import sys
        class _Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {TRAINING_ONLY!r}:
                    raise ImportError(f"not installed on this board: {{name}}")
                return None
        sys.meta_path.insert(0, _Block())
        """))
    return venv


def _run(venv: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*args], capture_output=True, text=True, timeout=120, cwd="/",
                          env={"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(venv)})


def test_the_wheel_holds_one_namespace(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"closedloop"}, tops
    for path in ("closedloop/runtime/__init__.py", "closedloop/firmware_bridge/c/closedloop_proto.c",
                 "closedloop/firmware_bridge/c/closedloop_proto.h", "closedloop/runtime/py.typed",
                 "closedloop/firmware_bridge/py.typed", "closedloop/common/config.py",
                 "closedloop/runtime/families/bci/ctc.py", "closedloop/sdk/cli.py"):
        assert path in names, path
    assert any(n.startswith("closedloop/firmware_bridge/testvectors/") and n.endswith(".json") for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[closedloop.transports]" in text and "sim = closedloop.sim.transport:open_sim" in text


def test_installed_layers_import_by_the_namespace_only(fresh_venv):
    py = str(fresh_venv / "bin" / "python")
    ok = _run(fresh_venv, py, "-c", "import closedloop.runtime, closedloop.firmware_bridge, closedloop; "
                                    "print(closedloop.runtime.__file__); print(closedloop.Model.__name__)")
    assert ok.returncode == 0, ok.stderr
    assert str(fresh_venv) in ok.stdout and ok.stdout.split()[-1] == "Model"
    for bare in ("runtime", "sim", "export", "sdk", "firmware_bridge"):
        r = _run(fresh_venv, py, "-c", f"import {bare}")
        assert r.returncode != 0 and "No module named" in r.stderr, (bare, r.stderr)
    blocked = _run(fresh_venv, py, "-c", "import torch")
    assert blocked.returncode != 0 and "not installed on this board" in blocked.stderr


def test_the_command_answers_help_without_the_training_extras(fresh_venv):
    r = _run(fresh_venv, str(fresh_venv / "bin" / "closedloop"), "--help")
    assert r.returncode == 0, r.stderr
    assert "run" in r.stdout and "inspect" in r.stdout


def test_an_emulator_opens_by_url_from_the_installed_package(fresh_venv):
    code = ("from closedloop.firmware_bridge import open_transport; "
            "t = open_transport('sim://headstage?channels=2'); print(type(t).__name__); t.close()")
    r = _run(fresh_venv, str(fresh_venv / "bin" / "python"), "-c", code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "SimTransport"
