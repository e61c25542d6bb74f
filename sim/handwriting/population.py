"""The neural population: per-channel tuning to pen dynamics, its drift across days, and firing rates.

Each channel records one unit (or none: a "dead" channel fires at a low unmodulated
rate). A unit's log firing rate is its baseline plus a gain times a linear function of
the pen features (cosine tuning to velocity and acceleration direction, a speed term,
and a condition-independent "writing" term), plus shared latent noise; an unmodulated
background rate is added on top. Across sessions the parameters drift by independent
random walks in day units, one per component of :class:`~.config.DriftConfig`:

- ``tuning_rotation``: each unit's preferred directions rotate (rad per sqrt(day));
- ``gain``: log modulation gain, per channel plus an array-wide part (mean-preserving);
- ``baseline``: log baseline rate, per channel plus an array-wide part (mean-preserving);
- ``unit_turnover``: with a hazard per day a channel's unit is replaced by a new one
  or lost (the channel goes dead);
- ``noise``: an unmodulated background rate (Hz) that grows like |random walk|.

Every component draws from its own random stream whatever the magnitudes are, so
switching one off leaves the others bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import DRIFT_COMPONENTS, HandwritingConfig, PopulationConfig

__all__ = ["ChannelParams", "session_channel_params", "rates_hz", "shared_latent", "stream"]

_LOG_RATE_RANGE = (-6.0, 8.0)


def stream(seed: int, *key: int) -> np.random.Generator:
    """An independent random stream for one purpose (``key``) of a recording with ``seed``."""
    return np.random.default_rng(np.random.SeedSequence(int(seed), spawn_key=tuple(int(k) for k in key)))


@dataclass
class ChannelParams:
    """Every channel's response parameters on one session (arrays of shape ``(C,)``)."""

    alive: np.ndarray
    log_baseline: np.ndarray
    vel_angle: np.ndarray
    acc_angle: np.ndarray
    vel_depth: np.ndarray
    acc_depth: np.ndarray
    speed_gain: np.ndarray
    writing_gain: np.ndarray
    log_gain: np.ndarray
    noise_hz: np.ndarray
    shared_loadings: np.ndarray   # (C, K), fixed across sessions

    def loadings(self, pop: PopulationConfig) -> np.ndarray:
        """``(6, C)`` map from the pen features (vx, vy, ax, ay, speed, writing) to log rate."""
        g = np.exp(self.log_gain) * self.alive
        return np.stack([
            self.vel_depth * np.cos(self.vel_angle) / pop.v_ref,
            self.vel_depth * np.sin(self.vel_angle) / pop.v_ref,
            self.acc_depth * np.cos(self.acc_angle) / pop.a_ref,
            self.acc_depth * np.sin(self.acc_angle) / pop.a_ref,
            self.speed_gain / pop.v_ref,
            self.writing_gain,
        ]) * g[None, :]


_UNIT_FIELDS = ("log_baseline", "vel_angle", "acc_angle", "vel_depth", "acc_depth", "speed_gain", "writing_gain")


