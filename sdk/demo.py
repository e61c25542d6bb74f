"""``make demo``: the main job, end to end on this machine.

1. The spine: build a GRU decoder (192 channels -> 2 x 256 GRU -> 32 log-probs) and an
   MLP policy (40 -> 256 -> 256 -> 8), export both to verified bundles (ONNX, parity
   checked), time each step on torch eager, ONNX Runtime and the Numba backend, back to
   back and inside the real-time loop, run the loop at 1 kHz and 50 Hz, print the table.
2. A closed-loop session: the decoder against the headstage emulator (a separate
   process speaking the wire protocol over a pty), recorded, then the recording
   replayed through the bundle offline.
3. A trained handwriting decoder typing: a small synthetic handwriting recording
   (the tiny preset at 192 channels and 160 trials per session: 3 held-in sessions and the first held-out one), a
   pooled GRU backbone and its meta-learned alignment trained on the held-in sessions,
   exported as a calibratable bundle, calibrated on the held-out session's first three
   sentences by the function ``closedloop calibrate`` runs, scored on the session's
   evaluation trials through the runtime (``closedloop evaluate``: greedy, and the beam
   search over the generator's vocabulary), then run live against the headstage emulator
   playing that same session from its first evaluation trial, printing the text as it is typed, its
   CER against the prompt and the per-bin latency.
4. A certified neural observer: trained in two stages on the flexible-joint robot
   (seconds), certified (an SDP), exported with its certificate, re-checked at load,
   and run at 1 kHz with a state-feedback controller against the plant emulator.
5. A robot policy: a push policy cloned from scripted demonstrations, exported with its
   observation normalisation and action limits, run for a few episodes against the
   PyBullet Panda emulator over the wire (success counted by the emulator).
6. Weights that survive bit flips: a decoder trained into the zero-sum block form, bits
   flipped in its weights while a session runs, located and repaired by the scrubber in
   the loop's spare time.

The full measurement is ``closedloop bench`` (minutes).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

from closedloop.export import export_bundle
from closedloop.runtime import SessionConfig, replay_recording, run_session

from .benchmark import SpineBenchConfig, run_spine_benchmark
from .models import GRUDecoder


def _session_demo(out: Path) -> None:

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


# The typing demo's recording: what sim://headstage?source=handwriting&preset=tiny&... plays, at 192 channels
# and with more trials per session than the preset's 8 (the pooled backbone needs some hundreds of sentences).
TYPING_SEED = 0
TYPING_CHANNELS = 192
TYPING_TRIALS = 160
TYPING_GAP_S = 0.5


def _typing_harness():
    from .bci.augment import DriftAugmentation
    from .bci.calibrate import CalibrationConfig
    from .bci.evaluate import HarnessConfig
    from .bci.meta import MetaConfig
    from .bci.train import BackboneConfig, TrainConfig

    return HarnessConfig(
        train=TrainConfig(backbone=BackboneConfig(128, 1, 0.0), steps=250, batch_size=16, lr=2e-2,
                          augmentation=DriftAugmentation(noise_std=0.2, offset_std=0.1, gain_std=0.1)),
        meta=MetaConfig(inner_steps=2, n_query=2, tasks_per_step=2, meta_steps=10),
        calibration=CalibrationConfig(steps=8, eval_every=2, folds=3, device="cpu"),
        seed=TYPING_SEED, device="cpu", progress=False,
    ).seeded()


def _live_trial_texts(record: Path, starts: list[int], ends: list[int]) -> list[str]:
    """Text typed during each trial (and the rest after it, where CTC may still emit its last letters)."""
    from closedloop.firmware_bridge import DecoderOutput, FrameParser
    from closedloop.runtime import RecordingReader, RecordType

    parser = FrameParser()
    texts = [""] * len(starts)
    for rec in RecordingReader(record).of_type(RecordType.TX):
        for f in parser.feed(rec.payload):
            m = f.message
            if isinstance(m, DecoderOutput) and m.text:
                k = int(np.searchsorted(starts, m.bin_index, side="right")) - 1
                if 0 <= k < len(starts) and m.bin_index < ends[k]:
                    texts[k] += m.text
    return texts


def _typing_demo(out: Path) -> None:
    from closedloop.sim.handwriting import VOCABULARY, HandwritingConfig, generate_session

    from .bci.metrics import falcon_metrics
    from .bci.nwb import write_falcon_h2
    from .bci.workflow import calibrate_bundle, evaluate_bundle, format_evaluation, train_pooled_bundle

    print("\n== trained handwriting decoder: pooled GRU + meta-learned alignment, 3-sentence calibration, live typing ==")
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    cfg = HandwritingConfig.tiny(seed=TYPING_SEED)
    cfg.n_channels, cfg.trials_per_session = TYPING_CHANNELS, TYPING_TRIALS
    index = len(cfg.held_in_dates)  # the first held-out session
    sessions = [generate_session(cfg, i) for i in range(index + 1)]
    target = sessions[index]
    print(f"data: {index} held-in sessions + held-out {target.name}, {TYPING_CHANNELS} channels, {TYPING_TRIALS} trials "
          f"each ({time.perf_counter() - t0:.1f} s)")
    hc = _typing_harness()
    pooled = train_pooled_bundle(sessions, hc, out / "bci_pooled", provenance={"data": cfg.to_dict()}, overwrite=True,
                                 end_completion="sentence-end")  # each trial's text ends with its ~ or ?
    data = write_falcon_h2(target, out / "bci_data" / f"sub-SIM-held-out_ses-{target.name.replace('.', '')}.nwb")
    report = calibrate_bundle(pooled, data, n_sentences=3, out=out / "bci_decoder", overwrite=True)
    print(report.format())
    words = out / "bci_data" / "vocabulary.txt"  # the generator's vocabulary: the beam search's lexicon
    words.write_text("\n".join(VOCABULARY) + "\n")
    scores = evaluate_bundle(report.bundle, data, beam=True, beam_width=16, lexicon=words, backend="numba")
    print(format_evaluation(scores))

    # live: the emulator plays the session from its first evaluation trial (never seen in training or calibration)
    first = int(target.evaluation[0])
    starts, ends, k = [], [], 0
    gap = int(round(TYPING_GAP_S * 50))
    for t in target.trials[first: first + 2]:
        starts.append(k + gap)
        ends.append(k + gap + t.spikes.shape[0] + gap)
        k = ends[-1] - gap
    n_bins = ends[-1] if ends[-1] <= 700 else ends[0]
    n_trials = 2 if ends[-1] <= 700 else 1
    url = (f"sim://headstage?source=handwriting&preset=tiny&session={index}&channels={TYPING_CHANNELS}"
           f"&trials={TYPING_TRIALS}&seed={TYPING_SEED}&gap_s={TYPING_GAP_S}&loop=0&first_trial={first}")
    print(f"\nclosedloop run {report.bundle} --device \"{url}\"  ({n_bins / 50:.1f} s: evaluation trials "
          f"{first}-{first + n_trials - 1})")
    rec = out / "typing.clrec"
    rec.unlink(missing_ok=True)
    summary = run_session(report.bundle, SessionConfig(device=url, max_steps=n_bins, record=str(rec), backend="auto",
                                                       status_interval_s=0.5))
    print(summary.format())
    typed = _live_trial_texts(rec, starts[:n_trials], ends[:n_trials])
    prompts = [t.sentence for t in target.trials[first: first + n_trials]]
    for p, t in zip(prompts, typed, strict=True):
        print(f"  prompt {p.replace('>', ' ').replace('~', '.')!r:<40} typed {t.replace('>', ' ').replace('~', '.')!r}")
    live = falcon_metrics([typed], [prompts])
    g, b = scores["mean"]["greedy_end"], scores["mean"]["beam"]
    print(f"live typing CER {live['CER']:.1%} on {n_trials} evaluation sentence(s) (greedy, streaming: the live "
          f"characters, without end-of-trial completion); all the session's {len(target.evaluation)} evaluation trials, "
          f"never seen in training or calibration: greedy with end-of-trial completion CER {g['CER']:.1%} "
          f"WER {g['WER']:.1%}, lexicon beam CER {b['CER']:.1%} WER {b['WER']:.1%}; "
          f"section {time.perf_counter() - t0:.1f} s")


def _observer_demo(out: Path) -> None:
    from closedloop.runtime.families.observer.certificate import certify_bundle

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


def _rl_demo(out: Path) -> None:
    from .rl.demo import rl_demo

    rl_demo(out / "rl")  # prints its own heading


def _robust_demo(out: Path) -> None:
    from .robust.demo import robust_demo

    print("\n== weights that survive bit flips: a protected decoder, flips injected mid-session, scrubbed ==")
    robust_demo(out / "robust")


def main(argv: list[str] | None = None) -> int:
    import argparse

    argparse.ArgumentParser(
        prog="python -m closedloop.sdk.demo",
        description="What `make demo` runs (a few minutes): export a GRU decoder and an MLP policy and run them in the "
                    "real-time loop, a session against the headstage emulator with a recording, a handwriting decoder "
                    "typing, a certified observer at 1 kHz, an RL policy on the Panda emulator, weights that survive "
                    "bit flips. Writes its bundles and recordings under ./out/demo. Takes no options.").parse_args(argv)
    print("closedloop demo: export a GRU decoder and an MLP policy, run them in the real-time loop\n")
    cfg = SpineBenchConfig.quick()
    run_spine_benchmark(cfg)
    out = Path(cfg.bundle_dir or "out/demo")
    _session_demo(out)
    _typing_demo(out)
    _observer_demo(out)
    _rl_demo(out)
    _robust_demo(out)
    print(
        f"\nbundles and the recording are in {out}/: try  .venv/bin/closedloop inspect {out}/decoder"
        f"  or  .venv/bin/closedloop run {out}/decoder --device sim://headstage"
        f"\nthe handwriting decoder: .venv/bin/closedloop evaluate {out}/bci_decoder --data {out}/bci_data --beam "
        f"--lexicon {out}/bci_data/vocabulary.txt"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
