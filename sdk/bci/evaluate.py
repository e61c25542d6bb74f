"""One harness for every method: same data, same calibration sentences, same normalisation, same metrics.

:func:`run_harness` trains what the chosen methods need on the held-in sessions
(stage-1 backbone, stage-2 meta-alignment, the per-session-input-layer decoder),
then for each held-out session computes the normalisation from its calibration
sentences, gets each method's decoder from those sentences only, and scores the
session's evaluation trials with FALCON's CER and WER (:mod:`closedloop.sdk.bci.metrics`), for
greedy CTC (plain, and with end-of-trial completion) and for the lexicon-constrained beam search. It also runs the drift
reference (per-session input layers: held-in CER with each session's own layer, and
held-out zero-shot with the last held-in session's layer), the yardstick the
synthetic generator is calibrated against. :mod:`closedloop.sdk.bci.report` aggregates seeds
into tables and plots.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from tqdm.auto import tqdm

from closedloop.common.config import JsonConfig
from closedloop.common.handwriting import Session

from .baselines import METHODS, TrainedModels, get_method, reference_layer
from .calibrate import CalibrationConfig
from .data import (
    Example,
    Normalization,
    collate,
    fit_indices,
    make_examples,
    resolve_device,
    session_normalization,
)
from .decoding import DECODERS, Lexicon, beam_decode, greedy_decode
from .meta import MetaConfig, meta_summary, meta_train_alignment
from .metrics import falcon_metrics
from .models import AlignedDecoder
from .train import TrainConfig, train_backbone, train_session_layers

DEFAULT_METHODS = ("zero_shot", "session_layers", "finetune", "alignment", "two_stage")


@dataclass
class HarnessConfig(JsonConfig):
    """What to train, how to calibrate and how to decode, for one seed."""

    methods: tuple[str, ...] = DEFAULT_METHODS
    train: TrainConfig = field(default_factory=TrainConfig)
    # the session_layers baseline's recipe (per-session input layers trained jointly); None: train
    session_train: TrainConfig | None = None
    # the drift reference's recipe (the same kind of decoder, the yardstick the generator was calibrated with);
    # None: the session_layers recipe, and the two share one trained decoder
    reference_train: TrainConfig | None = None
    meta: MetaConfig = field(default_factory=MetaConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    n_calibration: int = 3
    nearest: str = "loss"  # how session_layers picks its starting layer: "loss" or "day"
    finetune_lr_grid: tuple[float, ...] = (1e-4, 3e-4, 1e-3)
    beam_width: int = 16  # 0: greedy only
    word_weight: float = 0.0  # unigram prior weight in the beam search (0: lexicon constraint only)
    reference: bool = True
    seed: int = 0
    device: str = "auto"
    progress: bool = True

    def seeded(self) -> HarnessConfig:
        """Copies of the sub-configs with this harness's seed, device and progress setting."""
        common = {"seed": self.seed, "device": self.device, "progress": self.progress}
        session = None if self.session_train is None else replace(self.session_train, **common)
        ref = None if self.reference_train is None else replace(self.reference_train, **common)
        return replace(self, train=replace(self.train, **common), session_train=session, reference_train=ref,
                       meta=replace(self.meta, **common), calibration=replace(self.calibration, device=self.device))

    def session_recipe(self) -> TrainConfig:
        """The recipe of the per-session-input-layer decoder: ``session_train``, or ``train`` when unset."""
        return self.train if self.session_train is None else self.session_train

    def reference_recipe(self) -> TrainConfig:
        """The drift reference's recipe: ``reference_train``, or :meth:`session_recipe` when unset."""
        return self.session_recipe() if self.reference_train is None else self.reference_train

    def reference_is_separate(self) -> bool:
        """Whether the drift reference needs a decoder of its own (its recipe differs from session_layers')."""
        return self.reference_recipe() != self.session_recipe()


