"""``robust_demo``: a closed-loop session that survives bit flips in its weights, in a few seconds.

A small streaming decoder is put in the protected form (keyed blocks of 16), exported,
and run at 50 Hz against the headstage emulator on the Numba backend. While the loop
runs, a background thread flips random exponent bits in the very memory the kernels
compute with; the scrubber, running in the loop's idle time under a 200 us budget,
finds and repairs each one. The same is then done without scrubbing, for contrast.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from closedloop.common.jsonout import write_json


class FlipInjector(threading.Thread):
    """Flip ``count`` random bits (from ``bits``) of a scrub target's buffer, one every ``every_s``."""

    def __init__(self, target, count: int, every_s: float, bits=(30,), seed: int = 0, delay_s: float = 0.3):
        super().__init__(daemon=True)
        self.target, self.count, self.every_s, self.bits, self.delay_s = target, count, every_s, bits, delay_s
        self.rng = np.random.default_rng(seed)
        self.done: list[tuple[int, int]] = []

    def run(self) -> None:
        time.sleep(self.delay_s)
        pos = self.target.pos[self.target.pos >= 0]
        words = self.target.words
        for _ in range(self.count):
            p = int(self.rng.choice(pos))
            bit = int(self.rng.choice(self.bits))
            words[p] ^= words.dtype.type(1) << words.dtype.type(bit)
            self.done.append((p, bit))
            time.sleep(self.every_s)


def make_protected_decoder(out: str | Path, key: bytes | None, n_channels: int = 12, seed: int = 0,
                           report=lambda s: None) -> Path:
    """A small GRU decoder in protected form, exported with ``protect_bundle`` (session: headstage frames in)."""
    import torch

    from closedloop.export import export_bundle
    from closedloop.sdk.models import GRUDecoder

    from .bundle import protect_bundle
    from .protection import finalize, protect

    torch.manual_seed(seed)
    model = GRUDecoder(n_channels, 32, 1, 5).eval()
    plan = protect(model, torch.zeros(1, n_channels), kind="recurrent", k=16, key=key)
    finalize(model, plan, key)
    path = export_bundle(model, out, kind="recurrent", example_input=torch.zeros(1, n_channels), rate_hz=50.0,
                         name="robust-demo", preprocess={"mean": [0.16] * n_channels, "std": [1.0] * n_channels},
                         extra={"session": {"input": "neural_frame", "command": "decoder_output"}},
                         variants=("fp16",), tensorrt=False, overwrite=True, report=report)
    return protect_bundle(path, plan, key, report=report)


def robust_demo(out_dir: str | Path = "out/robust_demo", duration_s: float = 3.0, flips: int = 8,
                report=print) -> dict:
    """Run the demo; write ``robust_demo.json`` to ``out_dir`` and return its content."""
    import os

    from closedloop.runtime import Session, SessionConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    key = os.urandom(32)
    key_file = out_dir / "weights.key"  # kept beside the demo output, never inside the bundle
    key_file.write_text(key.hex())
    bundle = make_protected_decoder(out_dir / "bundle", key)
    report(f"protected decoder bundle: {bundle} (keyed blocks of 16; key in {key_file})")
    results = {}
    for scrub in ("auto", "off"):
        cfg = SessionConfig(device="sim://headstage?channels=12&seed=3", backend="numba", duration_s=duration_s,
                            status=False, scrub=scrub, weights_key_file=str(key_file), scrub_budget_us=200.0)
        with Session(bundle, cfg) as s:
            from closedloop.runtime.protect.scrubber import attach_scrubber

            scrubber = s.scrubber.scrubber if s.scrubber is not None else attach_scrubber(
                s.model, key=key, scrub_at_load=False)
            target = scrubber.targets[0]
            clean = target.buf.copy()
            inj = FlipInjector(target, flips, every_s=duration_s / (2 * flips), seed=1)
            s.start()
            inj.start()
            summary = s.run()
            inj.join()
            wrong = int(np.sum(target.buf[target.pos[target.pos >= 0]] != clean[target.pos[target.pos >= 0]]))
        results[scrub] = {"flips_injected": len(inj.done), "weights_still_wrong": wrong,
                          "scrub": summary.scrub, "steps": summary.loop.steps,
                          "latency_p99_us": summary.loop.latency_p99_us, "missed": summary.loop.missed_deadlines}
        if scrub == "auto":
            sc = summary.scrub
            report(f"with scrubbing: {len(inj.done)} exponent-bit flips injected into the running weights; "
                   f"repaired {sc['repaired']}, unrepairable {sc['unrepairable']}; weights still wrong at the end: "
                   f"{wrong}; full scrub {sc['full_scrub_us']:.1f} us, budget {sc['budget_us']:.0f} us/period; "
                   f"{summary.loop.steps} steps, p99 {summary.loop.latency_p99_us:.0f} us, "
                   f"missed deadlines {summary.loop.missed_deadlines}")
            for line in sc["events"][:4]:
                report(f"  {line}")
        else:
            report(f"without scrubbing: {len(inj.done)} flips injected; weights still wrong at the end: {wrong}")
    write_json(out_dir / "robust_demo.json", results)
    return results
