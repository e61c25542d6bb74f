"""Configuration of the synthetic handwriting recording: one dataclass tree, JSON round-trip.

:class:`HandwritingConfig` holds everything that decides a synthetic recording: the
seed, channel count, session dates (FALCON H2's real dates by default), trials per
session, how sentences are written (:class:`WritingConfig`), how channels respond to
pen dynamics (:class:`PopulationConfig`) and how those responses drift across days
(:class:`DriftConfig`, the one place where drift magnitudes live). The same config
with the same seed always gives the same data (see ``docs/handwriting_data.md``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import date

from closedloop.common.config import JsonConfig
from closedloop.common.handwriting import BIN_S, N_CHANNELS

__all__ = ["HandwritingConfig", "WritingConfig", "PopulationConfig", "DriftConfig", "DRIFT_COMPONENTS",
           "FALCON_H2_HELD_IN_DATES", "FALCON_H2_HELD_OUT_DATES"]

#: FALCON H2's held-in session dates (from the falcon_challenge evaluator's session map).
FALCON_H2_HELD_IN_DATES: tuple[str, ...] = (
    "2022-05-18", "2022-05-23", "2022-05-25", "2022-06-01", "2022-06-03", "2022-06-06", "2022-06-08",
    "2022-06-13", "2022-06-15", "2022-06-22", "2022-09-01", "2022-09-29", "2022-10-06", "2022-10-18",
    "2022-10-25", "2022-10-27", "2022-11-01", "2022-11-03", "2022-12-08", "2022-12-15", "2023-02-28",
)
#: FALCON H2's held-out session dates.
FALCON_H2_HELD_OUT_DATES: tuple[str, ...] = ("2023-04-17", "2023-05-31", "2023-06-28", "2023-08-16", "2023-10-09")

#: Names of the drift components, each with its own magnitude in :class:`DriftConfig`.
DRIFT_COMPONENTS: tuple[str, ...] = ("tuning_rotation", "gain", "baseline", "unit_turnover", "noise")


@dataclass
class WritingConfig:
    """How a sentence becomes pen motion (durations in seconds)."""

    words_per_sentence: tuple[int, int] = (3, 9)
    question_prob: float = 0.15      # a sentence ends with ``?`` instead of ``~``
    comma_prob: float = 0.07         # a comma after a (non-final) word
    char_base_s: float = 0.25        # character duration = base + per_unit * path length
    char_per_unit_s: float = 0.09
    trial_speed_sd: float = 0.10     # log-normal sigma of a trial's overall writing speed
    char_speed_sd: float = 0.12      # log-normal sigma of each character instance's speed
    time_warp: float = 0.3           # max amplitude of the monotone time warp within a character
    transition_s: tuple[float, float] = (0.06, 0.14)
    space_pause_s: tuple[float, float] = (0.05, 0.20)
    pre_idle_s: tuple[float, float] = (0.4, 0.8)
    post_idle_s: tuple[float, float] = (0.2, 0.5)
    trials_per_block: int = 10       # FALCON trials carry a block number


@dataclass
class PopulationConfig:
    """How each channel's firing rate depends on the pen dynamics on the first day.

    log rate = log baseline + gain * (velocity_depth * cos(angle to preferred direction) * |v|/v_ref
    + accel_depth * (same for acceleration) + speed_gain * |v|/v_ref + writing_gain * writing)
    + shared latent noise; rates are in Hz, velocity in x-heights per second.
    """

    baseline_hz: float = 10.0        # median baseline rate (log-normal across channels); calibrated, see below
    baseline_spread: float = 0.6
    velocity_depth: float = 3.0      # mean |modulation| per v_ref, log units; calibrated
    depth_spread: float = 0.3
    accel_depth: float = 1.0         # calibrated
    speed_gain: float = 0.15
    writing_gain: float = 0.3        # condition-independent "writing" component
    v_ref: float = 4.0               # x-heights per second
    a_ref: float = 40.0              # x-heights per second^2
    lag_s: float = 0.1               # neural activity leads the pen by this much
    dead_fraction: float = 0.08      # channels without a unit on day 0
    dead_rate_hz: float = 1.5
    overdispersion: float = 0.1      # gamma-Poisson: variance = mean + overdispersion * mean^2 (0: Poisson)
    shared_noise: float = 0.08       # SD of shared latent log-rate fluctuations; calibrated
    shared_noise_dims: int = 3
    shared_noise_tau_s: float = 0.3
    max_rate_hz: float = 400.0


@dataclass
class DriftConfig:
    """Cross-session drift: independent random walks in day units (std grows as sqrt(days)).

    Every magnitude below is multiplied by ``scale``; set one to 0 (or use
    :meth:`HandwritingConfig.ablate`) to switch that component off. ``scale`` (0.9) and
    the population's signal settings were calibrated against FALCON H2's published
    figures with ``bench/calibrate_bci_drift.py`` (docs/handwriting_data.md,
    "Calibration"); the generator is frozen at these values.
    """

    scale: float = 0.9
    tuning_rotation: float = 0.03    # preferred-direction angle, rad per sqrt(day), per channel
    gain: float = 0.02               # log modulation gain per sqrt(day) (per channel + array-wide)
    baseline: float = 0.03           # log baseline rate per sqrt(day) (per channel + array-wide)
    unit_turnover: float = 0.001     # per-channel hazard per day that the recorded unit changes
    noise: float = 0.08              # unmodulated background rate, Hz per sqrt(day), per channel
    array_wide: float = 0.5          # array-wide walk std relative to the per-channel one (gain, baseline)
    turnover_loss: float = 0.4       # probability that a turnover leaves the channel without a unit
    # Abrupt changes: each session's own jump, drawn afresh per session and not carried to the next (a
    # re-implanted reference, a headstage swap, a new amplifier setting). 0 (default) leaves the data as the
    # walks above make it. Not multiplied by ``scale``.
    session_rotation: float = 0.0    # SD of each session's own preferred-direction offset, rad, per channel
    session_gain: float = 0.0        # SD of each session's own log gain jump (per channel + array-wide part)
    session_baseline: float = 0.0    # SD of each session's own log baseline jump (per channel + array-wide)

    def magnitude(self, component: str) -> float:
        """Effective magnitude of ``component`` (its field times ``scale``)."""
        if component not in DRIFT_COMPONENTS:
            raise ValueError(f"unknown drift component {component!r}; expected one of {', '.join(DRIFT_COMPONENTS)}")
        return float(self.scale) * float(getattr(self, component))


@dataclass
class HandwritingConfig(JsonConfig):
    """A synthetic FALCON H2-like recording; every random draw follows from ``seed``."""

    seed: int = 0
    n_channels: int = N_CHANNELS
    bin_s: float = BIN_S
    held_in_dates: tuple[str, ...] = FALCON_H2_HELD_IN_DATES
    held_out_dates: tuple[str, ...] = FALCON_H2_HELD_OUT_DATES
    trials_per_session: int = 40
    n_calibration: int = 3
    writing: WritingConfig = field(default_factory=WritingConfig)
    population: PopulationConfig = field(default_factory=PopulationConfig)
    drift: DriftConfig = field(default_factory=DriftConfig)

    def __post_init__(self) -> None:
        self.held_in_dates = tuple(self.held_in_dates)
        self.held_out_dates = tuple(self.held_out_dates)
        dates = self.dates
        if not self.held_in_dates:
            raise ValueError("HandwritingConfig needs at least one held-in date")
        if any(b <= a for a, b in zip(dates, dates[1:], strict=False)):
            raise ValueError(f"session dates must increase (held-in, then held-out); got {list(map(str, dates))}")
        if self.n_channels < 1 or self.trials_per_session < 1:
            raise ValueError(f"n_channels and trials_per_session must be >= 1; got {self.n_channels}, "
                             f"{self.trials_per_session}")

    # -- sessions ------------------------------------------------------------------------------
    @property
    def dates(self) -> list[date]:
        return [date.fromisoformat(d) for d in self.held_in_dates + self.held_out_dates]

    @property
    def n_sessions(self) -> int:
        return len(self.held_in_dates) + len(self.held_out_dates)

    @property
    def days(self) -> list[float]:
        """Days since the first session, per session index."""
        dates = self.dates
        return [float((d - dates[0]).days) for d in dates]

    def split_of(self, index: int) -> str:
        return "held_in" if index < len(self.held_in_dates) else "held_out"

    # -- variants ------------------------------------------------------------------------------
    @classmethod
    def tiny(cls, seed: int = 0) -> HandwritingConfig:
        """16 channels, 3 held-in + 2 held-out sessions, 8 short trials: generates in well under 1 s."""
        return cls(seed=seed, n_channels=16, trials_per_session=8,
                   held_in_dates=("2022-05-18", "2022-06-22", "2023-02-28"),
                   held_out_dates=("2023-04-17", "2023-10-09"),
                   writing=WritingConfig(words_per_sentence=(1, 3)))

    def with_session_jumps(self, rotation: float = 0.3, gain: float = 0.2, baseline: float = 0.3
                           ) -> HandwritingConfig:
        """A copy in which every session also jumps on its own (``DriftConfig.session_*``): each day's own
        rotation, gain and baseline change on top of the slow walks."""
        return dataclasses.replace(self, drift=dataclasses.replace(
            self.drift, session_rotation=rotation, session_gain=gain, session_baseline=baseline))

    def ablate(self, component: str) -> HandwritingConfig:
        """A copy with one drift component switched off (``"all"``: no drift at all)."""
        if component == "all":
            return dataclasses.replace(self, drift=dataclasses.replace(self.drift, scale=0.0))
        self.drift.magnitude(component)  # validates the name
        return dataclasses.replace(self, drift=dataclasses.replace(self.drift, **{component: 0.0}))
