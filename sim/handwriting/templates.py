"""Pen-trajectory templates of the 31 characters, and their smooth, time-warped velocity.

Each character is a list of strokes, each stroke a list of control points in
x-height units (baseline y=0, x-height y=1, ascender y=2, descender y=-1). The pen
moves through every point in order; the move between strokes (pen lifted) is motion
too, as it is in attempted handwriting. A template becomes a smooth path by giving
each segment a duration that grows with its length (plus a fixed cost per corner),
interpolating in time and smoothing with a Gaussian; the pen therefore slows at
corners and starts and ends each character near rest. :func:`char_velocity` samples
one instance at bin resolution with a monotone time warp. Shapes are our own design:
``>`` (space) and ``~`` (period) are drawn as their glyphs, a chevron and a tilde, as the
participant of the source experiment wrote them (Willett et al. 2021: ">" for space,
"~" for period); the trial builder adds a pause after each space. ``,``, ``'`` and ``?``
look like their glyphs too.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from closedloop.common.handwriting import CHARSET

__all__ = ["CHAR_STROKES", "char_path", "char_path_length", "char_velocity"]

Point = tuple[float, float]


def _arc(cx: float, cy: float, r: float, a0_deg: float, a1_deg: float, n: int = 0) -> list[Point]:
    """Points on a circular arc from angle a0 to a1 (degrees; a1 < a0 runs clockwise)."""
    n = n or max(3, int(abs(a1_deg - a0_deg) / 30) + 1)
    a = np.deg2rad(np.linspace(a0_deg, a1_deg, n))
    return [(cx + r * float(np.cos(t)), cy + r * float(np.sin(t))) for t in a]


def _dot(x: float, y: float, r: float = 0.08) -> list[Point]:
    return _arc(x, y, r, 90, 450, 9)


_BOWL = _arc(0.45, 0.5, 0.45, 20, 380)  # counter-clockwise bowl starting at the upper right

#: Strokes per character (see the module docstring for units).
CHAR_STROKES: dict[str, list[list[Point]]] = {
    "a": [_BOWL + [(0.9, 1.0), (0.9, 0.0)]],
    "b": [[(0.0, 2.0), (0.0, 0.0)] + _arc(0.45, 0.5, 0.45, 200, -160)],
    "c": [_arc(0.5, 0.5, 0.5, 45, 315)],
    "d": [_BOWL + [(0.9, 2.0), (0.9, 0.0)]],
    "e": [[(0.05, 0.5), (0.95, 0.5)] + _arc(0.5, 0.5, 0.45, 0, 320)],
    "f": [_arc(0.55, 1.6, 0.3, 30, 180) + [(0.25, 0.0)], [(0.0, 1.0), (0.6, 1.0)]],
    "g": [_BOWL + [(0.9, 1.0), (0.9, -0.6)] + _arc(0.5, -0.6, 0.4, 0, -180)],
    "h": [[(0.0, 2.0), (0.0, 0.0), (0.0, 0.6)] + _arc(0.42, 0.6, 0.42, 180, 0) + [(0.84, 0.0)]],
    "i": [[(0.1, 1.0), (0.1, 0.0)], _dot(0.1, 1.5)],
    "j": [[(0.5, 1.0), (0.5, -0.6)] + _arc(0.25, -0.6, 0.25, 0, -180), _dot(0.5, 1.5)],
    "k": [[(0.0, 2.0), (0.0, 0.0)], [(0.7, 1.0), (0.0, 0.4), (0.7, 0.0)]],
    "l": [[(0.0, 0.3), (0.3, 1.2), (0.35, 1.9), (0.15, 1.9), (0.2, 0.8), (0.4, 0.0)]],
    "m": [[(0.0, 1.0), (0.0, 0.0), (0.0, 0.6)] + _arc(0.25, 0.6, 0.25, 180, 0)
          + [(0.5, 0.0), (0.5, 0.6)] + _arc(0.75, 0.6, 0.25, 180, 0) + [(1.0, 0.0)]],
    "n": [[(0.0, 1.0), (0.0, 0.0), (0.0, 0.55)] + _arc(0.4, 0.55, 0.4, 180, 0) + [(0.8, 0.0)]],
    "o": [_arc(0.5, 0.5, 0.5, 90, 450)],
    "p": [[(0.0, 1.0), (0.0, -1.0)], [(0.0, 0.8)] + _arc(0.45, 0.5, 0.45, 160, -160)],
    "q": [_BOWL + [(0.9, 1.0), (0.9, -1.0), (1.1, -0.8)]],
    "r": [[(0.0, 1.0), (0.0, 0.0), (0.0, 0.6)] + _arc(0.4, 0.6, 0.4, 180, 60)],
    "s": [[(0.9, 0.9), (0.5, 1.0), (0.1, 0.85), (0.15, 0.6), (0.5, 0.5), (0.85, 0.4), (0.9, 0.15),
           (0.5, 0.0), (0.1, 0.1)]],
    "t": [[(0.3, 1.8), (0.3, 0.1), (0.5, 0.0), (0.7, 0.1)], [(0.0, 1.0), (0.65, 1.0)]],
    "u": [[(0.0, 1.0), (0.0, 0.35)] + _arc(0.4, 0.35, 0.4, 180, 360) + [(0.8, 1.0), (0.8, 0.0)]],
    "v": [[(0.0, 1.0), (0.45, 0.0), (0.9, 1.0)]],
    "w": [[(0.0, 1.0), (0.25, 0.0), (0.5, 0.7), (0.75, 0.0), (1.0, 1.0)]],
    "x": [[(0.0, 1.0), (0.8, 0.0)], [(0.8, 1.0), (0.0, 0.0)]],
    "y": [[(0.0, 1.0), (0.45, 0.0)], [(0.9, 1.0), (0.3, -0.9), (0.05, -0.8)]],
    "z": [[(0.0, 1.0), (0.8, 1.0), (0.0, 0.0), (0.8, 0.0)]],
    "'": [[(0.1, 2.0), (0.05, 1.45)]],
    ",": [[(0.15, 0.15), (0.12, -0.1), (-0.05, -0.45)]],
    "?": [_arc(0.4, 1.5, 0.4, 150, -60) + [(0.4, 0.9), (0.4, 0.5)], _dot(0.4, 0.1)],
    ">": [[(0.0, 1.0), (0.6, 0.5), (0.0, 0.0)]],
    "~": [[(0.0, 0.4), (0.2, 0.65), (0.45, 0.5), (0.7, 0.35), (0.9, 0.6)]],
}

assert set(CHAR_STROKES) == set(CHARSET), "every character of CHARSET needs a template"

_N_FINE = 200           # samples of the smooth path per character
_CORNER_COST = 0.15     # extra "length" per control point: the pen slows at corners
_SMOOTH_SIGMA = 0.035   # Gaussian smoothing, as a fraction of the character's duration


def _control_points(ch: str) -> np.ndarray:
    strokes = CHAR_STROKES[ch]
    return np.array([p for stroke in strokes for p in stroke], dtype=float)


@cache
def char_path(ch: str) -> np.ndarray:
    """The smooth pen path of ``ch`` as ``(200, 2)`` positions at uniform normalized time."""
    if ch not in CHAR_STROKES:
        raise KeyError(f"no pen template for character {ch!r}; characters: {CHARSET!r}")
    pts = _control_points(ch)
    seg = np.linalg.norm(np.diff(pts, axis=0), axis=1)
    knots = np.concatenate([[0.0], np.cumsum(seg + _CORNER_COST)])
    knots /= knots[-1]
    t = np.linspace(0.0, 1.0, _N_FINE)
    path = np.stack([np.interp(t, knots, pts[:, k]) for k in range(2)], axis=1)
    sigma = _SMOOTH_SIGMA * _N_FINE
    half = int(np.ceil(3 * sigma))
    kernel = np.exp(-0.5 * (np.arange(-half, half + 1) / sigma) ** 2)
    kernel /= kernel.sum()
    padded = np.concatenate([np.repeat(path[:1], half, 0), path, np.repeat(path[-1:], half, 0)])
    smooth = np.stack([np.convolve(padded[:, k], kernel, mode="valid") for k in range(2)], axis=1)
    smooth.setflags(write=False)
    return smooth


@cache
def char_path_length(ch: str) -> float:
    """Length of the smooth path of ``ch`` in x-heights (sets its nominal duration)."""
    return float(np.linalg.norm(np.diff(char_path(ch), axis=0), axis=1).sum())


def char_velocity(ch: str, n_bins: int, bin_s: float, warp: float = 0.0) -> np.ndarray:
    """Mean pen velocity (x-heights/s) in each of ``n_bins`` bins of one instance of ``ch``.

    ``warp`` in (-1, 1) bends time monotonically (``u = tau + warp * sin(pi tau) / pi``):
    positive values rush the start and linger at the end, negative ones the reverse.
    Velocities are position differences at bin edges, so they integrate exactly to
    the template's displacement.
    """
    if n_bins < 1:
        raise ValueError(f"a character needs at least one bin; got n_bins={n_bins}")
    if not -1.0 < warp < 1.0:
        raise ValueError(f"warp must lie in (-1, 1) to keep time monotone; got {warp}")
    path = char_path(ch)
    tau = np.linspace(0.0, 1.0, n_bins + 1)
    u = np.clip(tau + warp * np.sin(np.pi * tau) / np.pi, 0.0, 1.0)
    grid = np.linspace(0.0, 1.0, len(path))
    pos = np.stack([np.interp(u, grid, path[:, k]) for k in range(2)], axis=1)
    return np.diff(pos, axis=0) / bin_s
