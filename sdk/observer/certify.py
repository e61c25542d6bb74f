"""Certify a trained neural observer: decay rate, margin, local stability radius, sampled coverage, times.

``certify`` solves the certificate's SDP (``closedloop.sdk.observer.lmi``; bisection on ``rho`` for the
fastest certified decay, the full form or the cheap one), and adds two pieces of evidence
a person asks for beside the global certificate:

- a *local* certificate with the tighter sector ``[tanh(vbar)/vbar, 1]``, valid while every
  activation stays in ``|v_i| <= vbar``; it holds in the largest level set ``V(e) <= c`` in
  which interval bounds keep ``|v_i| <= vbar``, reported as the level ``c``, the radius of
  the largest ball inside it and the fraction of the error box inside it;
- *probabilistic coverage* of the compact error box: ``N >= ln(1/beta) / eps`` points drawn
  uniformly; if none violates ``V(e+) <= (rho^2 - margin) V(e)`` (worst vertex of the
  nonlinearity's sector), the probability of a violation at a random error in the box is
  at most ``eps`` with confidence ``1 - beta``. The largest sampled ratio ``V(e+)/V(e)``
  gives the *sampled* decay rate, which holds in the same probabilistic sense (the mass
  above the largest of ``N`` samples exceeds ``eps`` with probability ``(1-eps)^N <= beta``).

``CertificateReport.to_manifest`` is the bundle's ``manifest.certificate``.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from closedloop.runtime.families.observer.certificate import (
    CERTIFICATE_KIND,
    CERTIFICATE_VERSION,
    SIGN_CONVENTION,
    ErrorModel,
    check_certificate,
    weights_fingerprint,
)

from .lmi import DEFAULT_MARGIN, LMISolution, best_decay_rate, solve_lmi
from .network import ObserverNet, numpy_forward
from .neural import ObserverModel


@dataclass
class LocalCertificate:
    vbar: float
    feasible: bool
    rho: float | None = None
    level: float = 0.0  # c in V(e) <= c
    radius: float = 0.0  # largest ball |e| <= radius inside the level set
    box_fraction: float = 0.0  # largest s with s * (error box) inside the level set
    time_s: float = 0.0


@dataclass
class Coverage:
    n_samples: int
    eps: float
    beta: float
    violations: int
    max_ratio: float  # largest sampled V(e+)/V(e)
    sampled_rho: float  # sqrt(max_ratio)
    time_s: float = 0.0


@dataclass
class CertificateReport:
    """What ``certify`` found; ``certified`` means the global LMI holds with the margin."""

    certified: bool
    rho: float
    margin: float
    max_eig: float
    P: np.ndarray | None
    t: np.ndarray | None
    lam: np.ndarray | None
    dt: float
    form: str
    solver: str
    weights_sha256: str
    layout: dict[str, Any]
    check_ms: float = 0.0
    bisection: list[tuple[float, bool]] = field(default_factory=list)
    local: LocalCertificate | None = None
    coverage: Coverage | None = None
    times: dict[str, float] = field(default_factory=dict)

    @property
    def decay_rate_per_s(self) -> float:
        """``-ln(rho) / dt``: ``sqrt(V)`` decays at least like ``exp(-rate t)``."""
        return float(-math.log(self.rho) / self.dt) if self.rho > 0 else float("inf")

    def to_manifest(self) -> dict[str, Any]:
        """The JSON block stored as ``manifest.certificate``."""
        if self.P is None:
            raise ValueError("no certificate to store: the LMI was not solved")
        return {
            "kind": CERTIFICATE_KIND, "version": CERTIFICATE_VERSION, "sign_convention": SIGN_CONVENTION,
            "rho": self.rho, "margin": self.margin, "max_eig": self.max_eig,
            "decay_rate_per_s": self.decay_rate_per_s, "dt": self.dt,
            "P": self.P.tolist(), "t": self.t.tolist(), "lam": self.lam.tolist(),
            "form": self.form, "solver": self.solver, "weights_sha256": self.weights_sha256, "layout": self.layout,
            "local": asdict(self.local) if self.local else None,
            "coverage": asdict(self.coverage) if self.coverage else None,
            "times": dict(self.times),
        }

    def summary(self) -> str:
        lines = [f"certified: {'yes' if self.certified else 'NO'} ({self.form} form, {self.solver})"]
        if self.certified:
            lines += [f"  decay rate rho {self.rho:.6g} per step = {self.decay_rate_per_s:.4g} 1/s (dt {self.dt:g} s)",
                      f"  max eig {self.max_eig:.4g} <= -margin {self.margin:.3g}; numpy check {self.check_ms:.2f} ms"]
        else:  # no rate is proven, and the inequality does not hold: say so rather than print it as if it did
            lines += [f"  no decay rate is proven (the largest rho tried, {self.rho:.6g} per step, failed; dt "
                      f"{self.dt:g} s)",
                      f"  max eig {self.max_eig:.4g} > -margin {self.margin:.3g}: the LMI is VIOLATED; numpy check "
                      f"{self.check_ms:.2f} ms"]
        if self.local and self.local.feasible:
            lo = self.local
            lines.append(f"  local (|v| <= {lo.vbar:g}): rho {lo.rho:.6g} in V(e) <= {lo.level:.4g}, ball radius "
                         f"{lo.radius:.4g}, {lo.box_fraction:.3g} x error box")
        if self.coverage:
            c = self.coverage
            lines.append(f"  coverage: {c.n_samples} samples, {c.violations} violations -> P(violation) <= {c.eps:g} "
                         f"with confidence {1 - c.beta:g}; sampled rho {c.sampled_rho:.6g}")
        lines.append("  times: " + ", ".join(f"{k} {v:.3g}" for k, v in self.times.items()))
        return "\n".join(lines)


def samples_needed(eps: float, beta: float) -> int:
    """``N = ceil(ln(1/beta) / eps)``: no violation in N samples gives P(violation) <= eps w.p. 1 - beta.

    >>> samples_needed(0.01, 1e-6)
    1382
    """
    return int(math.ceil(math.log(1.0 / beta) / eps))


def _vertices(em: ErrorModel) -> np.ndarray:
    np_ = em.Gf.shape[1]
    if not np_:
        return np.zeros((1, 0))
    return np.array(list(itertools.product(*zip(em.f_lo, em.f_hi, strict=True)))[:64], dtype=float)


def step_ratios(em: ErrorModel, weights: list[np.ndarray], activations: list[str], P: np.ndarray,
                e: np.ndarray) -> np.ndarray:
    """Worst ``V(e+)/V(e)`` over the nonlinearity's sector vertices, for each row of ``e``."""
    base = e @ em.luenberger.T - numpy_forward(weights, activations, e @ em.Cd.T)
    q = e @ em.H.T
    ve = np.einsum("bi,ij,bj->b", e, P, e)
    worst = np.zeros(e.shape[0])
    for s in _vertices(em):
        nxt = base + (s * q) @ em.Gf.T
        worst = np.maximum(worst, np.einsum("bi,ij,bj->b", nxt, P, nxt) / ve)
    return worst


