"""A real browser for the monitor's tests: Debian's Chromium driven by playwright (skipped, with the reason, without)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from closedloop.runtime.monitor.browser import CHROMIUM_FLAGS, chromium_path


@pytest.fixture(scope="session")
def browser():
    pytest.importorskip("aiohttp", reason="the monitor needs the [monitor] extra (aiohttp)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="browser tests need playwright (the [monitor] test set)")
    exe = chromium_path()
    if exe is None:
        pytest.skip("no Chromium: `make test` installs Debian's chromium where it can (root and apt); "
                    "or set CLOSEDLOOP_CHROMIUM")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=exe, headless=True, args=CHROMIUM_FLAGS)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    p = ctx.new_page()
    yield p
    ctx.close()


@pytest.fixture(scope="session")
def screenshot_dir(tmp_path_factory) -> Path:
    """Where the tests' screenshots go (CLOSEDLOOP_SCREENSHOTS keeps them, e.g. for docs/img)."""
    keep = os.environ.get("CLOSEDLOOP_SCREENSHOTS")
    d = Path(keep) if keep else tmp_path_factory.mktemp("screenshots")
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture
def recording_page(page):
    """``with recording_page(REC, READY_JS):`` serves REC with ``closedloop monitor REC --port 0`` in a child process,
    opens it in ``page`` and waits until READY_JS is true; the server stops after the block."""

    @contextlib.contextmanager
    def open_recording(rec, ready_js: str):
        p = subprocess.Popen([sys.executable, "-m", "closedloop.sdk.cli", "monitor", str(rec), "--port", "0"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            page.goto(p.stdout.readline().split()[1])
            page.wait_for_function(ready_js, timeout=30_000)
            yield page
        finally:
            p.terminate()
            p.communicate(timeout=10)

    return open_recording
