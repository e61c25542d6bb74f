"""``make demo``: the main job, end to end on this machine.

1. The spine: build a GRU decoder (192 channels -> 2 x 256 GRU -> 32 log-probs) and an
   MLP policy (40 -> 256 -> 256 -> 8), export both to verified bundles (ONNX, parity
   checked), time each step on torch eager, ONNX Runtime and the Numba backend, back to
   back and inside the real-time loop, run the loop at 1 kHz and 50 Hz, print the table.
2. A closed-loop session: the decoder against the headstage emulator (a separate
   process speaking the wire protocol over a pty), recorded, then the recording
   replayed through the bundle offline.
3. A certified neural observer: trained in two stages on the flexible-joint robot
   (seconds), certified (an SDP), exported with its certificate, re-checked at load,
   and run at 1 kHz with a state-feedback controller against the plant emulator.

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


def _observer_demo(out: Path) -> None:
    import sim  # noqa: F401  (registers sim://)
    from runtime.certificate import certify_bundle

    from .observer import NeuralObserver, ObserverModel, TrainConfig, certify, observer_system, train_observer
    from .observer.neural import export_observer_bundle

    print("\n== certified neural observer: flexible-joint robot, two-stage training, certificate, 1 kHz loop ==")
    model = ObserverModel.from_system(observer_system("flexible-joint"))
    torch.manual_seed(0)
    result = train_observer(model, TrainConfig(hidden=(8, 8), stage1_steps=60, n_traj=8, n_points=128))
    print(f"trained in {result.times['total_s']:.1f} s; certified: {result.certified}")
    if not result.certified:
        print("no certificate reached in the demo's short training: skipping the session")
        return
    report = certify(model, result.net, rho=result.rho, coverage_eps=0.01, coverage_beta=1e-3)
    bundle = export_observer_bundle(NeuralObserver(model, result.net), report, out / "observer", overwrite=True,
                                    report=lambda s: None)
    print(certify_bundle(bundle))
    summary = run_session(bundle, SessionConfig(device="sim://plant?model=flexible-joint&rate=1000&dist=step",
                                                duration_s=3.0, backend="auto", watchdog_s=0.1))
    print(summary.format())


def main() -> int:
    print("closedloop demo: export a GRU decoder and an MLP policy, run them in the real-time loop\n")
    cfg = SpineBenchConfig.quick()
    run_spine_benchmark(cfg)
    out = Path(cfg.bundle_dir or "out/demo")
    _session_demo(out)
    _observer_demo(out)
    print(
        f"\nbundles and the recording are in {out}/: try  .venv/bin/closedloop inspect {out}/decoder"
        f"  or  .venv/bin/closedloop run {out}/decoder --device sim://headstage"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
