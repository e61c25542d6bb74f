"""Screenshots of the browser monitor for docs/monitor.md: one live emulator session per family.

Builds three small bundles (a typing decoder with random weights on a 12-channel
headstage, a certified flexible-joint observer at 1 kHz, a push policy with random
weights against the PyBullet Panda), runs each with ``--monitor`` for a few seconds,
opens the page in headless Chromium and saves ``docs/img/monitor_{bci,observer,policy}.png``.

    python tools/monitor_screenshots.py [--out docs/img]
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


def bundles(root: Path) -> dict[str, tuple[Path, str]]:
    from closedloop.sdk.bci.deploy import export_bci_bundle
    from closedloop.sdk.models import GRUDecoder
    from closedloop.sdk.observer.neural import example_observer_bundle
    from closedloop.sdk.rl.deploy import export_policy
    from closedloop.sim.manipulation.env import PandaTaskEnv

    torch.manual_seed(3)
    dec = GRUDecoder(12, 16, 1, 32).eval()
    with torch.no_grad():  # random weights that type now and then on Poisson input
        dec.readout.weight.mul_(10)
    bci = export_bci_bundle(dec, root / "bci", n_channels=12, mean=np.full(12, 0.16), std=np.full(12, 0.4),
                            session_name="screenshot", variants=(), tensorrt=False, report=lambda s: None)
    obs_bundle = example_observer_bundle(root / "observer")
    torch.manual_seed(0)
    actor = torch.nn.Sequential(torch.nn.Linear(21, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3), torch.nn.Tanh())
    env = PandaTaskEnv("push")
    o = np.stack([env.reset(seed=s)[0] for s in range(20)])
    env.close()
    policy = export_policy(actor, o.mean(0), np.maximum(o.std(0), 0.01), "push", root / "policy")
    return {"bci": (Path(bci), "sim://headstage?channels=12&seed=3"),
            "observer": (Path(obs_bundle), "sim://plant?model=flexible-joint&rate=1000&seed=1"),
            "policy": (Path(policy), "sim://panda?task=push")}


def shoot(bundle: Path, device: str, out: Path, browser, seconds: float = 6.0) -> None:
    from closedloop.runtime import Session, SessionConfig

    s = Session(bundle, SessionConfig(device=device, duration_s=seconds + 3, status=False, monitor="0"))
    s.start()
    t = threading.Thread(target=s.run)
    t.start()
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(s.monitor_url)
    time.sleep(seconds)
    page.screenshot(path=str(out))
    page.close()
    t.join()
    s.close()
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "docs/img"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from playwright.sync_api import sync_playwright

    from closedloop.runtime.monitor.browser import CHROMIUM_FLAGS, chromium_path

    with tempfile.TemporaryDirectory() as tmp, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), headless=True, args=CHROMIUM_FLAGS)
        for name, (bundle, device) in bundles(Path(tmp)).items():
            shoot(bundle, device, out / f"monitor_{name}.png", browser)
        browser.close()


if __name__ == "__main__":
    main()
