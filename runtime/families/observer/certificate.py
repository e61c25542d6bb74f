"""Stability certificates of neural observers, rebuilt from a bundle's own weights and checked with numpy.

An observer bundle (family ``"observer"``) ships a discrete-time Lyapunov certificate for
its error dynamics: a matrix ``P``, sector multipliers ``t`` (one per hidden neuron) and
``lam`` (one per channel of the known nonlinearity), and a decay rate ``rho``. This module
rebuilds the certificate's LMI from the network weights found in the ONNX graph and from
the observer model in the manifest, and checks it with ``numpy.linalg.eigvalsh`` and a
Cholesky factorisation: no cvxpy, no torch, about a millisecond. The training side
(``closedloop.sdk.observer.lmi``) poses the *same* matrix in cvxpy and torch through
``LMIData.matrix``, so the solver, the fine-tuning loss and this check cannot disagree.

Notes
-----
Sign convention (the whole SDK uses it). Extended state ``z = [x; d]``, output error
``r = y - Cd z_hat``, network correction ``N(r)``; the observer is

    z_hat+ = Ad z_hat + Bd u + Fd f(z_hat, y) + L r + N(r),

so the error ``e = z - z_hat`` (noise-free, constant disturbance) obeys

    e+ = (Ad - L Cd) e - N(Cd e) + Gf p,      p = f(z, y) - f(z_hat, y) (through Fd).

The bias-free MLP ``N`` is the LFT ``v = Dvr r + Dvw w``, ``w = phi(v)`` (all hidden
activations stacked), ``N(r) = Dor r + Dow w``. With ``r = Cd e`` and ``xi = [e; w; p]``:

    e+ = Abar e + Bw w + Bp p,   Abar = Ad - L Cd - Dor Cd,   Bw = -Dow,   Bp = Gf,
    v  = Cv xi,                  Cv   = [Dvr Cd, Dvw, 0].

Each activation lies in a sector ``[a_i, b_i]`` (tanh and ReLU globally in ``[0, 1]``),
``(w_i - a_i v_i)(b_i v_i - w_i) >= 0``, and each nonlinearity channel ``p_j`` in a slope
sector ``[lo_j, hi_j]`` of ``q_j = (H e)_j``. With ``V(e) = e' P e`` the certificate is

    M = G' P G - rho^2 E' P E + sum_i 2 t_i S_i(a_i, b_i) + sum_j lam_j S_j(lo_j, hi_j)  <  0,
    P > 0,   t >= 0,   lam >= 0,   (with a margin, below)

where ``G = [Abar, Bw, Bp]``, ``E = [I, 0, 0]`` and ``S`` is the quadratic form of a sector
constraint in ``xi``. For a global ``[0, 1]`` sector the network part is the familiar
``[[0, Cv_e' T], [T Cv_e, T Dvw + Dvw' T - 2T]]``.

The margin is measured where ``P`` and the multipliers are identities: with the Cholesky
factor ``P = R'R`` and ``T = blockdiag(R^-1, diag(t)^-1/2, diag(lam)^-1/2)``, the checked
matrix is ``Mn = T' M T`` (same definiteness as ``M``; ``LMIData.normalised_matrix``). Every S-procedure term is
non-negative along trajectories, so ``max eig(Mn) <= -margin`` gives

    V(e+) <= (rho^2 - margin) V(e)    for every error, everywhere,

global exponential stability at ``rho`` per step (``-ln(rho) / dt`` per second), with a
margin that does not depend on the scale of ``P`` (error coordinates of very different
sizes, e.g. angles and disturbances, make ``P`` ill-conditioned; ``M`` itself would then
have a scale-dependent spectrum).

The bundle side (the network read back from ONNX, ``check_bundle_certificate``,
``certify_bundle``) is ``closedloop.runtime.families.observer.certificate_bundle``, re-exported here.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

CERTIFICATE_KIND = "discrete_lyapunov_lmi"
CERTIFICATE_VERSION = 1
#: The sector each activation lies in globally.
ACTIVATION_SECTORS: dict[str, tuple[float, float]] = {"tanh": (0.0, 1.0), "relu": (0.0, 1.0)}
SIGN_CONVENTION = ("z_hat+ = Ad z_hat + Bd u + Fd f(z_hat, y) + L r + N(r), r = y - Cd z_hat; "
                   "e = z - z_hat; e+ = (Ad - L Cd) e - N(Cd e) + Gf p; Bw = -Dow")


class CertificateError(ValueError):
    """A certificate or the network it certifies cannot be read (not: the check failed)."""


# --- array operations, so numpy, cvxpy and torch build the same matrix -----------------------


@dataclass(frozen=True)
class ArrayOps:
    """The few operations the LMI construction needs, for one array library."""

    block: Callable[[list[list[Any]]], Any]
    zeros: Callable[[int, int], Any]
    eye: Callable[[int], Any]
    diag: Callable[[Any], Any]
    asarray: Callable[[Any], Any]


NUMPY_OPS = ArrayOps(block=np.block, zeros=lambda r, c: np.zeros((r, c)), eye=np.eye, diag=np.diag,
                     asarray=lambda a: np.asarray(a, dtype=float))


# --- the network as an LFT ---------------------------------------------------------------------


@dataclass(frozen=True)
class NetworkLFT:
    """A bias-free MLP ``r -> N(r)`` as ``v = Dvr r + Dvw w``, ``w = phi(v)``, ``N = Dor r + Dow w``.

    ``activations[k]`` and ``widths[k]`` describe hidden layer ``k``; ``w`` stacks the
    hidden layers in order, so ``Dvw`` is block lower triangular (layer ``k`` reads ``k-1``).
    """

    Dvr: Any
    Dvw: Any
    Dor: Any
    Dow: Any
    activations: tuple[str, ...]
    widths: tuple[int, ...]

    @property
    def n_hidden(self) -> int:
        return int(sum(self.widths))

    def global_sector(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-neuron global sector bounds ``(a, b)``."""
        lo = np.concatenate([[ACTIVATION_SECTORS[a][0]] * n for a, n in zip(self.activations, self.widths, strict=True)] or [[]])
        hi = np.concatenate([[ACTIVATION_SECTORS[a][1]] * n for a, n in zip(self.activations, self.widths, strict=True)] or [[]])
        return lo.astype(float), hi.astype(float)


