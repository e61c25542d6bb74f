"""Synthetic handwriting trials streamed bin by bin: ``sim://headstage?source=handwriting&session=21``.

The source plays one session of the synthetic handwriting recording
(:mod:`closedloop.sim.handwriting`): ``gap_s`` seconds of resting activity, then a trial (one
prompted sentence, bin by bin), then the next gap and trial, and after the last
trial it starts the session again (or rests, with ``loop=0``). Trials are generated
one at a time as they are reached, so starting is instant even at 192 channels.
``session`` is the index into the recording (0-20 held-in, 21-25 held-out with the
default preset); ``channels`` (a headstage parameter) and ``seed`` set the recording's
channel count and seed. :meth:`HandwritingSource.report` gives the current prompt, so a
demo can show the prompted sentence beside the decoded text.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from closedloop.common.handwriting import Trial

from ..handwriting.config import HandwritingConfig
from ..handwriting.generator import idle_counts, iter_trials, session_name
from ..handwriting.population import session_channel_params, stream
from ..params import Param
from .base import NeuralSource, register_source

__all__ = ["HandwritingSource", "PRESETS"]

#: Recording presets by name.
PRESETS = {"default": HandwritingConfig, "tiny": HandwritingConfig.tiny}
_GAP_STREAM = 5  # random stream key of the resting bins between trials


@register_source("handwriting")
class HandwritingSource(NeuralSource):
    """One synthetic handwriting session, trial after trial, with resting gaps between them."""

    PARAMS = (
        Param("session", int, 0, "session index (default preset: 0-20 held-in, 21-25 held-out)", low=0),
        Param("preset", str, "default", "recording preset", choices=lambda: PRESETS),
        Param("trials", int, 0, "trials in the session (0: the preset's)", low=0, high=100_000),
        Param("gap_s", float, 1.0, "resting seconds before each trial", 0.0, 3600.0),
        Param("loop", bool, True, "start the session again after its last trial (else rest)"),
        Param("first_trial", int, 0, "start at this trial (e.g. the first evaluation trial); loops restart at 0",
              low=0, high=100_000),
    )

    def __init__(self, n_channels: int, rate_hz: float, seed: int = 0, *, session: int = 0,
                 preset: str = "default", trials: int = 0, gap_s: float = 1.0, loop: bool = True,
                 first_trial: int = 0) -> None:
        super().__init__(n_channels, rate_hz, seed)
        if preset not in PRESETS:
            raise ValueError(f"unknown handwriting preset {preset!r}; expected one of {', '.join(PRESETS)}")
        self.session_index, self.preset, self.trials = int(session), preset, int(trials)
        self.gap_bins = int(round(gap_s * rate_hz))
        self.loop = bool(loop)
        self.first_trial = int(first_trial)
        self.reset(seed)

    def _config(self, seed: int) -> HandwritingConfig:
        cfg = PRESETS[self.preset](seed=seed)
        cfg.n_channels = self.n_channels
        if self.trials:
            cfg.trials_per_session = self.trials
        if not 0 <= self.session_index < cfg.n_sessions:
            raise ValueError(f"handwriting source: session={self.session_index} is outside 0..{cfg.n_sessions - 1} "
                             f"for preset {self.preset!r} ({len(cfg.held_in_dates)} held-in + "
                             f"{len(cfg.held_out_dates)} held-out sessions)")
        return cfg

    def reset(self, seed: int | None = None) -> None:
        if seed is not None:
            self.seed = seed
        self.config = self._config(int(self.seed))
        self.params = session_channel_params(self.config)[self.session_index]
        self._gap_rng = stream(self.config.seed, _GAP_STREAM, self.session_index)
        self._trials: Iterator[tuple[Trial, Any]] = iter_trials(self.config, self.session_index, self.params)
        self.trial_index = -1
        if self.first_trial >= self.config.trials_per_session:
            raise ValueError(f"handwriting source: first_trial={self.first_trial} but the session has "
                             f"{self.config.trials_per_session} trials (0..{self.config.trials_per_session - 1})")
        for _ in range(self.first_trial):  # same random streams as the whole session: skip, don't reseed
            next(self._trials)
            self.trial_index += 1
        self.trial: Trial | None = None
        self._block = np.zeros((0, self.n_channels), dtype=np.uint8)
        self._pos = 0
        self._phase = "start"  # start, gap, trial or rest (after the last trial with loop=0)
        self.bin_index = 0

    def _next_block(self) -> None:
        """Queue the next block: a resting gap before each trial, then the trial."""
        if self._phase != "gap" and self.gap_bins > 0:
            self._phase, self._block = "gap", self._gap(self.gap_bins)
            return
        item = next(self._trials, None)
        if item is None:
            if not self.loop:  # the session is over: rest from now on
                self.trial = None
                self._phase, self._block = "rest", self._gap(max(self.gap_bins, 50))
                return
            self._trials = iter_trials(self.config, self.session_index, self.params)
            self.trial_index = -1
            item = next(self._trials)
        self.trial_index += 1
        self.trial = item[0]
        self._phase, self._block = "trial", self.trial.spikes

    def _gap(self, n_bins: int) -> np.ndarray:
        if n_bins <= 0:
            return np.zeros((0, self.n_channels), dtype=np.uint8)
        return idle_counts(self.config, self.session_index, n_bins, self._gap_rng, self.params)

    def next_bin(self) -> np.ndarray:
        while self._pos >= self._block.shape[0]:
            self._pos = 0
            self._next_block()
        row = self._block[self._pos].astype(np.uint16)
        self._pos += 1
        self.bin_index += 1
        return row

    @property
    def current_sentence(self) -> str:
        """The prompt being written now ("" while resting)."""
        return self.trial.sentence if (self._phase == "trial" and self.trial is not None) else ""

    def report(self) -> dict[str, Any]:
        """State for a device REPORT: the session, the trial and its prompted sentence."""
        return {"session": session_name((self.config.held_in_dates + self.config.held_out_dates)[self.session_index]),
                "session_index": self.session_index, "split": self.config.split_of(self.session_index),
                "day": self.config.days[self.session_index], "trial": self.trial_index,
                "sentence": self.current_sentence, "in_trial": self._phase == "trial",
                "bin_in_trial": self._pos - 1 if self._phase == "trial" else None}
