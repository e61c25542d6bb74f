"""Finding a Chromium to open the monitor headless (tests, benchmarks, screenshots for the docs)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

#: Headless Chromium on a machine with no network and as root: no sandbox, no GPU, nothing phoned home.
CHROMIUM_FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]


def chromium_path() -> str | None:
    """``$CLOSEDLOOP_CHROMIUM``, Debian's ``/usr/bin/chromium``, or a chromium on PATH; None if there is none."""
    for candidate in (os.environ.get("CLOSEDLOOP_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser")):
        if candidate and Path(candidate).exists():
            return candidate
    return None
