"""Observer bundles' certificates: the network read back from ONNX, the load-time check, the report.

The bundle side of ``closedloop.runtime.families.observer.certificate`` (which holds the math: the LFT, the error model,
the LMI and its numpy check). ``check_bundle_certificate`` rebuilds the LMI from the
bundle's ONNX initializers and manifest and checks it; ``certify_bundle`` is
``closedloop certify``. Everything here is re-exported by ``closedloop.runtime.families.observer.certificate``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from closedloop.runtime.families.observer.certificate import (
    CERTIFICATE_KIND,
    CERTIFICATE_VERSION,
    CertificateCheck,
    CertificateError,
    ErrorModel,
    check_certificate,
    known_nonlinearity,
    lft_from_weights,
    weights_fingerprint,
)

if TYPE_CHECKING:
    from closedloop.runtime.bundle import Bundle
    from closedloop.runtime.onnx_reader import OnnxModel

__all__ = ["OnnxMLP", "mlp_from_onnx", "observer_error_model", "BundleCertificateCheck", "check_bundle_certificate",
           "format_certificate_report", "certify_bundle"]

# --- reading the network from ONNX -------------------------------------------------------------


_LINEAR_OPS = ("MatMul", "Gemm")
_ACT_OPS = {"Tanh": "tanh", "Relu": "relu"}


@dataclass
class OnnxMLP:
    """A bias-free MLP read from an ONNX graph: weights ``(out, in)`` and hidden activations."""

    weights: list[np.ndarray]
    activations: list[str]
    initializers: list[str]
    input: str
    output: str


def mlp_from_onnx(model: OnnxModel) -> OnnxMLP:
    """Follow the graph from its input: ``(MatMul|Gemm) -> (Tanh|Relu) -> ... -> (MatMul|Gemm)``.

    Anything else (a bias, another op, a branch) raises ``CertificateError``: the
    certificate holds only for the bias-free MLP it describes, so the runtime must see
    that the graph computes exactly that.
    """
    inputs = model.graph_inputs()
    if len(inputs) != 1 or len(model.outputs) != 1:
        raise CertificateError(f"an observer network has one input and one output; the graph has "
                               f"{[v.name for v in inputs]} -> {[v.name for v in model.outputs]}")
    consumers: dict[str, list] = {}
    for node in model.nodes:
        for name in node.inputs:
            consumers.setdefault(name, []).append(node)
    cur, out = inputs[0].name, model.outputs[0].name
    weights: list[np.ndarray] = []
    acts: list[str] = []
    names: list[str] = []
    expect_linear = True
    while cur != out:
        nodes = consumers.get(cur, [])
        if len(nodes) != 1:
            raise CertificateError(f"tensor {cur!r} feeds {len(nodes)} nodes; an observer network is a plain chain")
        node = nodes[0]
        if expect_linear and node.op_type in _LINEAR_OPS:
            weights.append(_linear_weight(node, cur, model.initializers))
            names.append(node.inputs[1])
        elif not expect_linear and node.op_type in _ACT_OPS:
            acts.append(_ACT_OPS[node.op_type])
        else:
            want = "MatMul/Gemm (bias-free)" if expect_linear else "Tanh/Relu"
            raise CertificateError(f"node {node.name or node.op_type!r} is {node.op_type}, expected {want}: the graph is "
                                   "not the bias-free MLP the certificate describes")
        expect_linear = not expect_linear
        cur = node.outputs[0]
    if expect_linear or not weights:
        raise CertificateError("the graph ends on an activation; an observer network ends on a linear layer")
    for a, b in zip(weights[:-1], weights[1:], strict=True):
        if a.shape[0] != b.shape[1]:
            raise CertificateError(f"layer shapes {a.shape} -> {b.shape} do not chain")
    return OnnxMLP(weights, acts, names, inputs[0].name, out)


def _linear_weight(node: Any, cur: str, inits: dict[str, np.ndarray]) -> np.ndarray:
    if len(node.inputs) < 2 or node.inputs[0] != cur or node.inputs[1] not in inits:
        raise CertificateError(f"{node.op_type} node {node.name!r} must multiply the running tensor by a stored weight")
    w = np.asarray(inits[node.inputs[1]], dtype=np.float32)
    if w.ndim != 2:
        raise CertificateError(f"weight {node.inputs[1]!r} has shape {w.shape}; expected a matrix")
    if node.op_type == "MatMul":
        return w.T.copy()
    a = node.attributes
    if a.get("transA", 0) or a.get("alpha", 1.0) != 1.0:
        raise CertificateError(f"Gemm node {node.name!r} uses transA/alpha; re-export the network")
    if len(node.inputs) > 2 and node.inputs[2]:
        c = inits.get(node.inputs[2])
        if c is None or np.any(c != 0):
            raise CertificateError(f"Gemm node {node.name!r} adds a bias; a certified observer network has none "
                                   "(a bias moves N(0) off zero and the error equilibrium with it)")
    return (w if a.get("transB", 0) else w.T).copy()


# --- bundles ----------------------------------------------------------------------------------------


def _matrix(d: dict[str, Any], key: str, shape: tuple[int, ...] | None = None, where: str = "extra.observer") -> np.ndarray:
    if key not in d:
        raise CertificateError(f"{where}.{key} is missing; re-export the observer bundle")
    try:
        a = np.asarray(d[key], dtype=float)
    except (TypeError, ValueError):
        raise CertificateError(f"{where}.{key} is not a numeric array") from None
    if shape is not None and a.shape != shape:
        raise CertificateError(f"{where}.{key} has shape {a.shape}, expected {shape}")
    if not np.all(np.isfinite(a)):
        raise CertificateError(f"{where}.{key} holds non-finite values")
    return a


def observer_error_model(obs: dict[str, Any]) -> ErrorModel:
    """The error model of an ``extra.observer`` block (the matrices the runtime observer runs)."""
    Ad = _matrix(obs, "Ad")
    n = Ad.shape[0]
    if Ad.shape != (n, n):
        raise CertificateError(f"extra.observer.Ad has shape {Ad.shape}; expected a square matrix")
    Cd = _matrix(obs, "Cd")
    if Cd.ndim != 2 or Cd.shape[1] != n:
        raise CertificateError(f"extra.observer.Cd has shape {Cd.shape}; expected (ny, {n})")
    L = _matrix(obs, "L", (n, Cd.shape[0]))
    Fd = _matrix(obs, "Fd") if "Fd" in obs else np.zeros((n, 0))
    if Fd.ndim != 2 or Fd.shape[0] != n:
        raise CertificateError(f"extra.observer.Fd has shape {Fd.shape}; expected ({n}, n_x)")
    nl, params = known_nonlinearity(obs.get("nonlinearity"))
    try:
        Gf, H, lo, hi = nl.channel(params, Fd)
    except KeyError as exc:
        raise CertificateError(f"nonlinearity {nl.name!r} needs parameter {exc}") from None
    return ErrorModel(Ad, Cd, L, Gf, H, lo, hi)


@dataclass
class BundleCertificateCheck:
    """A bundle's certificate re-checked from its own weights."""

    check: CertificateCheck | None
    problems: list[str]
    fingerprint_ok: bool | None
    total_ms: float
    stored: dict[str, Any]

    @property
    def passed(self) -> bool:
        return not self.problems


