"""Fit the odd rational approximation of tanh that ``closedloop.runtime.kernels.fast_tanh`` uses.

Finds ``tanh(x) ~ x * P(x^2) / Q(x^2)`` on ``[0, c]`` with ``Q(0) = 1``, close to the
minimax (smallest maximum absolute error) one, and prints the coefficients to paste
into ``fast_tanh`` together with the maximum error of the float32 evaluation over
``[-10, 10]``, clamping at ``c`` as the kernel does. numpy only; runs in seconds::

    python tools/fit_tanh.py            # the defaults fast_tanh was built from
    python tools/fit_tanh.py --p 5 --q 3 --clamp 8.5

Notes
-----
The fit is Loeb's method with Lawson's weights. For a fixed denominator ``Q_k``
from the previous iteration, ``x P - f Q = Q_k e`` is linear in the unknown
coefficients, so dividing each row by ``Q_k(x_i^2)`` turns a weighted least-squares
solve into a near-fit of the true error ``e = x P / Q - f`` (Loeb). Lawson's update
``w_i <- w_i |e_i|`` then moves weight onto the points where the error peaks, which
drives the weighted least-squares solution towards the minimax one (equioscillating
error). Coefficients are solved in the scaled variable ``s = x^2 / c^2`` on Chebyshev
points (well conditioned), then converted to powers of ``x^2``.

Past ``c`` the kernel returns ``x c P(c^2) / Q(c^2)``'s value at ``c``, so ``c`` must
make ``1 - tanh(c) ~ 2 exp(-2c)`` small against the error budget (9 gives 3e-8).
"""

from __future__ import annotations

import argparse

import numpy as np


def fit(p_degree: int, q_degree: int, clamp: float, points: int = 3000, iterations: int = 400):
    """Return ``(p, q)``: coefficients of ``P`` and ``Q`` in powers of ``x^2``, lowest first, ``q[0] = 1``."""
    s = (1 - np.cos(np.linspace(0, np.pi, points))) / 2  # Chebyshev points of [0, 1], both ends included
    x = clamp * np.sqrt(s)
    f = np.tanh(x)
    # One more row at c with target 1: past c the kernel returns R(c) for every
    # tanh(x) in (tanh(c), 1), so the error there is at most max|R(c) - {tanh(c), 1}|.
    s, x, f = np.append(s, 1.0), np.append(x, clamp), np.append(f, 1.0)
    points += 1
    sp = s[:, None] ** np.arange(p_degree + 1)
    sq = s[:, None] ** np.arange(1, q_degree + 1)
    # Row i: x P(s) - f (Q(s) - 1) = f, unknowns [p_0..p_m, q_1..q_n].
    a = np.hstack([x[:, None] * sp, -f[:, None] * sq])
    weights = np.full(points, 1.0 / points)
    denominator = np.ones(points)
    best = (np.inf, None)
    for _ in range(iterations):
        row = np.sqrt(weights) / np.abs(denominator)
        coef = np.linalg.lstsq(a * row[:, None], f * row, rcond=None)[0]
        num = x * (sp @ coef[: p_degree + 1])
        denominator = 1 + sq @ coef[p_degree + 1 :]
        err = np.abs(num / denominator - f)
        if err.max() < best[0]:
            best = (err.max(), coef)
        weights = weights * (err + 1e-30)
        weights /= weights.sum()
    coef = best[1]
    scale = clamp**-2.0
    p = coef[: p_degree + 1] * scale ** np.arange(p_degree + 1)
    q = np.concatenate([[1.0], coef[p_degree + 1 :] * scale ** np.arange(1, q_degree + 1)])
    return p, q


def evaluate_float32(x: np.ndarray, p: np.ndarray, q: np.ndarray, clamp: float) -> np.ndarray:
    """``fast_tanh`` step by step in float32 (Horner, no FMA; NaN-preserving clamps of x and result)."""
    x = np.asarray(x, dtype=np.float32)
    c = np.float32(clamp)
    x = np.where(x > c, c, x)
    x = np.where(x < -c, -c, x)
    x2 = x * x
    pp = np.float32(p[-1])
    for k in p[-2::-1]:
        pp = pp * x2 + np.float32(k)
    qq = np.float32(q[-1])
    for k in q[-2::-1]:
        qq = qq * x2 + np.float32(k)
    y = x * pp / qq
    return np.where(y > 1, np.float32(1), np.where(y < -1, np.float32(-1), y))


def grid() -> np.ndarray:
    """Dense float32 test points: [-10, 10] in steps of ~5e-6, plus tiny, huge and infinite values."""
    dense = np.linspace(-10, 10, 4_000_001, dtype=np.float64)
    extra = [0.0, 1e-30, -1e-30, 1e-7, -1e-7, 30.0, -30.0, 1e4, -1e4, 3e38, -3e38, np.inf, -np.inf]
    return np.concatenate([dense, extra]).astype(np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--p", type=int, default=4, help="degree of P in x^2 (default 4)")
    parser.add_argument("--q", type=int, default=4, help="degree of Q in x^2 (default 4)")
    parser.add_argument("--clamp", type=float, default=9.0, help="inputs beyond +-clamp saturate (default 9)")
    args = parser.parse_args()
    clamp = float(np.float32(args.clamp))
    p, q = fit(args.p, args.q, clamp)
    x = grid()
    exact = np.tanh(x.astype(np.float64))
    on_range = np.abs(x) <= clamp
    x64 = x[on_range].astype(np.float64)
    fit64 = x64 * np.polyval(p[::-1], x64**2) / np.polyval(q[::-1], x64**2)
    got = evaluate_float32(x, p, q, clamp).astype(np.float64)
    err = np.abs(got - exact)
    print(f"tanh(x) ~ x P(x^2) / Q(x^2), P of degree {args.p}, Q of degree {args.q}, clamped at +-{clamp!r}")
    print(f"P (lowest power first): {', '.join(str(np.float32(k)) for k in p)}")
    print(f"Q (lowest power first): {', '.join(str(np.float32(k)) for k in q)}")
    print(f"max abs error, float64 fit on [-c, c]:         {np.abs(fit64 - exact[on_range]).max():.3g}")
    print(f"max abs error, float32 evaluation on [-10, 10]: {err.max():.3g} (at x = {x[np.argmax(err)]!r})")
    print(f"saturated value at +-c: {float(got[np.argmax(x)])!r}")


if __name__ == "__main__":
    main()
