"""The runtime installs offline and runs a bundle on aarch64, emulated by qemu-user (tools/aarch64_smoke.sh).

It needs an arm64 root filesystem that takes ~12 minutes to create (cached under
~/.cache/closedloop/aarch64-rootfs, or $CLOSEDLOOP_AARCH64_CACHE), and one emulated session on the
shared 2-core VM did not finish within minutes (docs/jetson.md), so it runs only when
CLOSEDLOOP_AARCH64_SMOKE=1 asks for it (creating the root filesystem if missing; offline when cached).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "aarch64_smoke.sh"
CACHE = Path(os.environ.get("CLOSEDLOOP_AARCH64_CACHE", Path.home() / ".cache/closedloop/aarch64-rootfs"))


def _skip_reason() -> str | None:
    if os.environ.get("CLOSEDLOOP_AARCH64_SMOKE") != "1":
        cached = (CACHE / "bookworm-arm64" / ".complete").exists()
        return ("emulated aarch64 smoke test runs only with CLOSEDLOOP_AARCH64_SMOKE=1 (minutes under qemu; "
                + (f"root filesystem cached at {CACHE})" if cached else "creates the root filesystem, ~12 min)"))
    if os.geteuid() != 0:
        return "the smoke test chroots into the arm64 root filesystem, which needs root"
    if os.uname().machine != "aarch64" and shutil.which("qemu-aarch64-static") is None:
        return "no qemu-aarch64-static (apt-get install qemu-user-static binfmt-support)"
    return None


_REASON = _skip_reason()


@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
@pytest.mark.timeout(1800)
def test_runtime_installs_and_runs_a_bundle_on_emulated_aarch64(mlp_bundle):
    offline = ["--offline"] if (CACHE / "bookworm-arm64" / ".complete").exists() else []
    proc = subprocess.run(["bash", str(SCRIPT), "--bundle", str(mlp_bundle), "--backend", "onnxruntime",
                           *offline], capture_output=True, text=True, timeout=1700)
    out = proc.stdout + proc.stderr
    if proc.returncode == 3:
        pytest.skip(f"this machine cannot run the emulated smoke test: {out.strip().splitlines()[-1]}")
    assert proc.returncode == 0, out
    assert re.search(r"^PASS rootfs python3 runs as aarch64$", out, re.M), out
    assert re.search(r"^PASS .*(offline install|reinstalled offline)", out, re.M), out
    assert re.search(r"^PASS closedloop inspect mlp \(no problems\)$", out, re.M), out
    run = re.search(r"^PASS closedloop run mlp .*--backend onnxruntime: steps=(\d+) stopped_by=duration "
                    r"backend=onnxruntime", out, re.M)
    assert run and int(run.group(1)) > 0, out
    assert "FAIL" not in out, out