def check_bundle_certificate(bundle: Bundle) -> BundleCertificateCheck:
    """Rebuild the LMI from ``bundle.onnx().initializers`` and the stored ``P``, ``t``, ``lam``, ``rho``.

    Problems named: an unreadable or absent certificate, a graph that is not the
    certified bias-free MLP, weights whose fingerprint differs from the certified ones,
    and a violated LMI (with the largest eigenvalue and the margin it violates).
    """
    t0 = time.perf_counter()
    cert = bundle.manifest.certificate
    if not isinstance(cert, dict):
        return BundleCertificateCheck(None, ["manifest.certificate is missing: an observer bundle must ship its "
                                             "stability certificate (certify it with sdk.observer.certify)"], None, 0.0, {})
    problems: list[str] = []
    try:
        if cert.get("kind") != CERTIFICATE_KIND or cert.get("version") != CERTIFICATE_VERSION:
            raise CertificateError(f"certificate kind/version {cert.get('kind')!r}/{cert.get('version')!r} is not "
                                   f"{CERTIFICATE_KIND!r}/{CERTIFICATE_VERSION}")
        model = observer_error_model(bundle.manifest.extra.get("observer") or {})
        mlp = mlp_from_onnx(bundle.onnx())
        lft = lft_from_weights([w.astype(float) for w in mlp.weights], mlp.activations)
        layout = cert.get("layout", {})
        if list(layout.get("activations", mlp.activations)) != mlp.activations:
            problems.append(f"the graph's activations {mlp.activations} differ from the certified {layout.get('activations')}")
        fp_ok = None
        if "weights_sha256" in cert:
            fp_ok = weights_fingerprint(mlp.weights) == cert["weights_sha256"]
            if not fp_ok:
                problems.append("the network's weights differ from the certified ones (fingerprint "
                                f"{weights_fingerprint(mlp.weights)[:12]}..., certified {str(cert['weights_sha256'])[:12]}...)")
        n = model.n
        P = _matrix(cert, "P", (n, n), "certificate")
        t = _matrix(cert, "t", (lft.n_hidden,), "certificate")
        lam = _matrix(cert, "lam", (model.Gf.shape[1],), "certificate")
        rho, margin = float(cert["rho"]), float(cert["margin"])
        dt = bundle.manifest.extra.get("observer", {}).get("dt")
        check = check_certificate(model, lft, P, t, lam, rho, margin, dt=dt)
        problems += check.problems + _claim_problems(cert, margin, check.max_eig)
    except (CertificateError, KeyError, TypeError, ValueError) as exc:
        what = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
        return BundleCertificateCheck(None, [f"certificate unreadable: {what}"], None, (time.perf_counter() - t0) * 1e3, cert)
    return BundleCertificateCheck(check, problems, fp_ok, (time.perf_counter() - t0) * 1e3, cert)


