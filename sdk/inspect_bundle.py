"""Human-readable rendering of a bundle's manifest and its verification result."""

from __future__ import annotations

import json

from closedloop.common.jsonout import json_text
from closedloop.runtime import check_bundle
from closedloop.runtime.manifest import GraphSpec, Manifest


def _shape(s: list) -> str:
    return "(" + ", ".join(str(d) for d in s) + ")"


def _graph_lines(name: str, g: GraphSpec) -> list[str]:
    out = [f"  graph {name!r}: {g.file} ({g.kind})"]
    for t in g.inputs:
        extra = f"  state -> {t.state_pair}" if t.state else f"  {g.role_of(t)}"
        if t.window is not None:  # the runtime keeps the last `length` frames and runs every `hop`
            w = t.window
            extra += (f", a window of the last {w.length} frames ({w.layout}), run every {w.hop} frame"
                      f"{'' if w.hop == 1 else 's'}")
        if t.initial is not None:  # a learned starting state (schema version 3)
            extra += f", starts at its initial value (|max| {max(abs(v) for v in t.initial):.3g})"
        out.append(f"    in  {t.name:<12} {t.dtype:<8} {_shape(t.shape)}{extra}")
    for t in g.outputs:
        extra = f"  state -> {t.state_pair}" if t.state else f"  {g.role_of(t)}"
        out.append(f"    out {t.name:<12} {t.dtype:<8} {_shape(t.shape)}{extra}")
    if g.parity:
        checks = g.parity.get("checks", {})
        verdict = "within tolerance" if g.parity.get("within_tolerance") else "OUTSIDE tolerance"
        out.append(
            f"    parity vs {g.parity.get('reference', 'torch')}: max abs {g.parity.get('max_abs', float('nan')):.2e}, "
            f"max rel {g.parity.get('max_rel', float('nan')):.2e} ({verdict})"
        )
        for check, rec in checks.items():
            if isinstance(rec, dict) and "max_abs" in rec:
                out.append(
                    f"    parity {check:<10} max abs {rec['max_abs']:.2e}  max rel {rec.get('max_rel', float('nan')):.2e}"
                    + (f"  ({rec['steps']} steps)" if "steps" in rec else "")
                )
        tol = g.parity.get("tolerance")
        if tol:
            out.append(f"    parity tolerance {tol}")
    for vname, v in g.variants.items():
        p = v.get("parity_vs_fp32", {})
        ok = v.get("within_tolerance")
        vtrt = v.get("tensorrt_compatibility")
        out.append(
            f"    variant {vname:<5} {v.get('file')}  vs fp32: max abs {p.get('max_abs', float('nan')):.2e}"
            + ("" if ok is None else ("  within tolerance" if ok else "  OUTSIDE tolerance"))
            + ("" if not vtrt else f"; TensorRT parser: {_trt_verdict(vtrt)}")
        )
    trt = g.tensorrt_compatibility
    if trt:
        out.append(f"    TensorRT parser: {_trt_verdict(trt)}")
    for e in g.tensorrt_engines:
        out.append(f"    TensorRT engine {e.get('file')} for {e.get('gpu')} / TensorRT {e.get('tensorrt_version')}")
    return out


def _trt_verdict(report: dict) -> str:
    return "compatible" if report.get("compatible") else f"NOT compatible: {report.get('unsupported_ops')}"


