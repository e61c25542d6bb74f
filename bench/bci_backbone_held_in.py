"""Held-in CER of cached stage-1 backbones: how much in-distribution accuracy a stage-1 recipe keeps.

    python bench/bci_backbone_held_in.py /tmp/closedloop_bci_cache/backbone_seed0_*.pt

Each argument is a pooled backbone that ``bench/explore_bci_meta.py`` trained and cached
(the cache key is the recipe; ``--train`` overrides give other recipes). It decodes every
held-in session's evaluation trials of the benchmark's data, each under its own session's
normalisation, with identity alignment, and prints the mean over sessions of FALCON's CER
for greedy decoding with end-of-trial completion (the harness's ``greedy_end``).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from closedloop.sdk.bci.benchmark import BciBenchConfig, generate_data
from closedloop.sdk.bci.data import make_examples, session_normalization
from closedloop.sdk.bci.evaluate import decode_examples
from closedloop.sdk.bci.metrics import falcon_metrics
from closedloop.sdk.bci.models import AffineAlignment, AlignedDecoder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("backbones", nargs="+", help="cached backbone .pt files")
    a = ap.parse_args()
    torch.set_num_threads(1)
    sessions, _ = generate_data(BciBenchConfig())
    held_in = [s for s in sessions if s.split == "held_in" and s.evaluation]
    for path in a.backbones:
        backbone = torch.load(path, weights_only=False)
        model = AlignedDecoder(AffineAlignment(backbone.n_inputs), backbone)
        cers = []
        for s in held_in:
            ev = make_examples(s, s.evaluation, session_normalization(s))
            decoded = decode_examples(model, ev, None, 0, 0.0, torch.device("cpu"))
            cers.append(falcon_metrics([decoded["greedy_end"]], [[e.sentence for e in ev]])["per_session"][0]["CER"])
        print(f"{path}: held-in greedy_end CER {100 * np.mean(cers):.2f}% over {len(cers)} sessions", flush=True)


if __name__ == "__main__":
    main()
