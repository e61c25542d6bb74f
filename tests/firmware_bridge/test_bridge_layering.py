"""Layering: firmware_bridge imports only the standard library, numpy and pyserial."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from closedloop import firmware_bridge

PACKAGE = Path(firmware_bridge.__file__).parent
ALLOWED = {"numpy", "serial", "firmware_bridge"}


def test_no_module_imports_outside_the_allowed_set() -> None:
    stdlib = set(sys.stdlib_module_names)
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top in stdlib or top in ALLOWED, f"{path.relative_to(PACKAGE)} imports {name}"


def test_importing_the_package_pulls_in_no_heavy_or_upper_layer() -> None:
    code = ("import sys, firmware_bridge; "
            "bad = [m for m in ('torch', 'onnx', 'onnxruntime', 'numba', 'sdk', 'runtime', 'sim', 'export', "
            "'matplotlib', 'hypothesis') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent)
    assert out.stdout.strip() == "[]"


def test_every_public_name_is_exported() -> None:
    for name in firmware_bridge.__all__:
        assert hasattr(firmware_bridge, name), name
