"""The observer certificate's LMI in cvxpy: the full solve in ``(P, t, lam)``, the cheap form, bisection on ``rho``.

The matrix is built by ``closedloop.runtime.families.observer.certificate.LMIData.matrix`` with cvxpy variables, the
very function the runtime evaluates with numpy at load time, so a solution found here is
checked there against the same expression (see that module for the math and the sign
convention). Every solve is timed; feasibility is always decided by the numpy check of
the returned ``(P, t, lam)``, never by the solver's status alone.

Notes
-----
Full form, for fixed ``rho``: in preconditioned error coordinates ``e_s = S e`` (``S`` from
the Lyapunov equation of the linear part, so that error components of very different
scales do not make the SDP ill-conditioned), variables ``Ps = Ps'``, ``t >= 0``,
``lam >= 0``, ``s``::

    minimise s   subject to   Ms(Ps, t, lam; rho) <= s I,   I <= Ps <= p_max I,

and ``P = S' Ps S``. ``Ps >= I`` fixes the scale (``M`` is homogeneous in ``(P, t, lam)``),
``p_max`` bounds the condition number. Certified when the numpy check
(``closedloop.runtime.families.observer.certificate.check_certificate``: ``max eig`` of ``M`` normalised by ``P``'s
Cholesky factor) is ``<= -margin``. Cheap form: ``P`` fixed (from a previous solve or a
Lyapunov equation), the normalised ``M`` is affine in ``t``, ``lam`` alone: a much smaller
SDP for large networks. The best certified decay
rate is found by bisection on ``rho`` in ``[spectral radius of the linearisation, 1]``.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import cvxpy as cp
import numpy as np
import scipy.linalg as sla

from closedloop.runtime.families.observer.certificate import ArrayOps, ErrorModel, NetworkLFT, lmi_data

CVXPY_OPS = ArrayOps(
    block=cp.bmat,
    zeros=lambda r, c: np.zeros((r, c)),
    eye=np.eye,
    diag=cp.diag,
    asarray=lambda a: np.asarray(a, dtype=float),
)
DEFAULT_MARGIN = 1e-6
DEFAULT_P_MAX = 1e4
#: Above this LMI size (error + neurons + channels) the full form goes to SCS first: an interior
#: point method factors a dense (N(N+1)/2)^2 system per iteration (measured on 2 cores, hidden
#: 32-64-32, N = 134: Clarabel 397 s and 4.5 GB, SCS 22 s), while for small N Clarabel is faster
#: and more accurate (16-16: 1.3 s vs 2.4 s). The cheap form has few variables, which suits SCS's
#: cached factorisation at every size (16-16: SCS 0.14 s, Clarabel 0.9 s; 32-64-32: SCS 3.1 s).
CLARABEL_MAX_SIZE = 48


def default_solvers(size: int, cheap: bool) -> tuple[str, ...]:
    """Solver order for an LMI of ``size`` rows (see ``CLARABEL_MAX_SIZE``)."""
    return ("SCS", "CLARABEL") if cheap or size > CLARABEL_MAX_SIZE else ("CLARABEL", "SCS")


@dataclass
class LMISolution:
    """One solve: the multipliers found, the numpy check of them, and the times."""

    feasible: bool
    rho: float
    margin: float
    max_eig: float  # numpy max eigenvalue of M at the returned (P, t, lam); inf if none
    P: np.ndarray | None
    t: np.ndarray | None
    lam: np.ndarray | None
    form: str  # "full" or "cheap"
    solver: str
    status: str
    solve_time_s: float  # wall clock: building the problem + the solver
    solver_time_s: float | None  # the solver's own report
    notes: list[str] = field(default_factory=list)


def _solve(problem: cp.Problem, solvers: tuple[str, ...]) -> tuple[str, str, float | None]:
    last = "not solved"
    for name in solvers:
        try:
            with warnings.catch_warnings():  # "may be inaccurate": the numpy check decides
                warnings.simplefilter("ignore", UserWarning)
                problem.solve(solver=name)
        except (cp.error.SolverError, ArithmeticError, ValueError) as exc:
            last = f"{name}: {exc}"
            continue
        if problem.status in ("optimal", "optimal_inaccurate"):
            stats = problem.solver_stats
            return name, problem.status, getattr(stats, "solve_time", None)
        last = f"{name}: {problem.status}"
    return "", last, None


def _check(model: ErrorModel, lft: NetworkLFT, P, t, lam, rho, w_lo, w_hi) -> float:
    try:
        M = lmi_data(model, lft, w_lo, w_hi).normalised_matrix(P, t, lam, rho)
    except np.linalg.LinAlgError:
        return float("inf")
    return float(np.linalg.eigvalsh(M)[-1])


def lyapunov_matrix(A: np.ndarray, rho: float | None = None) -> np.ndarray:
    """``P`` with ``A' P A - rho^2 P = -rho^2 I`` (``rho`` default halfway from the spectral radius to 1).

    The quadratic Lyapunov function of the linear part: stage 1's ``P`` and the SDP's
    preconditioner. Normalised to ``min eig P = 1``.
    """
    sr = float(np.max(np.abs(np.linalg.eigvals(A))))
    if sr >= 1.0:
        raise ValueError(f"the linear error dynamics Ad - L Cd have spectral radius {sr:.6g} >= 1: the gain L does "
                         "not stabilise the observer, so no certificate exists; choose L by pole placement first")
    rho = 0.5 * (sr + 1.0) if rho is None else float(rho)
    with warnings.catch_warnings():  # ill-conditioned for fast sampling; used as a preconditioner only
        warnings.simplefilter("ignore", sla.LinAlgWarning)
        P = sla.solve_discrete_lyapunov((A / rho).T, np.eye(A.shape[0]))
    P = 0.5 * (P + P.T)
    return P / float(np.linalg.eigvalsh(P)[0])


def signal_scales(model: ErrorModel, lft: NetworkLFT, S: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Typical size of each activation ``v_i`` and channel ``q_j`` per unit ``|S e|``.

    Layer 1: row norms of ``W_1 Cd S^-1``; layer k: ``|W_k|`` times layer k-1's sizes
    (activations shrink their input). They scale ``w`` and ``p`` in the SDP so that every
    block of the matrix has a similar size (with ``ny`` outputs in an error of very different
    components, ``v`` can be 1e-4 of ``|S e|``, and the solver then fails).
    """
    s_inv = np.linalg.inv(S)
    floor = 1e-12
    p_scale = np.maximum(np.linalg.norm(model.H @ s_inv, axis=1), floor) if model.H.shape[0] else np.zeros(0)
    if not lft.n_hidden:
        return np.zeros(0), p_scale
    sizes = []
    a = np.linalg.norm(lft.Dvr[: lft.widths[0]] @ model.Cd @ s_inv, axis=1)
    sizes.append(a)
    start = lft.widths[0]
    for k in range(1, len(lft.widths)):
        w = lft.Dvw[start: start + lft.widths[k], start - lft.widths[k - 1]: start]
        a = np.abs(w) @ a
        sizes.append(a)
        start += lft.widths[k]
    return np.maximum(np.concatenate(sizes), floor), p_scale