def lft_from_weights(weights: Sequence[Any], activations: Sequence[str], ops: ArrayOps = NUMPY_OPS) -> NetworkLFT:
    """Write the MLP ``W_last phi(... phi(W_1 r))`` (weights ``(out, in)``, no biases) as an LFT.

    ``activations`` has one entry per hidden layer (``len(weights) - 1``). With no hidden
    layer the network is linear: ``Dor = W_1`` and ``w`` is empty.
    """
    weights = list(weights)
    if len(activations) != len(weights) - 1:
        raise CertificateError(f"{len(weights)} weight matrices need {len(weights) - 1} activations, got {len(activations)}")
    for a in activations:
        if a not in ACTIVATION_SECTORS:
            raise CertificateError(f"activation {a!r} has no sector bound here; use one of {sorted(ACTIVATION_SECTORS)}")
    n_in, n_out = int(weights[0].shape[1]), int(weights[-1].shape[0])
    widths = tuple(int(w.shape[0]) for w in weights[:-1])
    if not widths:
        return NetworkLFT(ops.zeros(0, n_in), ops.zeros(0, 0), weights[0], ops.zeros(n_out, 0), (), ())
    k = len(widths)
    dvr = ops.block([[weights[0]]] + [[ops.zeros(widths[i], n_in)] for i in range(1, k)])
    rows = []
    for i in range(k):
        rows.append([weights[i] if j == i - 1 else ops.zeros(widths[i], widths[j]) for j in range(k)])
    dvw = ops.block(rows)
    dow = ops.block([[ops.zeros(n_out, widths[j]) for j in range(k - 1)] + [weights[-1]]])
    return NetworkLFT(dvr, dvw, ops.zeros(n_out, n_in), dow, tuple(activations), widths)


# --- the error model and the LMI ---------------------------------------------------------------


