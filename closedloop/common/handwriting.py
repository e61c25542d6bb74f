"""Data types shared by the handwriting generator, the NWB reader/writer and the decoders.

A recording is a list of sessions (days); a session holds trials, one prompted
sentence each, with the binned threshold crossings recorded while the participant
attempted to write it. This is the structure of FALCON H2 (192 channels, 20 ms
bins, labels are the prompted sentence only) whichever source the data come from:
the synthetic generator here or real FALCON H2 NWB files.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: FALCON H2's 31 characters; ``>`` is a space and ``~`` a period.
CHARSET = "abcdefghijklmnopqrstuvwxyz',?>~"
BIN_S = 0.02
N_CHANNELS = 192


@dataclass
class Trial:
    """One sentence: ``spikes`` (bins x channels, threshold-crossing counts) and its prompt."""

    spikes: np.ndarray
    sentence: str
    block: int = 0

    @property
    def n_bins(self) -> int:
        return int(self.spikes.shape[0])


@dataclass
class Session:
    """One recording day.

    ``split`` is ``"held_in"`` (training sessions) or ``"held_out"`` (later sessions).
    ``calibration`` lists the trial indices usable for calibration (FALCON: the first 3
    trials of a held-out session); ``evaluation`` the trials that are scored (the last
    40% of every session's trials).
    """

    name: str
    day: float
    split: str
    trials: list[Trial]
    calibration: list[int] = field(default_factory=list)
    evaluation: list[int] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    @property
    def n_channels(self) -> int:
        return int(self.trials[0].spikes.shape[1]) if self.trials else 0


def falcon_splits(n_trials: int, held_out: bool, n_calibration: int = 3) -> tuple[list[int], list[int]]:
    """(calibration, evaluation) trial indices as FALCON H2 defines them.

    Evaluation is the last 40% of the trials; calibration is the first ``n_calibration``
    trials of a held-out session (all non-evaluation trials of a held-in session).
    """
    n_eval = int(round(0.4 * n_trials))
    evaluation = list(range(n_trials - n_eval, n_trials))
    calibration = list(range(min(n_calibration, n_trials - n_eval))) if held_out else list(range(n_trials - n_eval))
    return calibration, evaluation