def _draw_units(pop: PopulationConfig, rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """Fresh units (a fixed number of draws, whatever the config values)."""
    z = rng.standard_normal((7, n))
    u = rng.uniform(0.0, 2.0 * np.pi, (2, n))
    return {
        "log_baseline": np.log(pop.baseline_hz) + pop.baseline_spread * z[0],
        "vel_angle": u[0],
        "acc_angle": u[1],
        "vel_depth": np.abs(pop.velocity_depth + pop.depth_spread * z[1]),
        "acc_depth": np.abs(pop.accel_depth * (1.0 + 0.5 * z[2])),
        "speed_gain": pop.speed_gain * (1.0 + z[3]),
        "writing_gain": pop.writing_gain * (1.0 + z[4]),
        "dead_log_baseline": np.log(pop.dead_rate_hz) + 0.3 * z[5],
    }


def _walk(z: np.ndarray, days: np.ndarray) -> np.ndarray:
    """Random walk at the session days from unit normal steps ``z`` (sessions first)."""
    dt = np.sqrt(np.diff(days, prepend=days[0]))
    shape = (-1,) + (1,) * (z.ndim - 1)
    return np.cumsum(z * dt.reshape(shape), axis=0)


def session_channel_params(cfg: HandwritingConfig) -> list[ChannelParams]:
    """Channel parameters of every session of ``cfg``, in session order (drift applied)."""
    pop, drift = cfg.population, cfg.drift
    n_sessions, n_ch = cfg.n_sessions, cfg.n_channels
    days = np.asarray(cfg.days, dtype=float)

    rng0 = stream(cfg.seed, 0)
    units = _draw_units(pop, rng0, n_ch)
    alive = rng0.random(n_ch) >= pop.dead_fraction
    units["log_baseline"] = np.where(alive, units["log_baseline"], units["dead_log_baseline"])
    loadings = rng0.standard_normal((n_ch, pop.shared_noise_dims)) * pop.shared_noise / np.sqrt(
        max(pop.shared_noise_dims, 1))

    walks = {}
    for j, name in enumerate(DRIFT_COMPONENTS):
        rng = stream(cfg.seed, 1, j)
        if name == "unit_turnover":
            continue
        per_channel = _walk(rng.standard_normal((n_sessions, n_ch)), days)
        array_wide = _walk(rng.standard_normal(n_sessions), days)
        mag = drift.magnitude(name)
        if name in ("gain", "baseline"):
            # Mean-preserving in rate: subtract half the walk's variance so E[exp(walk)] stays 1.
            per_channel = per_channel + drift.array_wide * array_wide[:, None]
            variance = mag**2 * (1.0 + drift.array_wide**2) * (days - days[0])
            walks[name] = mag * per_channel - 0.5 * variance[:, None]
        else:
            walks[name] = mag * per_channel

    # Each session's own jumps: a stream of their own, drawn only when asked for, so the default data
    # (and every other draw) stay bit-identical.
    jumps = {name: np.zeros((n_sessions, n_ch)) for name in ("rotation", "gain", "baseline")}
    for j, (name, sd) in enumerate((("rotation", drift.session_rotation), ("gain", drift.session_gain),
                                    ("baseline", drift.session_baseline))):
        if sd < 0:
            raise ValueError(f"DriftConfig.session_{name} must be >= 0 (an SD); got {sd}")
        if sd == 0:
            continue
        rng = stream(cfg.seed, 2, j)
        per_channel = rng.standard_normal((n_sessions, n_ch))
        if name == "rotation":
            jumps[name] = sd * per_channel
        else:  # per channel + array-wide, mean-preserving in rate like the walks
            z = per_channel + drift.array_wide * rng.standard_normal(n_sessions)[:, None]
            jumps[name] = sd * z - 0.5 * sd**2 * (1.0 + drift.array_wide**2)
    walks["tuning_rotation"] = walks["tuning_rotation"] + jumps["rotation"]
    walks["gain"] = walks["gain"] + jumps["gain"]
    walks["baseline"] = walks["baseline"] + jumps["baseline"]

    turnover_rng = stream(cfg.seed, 1, DRIFT_COMPONENTS.index("unit_turnover"))
    hazard = drift.magnitude("unit_turnover")
    base = {k: units[k].copy() for k in _UNIT_FIELDS}
    out: list[ChannelParams] = []
    for i in range(n_sessions):
        if i > 0:
            event_u, loss_u = turnover_rng.random(n_ch), turnover_rng.random(n_ch)
            fresh = _draw_units(pop, turnover_rng, n_ch)
            p_event = 1.0 - np.exp(-hazard * (days[i] - days[i - 1]))
            event = event_u < p_event
            lost = event & (loss_u < drift.turnover_loss)
            born = event & ~lost
            alive = (alive & ~lost) | born
            for k in _UNIT_FIELDS:
                base[k] = np.where(born, fresh[k], base[k])
            base["log_baseline"] = np.where(lost, fresh["dead_log_baseline"], base["log_baseline"])
        out.append(ChannelParams(
            alive=alive.copy(),
            log_baseline=base["log_baseline"] + walks["baseline"][i],
            vel_angle=base["vel_angle"] + walks["tuning_rotation"][i],
            acc_angle=base["acc_angle"] + walks["tuning_rotation"][i],
            vel_depth=base["vel_depth"].copy(),
            acc_depth=base["acc_depth"].copy(),
            speed_gain=base["speed_gain"].copy(),
            writing_gain=base["writing_gain"].copy(),
            log_gain=walks["gain"][i].copy(),
            noise_hz=np.abs(walks["noise"][i]),
            shared_loadings=loadings,
        ))
    return out


def shared_latent(n_bins: int, pop: PopulationConfig, bin_s: float, rng: np.random.Generator) -> np.ndarray:
    """Unit-variance AR(1) latent noise of shape ``(n_bins, K)`` with time constant ``shared_noise_tau_s``."""
    k = pop.shared_noise_dims
    e = rng.standard_normal((n_bins, k))
    if k == 0 or n_bins == 0:
        return e
    rho = float(np.exp(-bin_s / max(pop.shared_noise_tau_s, 1e-9)))
    if rho < 1e-3:  # time constant far below one bin: white noise
        return e
    e[1:] *= np.sqrt(1.0 - rho**2)
    z = np.empty_like(e)
    state = e[0] / rho  # so that z_0 = e_0 (stationary start)
    chunk = 256  # rho**-chunk stays far from overflow for any tau >= one bin
    powers = rho ** np.arange(1, chunk + 1)
    for start in range(0, n_bins, chunk):
        block = e[start:start + chunk].copy()
        if start == 0:
            block[0] = 0.0
        m = block.shape[0]
        p = powers[:m]
        # z_t = rho^t z_0 + sum_{s<=t} rho^(t-s) e_s, written with cumulative sums per chunk.
        z[start:start + m] = p[:, None] * (state[None, :] + np.cumsum(block / p[:, None], axis=0))
        state = z[start + m - 1]
    return z


def rates_hz(params: ChannelParams, features: np.ndarray, pop: PopulationConfig, bin_s: float,
             latent: np.ndarray | None = None) -> np.ndarray:
    """Firing rates ``(bins, C)`` in Hz for pen ``features`` ``(bins, 6)`` (neural lead applied here)."""
    lag = int(round(pop.lag_s / bin_s))
    if lag > 0 and features.shape[0] > 0:
        features = np.concatenate([features[lag:], np.repeat(features[-1:], min(lag, features.shape[0]), 0)])
    log_rate = params.log_baseline[None, :] + features @ params.loadings(pop)
    if latent is not None:
        log_rate = log_rate + latent @ params.shared_loadings.T
    rate = np.exp(np.clip(log_rate, *_LOG_RATE_RANGE))
    return np.minimum(rate, pop.max_rate_hz) + params.noise_hz[None, :]