def render_manifest(m: Manifest) -> str:
    lines = [
        f"bundle {m.name or '(unnamed)'}: family {m.family}, schema v{m.schema_version}, loop {m.rate_hz:g} Hz",
    ]
    for name, g in m.graphs.items():
        lines += _graph_lines(name, g)
    if m.family == "observer":  # its graph's roles read as a plain model's; what the session does with them
        lines.append("  observer family: the graph is the network N(r): its input is the residual r = y - C z_hat, its "
                     "output the correction to the estimate; the command sent is clip(-K z_hat), computed by the "
                     "family from the estimate (docs/observer.md)")
    for title, section in (("preprocess", m.preprocess), ("postprocess", m.postprocess)):
        if section:
            lines.append(f"  {title}: " + ", ".join(f"{k}={_brief(v)}" for k, v in section.items()))
    lines += _safe_output_note(m.postprocess)
    if m.certificate:
        lines.append("  certificate: " + ", ".join(f"{k}={_brief(v)}" for k, v in m.certificate.items()))
    robust = m.extra.get("robust") if isinstance(m.extra, dict) else None
    if isinstance(robust, dict):  # weight protection (docs/robustness.md): what the scrubber checks in a session
        precisions = robust.get("precisions") or {}
        guarded = sum(len((p or {}).get("guard") or {}) for p in precisions.values() if isinstance(p, dict))
        lines.append(f"  weights protected: {len(robust.get('tensors') or {})} tensors in zero-sum blocks of "
                     f"{robust.get('k')}, {'keyed (key fingerprint ' + str(robust.get('key_fingerprint')) + ')' if robust.get('keyed') else 'not keyed'}"
                     f"; precisions {', '.join(precisions)}; {guarded} guarded tensor records (stored sums); "
                     "sessions scrub it (--scrub auto)")
    if m.provenance:
        lines.append("  provenance: " + ", ".join(f"{k}={_brief(v)}" for k, v in m.provenance.items()))
    recipe = m.provenance.get("recipe") if isinstance(m.provenance, dict) else None
    if isinstance(recipe, dict) and recipe.get("learned") is False:  # bci-train's verdict, said where it is read
        lines.append("  NOT LEARNED: the training that wrote it ended without learning ("
                     + "; ".join(str(p) for p in (recipe.get("problems") or [])[:2]) + "): its outputs are not usable")
    made = (m.provenance.get("export") or {}) if isinstance(m.provenance, dict) else {}
    settings = made.get("settings") or {}
    if settings.get("source") == "import_onnx":  # what a reader of an imported bundle asks first: from which file
        lines.append(f"  imported from {settings.get('file')} (sha256 {str(settings.get('sha256'))[:16]}..., "
                     f"{settings.get('producer') or 'no producer named'}, opset {settings.get('opset')}, batch "
                     f"{settings.get('batch')}): {made.get('exporter')}")
    elif made.get("exporter"):
        lines.append(f"  exported by {made['exporter']} on {made.get('exported_utc', '?')} (torch {made.get('torch')})")
    for w in settings.get("export_warnings") or []:  # what the export said about the module (a frozen branch...)
        lines.append(f"  export warning: {w}")
    lines.append("  files:")
    for rel, meta in m.files.items():
        lines.append(f"    {rel:<32} {meta.get('bytes', 0):>10} B  sha256 {str(meta.get('sha256'))[:16]}...")
    return "\n".join(lines)


def _safe_output_note(post: dict) -> list[str]:
    """A safe command stated outside the limits is sent clipped to them (docs/bundle.md): say what goes out."""
    import numpy as np

    if "safe_output" not in post or not ("low" in post or "high" in post):
        return []
    try:
        safe = np.atleast_1d(np.asarray(post["safe_output"], dtype=float))
        lo = np.asarray(post.get("low", -np.inf), dtype=float)
        hi = np.asarray(post.get("high", np.inf), dtype=float)
        sent = np.clip(safe, lo, hi)
    except (TypeError, ValueError):
        return []  # the family's checks name a malformed one
    if np.array_equal(sent, np.broadcast_to(safe, sent.shape)):
        return []
    return [f"  note: postprocess.safe_output {_brief(safe.tolist())} lies outside [low, high]: the safe command goes "
            f"out clipped, as {_brief(sent.tolist())}"]


def _brief(v) -> str:
    if isinstance(v, list | tuple) and len(v) > 4:
        return f"[{len(v)} values]"
    if isinstance(v, dict):
        return "{" + ", ".join(list(v)[:5]) + ("..." if len(v) > 5 else "") + "}"
    s = json.dumps(v) if not isinstance(v, str) else v
    return s if len(s) <= 60 else s[:57] + "..."


def inspect_bundle(path: str, as_json: bool = False, trust: list[str] | None = None) -> tuple[str, bool]:
    """Return (text, ok); with ``trust`` (public keys or folders of them) the bundle must be signed by one."""
    manifest, problems, notes = check_bundle(path, trust=trust or None)
    if as_json:
        return json_text(
            {"manifest": manifest.to_dict() if manifest else None, "problems": problems, "notes": notes}
        ), not problems
    parts = [render_manifest(manifest)] if manifest else []
    parts += [f"note: {n}" for n in notes]
    if problems:
        parts.append("REFUSED:\n  - " + "\n  - ".join(problems))
    else:
        parts.append("verified: every file present with its SHA-256, schema known, graphs match the manifest")
    return "\n".join(parts), not problems