@dataclass(frozen=True)
class ErrorModel:
    """Linear part of the observer error dynamics and the nonlinearity-mismatch channel.

    ``e+ = (Ad - L Cd) e - N(Cd e) + Gf p`` with ``p_j`` in the slope sector
    ``[f_lo_j, f_hi_j]`` of ``q = H e``. No nonlinearity: ``Gf`` with zero columns.
    """

    Ad: np.ndarray
    Cd: np.ndarray
    L: np.ndarray
    Gf: np.ndarray
    H: np.ndarray
    f_lo: np.ndarray
    f_hi: np.ndarray

    @classmethod
    def linear(cls, Ad: Any, Cd: Any, L: Any) -> ErrorModel:
        Ad = np.asarray(Ad, dtype=float)
        n = Ad.shape[0]
        return cls(Ad, np.asarray(Cd, dtype=float), np.asarray(L, dtype=float),
                   np.zeros((n, 0)), np.zeros((0, n)), np.zeros(0), np.zeros(0))

    @property
    def n(self) -> int:
        return int(self.Ad.shape[0])

    @property
    def luenberger(self) -> np.ndarray:
        """``Ad - L Cd``: the error dynamics of the linear part alone."""
        return self.Ad - self.L @ self.Cd


@dataclass
class LMIData:
    """The constant matrices of the LMI for one network; ``matrix`` is linear in ``(P, t, lam)``."""

    G: Any  # [Abar, Bw, Bp]
    Rv: Any  # v = Rv xi
    Rw: Any  # w = Rw xi
    Rq: Any  # q = Rq xi
    Rp: Any  # p = Rp xi
    w_lo: np.ndarray
    w_hi: np.ndarray
    f_lo: np.ndarray
    f_hi: np.ndarray
    n_e: int
    n_w: int
    n_p: int

    @property
    def size(self) -> int:
        return self.n_e + self.n_w + self.n_p

    def matrix(self, P: Any, t: Any, lam: Any, rho: float, ops: ArrayOps = NUMPY_OPS) -> Any:
        """``M(P, t, lam)``; negative definite with margin means certified (see module notes)."""
        E = ops.block([[ops.eye(self.n_e), ops.zeros(self.n_e, self.n_w + self.n_p)]])
        m = self.G.T @ P @ self.G - (rho ** 2) * (E.T @ P @ E)
        if self.n_w:
            m = m + _sector_form(self.Rv, self.Rw, self.w_lo, self.w_hi, 2 * t, ops)
        if self.n_p:
            m = m + _sector_form(self.Rq, self.Rp, self.f_lo, self.f_hi, lam, ops)
        return 0.5 * (m + m.T)

    def in_coordinates(self, S: np.ndarray, w_scale: np.ndarray | None = None, p_scale: np.ndarray | None = None,
                       ops: ArrayOps = NUMPY_OPS) -> LMIData:
        """The same LMI in coordinates ``e_s = S e``, ``w = diag(w_scale) w_s``, ``p = diag(p_scale) p_s``.

        ``matrix`` of the result at ``P_s`` equals ``T' M(S' P_s S) T`` with the congruence
        ``T = blockdiag(S^-1, diag(w_scale), diag(p_scale))``: same definiteness, better scaled.
        """
        n, nw = self.n_e, self.n_w
        S = np.asarray(S, dtype=float)
        scale = np.ones(nw + self.n_p)
        if w_scale is not None:
            scale[:nw] = w_scale
        if p_scale is not None:
            scale[nw:] = p_scale
        s_inv = ops.asarray(np.linalg.inv(S))
        d = ops.asarray(scale)

        def right(x: Any) -> Any:
            return ops.block([[x[:, :n] @ s_inv, x[:, n:] * d]]) if self.size > n else x @ s_inv

        return LMIData(ops.asarray(S) @ right(self.G), right(self.Rv), right(self.Rw), right(self.Rq), right(self.Rp),
                       self.w_lo, self.w_hi, self.f_lo, self.f_hi, n, nw, self.n_p)

    def normalised_matrix(self, P: np.ndarray, t: Any, lam: Any, rho: float, ops: ArrayOps = NUMPY_OPS) -> Any:
        """The checked matrix: ``M`` where ``V(e) = |e_s|^2`` and every multiplier is 1.

        The congruence ``T = blockdiag(R^-1, diag(t)^-1/2, diag(lam)^-1/2)`` with ``P = R'R``
        (Cholesky; a zero multiplier keeps scale 1). If its largest eigenvalue is ``-m``,
        ``V(e+) <= (rho^2 - m) V(e)``: a margin relative to ``V``, independent of the scales
        of ``P``, ``t`` and ``lam``.
        """
        R = np.linalg.cholesky(np.asarray(P, dtype=float)).T
        t_np, lam_np = (np.asarray(x, dtype=float).reshape(-1) for x in (t, lam))
        w_scale = np.where(t_np > 0, 1.0 / np.sqrt(np.where(t_np > 0, t_np, 1.0)), 1.0)
        p_scale = np.where(lam_np > 0, 1.0 / np.sqrt(np.where(lam_np > 0, lam_np, 1.0)), 1.0)
        data = self.in_coordinates(R, w_scale, p_scale, ops)
        return data.matrix(ops.eye(self.n_e), ops.asarray(t_np), ops.asarray(lam_np), rho, ops)