def build_lexicon(sessions: Sequence[Session], extra_words: Sequence[str] = ()) -> Lexicon:
    """Words of every sentence a method may learn from (held-in training and held-out calibration trials), plus ``extra_words``.

    Word counts (the optional unigram prior) come from those training sentences only.
    """
    sentences = [s.trials[i].sentence for s in sessions for i in fit_indices(s)]
    lex = Lexicon.from_sentences(sentences)
    if extra_words:
        counts = {w: 0 for w in extra_words}
        for sentence in sentences:
            for w in Lexicon.from_sentences([sentence]).words:
                counts[w] = counts.get(w, 0) + 1
        lex = Lexicon(set(lex.words) | set(extra_words), counts, lex.sentence_end)
    return lex


def decode_examples(model: AlignedDecoder, examples: Sequence[Example], lexicon: Lexicon | None, beam_width: int,
                    word_weight: float, device: torch.device) -> dict[str, list[str]]:
    """The text of each example per decoder: ``greedy`` (best path), ``greedy_end`` (best path with
    end-of-trial completion, :func:`closedloop.sdk.bci.decoding.end_completion`, under the lexicon's sentence-end rule
    when there is a lexicon) and ``beam`` (only when ``beam_width`` > 0 and there is a lexicon)."""
    model = model.to(device).eval()
    sentence_end = lexicon.sentence_end if lexicon is not None else ""
    out: dict[str, list[str]] = {"greedy": [], "greedy_end": []}
    if beam_width and lexicon is not None:
        out["beam"] = []
    for i in range(0, len(examples), 16):
        chunk = examples[i: i + 16]
        batch = collate(chunk, device)
        with torch.no_grad():
            logp = model(batch.x)[0].cpu().numpy()
        for k, e in enumerate(chunk):
            lp = logp[k, : e.x.shape[0]]
            out["greedy"].append(greedy_decode(lp))
            out["greedy_end"].append(greedy_decode(lp, complete_end=True, sentence_end=sentence_end))
            if "beam" in out:
                out["beam"].append(beam_decode(lp, lexicon, beam_width, word_weight=word_weight))
    return out


def _score(decoded: dict[str, list[str]], refs: list[str]) -> dict:
    """One session's FALCON scores per decoder, and the decoded text of every trial (for paired bootstraps)."""
    out: dict = {dec: falcon_metrics([texts], [refs])["per_session"][0] for dec, texts in decoded.items()}
    out["texts"] = {"reference": list(refs), **{dec: list(texts) for dec, texts in decoded.items()}}
    return out


def resolve_needs(needs: set[str], config: HarnessConfig) -> set[str]:
    """``needs`` with "reference" replaced by "session_layers" when the drift reference shares that decoder."""
    if "reference" in needs and not config.reference_is_separate():
        return (needs - {"reference"}) | {"session_layers"}
    return set(needs)


def harness_needs(config: HarnessConfig) -> set[str]:
    """What :func:`run_harness` trains for ``config``: its methods' needs and, with ``reference``, the drift reference's."""
    needs = {n for m in config.methods for n in get_method(m).needs} | ({"reference"} if config.reference else set())
    return resolve_needs(needs, config)


def train_models(sessions: Sequence[Session], config: HarnessConfig, needs: set[str]) -> TrainedModels:
    """Train, on held-in sessions only, what ``needs`` names ("backbone", "meta", "session_layers", "reference").

    "reference" is the drift reference's decoder: the session_layers decoder itself when the two recipes
    are the same, else one trained with :meth:`HarnessConfig.reference_recipe`.
    """
    needs = resolve_needs(needs, config)
    models = TrainedModels(held_in_days={s.name: float(s.day) for s in sessions if s.split == "held_in"})
    if "backbone" in needs or "meta" in needs:
        models.backbone, models.logs["backbone"] = train_backbone(sessions, config.train)
    if "meta" in needs:
        models.meta, models.logs["meta"] = meta_train_alignment(models.backbone, sessions, config.meta)
    if "session_layers" in needs:
        models.session_model, models.logs["session_layers"] = train_session_layers(sessions, config.session_recipe())
    if "reference" in needs:
        models.reference_model, models.logs["reference"] = train_session_layers(sessions, config.reference_recipe())
    return models


