"""``closedloop inject-faults`` and ``closedloop scrub``: fault injection and weight checks from the shell."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from closedloop.sdk.cli import command


def _inject_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", help="bundle folder")
    p.add_argument("--flips", type=int, required=True, help="number of bits to flip")
    p.add_argument("--mode", choices=("random", "targeted"), default="random",
                   help="random: uniform over all weight bits; targeted: Bit-Flip-Attack-style progressive search")
    p.add_argument("--adaptive", action="store_true",
                   help="targeted, int8 variant only: flip only sets that keep the block constraints of the unkeyed "
                        "layout")
    p.add_argument("--seed", type=int, default=0, help="seed of the random flips or the targeted search (default 0)")
    p.add_argument("--variant", choices=("fp32", "fp16", "int8"), default="fp32", help="which stored precision to hit")
    p.add_argument("--data", help="targeted only: .npy of model inputs (recurrent: batch x steps x features)")
    p.add_argument("--out", help="where to write the corrupted copy (default BUNDLE.faulty)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")


@command("inject-faults", "write a copy of a bundle with flipped weight bits (refused by its checksum unless skipped)",
         _inject_args)
def _inject(a: argparse.Namespace) -> int:
    import numpy as np

    from .faults import inject_faults

    if a.flips < 1:
        raise ValueError(f"--flips {a.flips}: give the number of bits to flip, 1 or more")
    out = Path(a.out) if a.out else Path(str(Path(a.bundle)).rstrip("/") + ".faulty")
    data = np.load(a.data) if a.data else None
    inject_faults(a.bundle, out, a.flips, a.mode, a.seed, None if a.variant == "fp32" else a.variant,
                  adaptive=a.adaptive, data=data, overwrite=a.overwrite)
    return 0


def _scrub_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", help="bundle folder or zip (protected with sdk.robust)")
    p.add_argument("--variant", choices=("fp32", "fp16", "int8"), default=None,
                   help="which stored precision to check and repair (default: the one the copy's faults.json names, "
                        "as inject-faults wrote it; else fp32)")
    p.add_argument("--backend", default="onnxruntime",
                   help="backend whose weights are checked (numba, onnxruntime; default onnxruntime)")
    p.add_argument("--skip-checksum", action="store_true",
                   help="load a bundle whose checksums fail (fault-injection studies only)")
    p.add_argument("--weights-key-file", help="key of a keyed layout (or $CLOSEDLOOP_WEIGHTS_KEY_FILE)")


@command("scrub", "load a protected bundle, check every weight block, repair single bit flips and report (exit 1 "
                  "when a fault was found that is not repaired)",
         _scrub_args)
def _scrub(a: argparse.Namespace) -> int:
    from closedloop.runtime import Model, load_bundle
    from closedloop.runtime.protect.scrubber import WeightsCorruptedError, attach_scrubber, read_key

    variant = a.variant
    faults = Path(a.bundle) / "faults.json"
    if variant is None and faults.is_file():  # a copy inject-faults wrote: check the precision its flips are in
        import json

        variant = json.loads(faults.read_text()).get("variant") or "fp32"
        print(f"checking the {variant} weights, where {faults} puts the flips (--variant chooses another)",
              file=sys.stderr)
    variant = variant or "fp32"
    bundle = load_bundle(a.bundle, verify_checksums=not a.skip_checksum)
    model = Model(bundle, backend=a.backend, variant=None if variant == "fp32" else variant)
    try:
        scrubber = attach_scrubber(model, key=read_key(key_file=a.weights_key_file))
    except WeightsCorruptedError as exc:
        print(f"UNREPAIRABLE: {exc}")
        return 1
    if scrubber is None:
        print(f"closedloop scrub: error: {a.bundle} is not protected (no manifest.extra.robust), so there is nothing to scrub; protect "
              "it first (docs/robustness.md)", file=sys.stderr)
        return 2
    st = scrubber.stats
    for line in st.events:
        print(line)
    where = ", ".join(t.name for t in scrubber.targets)
    print(f"{st.blocks} blocks on {where} ({st.guarded_blocks} of them guarded: biases, scales): repaired "
          f"{st.repaired} (each verified), ambiguous {st.ambiguous} (not repaired, left as found), unrepairable "
          f"{st.unrepairable}; full scrub {st.full_scrub_us:.0f} us")
    return 1 if st.ambiguous else 0