def sampled_coverage(em: ErrorModel, weights: list[np.ndarray], activations: list[str], P: np.ndarray, rho: float,
                     margin: float, box: np.ndarray, eps: float = 1e-3, beta: float = 1e-6, seed: int = 0) -> Coverage:
    t0 = time.perf_counter()
    n = samples_needed(eps, beta)
    e = np.random.default_rng(seed).uniform(-1, 1, (n, box.size)) * box
    ratios = step_ratios(em, weights, activations, P, e)
    worst = float(ratios.max())
    return Coverage(n, eps, beta, int(np.sum(ratios > rho ** 2 - margin)), worst, math.sqrt(worst),
                    time.perf_counter() - t0)


def _level_for(P: np.ndarray, weights: list[np.ndarray], activations: list[str], Cd: np.ndarray, vbar: float) -> float:
    """Largest ``c`` with interval bounds ``|v_i| <= vbar`` on ``{e' P e <= c}``."""
    Pinv = np.linalg.inv(P)
    a1 = weights[0] @ Cd
    g1 = np.sqrt(np.einsum("ij,jk,ik->i", a1, Pinv, a1))  # max |v1_i| on V <= 1

    def worst(c: float) -> float:
        v = math.sqrt(c) * g1
        top = float(v.max()) if v.size else 0.0
        for k in range(1, len(weights) - 1):
            h = np.minimum(v, 1.0) if activations[k - 1] == "tanh" else v
            v = np.abs(weights[k]) @ h
            top = max(top, float(v.max()))
        return top

    lo, hi = 0.0, 1.0
    while worst(hi) <= vbar and hi < 1e12:
        lo, hi = hi, hi * 4
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if worst(mid) <= vbar else (lo, mid)
    return lo