def _mean_over_sessions(per_session: dict[str, dict]) -> dict:
    out = {}
    for dec in DECODERS:
        rows = [v[dec] for v in per_session.values() if dec in v]
        if rows:
            out[dec] = {"CER": float(np.mean([r["CER"] for r in rows])), "WER": float(np.mean([r["WER"] for r in rows]))}
    return out


def run_harness(sessions: Sequence[Session], config: HarnessConfig | None = None, lexicon: Lexicon | None = None,
                models: TrainedModels | None = None) -> dict:
    """Train, calibrate and score every method of ``config`` on ``sessions`` (one seed).

    Returns
    -------
    dict
        ``sessions`` (day and days since the last held-in session per held-out
        session), ``methods`` (per method: per-session scores, mean over sessions,
        training, calibration and decoding seconds, what calibration chose), ``reference`` (the
        drift reference), ``logs`` (loss curves), ``config`` and ``wall_s`` (this call's seconds).
    """
    t_start = time.perf_counter()
    config = (config or HarnessConfig()).seeded()
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)
    methods = [get_method(m) for m in config.methods]
    held_in = [s for s in sessions if s.split == "held_in"]
    held_out = [s for s in sessions if s.split == "held_out"]
    if not held_in or not held_out:
        raise ValueError(f"the harness needs held-in and held-out sessions; got {len(held_in)} and {len(held_out)}")
    lexicon = lexicon if lexicon is not None else build_lexicon(sessions)
    if models is None:
        models = train_models(sessions, config, harness_needs(config))
    last_day = max(s.day for s in held_in)
    out: dict = {
        "seed": config.seed, "device": str(device), "config": config.to_dict(), "lexicon_words": len(lexicon),
        "sessions": {s.name: {"day": float(s.day), "days_since_last_held_in": float(s.day - last_day)} for s in held_out},
        "train_s": {k: log.wall_s for k, log in models.logs.items()},
        "logs": {k: log.to_dict() for k, log in models.logs.items()},
        "training_warnings": [w for log in models.logs.values() if (w := getattr(log, "warning", lambda: None)())],
        "methods": {},
    }
    if models.meta is not None:
        out["meta"] = meta_summary(models.meta)
    options = method_options(config)
    prepared = []
    for s in held_out:
        if s.evaluation:  # real FALCON H2 held-out files have none: their scores come from FALCON's server
            calib, norm = held_out_calibration(s, config)
            prepared.append((s, calib, norm, make_examples(s, s.evaluation, norm)))
    if not prepared:
        raise ValueError("no held-out session has evaluation trials to score (real FALCON H2 keeps them on its server): "
                         "calibrate with adapt_held_out, export bundles and score them with "
                         "closedloop.sdk.bci.falcon_decoder.FalconBundleDecoder through the FALCON evaluator")
    out["sessions"] = {s.name: out["sessions"][s.name] for s, *_ in prepared}
    bar = tqdm(total=len(methods) * len(prepared), desc="calibrate + decode", disable=not config.progress, leave=False)
    for m in methods:
        per_session, chosen, calib_s, decode_s = {}, {}, 0.0, 0.0
        for s, calib, norm, ev in prepared:
            adapted = m.adapt(models, s, calib, norm, config.calibration, options)
            calib_s += adapted.wall_s
            t0 = time.perf_counter()
            decoded = decode_examples(adapted.model, ev, lexicon, config.beam_width, config.word_weight, device)
            decode_s += time.perf_counter() - t0
            per_session[s.name] = _score(decoded, [e.sentence for e in ev])
            chosen[s.name] = adapted.info
            bar.update()
        train_s = sum(out["train_s"].get(n, 0.0) for n in m.needs)
        out["methods"][m.name] = {"sessions": per_session, "mean": _mean_over_sessions(per_session),
                                  "train_s": train_s, "calibrate_s": calib_s, "decode_s": decode_s, "chosen": chosen}
    bar.close()
    if config.reference:
        out["reference"] = drift_reference(sessions, models, config, lexicon)
    out["wall_s"] = time.perf_counter() - t_start  # the whole seed: training, calibration, decoding and the rest
    return out


