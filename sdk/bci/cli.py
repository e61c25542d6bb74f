"""``closedloop bci-train``, ``closedloop calibrate`` and ``closedloop evaluate``: argument parsing only.

The work is done by :mod:`closedloop.sdk.bci.workflow` (importable as ``closedloop.sdk.bci``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from closedloop.common.jsonout import json_text

from ..cli import command
from .checks import check_training_sessions, data_warnings
from .workflow import (
    calibrate_bundle,
    compare_evaluations,
    describe_session,
    evaluate_bundle,
    format_comparison,
    format_evaluation,
    load_sessions,
    train_harness,
    unlearned_warning,
)


def _data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("data", help="a FALCON H2-layout NWB file or a folder of them")
    p.add_argument("--json", action="store_true", help="print the sessions as JSON")


@command("bci-data", "list the sessions of FALCON H2-layout NWB data as bci-train, calibrate and evaluate read them",
         _data_args)
def _bci_data(a: argparse.Namespace) -> int:
    sessions = load_sessions(a.data)
    rows = [describe_session(s) for s in sessions]
    warnings = data_warnings(sessions)
    if a.json:
        print(json_text({"data": str(a.data), "sessions": rows, "warnings": warnings}))
    else:
        print(f"{'session':<14}{'date':<12}{'day':>6}  {'split':<9}{'from':<8}{'ch':>5}{'silent':>7}{'trials':>8}"
              f"{'calib':>7}{'eval':>6}{'bins':>9}{'bin ms':>7}{'chars':>8}  files")
        for r in rows:
            silent = "ALL" if r["trials"] and not r["counts"] else str(len(r["silent_channels"]))
            print(f"{r['name']:<14}{r['date'] or '-':<12}{r['day']:>6g}  {r['split']:<9}{r['split_from']:<8}"
                  f"{r['n_channels']:>5}{silent:>7}{r['trials']:>8}{r['calibration']:>7}{r['evaluation']:>6}"
                  f"{r['bins']:>9}{r['bin_ms']:>7g}{r['characters']:>8}  {', '.join(Path(f).name for f in r['files'])}"
                  + ("  NO COUNTS" if r["trials"] and not r["counts"] else ""))
        held = {k: sum(r["split"] == k for r in rows) for k in ("held_in", "held_out")}
        print(f"{len(rows)} sessions: {held['held_in']} held-in, {held['held_out']} held-out. from: where the split "
              "came from (name, notes, date: the date is one of FALCON H2's held-in or held-out days, so the day is "
              "split as T5's was; default: nothing said it, taken as held-in). silent: channels with no "
              "count in any bin (ALL: the session holds no counts). calib: trials offered for calibration (a held-out "
              "day: FALCON's first 3 of its calibration file; calibrate --sentences N reads the file's); eval: trials "
              "scored")
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    return 0


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
    quiet = a.json or getattr(a, "global_quiet", False)

    def report(line: str) -> None:  # progress on stderr (not with --json or -q); warnings always, as every command's
        if line.startswith("warning") or not quiet:
            print(line, file=sys.stderr)

    if (unlearned := unlearned_warning(a.bundle)) is not None:
        report(f"warning: {unlearned}")
    r = calibrate_bundle(a.bundle, a.data, n_sentences=a.sentences, out=a.out, session_name=a.session,
                         device=a.device, overwrite=a.overwrite, report=report)
    # "warning" is the calibration's own (it made the CER worse); "unlearned" the given bundle's (bci-train's verdict)
    print(json_text({**r.to_dict(), "unlearned": unlearned}) if a.json else r.format())
    return 0


def _train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("data", help="folder of FALCON H2 NWB files (real or from `closedloop generate-data`)")
    p.add_argument("--out", required=True, help="bundle to write (calibratable: `closedloop calibrate` it per session)")
    p.add_argument("--config", help="a HarnessConfig JSON (train/meta/calibration sections): its settings replace "
                                    "those of the benchmark's configuration (or --tiny's); the rest stay")
    p.add_argument("--tiny", action="store_true", help="the tests' tiny training configuration (a minute; not scaled)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the model's initial weights, the batches and the validation split (default 0)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--end-completion", choices=("off", "sentence-end", "plain"), default="off",
                   help="end-of-trial completion in the bundle's runtime text (docs/bci_deployment.md): 'sentence-end' "
                        "appends the sentence-final mark greedy decoding leaves out (default off: plain greedy)")
    p.add_argument("--steps", type=int, default=None,
                   help="stage 1's step ceiling (default: scaled with the data, docs/bci.md); training stops earlier "
                        "when validation stops improving")
    p.add_argument("--time-budget", type=float, default=1800.0,
                   help="wall-time budget in seconds for both stages (default 1800; 0: none): stage 1 stops at "
                        "90%% of it, stage 2 at its end")
    p.add_argument("--budget", type=float, default=1.0,
                   help="multiplies the step ceiling, the time budget and the patience (default 1; 4 is the "
                        "robustness benchmark's longer run, for a recording the default stops too early on)")
    p.add_argument("--patience", type=int, default=6,
                   help="validation evaluations without a lower CER before stage 1 halves its learning rate, or "
                        "stops once the rate is at its floor (default 6)")
    p.add_argument("--min-patience-steps", type=int, default=0,
                   help="the patience's floor in steps, however close together the evaluations are (default 0: "
                        "none; 500 for a recording with few trials per session, docs/bci.md)")
    p.add_argument("--eval-every", type=int, default=0,
                   help="steps between validation evaluations (default: an eightieth of the ceiling, at least 10)")
    p.add_argument("--validation-fraction", type=float, default=0.1,
                   help="share of each held-in session's trials withheld for validation (default 0.1, at least 1)")
    p.add_argument("--unlearned-cer", type=float, default=0.4,
                   help="best validation greedy CER above which the decoder counts as not learned (default 0.4)")
    p.add_argument("--allow-unlearned", action="store_true",
                   help="exit 0 even when the decoder has not learned (it is written either way)")
    p.add_argument("--json", action="store_true", help="print the training summary as JSON on stdout")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists (atomically)")


def _explicit_train_settings(config: str | None, steps: int | None) -> frozenset[str]:
    """The stage-1 settings the user chose (a --config's train.backbone / train.steps, --steps): not scaled."""
    keep = set()
    if config:
        train = json.loads(open(config).read()).get("train") or {}
        keep |= {k for k in ("backbone", "steps") if k in train}
    if steps is not None:
        keep.add("steps")
    return frozenset(keep)


@command("bci-train", "train the pooled handwriting decoder and its meta-learned alignment until it has learned "
                      "(validation, early stopping, a time budget); write a calibratable bundle", _train_args)
def _train(a: argparse.Namespace) -> int:
    import dataclasses

    from .data import resolve_device
    from .malloc import retain_freed_memory
    from .progress import Progress
    from .recipe import Recipe, train_recipe

    resolve_device(a.device)  # a device this machine lacks is refused before the data are read
    if a.steps is not None and a.steps < 1:
        raise ValueError(f"--steps {a.steps}: the step ceiling must be at least 1")
    recipe = Recipe(validation_fraction=a.validation_fraction, eval_every=a.eval_every, patience=a.patience,
                    time_budget_s=a.time_budget, unlearned_cer=a.unlearned_cer, scale=not a.tiny, seed=a.seed,
                    budget=a.budget, min_patience_steps=a.min_patience_steps)
    retain_freed_memory()  # this process only trains: keep freed tensors' memory for the next step (sdk.bci.malloc)
    harness = train_harness(a.config, tiny=a.tiny, seed=a.seed, device=a.device)
    if a.steps is not None:
        harness = dataclasses.replace(harness, train=dataclasses.replace(harness.train, steps=a.steps))
    progress = Progress(quiet=getattr(a, "global_quiet", False))
    sessions = load_sessions(a.data)
    for w in check_training_sessions(sessions):  # a held-in session without counts is refused (exit 2)
        print(f"warning: {w}", file=sys.stderr)
    progress.note(f"{len(sessions)} sessions from {a.data} ({sum(s.split == 'held_in' for s in sessions)} held-in)")
    unnamed = [s.name for s in sessions if s.meta.get("split_from") == "default"]
    if unnamed:
        progress.note(f"  {len(unnamed)} of them held-in because nothing names their split ({', '.join(unnamed[:3])}"
                      f"{' ...' if len(unnamed) > 3 else ''}): a new day a decoder must not train on is named "
                      "held-out (sub-X-held-out-calib_ses-YYYYMMDD.nwb; docs/handwriting_data.md)")
    by_date = [s for s in sessions if s.meta.get("split_from") == "date"]
    if by_date:
        progress.note(f"  {len(by_date)} of them split by their date alone, a day of FALCON H2's own lists "
                      f"({', '.join(f'{s.name} {s.split}' for s in by_date[:3])}{' ...' if len(by_date) > 3 else ''}): "
                      "a recording of yours on such a date is split as that day of T5 was; name the split in the "
                      "file name to decide it yourself (held-in / held-out, docs/handwriting_data.md)")
    result = train_recipe(sessions, harness, a.out, recipe=recipe, keep=_explicit_train_settings(a.config, a.steps),
                          progress=progress, provenance={"data": str(a.data)}, overwrite=a.overwrite,
                          end_completion=None if a.end_completion == "off" else a.end_completion)
    if a.json:
        print(json_text(result.summary))
    else:
        print(result.format())
        print(f"wrote {result.bundle}: calibrate it per session with `closedloop calibrate {result.bundle} "
              "--data SESSION.nwb --sentences 3`" if result.learned else
              f"wrote {result.bundle}, NOT LEARNED (below): its text is not usable as it is")
    for w in result.summary.get("warnings", []):
        print(f"warning: {w}", file=sys.stderr)
    if not result.learned:
        for p in result.problems:  # an error, or a warning where --allow-unlearned says to go on
            print(f"{'warning' if a.allow_unlearned else 'error'}: NOT LEARNED: {p}", file=sys.stderr)
        if not a.allow_unlearned:
            print("error: the decoder has not learned (exit 1); --allow-unlearned keeps going", file=sys.stderr)
            return 1
    return 0


def _evaluate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", help="a bci_handwriting bundle")
    p.add_argument("--data", required=True, help="an NWB file or a folder of them (FALCON H2 layout)")
    p.add_argument("--beam", action="store_true", help="also score the lexicon-constrained beam search")
    p.add_argument("--beam-width", type=int, default=16, help="prefixes the beam search keeps (default 16)")
    p.add_argument("--lexicon", default=None, metavar="closed|open|FILE",
                   help="the beam's vocabulary: 'closed' (default; the words of the sentences the bundle was trained "
                        "and calibrated on, stored in it: optimistic WER), 'open' (English, the most frequent words "
                        "of wordfreq with their frequencies as prior: for comparisons with published numbers) or a "
                        "file of words")
    p.add_argument("--sentence-end", default=None, metavar="MARKS|none",
                   help="the marks a sentence ends with: greedy_end appends the likeliest where a text ends with none of them, "
                        "beam prefers hypotheses ending with one, e.g. '~?' (default: the rule the "
                        "bundle stored from its training sentences; 'none': no rule)")
    p.add_argument("--word-weight", type=float, default=None,
                   help="weight of the beam's unigram word prior (default 0.5 for open, 0 for closed or a file)")
    p.add_argument("--open-words", type=int, default=None, help="size of the open vocabulary (default 50000)")
    p.add_argument("--backend", default="auto", help="runtime backend or 'auto'")
    p.add_argument("--against", default=None, metavar="BUNDLE",
                   help="also score BUNDLE on the same data with the same options and compare the two trial for "
                        "trial: each decoder's CER and WER ratio (bundle / BUNDLE) with a paired bootstrap 95%% "
                        "interval (e.g. a longer bci-train run against the default one, on a later day of your own)")
    p.add_argument("--json", action="store_true", help="print scores, predictions and references as JSON")


@command("evaluate", "score a decoder bundle on NWB data (FALCON CER/WER per session, through the runtime)",
         _evaluate_args)
def _evaluate(a: argparse.Namespace) -> int:
    options = dict(beam=a.beam, beam_width=a.beam_width, lexicon=a.lexicon, sentence_end=a.sentence_end,
                   word_weight=a.word_weight, open_words=a.open_words, backend=a.backend)
    for b in (a.bundle, a.against):
        if b is not None and (w := unlearned_warning(b)) is not None:
            print(f"warning: {w}", file=sys.stderr)
    r = evaluate_bundle(a.bundle, a.data, **options)
    for w in r["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    if a.against is None:
        print(json_text(r) if a.json else format_evaluation(r))
        return 0
    other = evaluate_bundle(a.against, a.data, **options)
    comparison = compare_evaluations(r, other)
    if a.json:
        print(json_text({**r, "against": other, "comparison": comparison}))
    else:
        print("\n\n".join([format_evaluation(r), format_evaluation(other), format_comparison(comparison)]))
    return 0
