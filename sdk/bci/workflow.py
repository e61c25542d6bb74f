"""Train, calibrate and score deployed handwriting decoders: the Python side of ``closedloop bci-train``,
``closedloop calibrate`` and ``closedloop evaluate``.

:func:`calibrate_bundle` takes a calibratable ``bci_handwriting`` bundle (one that
carries ``calibration_state.npz``, see :mod:`closedloop.sdk.bci.deploy`) and a session's NWB file,
and writes a new self-contained bundle for that session: the normalisation from the
session's first N calibration sentences only, and an alignment layer fitted on those
sentences by the harness's own method (:mod:`closedloop.sdk.bci.baselines`: ``two_stage``, the
meta-learned initialisation and step sizes, when the bundle has the meta state;
``alignment``, Adam from identity, when it has not). The backbone comes from the state
file and goes back into the new bundle bit-identical, which is checked. The new
bundle carries the state again, so it can itself be recalibrated.

:func:`evaluate_bundle` scores a bundle on the evaluation trials (``eval_mask``) of one
NWB file or a folder of them through the runtime (``runtime.Model`` and the family's
Numba normalisation and streaming CTC: no torch), with FALCON's CER and WER per
session and their mean, for greedy decoding and optionally the lexicon beam search.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from closedloop.common.atomic import refuse_existing

from .checks import data_warnings, has_no_counts, session_counts, where

__all__ = ["CalibrationReport", "calibrate_bundle", "compare_evaluations", "evaluate_bundle", "export_pooled_bundle",
           "format_comparison", "format_evaluation", "load_sessions", "train_harness", "train_pooled_bundle"]

# --- calibrate ------------------------------------------------------------------------------

# calibration trials after the first ``n_sentences`` that calibrate scores before and after the fit (not fitted)
HELD_OUT_CALIBRATION = 3


@dataclass
class CalibrationReport:
    """What :func:`calibrate_bundle` did; ``format()`` is what the command prints.

    Losses are the mean CTC loss per character on the calibration sentences, normalised
    with the new session's statistics: with the given bundle's alignment layer, at the
    fit's starting point (meta-learned initialisation or identity) and after the fit.
    """

    bundle: str
    source: str
    data: str
    session: str
    trials: list[int]
    method: str
    loss_given: float
    loss_start: float
    loss_after: float
    chosen: dict = field(default_factory=dict)
    backbone_identical: bool = True
    fit_s: float = 0.0
    wall_s: float = 0.0
    # greedy CER / WER of the scored trials with the given bundle's alignment and after the fit (both with the new
    # session's normalisation): held-out calibration trials the fit did not use when the session has them, else the
    # fitted trials themselves (``scored_on`` says which: "held_out" or "fitted")
    scored_trials: list[int] = field(default_factory=list)
    scored_on: str = "fitted"
    cer_given: float = float("nan")
    cer_after: float = float("nan")
    wer_given: float = float("nan")
    wer_after: float = float("nan")
    warning: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        on = (f"held-out calibration trials {self.scored_trials} (not fitted)" if self.scored_on == "held_out" else
              "the fitted trials (no other calibration trials to hold out)")
        return "\n".join([
            f"calibrated {self.source} for session {self.session} on trials {self.trials} of {self.data}",
            f"  method: {self.method}; chosen {self.chosen}",
            f"  calibration CTC loss per char: given bundle {self.loss_given:.3f}, fit start {self.loss_start:.3f}, "
            f"after {self.loss_after:.3f}",
            f"  greedy CER on {on}: before (the given bundle's alignment with this session's normalisation from "
            f"the calibration sentences: not the bundle uncalibrated as a live session runs it) {self.cer_given:.1%}, "
            f"after {self.cer_after:.1%} (WER {self.wer_given:.1%} -> {self.wer_after:.1%}); to see what calibrating "
            "gains, score both on the day's evaluation trials (closedloop evaluate NEW --data DAY --against GIVEN)",
            *([f"  warning: {self.warning}"] if self.warning else []),
            f"  backbone bit-identical: {'yes' if self.backbone_identical else 'NO'}; fit {self.fit_s:.1f} s, "
            f"total {self.wall_s:.1f} s",
            f"  wrote {self.bundle}",
        ])


def unlearned_warning(bundle: Any) -> str | None:
    """A warning for a bundle (or one calibrated from it) whose ``bci-train`` run ended NOT LEARNED, else None."""
    from closedloop.runtime import BundleError, load_bundle

    try:
        b = load_bundle(bundle) if isinstance(bundle, str | Path) else bundle
    except (BundleError, OSError):  # the command's own load says what is wrong with it
        return None
    recipe = b.manifest.provenance.get("recipe") if isinstance(b.manifest.provenance, dict) else None
    if not isinstance(recipe, dict) or recipe.get("learned") is not False:
        return None
    why = "; ".join(str(p) for p in recipe.get("problems", [])[:2])
    return (f"{b.source}: bci-train wrote this decoder NOT LEARNED ({why}): its text is not usable; train again "
            "with more data or a longer budget (docs/bci.md, the training recipe)")


def _load_session(data: Any, n_calibration: int) -> tuple[Any, str]:
    from closedloop.common.handwriting import Session

    from .nwb import load_falcon_h2

    if isinstance(data, Session):
        return data, f"session {data.name}"
    path = Path(data)
    if path.is_dir():
        raise ValueError(f"--data {path} is a folder; calibrate takes one session's NWB file")
    return load_falcon_h2(path, n_calibration=n_calibration), str(path)


def _backbone_bits(state: dict) -> dict[str, bytes]:
    return {k: np.ascontiguousarray(v).tobytes() for k, v in state.items() if k.startswith("backbone.")}


def calibrate_bundle(
    bundle: str | Path,
    data: Any,
    *,
    n_sentences: int = 3,
    out: str | Path | None = None,
    session_name: str | None = None,
    device: str | None = None,
    overwrite: bool = False,
    variants: tuple[str, ...] | None = None,
    report: Any = print,
) -> CalibrationReport:
    """Fit ``bundle``'s alignment layer to a new session and write the calibrated bundle.

    Parameters
    ----------
    bundle
        A calibratable ``bci_handwriting`` bundle (folder or zip).
    data
        The session: a FALCON H2 NWB file (``closedloop.sdk.bci.nwb.load_falcon_h2``: our synthetic
        files and the real ones), or a ``closedloop.sim.handwriting.Session``.
    n_sentences
        Calibration sentences: the session's first ``n_sentences`` calibration trials
        (FALCON: its first trials; evaluation trials are never used).
    out
        The new bundle (default: ``<bundle>-<session>`` beside it; a ``.zip`` name writes a zip).
    session_name
        Name stored in the bundle (default: the loader's, e.g. ``2023.04.17``).
    device
        Torch device for the fit (default: the bundle's calibration config, ``auto``).
    variants
        Reduced-precision variants of the new bundle (default: those of the given bundle).
    report
        Called with progress lines (``print``; ``lambda s: None`` for silence).
    """

    from closedloop.runtime import load_bundle
    from closedloop.runtime.families.bci import read_calibration_state

    from .baselines import TrainedModels, get_method, mean_calibration_loss
    from .calibrate import CalibrationConfig, trials_to_examples
    from .data import Normalization, resolve_device
    from .deploy import BCI_FAMILY, decoder_from_state, export_bci_bundle
    from .lexicon import calibrated_decoding
    from .models import AffineAlignment, AlignedDecoder
    from .train import validation_scores

    t0 = time.perf_counter()
    if device is not None:
        resolve_device(device)  # a device this machine lacks is refused before anything is read
    src = load_bundle(bundle)  # checksums, state file included
    m = src.manifest
    if m.family != BCI_FAMILY:
        raise ValueError(f"bundle {bundle} is family {m.family!r}; calibrate takes {BCI_FAMILY!r} bundles")
    state = read_calibration_state(src)
    if state is None:
        raise ValueError(f"bundle {bundle} has no calibration state (extra.bci.calibration_state): export it with "
                         "closedloop.sdk.bci.deploy.export_bci_bundle from an AlignedDecoder(AffineAlignment, GRUBackbone)")
    if n_sentences < 1:
        raise ValueError(f"--sentences {n_sentences}: at least one calibration sentence is needed")
    session, data_name = _load_session(data, n_sentences + HELD_OUT_CALIBRATION)
    idx = list(session.calibration)[:n_sentences]
    scored_idx = list(session.calibration)[n_sentences:n_sentences + HELD_OUT_CALIBRATION]
    if len(idx) < n_sentences:
        why = ("it is a file of evaluation trials, which never calibrate: use the session's calibration file"
               if not idx and session.evaluation else f"use --sentences {len(idx)} or fewer" if idx else
               "the file has no trials")
        raise ValueError(f"{data_name}: session {session.name} has {len(idx)} calibration trials; "
                         f"{n_sentences} needed ({why})")
    calib = [session.trials[i] for i in idx]
    if has_no_counts(session, idx):
        raise ValueError(f"{data_name}: the {len(idx)} calibration sentence(s) (trials {idx}) of session "
                         f"{session.name} hold no counts at all (every bin of every channel is 0): an alignment "
                         "fitted to them decodes nothing; check the recording and the export that wrote the file "
                         "(closedloop bci-data shows what it holds)")
    for w in session.meta.get("warnings", []):  # the loader's notes (an eval_mask set on part of a trial)
        report(f"warning: {w}")
    name = session_name or session.name
    out = Path(out) if out is not None else Path(str(src.source).removesuffix(".zip") + f"-{name}")
    refuse_existing(out, overwrite)  # before the fit, not after it
    c = int(state["n_channels"])
    if calib[0].spikes.shape[1] != c:
        raise ValueError(f"{data_name} has {calib[0].spikes.shape[1]} channels; bundle {bundle} takes {c}")
    bci = m.extra["bci"]
    block = bci["calibration_state"]
    cfg_dict = dict(block.get("config") or {})
    if device is not None:
        cfg_dict["device"] = device
    config = CalibrationConfig.from_dict(cfg_dict)
    torch_device = resolve_device(config.device)
    before = _backbone_bits(state)

    decoder, meta = decoder_from_state(state)
    norm = Normalization.from_trials(calib, state["std_floor"])
    examples = trials_to_examples(calib, norm)
    method = "two_stage" if meta is not None else "alignment"
    what = ("two_stage: meta-learned alignment initialisation and step sizes" if meta is not None else
            "alignment from identity with Adam (the bundle has no meta-learned state)")
    report(f"calibrating on {len(calib)} sentences of {session.name}: {what}")
    start = AlignedDecoder(meta.new_alignment() if meta is not None else AffineAlignment(c), decoder.backbone)
    loss_given = mean_calibration_loss(decoder, examples, torch_device)
    loss_start = mean_calibration_loss(start, examples, torch_device)
    adapted = get_method(method).adapt(TrainedModels(backbone=decoder.backbone, meta=meta), session, calib, norm,
                                       config, {})
    loss_after = mean_calibration_loss(adapted.model, examples, torch_device)
    scored = trials_to_examples([session.trials[i] for i in scored_idx], norm) if scored_idx else examples
    given_s = validation_scores(decoder, lambda x, b: decoder(x)[0], scored, torch_device)
    after_s = validation_scores(adapted.model, lambda x, b: adapted.model(x)[0], scored, torch_device)
    warning = None
    if after_s["CER"] > given_s["CER"]:
        chars = sum(len(e.sentence) for e in scored)
        warning = (f"calibration made the greedy CER worse ({given_s['CER']:.1%} -> {after_s['CER']:.1%} on "
                   f"{len(scored)} {'held-out calibration' if scored_idx else 'fitted'} trials: "
                   f"{round(given_s['CER'] * chars)} -> {round(after_s['CER'] * chars)} character errors of {chars}"
                   + ("; a check this small is noisy" if len(scored) < 10 else "")
                   + "): try more --sentences, or keep the given bundle for this session")
        report(f"warning: {warning}")
    model = adapted.model.cpu().eval()
    if model.backbone is not decoder.backbone or _backbone_bits(
            {f"backbone.{k}": v.numpy() for k, v in model.backbone.state_dict().items()}) != before:
        raise RuntimeError("calibration changed the backbone; only the alignment layer may change (a bug: report it)")

    spec = src.graph()
    provenance = {k: v for k, v in m.provenance.items() if k != "export"}
    provenance["calibrated_from"] = {"bundle": m.name, "path": str(src.source),
                                     "main_sha256": m.files[spec.file]["sha256"]}
    info = {"method": method, "trials": idx, "data": data_name, "data_session": session.name,  # the day, as loaded
            "chosen": adapted.info, "bins": int(sum(
        t.spikes.shape[0] for t in calib)), "loss_given": loss_given, "loss_start": loss_start, "loss_after": loss_after}
    path = export_bci_bundle(
        model, out, n_channels=c, mean=norm.mean, std=norm.std, session_name=name, calibration_info=info,
        provenance=provenance, charset=state["charset"], blank=state["blank"], rate_hz=m.rate_hz,
        recorded_bins=calib[0].spikes, display=bci.get("display"), char_probs=bool(bci.get("char_probs", False)),
        end_completion=(bci.get("end_completion") or {}).get("sentence_end"), meta=meta, std_floor=state["std_floor"],
        decoding=calibrated_decoding(bci, [t.sentence for t in calib]),
        calibration_config=block.get("config") or {}, calibratable=True,
        variants=tuple(spec.variants) if variants is None else variants, tensorrt=bool(spec.tensorrt_engines),
        overwrite=overwrite, zip=out.suffix == ".zip", report=lambda s: None,
    )
    after = _backbone_bits(read_calibration_state(load_bundle(path)))
    if after != before:
        raise RuntimeError(f"{path}: the written backbone differs from {bundle}'s (a bug: report it)")
    return CalibrationReport(str(path), str(src.source), data_name, name, idx, what, loss_given, loss_start, loss_after,
                             adapted.info, True, adapted.wall_s, time.perf_counter() - t0,
                             scored_trials=list(scored_idx or idx), scored_on="held_out" if scored_idx else "fitted",
                             cer_given=given_s["CER"], cer_after=after_s["CER"], wer_given=given_s["WER"],
                             wer_after=after_s["WER"], warning=warning)


# --- train ----------------------------------------------------------------------------------


def end_completion_marks(sessions: Sequence[Any], end_completion: str | None) -> str | None:
    """The bundle's end-of-trial completion for ``end_completion``: None (off), ``""`` (``"plain"``) or the marks the
    held-in sentences end with (``"sentence-end"``: every one must end with ``~`` or ``?``, else a ValueError naming
    those that do not). Checked before any training, and again on the sentences the bundle is exported from."""
    from .decoding import Lexicon

    if end_completion is None:
        return None
    if end_completion == "plain":
        return ""
    if end_completion != "sentence-end":
        raise ValueError(f"end_completion {end_completion!r}: expected None, 'plain' or 'sentence-end'")
    sentences = [t.sentence for s in sessions if s.split == "held_in" for t in s.trials]
    marks = Lexicon.from_sentences(sentences).sentence_end
    if not marks:
        odd = [s for s in sentences if not s or s[-1] not in "~?"]
        raise ValueError(f"--end-completion sentence-end: {len(odd)} of the {len(sentences)} held-in sentences do "
                         f"not end with '~' or '?' (e.g. {odd[:3]!r}), so there is no sentence-end rule to apply; "
                         "use 'plain' or 'off'")
    return marks


def train_pooled_bundle(sessions: list, harness: Any, out: str | Path, *, provenance: dict | None = None,
                        end_completion: str | None = None, overwrite: bool = False, report=print) -> Path:
    """Stage 1 (pooled backbone) and stage 2 (meta-learned alignment) on the held-in sessions; a calibratable bundle.

    The bundle decodes with the meta-learned initial alignment and the last held-in
    session's normalisation until ``closedloop calibrate`` fits it to a session.
    ``end_completion``: None (plain greedy text), ``"plain"`` or ``"sentence-end"`` (the
    sentence-final marks every held-in training sentence ends with): the runtime's
    end-of-trial completion (docs/bci_deployment.md).
    """
    from .evaluate import train_models

    held_in = [s for s in sessions if s.split == "held_in"]
    if not held_in:
        raise ValueError(f"none of the {len(sessions)} sessions is held-in: training needs held-in sessions "
                         "(FALCON H2's held-in files, or `closedloop generate-data`)")
    end_completion_marks(sessions, end_completion)  # a cue that breaks the rule is refused before training
    models = train_models(sessions, harness, {"backbone", "meta"})
    report(f"stage 1 (pooled backbone) {models.logs['backbone'].wall_s:.1f} s, stage 2 (meta-learned alignment) "
           f"{models.logs['meta'].wall_s:.1f} s")
    if (warning := models.logs["backbone"].warning()) is not None:
        report(f"warning: {warning}")
    return export_pooled_bundle(models, sessions, harness, out, provenance=provenance, end_completion=end_completion,
                                overwrite=overwrite)


def export_pooled_bundle(models: Any, sessions: list, harness: Any, out: str | Path, *, provenance: dict | None = None,
                         end_completion: str | None = None, overwrite: bool = False) -> Path:
    """The calibratable bundle of trained ``models`` (backbone and meta): :func:`train_pooled_bundle`'s export step,
    also used by :func:`closedloop.sdk.bci.recipe.train_recipe`."""
    from .data import session_normalization
    from .deploy import export_bci_bundle
    from .lexicon import pooled_bundle_defaults
    from .models import AlignedDecoder

    held_in = [s for s in sessions if s.split == "held_in"]
    marks = end_completion_marks(held_in, end_completion)
    norm = session_normalization(held_in[-1])  # a placeholder until calibration replaces it
    return export_bci_bundle(
        AlignedDecoder(models.meta.new_alignment(), models.backbone), out, n_channels=held_in[0].n_channels,
        mean=norm.mean, std=norm.std, session_name="pooled", meta=models.meta, std_floor=harness.calibration.std_floor,
        calibration_config=harness.calibration.to_dict(), end_completion=marks, **pooled_bundle_defaults(held_in),
        provenance={"training": harness.to_dict(), **(provenance or {})},
        variants=(), tensorrt=False, overwrite=overwrite, report=lambda s: None,
    )


def train_harness(config: str | Path | None, *, tiny: bool = False, seed: int = 0, device: str = "auto") -> Any:
    """``bci-train``'s configuration: the benchmark's (or the tiny one), with a ``--config`` JSON's settings over it."""
    import dataclasses

    from .benchmark import BciBenchConfig
    from .evaluate import HarnessConfig

    harness = (BciBenchConfig.tiny() if tiny else BciBenchConfig()).harness
    if config:  # a partial file changes only the settings it names
        harness = HarnessConfig.from_dict(_merged(harness.to_dict(), json.loads(Path(config).read_text())))
    return dataclasses.replace(harness, seed=seed, device=device).seeded()


def _merged(base: dict, over: dict) -> dict:
    """``base`` with ``over``'s values in place, section by section (nested dicts merged, other values replaced)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


# --- evaluate -------------------------------------------------------------------------------


def describe_session(s: Any) -> dict:
    """One loaded session as ``closedloop bci-data`` lists it: name, date, day, split and where it came from,
    channels, trials (all, offered for calibration, scored), bins and their width, characters, the total count and
    the channels silent throughout (:mod:`closedloop.sdk.bci.checks`) and the files it came from."""
    counts = session_counts(s) if s.trials else np.zeros(0, dtype=np.int64)
    return {"name": s.name, "date": s.meta.get("date"), "day": float(s.day), "split": s.split,
            "split_from": s.meta.get("split_from", "-"), "n_channels": s.n_channels, "trials": len(s.trials),
            "calibration": len(s.calibration), "evaluation": len(s.evaluation),
            "bins": int(sum(t.n_bins for t in s.trials)), "bin_ms": round(1000 * float(s.meta.get("bin_s", 0.02)), 3),
            "characters": int(sum(len(t.sentence) for t in s.trials)), "counts": int(counts.sum()),
            "silent_channels": [int(c) for c in np.flatnonzero(counts == 0)],
            "files": list(s.meta.get("files", []))}


def load_sessions(data: str | Path) -> list:
    """One NWB file (one session) or every session of a folder (``load_falcon_h2_dir``)."""
    from .nwb import load_falcon_h2, load_falcon_h2_dir

    path = Path(data)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder (expected a FALCON H2 .nwb file, or a folder of them)")
    return load_falcon_h2_dir(path) if path.is_dir() else [load_falcon_h2(path)]


def evaluate_bundle(
    bundle: str | Path,
    data: str | Path,
    *,
    beam: bool = False,
    beam_width: int = 16,
    lexicon: str | Path | None = None,
    sentence_end: str | None = None,
    word_weight: float | None = None,
    open_words: int | None = None,
    backend: str = "auto",
) -> dict:
    """Score ``bundle`` on the evaluation trials of ``data`` (an NWB file or a folder) through the runtime.

    Each trial is streamed bin by bin through the bundle (normalise, step, greedy CTC),
    with the recurrent state and text reset between trials, as a live session and the
    FALCON adapter do; a bundle that normalises with a new day's own statistics
    (``extra.bci.normalization``: the uncalibrated pooled bundle) starts its warm-up again at
    each session's first evaluation trial, as a live session starts it at its first bin.
    Every trial is scored with three decoders: ``greedy`` (the runtime's best path, nothing a
    board lacks), ``greedy_end`` (the same with end-of-trial completion under the sentence-end
    rule) and, with ``beam``, the lexicon beam search
    (:func:`closedloop.sdk.bci.decoding.beam_decode`) over the same bins' log-probabilities.

    The sentence-end rule and the beam's vocabulary come from ``sentence_end`` / ``lexicon``
    (``"closed"`` when None, ``"open"`` or a word file: :mod:`closedloop.sdk.bci.lexicon`) or
    from what the bundle stored at training, never from ``data``: a file and a folder
    holding it give the same text.

    Returns
    -------
    dict
        ``sessions`` (per session: each decoder's scores as
        ``closedloop.sdk.bci.metrics.falcon_metrics`` reports them, the ``predictions`` and
        ``references``), ``mean`` (per decoder: ``CER`` and ``WER`` averaged over
        sessions), ``skipped`` (sessions without evaluation trials), ``sentence_end``,
        ``lexicon`` (mode, source, words, prior weight; with ``beam``), ``normalization``
        and the setup.
    """
    from closedloop.runtime import Model, get_family, load_bundle

    from .decoding import beam_decode
    from .lexicon import OPEN_WORDS, resolve_lexicon, resolve_sentence_end
    from .metrics import falcon_metrics

    t0 = time.perf_counter()
    b = load_bundle(bundle)
    if b.manifest.family != "bci_handwriting":
        raise ValueError(f"bundle {bundle} is family {b.manifest.family!r}; evaluate scores 'bci_handwriting' bundles")
    if beam_width < 1:
        raise ValueError(f"--beam-width {beam_width}: the beam keeps at least 1 prefix")
    if open_words is not None and (open_words < 1 or not beam or lexicon != "open"):
        raise ValueError(f"--open-words {open_words}: " + (
            "the open vocabulary's size is a number of words, 1 or more (default 50000)" if open_words < 1 else
            "it sizes the open vocabulary: give --beam --lexicon open with it"))
    if lexicon is not None and not beam:
        raise ValueError(f"--lexicon {lexicon}: the lexicon is the beam search's vocabulary, and greedy decoding uses "
                         "none; add --beam to score the beam search with it")
    if word_weight is not None and not (np.isfinite(word_weight) and word_weight >= 0):
        raise ValueError(f"--word-weight {word_weight:g}: the word prior's weight is 0 (none) or more")
    bci = b.manifest.extra["bci"]
    stored = bci.get("decoding")
    rule, rule_source = resolve_sentence_end(sentence_end, stored, (bci.get("end_completion") or {}).get("sentence_end"))
    choice = (resolve_lexicon(lexicon, stored, rule, rule_source, word_weight, open_words or OPEN_WORDS)
              if beam else None)
    sessions = load_sessions(data)
    scored = [s for s in sessions if s.evaluation]
    skipped = [s.name for s in sessions if not s.evaluation]
    if not scored:
        raise ValueError(f"{data}: no evaluation trials in {[s.name for s in sessions]}: a calibration file (its name "
                         "has 'calib') is never scored; point --data at the evaluation files (DANDI's '-minival', "
                         "FALCON's '_eval') or a folder holding them. FALCON's held-out evaluation data stay on its "
                         "server: score those with sdk.bci.falcon_decoder")
    model = Model(b, backend=backend)
    fam = get_family(b.manifest.family)(b, model)
    n_ch = fam.n_channels
    decoders = ["greedy", "greedy_end"] + (["beam"] if beam else [])
    calibrated_for = bci.get("session")
    norm = bci.get("normalization")
    warnings = data_warnings(scored) + [
        f"{where(s)}: its {len(s.evaluation)} evaluation trial(s) hold no counts at all (every bin of every channel "
        "is 0): its scores say nothing about the decoder; check the recording and the export that wrote the file"
        for s in scored if not has_no_counts(s) and has_no_counts(s, s.evaluation)]
    warmup = int(norm["warmup_bins"]) if norm is not None else 0
    bin_s = float(bci.get("bin_s", 0.02))
    # the statistics of a warm-up bundle come from each session's first bins: all of them where it has fewer
    used = {s.name: min(warmup, int(sum(s.trials[i].n_bins for i in s.evaluation))) for s in scored}
    short = {k: n for k, n in used.items() if n < warmup}
    out: dict[str, Any] = {
        "bundle": str(bundle), "data": str(data), "backend": model.backend_name, "decoders": decoders,
        "sessions": {}, "skipped": skipped, "end_completion": fam.sentence_end,
        # the text the bundle's runtime itself produces at each trial's end
        "runtime_decoder": "greedy" if fam.sentence_end is None else "greedy_end",
        "sentence_end": rule, "sentence_end_source": rule_source,
        "lexicon": choice.describe() if choice is not None else None,
        "normalization": ("calibration statistics" if norm is None else
                          f"each session's own: its first {warmup} bins ({warmup * bin_s:.0f} s) of evaluation trials"
                          + ("; " + ", ".join(f"session {k} has only {n} ({n * bin_s:.1f} s), all of them used"
                                              for k, n in short.items()) if short else "")),
        "normalization_bins": used if norm is not None else None,
        "warnings": warnings,
        "calibrated_for": calibrated_for,
        # which day the calibration data were (the name given with --session may be the lab's own)
        "other_sessions": [] if norm is not None else _other_sessions(
            (bci.get("calibration") or {}).get("data_session") or calibrated_for, [s.name for s in scored]),
    }
    try:
        for s in scored:
            fam.restart_warmup()  # another day: a warm-up bundle learns its statistics again
            texts: dict[str, list[str]] = {d: [] for d in decoders}
            refs = []
            for i in s.evaluation:
                spikes = s.trials[i].spikes
                if spikes.shape[1] != n_ch:
                    raise ValueError(f"{data}: session {s.name} has {spikes.shape[1]} channels; the bundle takes {n_ch}")
                fam.reset()
                logp = np.empty((spikes.shape[0], fam.log_probs.shape[-1]), dtype=np.float32) if beam else None
                for k, row in enumerate(spikes):
                    fam.decode_bin(row)
                    if logp is not None:
                        logp[k] = fam.log_probs[0]
                texts["greedy"].append(fam.ctc.text())
                fam.ctc.complete_end(rule)
                texts["greedy_end"].append(fam.ctc.text())
                fam.reset()
                if logp is not None:
                    texts["beam"].append(beam_decode(logp, choice.lexicon, beam_width, word_weight=choice.word_weight))
                refs.append(s.trials[i].sentence)
            row: dict[str, Any] = {d: falcon_metrics([texts[d]], [refs])["per_session"][0] for d in decoders}
            row.update(predictions=texts, references=refs, split=s.split)
            out["sessions"][s.name] = row
    finally:
        model.close()

    def mean(rows: list[dict]) -> dict:
        return {d: {k: float(np.mean([r[d][k] for r in rows])) for k in ("CER", "WER")} for d in decoders}

    out["mean"] = mean(list(out["sessions"].values()))
    # held-in days (seen in training) and held-out ones (new days) apart, as FALCON reports them, where both are here
    splits = {r["split"] for r in out["sessions"].values()}
    out["mean_by_split"] = ({sp: mean([r for r in out["sessions"].values() if r["split"] == sp])
                             for sp in sorted(splits)} if len(splits) > 1 else {})
    out["wall_s"] = time.perf_counter() - t0
    return out


def compare_evaluations(result: dict, against: dict, n_boot: int = 2000, seed: int = 0) -> dict:
    """Two :func:`evaluate_bundle` results on the same data, compared trial for trial.

    For every decoder both scored, CER and WER of ``result``'s bundle over ``against``'s: the figures are
    ``evaluate``'s (per session, then the mean over sessions), the 95% intervals a paired bootstrap that resamples
    each session's evaluation trials with replacement, the same trials for both bundles
    (:func:`closedloop.sdk.bci.report.paired_bootstrap`, ``n_boot`` replicates); ``p_better`` is the share of
    replicates in which ``result``'s bundle has the lower figure. The interval says how far the comparison could
    move with other sentences of the same sessions, not with another training run.

    Raises ``ValueError`` when the two did not score the same sessions and sentences.
    """
    from .report import paired_bootstrap

    mine, theirs = result["sessions"], against["sessions"]
    if list(mine) != list(theirs) or any(mine[k]["references"] != theirs[k]["references"] for k in mine):
        raise ValueError(f"{result['bundle']} and {against['bundle']} were not scored on the same sessions and "
                         f"sentences ({list(mine)} against {list(theirs)}): compare evaluations of the same --data")
    decoders = [d for d in result["decoders"] if d in against["decoders"]]

    def texts(sessions: dict) -> dict:
        return {k: {"texts": {"reference": r["references"], **r["predictions"]}} for k, r in sessions.items()}

    runs = [{"methods": {"bundle": {"sessions": texts(mine)}, "against": {"sessions": texts(theirs)}}}]
    rows = {}
    for d in decoders:
        rows[d] = {}
        for metric in ("CER", "WER"):
            b = paired_bootstrap(runs, "bundle", "against", decoder=d, n_boot=n_boot, seed=seed, metric=metric)
            key = metric.lower()
            rows[d][metric] = {"bundle": b[key], "against": b[f"{key}_against"], "ratio": _finite(b["ratio"]),
                               "ratio_95": [_finite(v) for v in b["ratio_95"]], "difference": b["difference"],
                               "difference_95": b["difference_95"], "p_better": b["p_better"]}
    return {"bundle": result["bundle"], "against": against["bundle"], "data": result["data"],
            "sessions": list(mine), "trials": sum(len(r["references"]) for r in mine.values()),
            "n_boot": n_boot, "decoders": rows}


def _finite(x: float) -> float | None:
    """A ratio over a zero error rate is no number: None (JSON null), not inf."""
    return float(x) if np.isfinite(x) else None


def _ratio_text(c: dict) -> str:
    if c["ratio"] is None:
        return "- (B is 0)"
    lo, hi = ("inf" if v is None else f"{v:.2f}" for v in c["ratio_95"])  # some replicates had B at 0: unbounded
    return f"{c['ratio']:.2f} [{lo}, {hi}]"


def format_comparison(comparison: dict) -> str:
    """The comparison table ``closedloop evaluate --against`` prints after both evaluations."""
    lines = [f"{comparison['bundle']} (A) against {comparison['against']} (B): {comparison['trials']} evaluation "
             f"trials in {len(comparison['sessions'])} session(s); ratio A / B with a paired bootstrap 95% interval "
             f"({comparison['n_boot']} replicates of the trials; an end at inf: replicates where B made no error, "
             "null in --json); P(A lower): the share of replicates A is lower",
             f"{'decoder':<12}{'metric':<8}{'A':>9}{'B':>9}{'A / B [95%]':>24}{'P(A lower)':>12}"]
    for d, row in comparison["decoders"].items():
        for metric, c in row.items():
            lines.append(f"{d:<12}{metric:<8}{c['bundle']:>9.2%}{c['against']:>9.2%}{_ratio_text(c):>24}"
                         f"{c['p_better']:>12.2f}")
    return "\n".join(lines)


def _other_sessions(calibrated_for: str | None, names: list[str]) -> list[str]:
    """The scored sessions that are not the one the bundle was calibrated on (compared by date where both name one)."""
    from .nwb import parse_falcon_name

    if not calibrated_for:
        return []
    day = parse_falcon_name(calibrated_for).date
    return [n for n in names if n != calibrated_for and (day is None or parse_falcon_name(n).date != day)]


def format_evaluation(result: dict) -> str:
    """The table ``closedloop evaluate`` prints."""
    decs = result["decoders"]
    width = {d: max(12, len(d) + 6) for d in decs}  # "greedy_end CER" needs more than 12
    head = f"{'session':<14}{'trials':>7}" + "".join(f"{d + ' CER':>{width[d]}}{d + ' WER':>{width[d]}}" for d in decs)
    lines = [f"{result['bundle']} on {result['data']} (evaluation trials; backend {result['backend']}; "
             f"{result['wall_s']:.1f} s)", head]
    for name, r in result["sessions"].items():
        lines.append(f"{name:<14}{r[decs[0]]['n_trials']:>7}"
                     + "".join(f"{r[d]['CER']:>{width[d]}.2%}{r[d]['WER']:>{width[d]}.2%}" for d in decs))
    lines.append(f"{'mean':<14}{'':>7}" + "".join(f"{result['mean'][d]['CER']:>{width[d]}.2%}"
                                                  f"{result['mean'][d]['WER']:>{width[d]}.2%}" for d in decs))
    for split, m in result.get("mean_by_split", {}).items():  # held-in and held-out days apart, when both were scored
        lines.append(f"{'mean ' + split.replace('_', '-'):<14}{'':>7}"
                     + "".join(f"{m[d]['CER']:>{width[d]}.2%}{m[d]['WER']:>{width[d]}.2%}" for d in decs))
    rule = result.get("sentence_end")
    if rule is not None:
        which = "greedy_end and beam" if "beam" in decs else "greedy_end"
        lines.append(f"{which}: sentences end with {rule!r} ({result['sentence_end_source']})" if rule else
                     f"{which}: no sentence-end rule ({result['sentence_end_source']})")
    if result.get("runtime_decoder"):
        lines.append(f"the bundle's runtime text is {result['runtime_decoder']}; normalisation: {result['normalization']}")
    lex = result.get("lexicon")
    if lex:
        lines.append(f"beam lexicon: {lex['mode']} ({lex['source']}; {lex['words']} words, prior weight "
                     f"{lex['word_weight']:g})" + ("; closed-lexicon WER is optimistic: compare with published "
                                                  "numbers using --lexicon open" if lex["mode"] == "closed" else ""))
    if result["skipped"]:
        lines.append(f"skipped (no evaluation trials): {', '.join(result['skipped'])}")
    if result.get("other_sessions"):
        lines.append(f"note: the bundle was calibrated on session {result['calibrated_for']}; "
                     f"{', '.join(result['other_sessions'])} scored with that calibration")
    return "\n".join(lines)