def local_certificate(em: ErrorModel, net: ObserverNet, box: np.ndarray, *, vbar: float = 1.0,
                      margin: float = DEFAULT_MARGIN, iters: int = 8) -> LocalCertificate:
    """Bisection on ``rho`` with the local sector, then the largest level set where it is valid."""
    t0 = time.perf_counter()
    lft = net.lft()
    slope = math.tanh(vbar) / vbar
    w_lo = np.concatenate([[slope if a == "tanh" else 0.0] * k for a, k in zip(lft.activations, lft.widths,
                                                                               strict=True)] or [[]])
    search = best_decay_rate(em, lft, margin=margin, iters=iters, w_lo=w_lo)
    if search.best is None:
        return LocalCertificate(vbar, False, time_s=time.perf_counter() - t0)
    P = search.best.P
    c = _level_for(P, net.weights(), list(net.activations), em.Cd, vbar) if lft.n_hidden else float("inf")
    radius = math.sqrt(c / float(np.linalg.eigvalsh(P)[-1]))
    corners = np.array(list(itertools.product(*[(-b, b) for b in box]))[:4096])
    box_v = float(np.max(np.einsum("bi,ij,bj->b", corners, P, corners)))
    return LocalCertificate(vbar, True, search.best.rho, c, radius, math.sqrt(c / box_v), time.perf_counter() - t0)


def certify(model: ObserverModel, net: ObserverNet, *, rho: float | None = None, margin: float = 1e-4,
            iters: int = 10, P_fixed: np.ndarray | None = None, local_vbar: float | None = 1.0,
            coverage_eps: float | None = 1e-3, coverage_beta: float = 1e-6, seed: int = 0) -> CertificateReport:
    """Certify ``net`` in ``model``: the best ``rho`` by bisection (or the given ``rho``), then the extras.

    Parameters
    ----------
    rho
        Certify at this decay rate only (no bisection).
    margin
        Required margin of the normalised LMI (``V(e+) <= (rho^2 - margin) V(e)``).
    P_fixed
        Use the cheap form (multipliers only) with this ``P``.
    local_vbar, coverage_eps
        ``None`` skips the local certificate / the sampled coverage.
    """
    t0 = time.perf_counter()
    em = model.error_model()
    lft = net.lft()
    tried: list[tuple[float, bool]] = []
    if rho is None:
        search = best_decay_rate(em, lft, margin=margin, iters=iters, P_fixed=P_fixed)
        sol, tried = search.best, search.tried
        if sol is None:
            sol = solve_lmi(em, lft, 1.0, margin=margin, P_fixed=P_fixed)
    else:
        sol = solve_lmi(em, lft, rho, margin=margin, P_fixed=P_fixed)
        tried = [(rho, sol.feasible)]
    times = {"sdp_s": time.perf_counter() - t0}
    weights = net.weights()
    layout = {"n_error": model.n_z, "n_outputs": model.n_y, "widths": list(lft.widths),
              "activations": list(net.activations), "input": "r", "output": "correction", "biases": False,
              "lft": "v = Dvr r + Dvw w, w = phi(v), N(r) = Dor r + Dow w; Bw = -Dow, Cv = [Dvr Cd, Dvw, 0]"}
    report = CertificateReport(sol.feasible, sol.rho, margin, sol.max_eig, sol.P, sol.t, sol.lam, model.dt, sol.form,
                               sol.solver, weights_fingerprint(weights), layout, bisection=tried, times=times)
    if sol.P is not None:
        chk = check_certificate(em, lft, sol.P, sol.t, sol.lam, sol.rho, margin, dt=model.dt)
        report.check_ms = chk.check_ms
        report.certified = chk.passed
    if report.certified and local_vbar is not None and lft.n_hidden:
        report.local = local_certificate(em, net, model.error_box, vbar=local_vbar, margin=margin)
        times["local_s"] = report.local.time_s
    if report.certified and coverage_eps is not None:
        report.coverage = sampled_coverage(em, weights, list(net.activations), sol.P, sol.rho, margin,
                                           model.error_box, coverage_eps, coverage_beta, seed)
        times["coverage_s"] = report.coverage.time_s
    times["total_s"] = time.perf_counter() - t0
    return report


def report_from_solution(model: ObserverModel, net: ObserverNet, sol: LMISolution) -> CertificateReport:
    """Wrap one solve (e.g. stage 2's) as a report without extra solves."""
    return certify(model, net, rho=sol.rho, margin=sol.margin, P_fixed=sol.P, local_vbar=None, coverage_eps=None)