def _claim_problems(cert: dict[str, Any], margin: float, max_eig: float) -> list[str]:
    """The stored largest eigenvalue against the one recomputed from the bundle's own weights.

    (``check_certificate`` refuses a stored margin that is not positive, or larger than the
    recomputed one, ``-max_eig``.) A stored ``max_eig`` the weights do not give is a forged or
    damaged certificate, refused with both values.
    """
    if "max_eig" not in cert:
        return []
    try:
        stored = float(cert["max_eig"])
    except (TypeError, ValueError):
        stored = float("nan")
    if abs(stored - max_eig) <= 1e-6 * max(1.0, abs(max_eig)):
        return []
    return [f"certificate.max_eig is {cert['max_eig']!r}, but the LMI rebuilt from the bundle's network and its "
            f"observer matrices (extra.observer: Ad, Cd, L, Fd, the nonlinearity) has largest eigenvalue {max_eig:.6g} "
            f"(a margin of {-max_eig:.6g}; stored margin {margin:.6g}): the certificate was not made for this network "
            "with these matrices (closedloop certify's weights line says whether the network is the certified one); "
            "re-certify and re-export the bundle"]


def format_certificate_report(result: BundleCertificateCheck, source: str = "") -> str:
    """The text ``closedloop certify`` prints."""
    lines = [f"certificate of {source}" if source else "certificate"]
    c, s = result.check, result.stored
    if c is not None:
        rate = c.decay_rate_per_s
        lines += [
            f"  LMI size            {c.size} x {c.size} (error {s.get('layout', {}).get('n_error', '?')}, "
            f"neurons {len(s.get('t', []))}, nonlinearity channels {len(s.get('lam', []))})",
            f"  decay rate rho      {c.rho:.6g} per step" + (f" ({rate:.4g} 1/s at dt = {c.dt:g} s)" if rate else ""),
            f"  largest eigenvalue  {c.max_eig:.6g} (must be <= -{c.margin:.3g}: "
            f"{'holds' if c.max_eig <= -c.margin else 'VIOLATED'}; certified {s.get('max_eig', float('nan')):.6g})",
            f"  P min eigenvalue    {c.p_min_eig:.6g}" if c.p_min_eig is not None else "  P                   NOT positive definite",
            f"  weights             {'match the certified fingerprint' if result.fingerprint_ok else 'NOT the certified ones' if result.fingerprint_ok is False else 'no fingerprint stored'}",
            f"  check time          {result.total_ms:.2f} ms (LMI {c.check_ms:.2f} ms)",
        ]
    local, cov = s.get("local"), s.get("coverage")
    if isinstance(local, dict) and "radius" in local:
        lines.append(f"  local (stored)      rho {local.get('rho', float('nan')):.6g} in V(e) <= {local.get('level', float('nan')):.4g} "
                     f"(ball radius {local['radius']:.4g})")
    if isinstance(cov, dict) and "n_samples" in cov:
        lines.append(f"  coverage (stored)   {cov['n_samples']} samples, {cov.get('violations', '?')} violations: violation "
                     f"probability <= {cov.get('eps', float('nan')):.3g} with confidence 1 - {cov.get('beta', float('nan')):.3g}")
    lines.append("  result              " + ("PASS" if result.passed else "FAIL"))
    lines += [f"    - {p}" for p in result.problems]
    return "\n".join(lines)


