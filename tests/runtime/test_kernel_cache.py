"""Numba's disk cache of the kernels follows every kernel module, not only the file a function is in.

Numba keys a cached function on its own file's text, and ``kernels.run_plan`` compiles in the kernels of
four other modules: without a digest of all of them in each, an edit to ``kernels_dense.py`` alone left the
old ``run_plan`` running from the cache (tools/kernel_digest.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_kernel_module_carries_the_digest_of_all_of_them():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "kernel_digest.py")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_check_names_a_stale_module(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import kernel_digest
    finally:
        sys.path.remove(str(ROOT / "tools"))
    for p in kernel_digest.kernel_files():
        (tmp_path / p.name).write_text(p.read_text())
    monkeypatch.setattr(kernel_digest, "RUNTIME", tmp_path)
    assert kernel_digest.stale() == []
    (tmp_path / "kernels_dense.py").write_text((tmp_path / "kernels_dense.py").read_text() + "# an edit\n")
    assert kernel_digest.stale() == sorted(p.name for p in tmp_path.glob("kernels*.py"))