def _sector_form(r_in: Any, r_out: Any, lo: np.ndarray, hi: np.ndarray, mult: Any, ops: ArrayOps) -> Any:
    """Matrix of ``sum_i mult_i (out_i - lo_i in_i)(hi_i in_i - out_i)`` as a form in ``xi``."""
    d = ops.diag(mult)
    sym = 0.5 * (r_in.T @ d @ (_scale_rows(r_out, lo + hi)))
    return r_in.T @ d @ _scale_rows(r_in, -lo * hi) + sym + sym.T - r_out.T @ d @ r_out


def _scale_rows(a: Any, s: np.ndarray) -> Any:
    if isinstance(a, np.ndarray):
        return s[:, None] * a
    return a * a.new_tensor(s)[:, None] if hasattr(a, "new_tensor") else np.diag(s) @ a


def lmi_data(model: ErrorModel, lft: NetworkLFT, w_lo: np.ndarray | None = None, w_hi: np.ndarray | None = None,
             ops: ArrayOps = NUMPY_OPS) -> LMIData:
    """Build the constant matrices (``ops`` decides the array type of the weight-dependent ones).

    ``w_lo``/``w_hi`` are per-neuron sector bounds (default: each activation's global sector;
    a local certificate passes ``tanh(vbar)/vbar`` as ``w_lo``).
    """
    n, nw, npch = model.n, lft.n_hidden, model.Gf.shape[1]
    g_lo, g_hi = lft.global_sector()
    w_lo = g_lo if w_lo is None else np.asarray(w_lo, dtype=float)
    w_hi = g_hi if w_hi is None else np.asarray(w_hi, dtype=float)
    cd = ops.asarray(model.Cd)
    abar = ops.asarray(model.luenberger) - lft.Dor @ cd
    G = ops.block([[abar, -lft.Dow, ops.asarray(model.Gf)]])
    Rv = ops.block([[lft.Dvr @ cd, lft.Dvw, ops.zeros(nw, npch)]])
    Rw = ops.block([[ops.zeros(nw, n), ops.eye(nw), ops.zeros(nw, npch)]])
    Rq = ops.block([[ops.asarray(model.H), ops.zeros(npch, nw + npch)]])
    Rp = ops.block([[ops.zeros(npch, n + nw), ops.eye(npch)]])
    return LMIData(G, Rv, Rw, Rq, Rp, w_lo, w_hi, np.asarray(model.f_lo, float), np.asarray(model.f_hi, float), n, nw, npch)


# --- checking a certificate ----------------------------------------------------------------------


@dataclass
class CertificateCheck:
    """Result of rebuilding and checking a certificate with numpy."""

    passed: bool
    max_eig: float  # largest eigenvalue of M(P, t, lam); must be <= -margin
    margin: float  # the margin the certificate claims
    rho: float
    dt: float | None
    p_min_eig: float | None  # smallest eigenvalue of P (None when Cholesky failed)
    problems: list[str] = field(default_factory=list)
    check_ms: float = 0.0
    size: int = 0

    @property
    def decay_rate_per_s(self) -> float | None:
        """The certified continuous-time rate ``-ln(rho) / dt`` (V^(1/2) decays like exp(-rate t))."""
        return None if not self.dt or self.rho <= 0 else float(-np.log(self.rho) / self.dt)