def certify_bundle(path: str | Path) -> str:
    """Re-check an observer bundle's certificate from its own files; return the report text.

    The bundle's other checks (checksums, schema, graph) are run too and listed; the
    certificate is checked even when they fail, so a person sees both.
    """
    return certify_bundle_record(path)["report"]


def certify_bundle_record(path: str | Path) -> dict[str, Any]:
    """What ``closedloop certify --json`` prints: the verdicts and figures as fields, and the report text.

    ``passed`` (the certificate holds and the bundle verifies), ``certificate_holds``, ``bundle_verifies``,
    ``rho``, ``decay_rate_per_s``, ``dt``, ``max_eig``, ``margin``, ``p_min_eig``, ``fingerprint_ok``,
    ``problems`` (the certificate's), ``bundle_problems`` (the bundle's other checks), ``report``.
    """
    from closedloop.runtime.bundle import Bundle, _open, _read_manifest, check_bundle

    root, source = _open(path)
    manifest = _read_manifest(root, source)
    if manifest.family != "observer":  # the wrong kind of bundle is bad input, as calibrate and evaluate say it
        raise ValueError(f"{path} is a {manifest.family!r} bundle: certify re-checks an observer bundle's stability "
                         "certificate (docs/observer.md)")
    result = check_bundle_certificate(Bundle(root=root, manifest=manifest, source=source))
    text = format_certificate_report(result, str(source))
    _, problems, _ = check_bundle(path)
    others = [p for p in problems if not any(p.endswith(q) for q in result.problems)]
    if others:  # the certificate may hold for these weights, but the bundle itself is refused
        text += ("\n  other bundle problems:\n" + "\n".join(f"    - {p}" for p in others)
                 + "\n  bundle              REFUSED: it does not verify (above), whatever its certificate says")
    c = result.check
    return {"passed": result.passed and not others, "certificate_holds": result.passed, "bundle_verifies": not others,
            "rho": c.rho if c else None, "decay_rate_per_s": c.decay_rate_per_s if c else None,
            "dt": c.dt if c else None, "max_eig": c.max_eig if c else None, "margin": c.margin if c else None,
            "p_min_eig": c.p_min_eig if c else None, "fingerprint_ok": result.fingerprint_ok,
            "problems": list(result.problems), "bundle_problems": others, "report": text}
