"""``make demo``: the main job, end to end on this machine.

1. The spine: build a GRU decoder (192 channels -> 2 x 256 GRU -> 32 log-probs) and an
   MLP policy (40 -> 256 -> 256 -> 8), export both to verified bundles (ONNX, parity
   checked), time each step on torch eager, ONNX Runtime and the Numba backend, back to
   back and inside the real-time loop, run the loop at 1 kHz and 50 Hz, print the table.
2. A closed-loop session: the decoder against the headstage emulator (a separate
   process speaking the wire protocol over a pty), recorded, then the recording
   replayed through the bundle offline.

The full measurement is ``closedloop bench`` (minutes).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from export import export_bundle
from runtime import SessionConfig, replay_recording, run_session

from .benchmark import SpineBenchConfig, run_spine_benchmark
from .models import GRUDecoder


def _session_demo(out: Path) -> None:
    import sim  # noqa: F401  (registers sim://)

    print("\n== closed-loop session: GRU decoder <- headstage emulator over a pty, 3 s, recorded ==")
    torch.manual_seed(0)
    bundle = export_bundle(
        GRUDecoder(192, 256, 2, 32).eval(), out / "decoder", kind="recurrent", example_input=torch.zeros(1, 192),
        rate_hz=50.0, name="demo-decoder", preprocess={"mean": [0.16] * 192, "std": [0.4] * 192},
        extra={"session": {"input": "neural_frame", "command": "decoder_output"}},
        variants=(), tensorrt=False, overwrite=True, report=lambda s: None,
    )
    rec = out / "session.clrec"
    rec.unlink(missing_ok=True)
    summary = run_session(bundle, SessionConfig(device="sim://headstage?channels=192&seed=1", duration_s=3.0,
                                                record=str(rec), backend="auto"))
    print(summary.format())
    print("\n== replay: the recorded frames through the same bundle, offline ==")
    print(replay_recording(rec, bundle).format())


def main() -> int:
    print("closedloop demo: export a GRU decoder and an MLP policy, run them in the real-time loop\n")
    cfg = SpineBenchConfig.quick()
    run_spine_benchmark(cfg)
    out = Path(cfg.bundle_dir or "out/demo")
    _session_demo(out)
    print(
        f"\nbundles and the recording are in {out}/: try  .venv/bin/closedloop inspect {out}/decoder"
        f"  or  .venv/bin/closedloop run {out}/decoder --device sim://headstage"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