def check_certificate(model: ErrorModel, lft: NetworkLFT, P: Any, t: Any, lam: Any, rho: float, margin: float,
                      *, dt: float | None = None, w_lo: np.ndarray | None = None,
                      w_hi: np.ndarray | None = None) -> CertificateCheck:
    """Rebuild ``M`` and check ``max eig(M) <= -margin`` with ``margin > 0``, ``P > 0`` (Cholesky), ``t, lam >= 0``."""
    t0 = time.perf_counter()
    P = np.asarray(P, dtype=float)
    t = np.asarray(t, dtype=float).reshape(-1)
    lam = np.asarray(lam, dtype=float).reshape(-1)
    problems: list[str] = []
    n = model.n
    if P.shape != (n, n):
        raise CertificateError(f"P has shape {P.shape}, the error state has {n} components: expected ({n}, {n})")
    if t.size != lft.n_hidden:
        raise CertificateError(f"t has {t.size} multipliers, the network has {lft.n_hidden} hidden neurons")
    if lam.size != model.Gf.shape[1]:
        raise CertificateError(f"lam has {lam.size} multipliers, the nonlinearity has {model.Gf.shape[1]} channels")
    if not (np.all(np.isfinite(P)) and np.all(np.isfinite(t)) and np.all(np.isfinite(lam))):
        problems.append("P, t or lam holds non-finite values")
    asym = float(np.max(np.abs(P - P.T))) if P.size else 0.0
    if asym > 1e-9 * max(1.0, float(np.max(np.abs(P)))):
        problems.append(f"P is not symmetric (max |P - P'| = {asym:.3g})")
    P = 0.5 * (P + P.T)
    p_min = None
    try:
        np.linalg.cholesky(P)
        p_min = float(np.linalg.eigvalsh(P)[0])
    except np.linalg.LinAlgError:
        problems.append("P is not positive definite (Cholesky failed): V(e) = e'Pe is not a Lyapunov function")
    if np.any(t < 0):
        problems.append(f"sector multipliers t are negative at neurons {np.flatnonzero(t < 0)[:8].tolist()}")
    if np.any(lam < 0):
        problems.append(f"nonlinearity multipliers lam are negative at channels {np.flatnonzero(lam < 0).tolist()}")
    if not 0 < rho <= 1:
        problems.append(f"decay rate rho = {rho!r} is not in (0, 1]")
    data = lmi_data(model, lft, w_lo, w_hi)
    if p_min is None:
        max_eig = float("inf")
    else:
        M = data.normalised_matrix(P, t, lam, float(rho))
        max_eig = float(np.linalg.eigvalsh(M)[-1]) if np.all(np.isfinite(M)) else float("inf")
    if not (np.isfinite(margin) and margin > 0):
        # max eig(M) <= -margin proves V(e+) <= (rho^2 - margin) V(e) only for a positive margin; a zero or
        # negative one lets an indefinite M (no certificate at all) pass the comparison below
        problems.append(f"certificate margin {margin:.6g} is not positive, and the LMI rebuilt from the weights has "
                        f"largest eigenvalue {max_eig:.6g} (a margin of {-max_eig:.6g}): a certificate needs the "
                        "largest eigenvalue <= -margin < 0; the stored margin is forged or damaged: re-certify")
    elif not max_eig <= -margin:
        problems.append(f"LMI violated: largest eigenvalue of M is {max_eig:.6g}, the certificate needs <= -{margin:.6g} "
                        f"(margin {margin:.6g} violated by {max_eig + margin:.3g}) at rho = {rho:.6g}")
    return CertificateCheck(not problems, max_eig, float(margin), float(rho), dt, p_min, problems,
                            (time.perf_counter() - t0) * 1e3, data.size)


def weights_fingerprint(weights: Sequence[np.ndarray]) -> str:
    """SHA-256 of the float32 weights ``(out, in)`` in layer order: which weights were certified."""
    h = hashlib.sha256()
    for w in weights:
        a = np.ascontiguousarray(np.asarray(w, dtype=np.float32))
        h.update(np.asarray(a.shape, dtype=np.int64).tobytes())
        h.update(a.tobytes())
    return h.hexdigest()


# --- the observer's known nonlinearity ----------------------------------------------------------