def held_out_calibration(session: Session, config: HarnessConfig) -> tuple[list, Normalization]:
    """A held-out session's first ``n_calibration`` calibration trials and the normalisation computed from them."""
    calib_idx = list(session.calibration)[: config.n_calibration]
    if len(calib_idx) < config.n_calibration:
        raise ValueError(f"held-out session {session.name!r} has {len(calib_idx)} calibration trials; "
                         f"{config.n_calibration} needed")
    calib = [session.trials[i] for i in calib_idx]
    return calib, Normalization.from_trials(calib, config.calibration.std_floor)


def method_options(config: HarnessConfig) -> dict:
    """The per-method settings of ``config`` that :data:`~closedloop.sdk.bci.baselines.METHODS` read."""
    return {"nearest": config.nearest, "finetune_lr_grid": config.finetune_lr_grid,
            "alignment_form": (config.meta.form, config.meta.rank), "seed": config.seed}


def adapt_held_out(sessions: Sequence[Session], models: TrainedModels, method: str = "two_stage",
                   config: HarnessConfig | None = None) -> dict[str, tuple[AlignedDecoder, Normalization, dict]]:
    """Calibrate every held-out session with ``method``: ``{name: (decoder, normalisation, what was chosen)}``.

    This is what a deployment (or a FALCON submission) needs per session; evaluation
    trials are not used and need not exist.
    """
    config = (config or HarnessConfig()).seeded()
    m = get_method(method)
    options = method_options(config)
    out = {}
    for s in sessions:
        if s.split != "held_out":
            continue
        calib, norm = held_out_calibration(s, config)
        adapted = m.adapt(models, s, calib, norm, config.calibration, options)
        out[s.name] = (adapted.model, norm, adapted.info)
    return out


def drift_reference(sessions: Sequence[Session], models: TrainedModels, config: HarnessConfig, lexicon: Lexicon) -> dict:
    """Per-session-input-layer decoder: held-in CER (own layers) and held-out zero-shot CER (last held-in layer)."""
    device = resolve_device(config.device)
    sm = models.reference_decoder()
    held_in, held_out = {}, {}
    for s in sessions:
        if s.split == "held_in":
            model = sm.decoder_for(s.name)
            norm = session_normalization(s, config.reference_recipe().std_floor)
        else:
            if not s.evaluation:
                continue
            model = reference_layer(models, s)
            norm = held_out_calibration(s, config)[1]
        if not s.evaluation:
            continue
        ev = make_examples(s, s.evaluation, norm)
        decoded = decode_examples(model, ev, lexicon, config.beam_width, config.word_weight, device)
        (held_in if s.split == "held_in" else held_out)[s.name] = _score(decoded, [e.sentence for e in ev])
    return {"held_in": {"sessions": held_in, "mean": _mean_over_sessions(held_in)},
            "held_out_zero_shot": {"sessions": held_out, "mean": _mean_over_sessions(held_out)},
            "published": {"held_in_CER": 0.0335, "held_out_zero_shot_CER": [0.22, 0.38]}}


def available_methods() -> list[str]:
    return sorted(METHODS)


__all__ = ["DEFAULT_METHODS", "HarnessConfig", "CalibrationConfig", "MetaConfig", "TrainConfig", "adapt_held_out",
           "available_methods", "build_lexicon", "decode_examples", "drift_reference", "harness_needs",
           "held_out_calibration", "resolve_needs", "run_harness", "train_models"]
