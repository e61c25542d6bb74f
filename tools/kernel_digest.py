"""Keep Numba's disk cache of the runtime's kernels honest: write the kernels' source digest into each kernel module.

Numba keys a cached function on the SHA-256 of the file that defines it, not of the files whose functions it
compiles in: ``kernels.run_plan`` holds the machine code of every kernel in ``kernels_dense``, ``kernels_conv``,
``kernels_nd`` and ``kernels_act``, so an edit to one of those alone leaves the old code running from the cache
(a changed plan row layout then reads the wrong arguments). Each kernel module carries
``KERNEL_SOURCES = "<digest of all of them>"``, so any edit changes every module's text and every cache entry.

    python tools/kernel_digest.py          # check (exit 1 naming the stale modules)
    python tools/kernel_digest.py --write  # update the digest line in every kernel module

``tests/runtime/test_kernel_cache.py`` runs the check.
"""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

RUNTIME = Path(__file__).resolve().parent.parent / "runtime"
LINE = re.compile(r'^KERNEL_SOURCES = "[0-9a-f]*"(.*)$', re.M)


def kernel_files() -> list[Path]:
    return sorted(RUNTIME.glob("kernels*.py"))


def digest() -> str:
    """SHA-256 over every kernel module with its digest line blanked (so the digest can live in them)."""
    h = hashlib.sha256()
    for path in kernel_files():
        h.update(path.name.encode() + b"\0" + LINE.sub('KERNEL_SOURCES = ""', path.read_text()).encode())
    return h.hexdigest()[:16]


def stale() -> list[str]:
    want = f'KERNEL_SOURCES = "{digest()}"'
    return [p.name for p in kernel_files() if not any(m.group(0).startswith(want) for m in LINE.finditer(p.read_text()))]


def main(argv: list[str]) -> int:
    if "--write" in argv:
        d = digest()
        for path in kernel_files():
            text = path.read_text()
            if not LINE.search(text):
                raise SystemExit(f"{path.name} has no KERNEL_SOURCES line; add one after its imports")
            path.write_text(LINE.sub(lambda m: f'KERNEL_SOURCES = "{d}"{m.group(1)}', text))
        print(f"KERNEL_SOURCES = {d} in {', '.join(p.name for p in kernel_files())}")
        return 0
    bad = stale()
    if bad:
        print(f"stale KERNEL_SOURCES in {', '.join(bad)} (the kernels changed): run python tools/kernel_digest.py --write")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