@dataclass(frozen=True)
class KnownNonlinearity:
    """A nonlinearity the observer copies from the plant model, and its mismatch sector.

    The observer adds ``Fd f(z_hat, y)``; the plant has ``Fd f(z, y)``. The difference is
    written ``Gf p`` with each ``p_j`` in the slope sector ``[lo_j, hi_j]`` of ``q = H e``,
    which the LMI covers with a multiplier ``lam_j >= 0`` (S-procedure), so the
    certificate holds for the true mismatch whatever the unmeasured states are.
    ``code`` selects the runtime's compiled evaluation.
    """

    name: str
    code: int
    channel: Callable[[dict[str, Any], np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]
    doc: str


def _none_channel(params: dict[str, Any], Fd: np.ndarray):
    n = Fd.shape[0]
    return np.zeros((n, 0)), np.zeros((0, n)), np.zeros(0), np.zeros(0)


def _sin_EH(params: dict[str, Any], Fd: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    E = np.asarray(params["E"], dtype=float)
    H = np.asarray(params["H"], dtype=float)
    if E.ndim != 2 or H.ndim != 2 or E.shape[1] != H.shape[0] or E.shape[0] != Fd.shape[1] or H.shape[1] != Fd.shape[0]:
        raise CertificateError(f"nonlinearity {name!r}: E {E.shape} and H {H.shape} must be (n_x, c) and (c, n_z) "
                               f"with n_z, n_x = {Fd.shape}")
    return E, H


def _sin_channel(params: dict[str, Any], Fd: np.ndarray):
    E, H = _sin_EH(params, Fd, "sin")
    c = H.shape[0]
    # sin(a) - sin(b) = cos(xi) (a - b): slope in [-1, 1] (mean value theorem)
    return Fd @ E, H, -np.ones(c), np.ones(c)


def output_scaled_bounds(params: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Range of ``g_j = a_j + b_j y_k^2`` over ``|y_k| <= y_max_j``."""
    a, b, ymax = (np.asarray(params[k], dtype=float).reshape(-1) for k in ("a", "b", "y_max"))
    ends = np.stack([a, a + b * ymax ** 2])
    return ends.min(axis=0), ends.max(axis=0)


def _output_scaled_channel(params: dict[str, Any], Fd: np.ndarray):
    E, H = _sin_EH(params, Fd, "output_scaled")
    lo, hi = output_scaled_bounds(params)
    if lo.size != H.shape[0] or np.asarray(params["index"]).size != H.shape[0]:
        raise CertificateError(f"nonlinearity 'output_scaled': a, b, y_max and index need {H.shape[0]} entries")
    return Fd @ E, H, lo, hi


NONLINEARITIES: dict[str, KnownNonlinearity] = {
    "none": KnownNonlinearity("none", 0, _none_channel, "no nonlinearity: f = 0"),
    "sin": KnownNonlinearity("sin", 1, _sin_channel,
                             "f(z) = E sin(H z) (elementwise); mismatch slope in [-1, 1], globally"),
    "output_scaled": KnownNonlinearity(
        "output_scaled", 2, _output_scaled_channel,
        "f(z, y) = E ((a + b y[index]^2) * (H z)) with the measured y; mismatch slope in the range of "
        "a + b y^2 over |y| <= y_max: the certificate holds while the outputs stay within y_max"),
}


def known_nonlinearity(spec: dict[str, Any] | None) -> tuple[KnownNonlinearity, dict[str, Any]]:
    """Look up ``{"name": ..., **params}`` (None means ``"none"``)."""
    spec = dict(spec or {"name": "none"})
    name = spec.pop("name", "none")
    if name not in NONLINEARITIES:
        raise CertificateError(f"unknown observer nonlinearity {name!r}; this runtime knows {sorted(NONLINEARITIES)}")
    return NONLINEARITIES[name], spec


# --- bundles (closedloop.runtime.families.observer.certificate_bundle; re-exported so ``from closedloop.runtime.families.observer.certificate import ...`` works)
from closedloop.runtime.families.observer.certificate_bundle import (  # noqa: E402
    BundleCertificateCheck,
    OnnxMLP,
    certify_bundle,
    check_bundle_certificate,
    format_certificate_report,
    mlp_from_onnx,
    observer_error_model,
)

__all__ = ["CERTIFICATE_KIND", "CERTIFICATE_VERSION", "ACTIVATION_SECTORS", "SIGN_CONVENTION", "CertificateError",
           "ArrayOps", "NUMPY_OPS", "NetworkLFT", "lft_from_weights", "ErrorModel", "LMIData", "lmi_data",
           "CertificateCheck", "check_certificate", "weights_fingerprint", "KnownNonlinearity", "NONLINEARITIES",
           "known_nonlinearity", "output_scaled_bounds", "OnnxMLP", "mlp_from_onnx", "observer_error_model",
           "BundleCertificateCheck", "check_bundle_certificate", "format_certificate_report", "certify_bundle"]