def preconditioner(model: ErrorModel) -> np.ndarray:
    """``S`` with ``S' S`` the linear part's Lyapunov matrix (identity if it is not stable)."""
    try:
        return np.linalg.cholesky(lyapunov_matrix(model.luenberger)).T
    except (ValueError, np.linalg.LinAlgError):
        return np.eye(model.n)


def solve_lmi(model: ErrorModel, lft: NetworkLFT, rho: float, *, margin: float = DEFAULT_MARGIN,
              p_max: float = DEFAULT_P_MAX, P_fixed: np.ndarray | None = None,
              w_lo: np.ndarray | None = None, w_hi: np.ndarray | None = None,
              S: np.ndarray | None = None, solvers: tuple[str, ...] | None = None) -> LMISolution:
    """Solve the certificate LMI at decay rate ``rho``; the cheap form when ``P_fixed`` is given.

    Parameters
    ----------
    model, lft
        The error model and the network (float64 numpy; see ``closedloop.runtime.families.observer.certificate``).
    rho
        Decay rate per step: ``V(e+) <= rho^2 V(e) - margin |e|^2``.
    margin
        Required ``-max eig M`` (with the normalisation ``P >= I``).
    P_fixed
        Cheap form: keep this ``P`` and solve for the multipliers only.
    w_lo, w_hi
        Per-neuron sector bounds (default the activations' global sectors).
    S
        Preconditioner of the full form (default ``preconditioner(model)``).
    solvers
        cvxpy solver names in order of preference (default ``default_solvers``).

    Examples
    --------
    >>> from closedloop.runtime.families.observer.certificate import ErrorModel, lft_from_weights
    >>> m = ErrorModel.linear([[0.9, 0.1], [0.0, 0.8]], [[1.0, 0.0]], [[0.3], [0.0]])
    >>> lft = lft_from_weights([np.array([[0.5]]), np.array([[0.1], [0.0]])], ["tanh"])
    >>> solve_lmi(m, lft, rho=0.95).feasible
    True
    """
    t0 = time.perf_counter()
    data = lmi_data(model, lft, w_lo, w_hi)
    n, nw, npch = data.n_e, data.n_w, data.n_p
    form = "full" if P_fixed is None else "cheap"
    if P_fixed is None:
        S = preconditioner(model) if S is None else np.asarray(S, dtype=float)
        Ps = cp.Variable((n, n), symmetric=True)
    else:
        P_fixed = 0.5 * (np.asarray(P_fixed, dtype=float) + np.asarray(P_fixed, dtype=float).T)
        S, Ps = np.linalg.cholesky(P_fixed).T, np.eye(n)
    w_scale, p_scale = signal_scales(model, lft, S)
    # multipliers in units where each scaled signal is O(1): t = tau / w_scale^2
    tau = cp.Variable(nw, nonneg=True) if nw else None
    lam_s = cp.Variable(npch, nonneg=True) if npch else None
    t = cp.multiply(1.0 / w_scale ** 2, tau) if nw else np.zeros(0)
    lam = cp.multiply(1.0 / p_scale ** 2, lam_s) if npch else np.zeros(0)
    s = cp.Variable()
    M = data.in_coordinates(S, w_scale, p_scale).matrix(Ps, t, lam, float(rho), CVXPY_OPS)
    cons = [M << s * np.eye(data.size)]
    if P_fixed is None:
        cons += [Ps >> np.eye(n), Ps << p_max * np.eye(n)]
    problem = cp.Problem(cp.Minimize(s), cons)
    solvers = solvers or default_solvers(data.size, P_fixed is not None)
    solver, status, solver_time = _solve(problem, solvers)
    if not solver:
        return LMISolution(False, float(rho), margin, float("inf"), None, None, None, form, "", status,
                           time.perf_counter() - t0, None)
    P_val = S.T @ np.asarray(Ps.value, dtype=float) @ S if P_fixed is None else P_fixed
    P_val = 0.5 * (P_val + P_val.T)
    t_val = np.maximum(np.asarray(tau.value, dtype=float), 0.0) / w_scale ** 2 if nw else np.zeros(0)
    lam_val = np.maximum(np.asarray(lam_s.value, dtype=float), 0.0) / p_scale ** 2 if npch else np.zeros(0)
    max_eig = _check(model, lft, P_val, t_val, lam_val, float(rho), w_lo, w_hi)
    p_ok = bool(np.linalg.eigvalsh(P_val)[0] > 0)
    notes = [] if p_ok else ["returned P is not positive definite"]
    return LMISolution(bool(max_eig <= -margin and p_ok), float(rho), margin, max_eig, P_val, t_val, lam_val,
                       form, solver, status, time.perf_counter() - t0, solver_time, notes)


