"""A tiny learnable stand-in for a handwriting recording, for tests and quick checks.

Each character has a fixed random firing pattern over the channels; a trial writes
its sentence character by character (a few bins each, with jittered durations) and
records Poisson counts of the pattern's rates. Each day mixes the channels a little
more (a random walk on a mixing matrix) and shifts baselines, so held-out days
drift away from held-in ones. It has the same types as the real generator
(:mod:`closedloop.sim.handwriting`) and runs in milliseconds; it is not a model of neural
data (use ``closedloop.sim.handwriting.generate_recording`` for that).
"""

from __future__ import annotations

import numpy as np

from closedloop.common.handwriting import CHARSET, Session, Trial, falcon_splits

TOY_WORDS = ("a", "an", "the", "cat", "hat", "sat", "on", "mat", "dog", "ran", "to", "it", "is", "was", "he", "she")


def toy_sentence(rng: np.random.Generator, max_words: int = 3) -> str:
    words = [TOY_WORDS[i] for i in rng.integers(len(TOY_WORDS), size=int(rng.integers(1, max_words + 1)))]
    return ">".join(words) + ("~" if rng.random() < 0.7 else "?")


def toy_recording(n_channels: int = 16, n_held_in: int = 3, n_held_out: int = 2, n_trials: int = 10,
                  bins_per_char: int = 4, drift: float = 0.3, seed: int = 0) -> list[Session]:
    """Sessions on days 0, 1, ... (held-in first, then held-out), FALCON-style splits."""
    rng = np.random.default_rng(seed)
    patterns = rng.gamma(2.0, 0.6, size=(len(CHARSET) + 1, n_channels))  # last row: rest
    mix = np.eye(n_channels)
    base = np.zeros(n_channels)
    sessions = []
    for day in range(n_held_in + n_held_out):
        mix = mix + drift * rng.normal(size=mix.shape) / np.sqrt(n_channels)
        base = base + 0.2 * drift * rng.normal(size=n_channels)
        trials = []
        for _ in range(n_trials):
            sentence = toy_sentence(rng)
            rows = [patterns[-1]] * 3
            for ch in sentence:
                rows += [patterns[CHARSET.index(ch)]] * int(rng.integers(bins_per_char - 1, bins_per_char + 2))
                rows += [patterns[-1]]
            rows += [patterns[-1]] * 3
            rates = np.clip(np.asarray(rows) @ np.abs(mix) + base, 0.02, None)
            trials.append(Trial(rng.poisson(rates).astype(np.float32), sentence))
        held_out = day >= n_held_in
        calibration, evaluation = falcon_splits(n_trials, held_out)
        sessions.append(Session(f"toy-{day:02d}", float(day), "held_out" if held_out else "held_in", trials,
                                calibration, evaluation))
    return sessions
