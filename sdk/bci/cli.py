"""``closedloop bci-train``, ``closedloop calibrate`` and ``closedloop evaluate``: argument parsing only.

The work is done by :mod:`closedloop.sdk.bci.workflow` (importable as ``closedloop.sdk.bci``).
"""

from __future__ import annotations

import argparse
import json

from ..cli import command
from .workflow import (
    calibrate_bundle,
    evaluate_bundle,
    format_evaluation,
    load_sessions,
    train_harness,
    train_pooled_bundle,
)


def _calibrate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", help="a calibratable bci_handwriting bundle (it carries calibration_state.npz)")
    p.add_argument("--data", required=True, help="the session's NWB file (FALCON H2 layout, synthetic or real)")
    p.add_argument("--sentences", type=int, default=3, help="calibration sentences: the session's first N (default 3)")
    p.add_argument("--out", default=None, help="new bundle (default BUNDLE-SESSION; a .zip name writes a zip)")
    p.add_argument("--session", default=None, help="session name stored in the bundle (default: from the file)")
    p.add_argument("--device", default=None, help="torch device for the fit (default: auto)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists (atomically)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


@command("calibrate", "fit a bundle's alignment layer to a new session's first sentences; write a new bundle",
         _calibrate_args)
def _calibrate(a: argparse.Namespace) -> int:
    r = calibrate_bundle(a.bundle, a.data, n_sentences=a.sentences, out=a.out, session_name=a.session,
                         device=a.device, overwrite=a.overwrite, report=(lambda s: None) if a.json else print)
    print(json.dumps(r.to_dict(), indent=2) if a.json else r.format())
    return 0


def _train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("data", help="folder of FALCON H2 NWB files (real or from `closedloop generate-data`)")
    p.add_argument("--out", required=True, help="bundle to write (calibratable: `closedloop calibrate` it per session)")
    p.add_argument("--config", help="a HarnessConfig JSON (train/meta/calibration sections): its settings replace "
                                    "those of the benchmark's configuration (or --tiny's); the rest stay")
    p.add_argument("--tiny", action="store_true", help="the tests' tiny training configuration (a minute)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--end-completion", choices=("off", "sentence-end", "plain"), default="off",
                   help="end-of-trial completion in the bundle's runtime text (docs/bci_deployment.md): 'sentence-end' "
                        "appends the sentence-final mark greedy decoding leaves out (default off: plain greedy)")
    p.add_argument("--overwrite", action="store_true")


@command("bci-train", "train the pooled handwriting decoder and its meta-learned alignment; write a calibratable bundle",
         _train_args)
def _train(a: argparse.Namespace) -> int:
    from .data import resolve_device
    from .malloc import retain_freed_memory

    resolve_device(a.device)  # a device this machine lacks is refused before the data are read
    retain_freed_memory()  # this process only trains: keep freed tensors' memory for the next step (sdk.bci.malloc)
    harness = train_harness(a.config, tiny=a.tiny, seed=a.seed, device=a.device)
    sessions = load_sessions(a.data)
    print(f"{len(sessions)} sessions from {a.data} ({sum(s.split == 'held_in' for s in sessions)} held-in)")
    path = train_pooled_bundle(sessions, harness, a.out, provenance={"data": str(a.data)}, overwrite=a.overwrite,
                               end_completion=None if a.end_completion == "off" else a.end_completion)
    print(f"wrote {path}: calibrate it per session with `closedloop calibrate {path} --data SESSION.nwb --sentences 3`")
    return 0


def _evaluate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", help="a bci_handwriting bundle")
    p.add_argument("--data", required=True, help="an NWB file or a folder of them (FALCON H2 layout)")
    p.add_argument("--beam", action="store_true", help="also score the lexicon-constrained beam search")
    p.add_argument("--beam-width", type=int, default=16)
    p.add_argument("--lexicon", default=None,
                   help="extra words for the beam (default: the words of the data's non-evaluation sentences)")
    p.add_argument("--backend", default="auto", help="runtime backend or 'auto'")
    p.add_argument("--json", action="store_true", help="print scores, predictions and references as JSON")


@command("evaluate", "score a decoder bundle on NWB data (FALCON CER/WER per session, through the runtime)",
         _evaluate_args)
def _evaluate(a: argparse.Namespace) -> int:
    r = evaluate_bundle(a.bundle, a.data, beam=a.beam, beam_width=a.beam_width, lexicon=a.lexicon, backend=a.backend)
    print(json.dumps(r, indent=2) if a.json else format_evaluation(r))
    return 0
