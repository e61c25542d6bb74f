"""Synthetic handwriting iBCI recordings: sessions of prompted sentences with binned spike counts.

:func:`generate_recording` makes every session of a :class:`~.config.HandwritingConfig`
(held-in, then held-out, on the configured dates); :func:`generate_session` makes one
alone and gives exactly the same data (each session has its own random streams, and
the drift state at a session depends only on the seed and the dates). Per trial: a
sentence from the built-in vocabulary, its pen dynamics (:mod:`.kinematics`), the
population's rates on that day (:mod:`.population`) and gamma-Poisson counts in 20 ms
bins, stored as uint8. Splits follow FALCON H2 (:func:`~.types.falcon_splits`).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from closedloop.common.handwriting import Session, Trial, falcon_splits

from .config import HandwritingConfig
from .kinematics import TrialKinematics, trial_kinematics
from .population import ChannelParams, rates_hz, session_channel_params, shared_latent, stream
from .vocabulary import make_sentence

__all__ = ["generate_recording", "generate_session", "iter_trials", "session_name", "spike_counts", "idle_counts"]

GENERATOR_VERSION = 3  # 2: population signal and drift scale calibrated against FALCON H2; 3: '>' and '~'
#                         drawn as glyphs (chevron, tilde) instead of a short move and a dot, recalibrated
_SENTENCES, _BEHAVIOUR, _SPIKES = 4, 2, 3  # random stream keys (stable: changing them changes the data)


def session_name(date_iso: str) -> str:
    """FALCON's session key for a date: ``2022-05-18`` -> ``2022.05.18``."""
    return date_iso.replace("-", ".")


def spike_counts(rates: np.ndarray, bin_s: float, overdispersion: float, rng: np.random.Generator) -> np.ndarray:
    """Gamma-Poisson counts (uint8) for ``rates`` in Hz; ``overdispersion`` 0 gives Poisson."""
    lam = rates * bin_s
    if overdispersion > 0:
        lam = lam * rng.gamma(1.0 / overdispersion, overdispersion, size=lam.shape)
    return np.minimum(rng.poisson(lam), 255).astype(np.uint8)


def _check_index(cfg: HandwritingConfig, index: int) -> None:
    if not 0 <= index < cfg.n_sessions:
        raise IndexError(f"session index {index} is outside 0..{cfg.n_sessions - 1} "
                         f"({len(cfg.held_in_dates)} held-in + {len(cfg.held_out_dates)} held-out sessions)")


def iter_trials(cfg: HandwritingConfig, index: int,
                params: ChannelParams | None = None) -> Iterator[tuple[Trial, TrialKinematics]]:
    """Trials of session ``index`` one at a time, with their pen dynamics (same data as the session)."""
    _check_index(cfg, index)
    if params is None:
        params = session_channel_params(cfg)[index]
    w = cfg.writing
    sentence_rng = stream(cfg.seed, _SENTENCES, index)
    sentences = [make_sentence(sentence_rng, w.words_per_sentence, w.question_prob, w.comma_prob)
                 for _ in range(cfg.trials_per_session)]
    behaviour_rng = stream(cfg.seed, _BEHAVIOUR, index)
    spike_rng = stream(cfg.seed, _SPIKES, index)
    for k, sentence in enumerate(sentences):
        kin = trial_kinematics(sentence, w, cfg.bin_s, behaviour_rng)
        latent = shared_latent(kin.features.shape[0], cfg.population, cfg.bin_s, spike_rng)
        rates = rates_hz(params, kin.features, cfg.population, cfg.bin_s, latent)
        counts = spike_counts(rates, cfg.bin_s, cfg.population.overdispersion, spike_rng)
        yield Trial(spikes=counts, sentence=sentence, block=k // max(w.trials_per_block, 1)), kin


def _make_session(cfg: HandwritingConfig, index: int, params: ChannelParams, with_kinematics: bool) -> Session:
    pairs = list(iter_trials(cfg, index, params))
    trials = [trial for trial, _ in pairs]
    split = cfg.split_of(index)
    calibration, evaluation = falcon_splits(len(trials), split == "held_out", cfg.n_calibration)
    date_iso = (cfg.held_in_dates + cfg.held_out_dates)[index]
    meta: dict = {"date": date_iso, "index": index, "source": "synthetic", "seed": cfg.seed,
                  "generator_version": GENERATOR_VERSION}
    if with_kinematics:
        meta["kinematics"] = [kin for _, kin in pairs]
    return Session(name=session_name(date_iso), day=cfg.days[index], split=split, trials=trials,
                   calibration=calibration, evaluation=evaluation, meta=meta)


def generate_session(cfg: HandwritingConfig, index: int, with_kinematics: bool = False) -> Session:
    """Session ``index`` of ``cfg`` (0-based: held-in first, then held-out).

    ``with_kinematics`` keeps each trial's pen dynamics in ``session.meta["kinematics"]``
    (a list of :class:`~.kinematics.TrialKinematics`) for plots and diagnostics.
    """
    _check_index(cfg, index)
    return _make_session(cfg, index, session_channel_params(cfg)[index], with_kinematics)


def generate_recording(cfg: HandwritingConfig, with_kinematics: bool = False) -> list[Session]:
    """Every session of ``cfg``, in order: ``len(held_in_dates)`` held-in then the held-out ones."""
    params = session_channel_params(cfg)
    return [_make_session(cfg, i, params[i], with_kinematics) for i in range(cfg.n_sessions)]


def idle_counts(cfg: HandwritingConfig, index: int, n_bins: int, rng: np.random.Generator,
                params: ChannelParams | None = None) -> np.ndarray:
    """``(n_bins, C)`` counts of session ``index`` while the participant rests (between trials)."""
    _check_index(cfg, index)
    if params is None:
        params = session_channel_params(cfg)[index]
    features = np.zeros((max(n_bins, 1), 6))
    latent = shared_latent(features.shape[0], cfg.population, cfg.bin_s, rng)
    rates = rates_hz(params, features, cfg.population, cfg.bin_s, latent)
    return spike_counts(rates, cfg.bin_s, cfg.population.overdispersion, rng)[:n_bins]
