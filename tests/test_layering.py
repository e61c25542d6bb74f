"""Layering (docs: DESIGN.md): each layer imports only what is below it, checked on every module's imports.

    common          -> stdlib, numpy
    firmware_bridge -> common, numpy, pyserial
    runtime         -> firmware_bridge, common, numpy, numba, onnxruntime, cryptography, (tensorrt, cuda)
    sim             -> firmware_bridge, common, numpy, pybullet, gymnasium
    export          -> runtime, firmware_bridge, common, torch, onnx, onnxruntime, (tensorrt)
    sdk             -> everything

Imports are read from the source (ast), relative ones resolved, so an import inside a
function or behind ``TYPE_CHECKING`` counts too. A bare layer name (``import runtime``)
is never allowed: installed, the layers exist only as ``closedloop.<layer>``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import closedloop

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"common": ROOT / "closedloop" / "common", "firmware_bridge": ROOT / "firmware_bridge",
           "runtime": ROOT / "runtime", "sim": ROOT / "sim", "export": ROOT / "export", "sdk": ROOT / "sdk"}
THIRD_PARTY = {
    "common": {"numpy"},
    "firmware_bridge": {"numpy", "serial"},
    "runtime": {"numpy", "numba", "onnxruntime", "cryptography", "tensorrt", "cuda", "llvmlite"},
    "sim": {"numpy", "pybullet", "pybullet_data", "gymnasium"},
    "export": {"numpy", "torch", "onnx", "onnxruntime", "tensorrt"},
    "sdk": None,  # the user-facing layer may import anything
}
LAYERS_BELOW = {
    "common": set(),
    "firmware_bridge": {"common"},
    "runtime": {"firmware_bridge", "common"},
    "sim": {"firmware_bridge", "common"},
    "export": {"runtime", "firmware_bridge", "common"},
    "sdk": {"export", "runtime", "sim", "firmware_bridge", "common"},
}
BARE_LAYER_NAMES = {"sdk", "runtime", "firmware_bridge", "export", "sim"}
# An optional package (an extra) that one module alone may import, inside a function, with an error that
# names the extra when it is missing.
OPTIONAL_IMPORTS = {
    "closedloop.firmware_bridge.transports.lsl": {"pylsl"},  # lsl:// and --lsl-out: pip install 'closedloop[lsl]'
    # the browser monitor's web server, imported only where it serves: pip install 'closedloop[monitor]'
    "closedloop.runtime.monitor.server": {"aiohttp"},
    "closedloop.runtime.monitor.recording_server": {"aiohttp"},
}


def module_name(layer: str, path: Path) -> str:
    rel = path.relative_to(FOLDERS[layer]).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(["closedloop", layer, *parts])


def imported_names(source: str, module: str, is_package: bool) -> list[str]:
    """Absolute names of everything ``source`` imports (relative imports resolved against ``module``)."""
    package = module if is_package else module.rsplit(".", 1)[0]
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names.append(target)
            if target == "closedloop":  # from closedloop import runtime
                names += [f"closedloop.{a.name}" for a in node.names]
    return names


def violations(layer: str, module: str, source: str, is_package: bool = False) -> list[str]:
    """What ``module`` of ``layer`` imports that the layering forbids, one line each."""
    stdlib = set(sys.stdlib_module_names)
    bad = []
    for name in imported_names(source, module, is_package):
        parts = name.split(".")
        top = parts[0]
        if top in BARE_LAYER_NAMES:
            bad.append(f"{module} imports {name}: a bare layer name; use closedloop.{name}")
        elif top == "closedloop":
            if len(parts) == 1:
                continue  # the namespace itself (its public names load lazily)
            other = parts[1]
            if other != layer and other not in LAYERS_BELOW[layer]:
                bad.append(f"{module} imports {name}: {layer} may import only "
                           f"{sorted(LAYERS_BELOW[layer]) or 'no other layer'}")
        elif top in OPTIONAL_IMPORTS.get(module, ()):
            continue
        elif top not in stdlib and THIRD_PARTY[layer] is not None and top not in THIRD_PARTY[layer]:
            bad.append(f"{module} imports {name}: not among {layer}'s dependencies {sorted(THIRD_PARTY[layer])}")
    return bad


def _modules():
    for layer, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            yield layer, path


@pytest.mark.parametrize("layer", list(FOLDERS))
def test_every_module_keeps_the_layering(layer):
    found = []
    for lay, path in _modules():
        if lay == layer:
            found += violations(layer, module_name(layer, path), path.read_text(), path.name == "__init__.py")
    assert not found, "\n".join(found)


@pytest.mark.parametrize(("layer", "line", "why"), [
    ("runtime", "from closedloop.sdk.bci import train_harness", "runtime may import only"),
    ("runtime", "import torch", "not among runtime's dependencies"),
    ("firmware_bridge", "from closedloop.runtime import Model", "firmware_bridge may import only"),
    ("sim", "from closedloop.export import export_bundle", "sim may import only"),
    ("sim", "from ...runtime.session import Session", "sim may import only"),
    ("export", "from closedloop import sdk", "export may import only"),
    ("common", "from closedloop.firmware_bridge import Frame", "common may import only"),
    ("sdk", "import runtime", "a bare layer name"),
])
def test_a_forbidden_import_is_caught(layer, line, why):
    """The checker above is not vacuous: the same import added to a module of that layer is reported."""
    module = f"closedloop.{layer}.somewhere.mod"
    assert violations(layer, module, "import numpy\n") == []
    bad = violations(layer, module, f"import numpy\n{line}\n")
    assert len(bad) == 1 and why in bad[0], bad


def test_the_layers_are_the_installed_namespace():
    import closedloop.firmware_bridge
    import closedloop.runtime

    assert Path(closedloop.runtime.__file__).parent == FOLDERS["runtime"]
    assert Path(closedloop.firmware_bridge.__file__).parent == FOLDERS["firmware_bridge"]


def test_importing_the_bridge_pulls_in_no_heavy_or_upper_layer():
    code = ("import sys, closedloop.firmware_bridge; "
            "bad = [m for m in ('torch', 'onnx', 'onnxruntime', 'numba', 'closedloop.sdk', 'closedloop.runtime', "
            "'closedloop.sim', 'closedloop.export', 'matplotlib', 'hypothesis') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "[]"


def test_importing_closedloop_pulls_in_no_layer_until_a_name_is_used():
    code = ("import sys, closedloop; assert not [m for m in sys.modules if m.startswith('closedloop.') "
            "and not m.startswith('closedloop.common')], sorted(sys.modules); "
            "closedloop.Model; assert 'torch' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("package", ["closedloop", "closedloop.firmware_bridge", "closedloop.runtime",
                                     "closedloop.sim", "closedloop.export", "closedloop.sdk.bci",
                                     "closedloop.sdk.observer", "closedloop.sdk.rl", "closedloop.sdk.robust"])
def test_every_public_name_is_exported(package):
    import importlib

    mod = importlib.import_module(package)
    assert mod.__all__, f"{package} has an empty __all__"
    missing = [name for name in mod.__all__ if not hasattr(mod, name)]
    assert not missing, f"{package}.__all__ names what it does not export: {missing}"
    assert closedloop.__version__