def linearised_spectral_radius(model: ErrorModel, lft: NetworkLFT) -> float:
    """A lower bound on any certified ``rho``: spectral radii of linear members of the sector family.

    The certificate covers every activation slope in its sector and every nonlinearity
    slope in ``[lo, hi]``, so it covers the linear systems with all activation slopes 0
    (network off) or all 1 (for tanh: the linearisation at ``e = 0``), each with the
    nonlinearity at the middle of its sector; ``rho`` is at least their spectral radii.
    """
    nw = lft.n_hidden
    mid = 0.5 * (model.f_lo + model.f_hi)
    base = model.luenberger + model.Gf @ (mid[:, None] * model.H)
    radii = [float(np.max(np.abs(np.linalg.eigvals(base))))]
    if nw:
        dwdr = np.linalg.solve(np.eye(nw) - lft.Dvw, lft.Dvr)
        jac = lft.Dor + lft.Dow @ dwdr
        radii.append(float(np.max(np.abs(np.linalg.eigvals(base - jac @ model.Cd)))))
    return max(radii)


@dataclass
class DecayRateSearch:
    best: LMISolution | None  # the certificate at the smallest certified rho
    tried: list[tuple[float, bool]]
    time_s: float


def best_decay_rate(model: ErrorModel, lft: NetworkLFT, *, margin: float = DEFAULT_MARGIN, iters: int = 12,
                    rho_max: float = 1.0, P_fixed: np.ndarray | None = None, **kw) -> DecayRateSearch:
    """Bisection on ``rho`` for the fastest certified decay (full form, or cheap with ``P_fixed``)."""
    t0 = time.perf_counter()
    lo = min(linearised_spectral_radius(model, lft), rho_max)
    hi = rho_max
    tried: list[tuple[float, bool]] = []
    best = solve_lmi(model, lft, hi, margin=margin, P_fixed=P_fixed, **kw)
    tried.append((hi, best.feasible))
    if not best.feasible:
        return DecayRateSearch(None, tried, time.perf_counter() - t0)
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        sol = solve_lmi(model, lft, mid, margin=margin, P_fixed=P_fixed, **kw)
        tried.append((mid, sol.feasible))
        if sol.feasible:
            hi, best = mid, sol
        else:
            lo = mid
    return DecayRateSearch(best, tried, time.perf_counter() - t0)
