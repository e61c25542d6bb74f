"""One trial's pen dynamics: a prompted sentence becomes per-bin velocity, speed and a writing signal.

A trial is: idle bins (the participant reads the prompt), then each character written
at its own speed and time warp with a short smooth pen transition to the start of the
next character (x advances by the character's width plus a gap), a pause after each
``>`` (space), and idle bins after the last character. The result feeds the neural
population model (:mod:`.population`) as the kinematic features per bin.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import WritingConfig
from .templates import char_path, char_path_length, char_velocity

__all__ = ["TrialKinematics", "trial_kinematics", "N_FEATURES"]

#: Features per bin: vx, vy, ax, ay, speed, writing.
N_FEATURES = 6
_GAP_X = 0.3            # x-heights between characters
_WRITING_RAMP_BINS = 5  # the writing signal rises and falls over ~100 ms


@dataclass
class TrialKinematics:
    """Per-bin pen dynamics of one trial.

    ``features`` is ``(bins, 6)``: velocity (x-heights/s), acceleration, speed and the
    writing envelope in [0, 1]. ``char_onsets[i]`` is the first bin of character ``i``
    of ``sentence`` (kept for diagnostics; FALCON labels have no character timing).
    """

    sentence: str
    features: np.ndarray
    char_onsets: np.ndarray

    @property
    def velocity(self) -> np.ndarray:
        return self.features[:, :2]


def _min_jerk_velocity(displacement: np.ndarray, n_bins: int, bin_s: float) -> np.ndarray:
    tau = np.linspace(0.0, 1.0, n_bins + 1)
    s = 10 * tau**3 - 15 * tau**4 + 6 * tau**5
    return np.diff(s)[:, None] * displacement[None, :] / bin_s


def _bins(seconds: float, bin_s: float) -> int:
    return max(1, int(round(seconds / bin_s)))


def trial_kinematics(sentence: str, cfg: WritingConfig, bin_s: float, rng: np.random.Generator) -> TrialKinematics:
    """Pen dynamics of one attempt to write ``sentence`` (random draws from ``rng``)."""
    trial_speed = float(np.exp(rng.normal(0.0, cfg.trial_speed_sd)))
    pieces: list[np.ndarray] = [np.zeros((_bins(rng.uniform(*cfg.pre_idle_s), bin_s), 2))]
    onsets: list[int] = []
    n_written = pieces[0].shape[0]
    writing_start = n_written
    x_offset = 0.0
    pen = np.zeros(2)  # pen position at the end of the previous character
    for k, ch in enumerate(sentence):
        path = char_path(ch)
        if k > 0:
            # Pen transition from the end of the previous character to the start of this one.
            target = path[0] + np.array([x_offset, 0.0])
            n_tr = _bins(rng.uniform(*cfg.transition_s), bin_s)
            pieces.append(_min_jerk_velocity(target - pen, n_tr, bin_s))
            n_written += n_tr
        duration = (cfg.char_base_s + cfg.char_per_unit_s * char_path_length(ch)) / trial_speed
        duration *= float(np.exp(rng.normal(0.0, cfg.char_speed_sd)))
        warp = float(rng.uniform(-cfg.time_warp, cfg.time_warp))
        n_ch = _bins(duration, bin_s)
        onsets.append(n_written)
        pieces.append(char_velocity(ch, n_ch, bin_s, warp))
        n_written += n_ch
        pen = path[-1] + np.array([x_offset, 0.0])
        if ch == ">":
            n_pause = _bins(rng.uniform(*cfg.space_pause_s), bin_s)
            pieces.append(np.zeros((n_pause, 2)))
            n_written += n_pause
        x_offset += float(path[:, 0].max() - min(path[:, 0].min(), 0.0)) + _GAP_X
    writing_stop = n_written
    pieces.append(np.zeros((_bins(rng.uniform(*cfg.post_idle_s), bin_s), 2)))
    velocity = np.concatenate(pieces)
    n = velocity.shape[0]
    accel = np.gradient(velocity, bin_s, axis=0) if n > 1 else np.zeros_like(velocity)
    speed = np.linalg.norm(velocity, axis=1)
    writing = np.zeros(n)
    writing[writing_start:writing_stop] = 1.0
    ramp = np.ones(_WRITING_RAMP_BINS) / _WRITING_RAMP_BINS
    writing = np.convolve(writing, ramp, mode="same")
    features = np.column_stack([velocity, accel, speed, writing])
    return TrialKinematics(sentence, features, np.asarray(onsets, dtype=np.int64))
