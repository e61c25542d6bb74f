"""Record the protected layout in a bundle, with an int8 variant that keeps the constraints exact.

``protect_bundle`` takes a bundle exported (by ``closedloop.export.export_bundle`` or a family's
exporter such as ``closedloop.sdk.bci.deploy.export_bci_bundle``) from a model that went through
``protect`` and ``finalize``. It checks that every protected initializer really holds
the constraints, measures the float check tolerances of each stored precision (fp32,
and fp16 when the bundle has that variant), adds (or replaces) the ``int8`` variant with
the exact-zero-sum weight-only quantization, and writes ``manifest.extra["robust"]``:
block size, window, whether keyed and the key's fingerprint (never the key), and per
precision the file, storage dtype, initializer names and tolerances. The bundle is then
re-written atomically with fresh checksums.

Every other weight of each precision's graph (biases, the GRU's joined bias, int8 scales and
zero points, small tensors) is *guarded*: its clean block sums go into the record
(``precisions[p]["guard"]``), so the scrubber finds and undoes a flip there too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from closedloop.export.parity import Tolerance, compare, make_parity_inputs, ort_runner
from closedloop.export.tensorrt import tensorrt_compatibility
from closedloop.export.writer import write_bundle
from closedloop.runtime.bundle import load_bundle
from closedloop.runtime.protect.scrubber import (
    LAYOUT_VERSION,
    ROBUST_EXTRA,
    block_positions,
    guard_record,
    guardable,
    key_fingerprint,
    syndromes,
    tail_positions,
    tolerances,
)

from .protection import ProtectionPlan
from .quantize import int8_weight_only, quantize_blocks

INT8_TOLERANCE = Tolerance(abs=5e-2, rel=5e-2)


def _precision(inits: dict, plan: ProtectionPlan, key: bytes | None, names: dict[str, str],
               tolerance: dict | None = None) -> dict:
    tol, tail = {}, {}
    for t in plan.tensors:
        w = inits[names[t.onnx_name]]
        tol[t.onnx_name] = list(tolerances(w, block_positions(w.size, plan.k, key, t.onnx_name, plan.window)))
        tail_pos = tail_positions(w.size, plan.k, key, t.onnx_name, plan.window)
        if tail_pos is not None:  # 1 or 2 leftover members, too few to constrain: their clean sums, stored
            s0, s1 = syndromes(w, tail_pos)
            tail[t.onnx_name] = [float(s0[0]), float(s1[0])]
    return {"dtype": str(inits[names[plan.tensors[0].onnx_name]].dtype), "names": names,
            "tolerance": tolerance if tolerance is not None else tol, "tail": tail}


def _guard(inits: dict, protected: set[str], plan: ProtectionPlan, key: bytes | None) -> dict:
    """Guard records (stored clean block sums) of every weight of one graph that is not constrained."""
    return {o: guard_record(a, plan.k, key, o, plan.window) for o, a in sorted(inits.items())
            if o not in protected and guardable(a)}


def protect_bundle(path: str | Path, plan: ProtectionPlan, key: bytes | None = None, int8: bool = True,
                   guard: bool = True, report=print) -> Path:
    """Add the protection record (and the exact int8 variant) to the bundle at ``path``; return the path."""
    path = Path(path)
    if plan.keyed and (key is None or key_fingerprint(key) != plan.key_fingerprint):
        raise ValueError("protect_bundle needs the key the plan was made with")
    bundle = load_bundle(path)
    m = bundle.manifest
    spec = m.graphs["main"]
    inits = bundle.onnx("main").initializers
    key = key if plan.keyed else None
    for t in plan.tensors:
        w = inits.get(t.onnx_name)
        if w is None or list(w.shape) != t.shape:
            raise ValueError(f"initializer {t.onnx_name!r} is missing or reshaped in {path}; export the model the plan "
                             "was made for, after finalize(model, plan, key) (before it, the export holds the "
                             "parametrization's tensors instead of the weights)")
        s0, _ = syndromes(w, block_positions(w.size, plan.k, key, t.onnx_name, plan.window))
        if np.max(np.abs(s0)) > 1e-4 * max(1e-12, float(np.abs(w).max())) * plan.k:
            raise ValueError(f"initializer {t.onnx_name!r} does not hold the block constraints (largest block sum "
                             f"{np.max(np.abs(s0)):.3g}); call sdk.robust.finalize(model, plan, key) before exporting")
    ident = {t.onnx_name: t.onnx_name for t in plan.tensors}
    precisions = {"fp32": {"file": spec.file, **_precision(inits, plan, key, ident)}}
    if "fp16" in spec.variants:
        precisions["fp16"] = {"file": spec.variants["fp16"]["file"],
                              **_precision(bundle.onnx("main", "fp16").initializers, plan, key, ident)}
    if guard:
        for p, rec in precisions.items():
            rec["guard"] = _guard(bundle.onnx("main", None if p == "fp32" else p).initializers, set(ident), plan, key)
    files = {rel: (bundle.root / rel).read_bytes() for rel in m.files}
    if int8:
        fp32 = files[spec.file]
        qw = {}
        for t in plan.tensors:
            w = inits[t.onnx_name]
            qw[t.onnx_name] = quantize_blocks(w, block_positions(w.size, plan.k, key, t.onnx_name, plan.window))
        data = int8_weight_only(fp32, qw)
        rel = "main.int8.onnx"
        start = {t.name: t.initial_value(1) for t in spec.state_inputs}  # where the runtime starts each state
        inputs = make_parity_inputs(spec, batch_sizes=(1,), sequence_steps=32, seed=0, initial_state=start)
        parity = compare(ort_runner(fp32), ort_runner(data), spec, inputs, INT8_TOLERANCE)
        old = spec.variants.pop("int8", None)
        if old is not None and old["file"] != rel:
            files.pop(old["file"], None)
        spec.variants["int8"] = {
            "file": rel, "quantizer": "closedloop.sdk.robust weight-only int8, per-tensor symmetric, block sums exactly zero",
            "parity_vs_fp32": parity, "within_tolerance": parity["within_tolerance"],
            "tolerance": INT8_TOLERANCE.to_dict(), "tensorrt_compatibility": tensorrt_compatibility(data),
        }
        files[rel] = data
        names = {t.onnx_name: t.onnx_name + "_q" for t in plan.tensors}
        q_inits = {names[t.onnx_name]: qw[t.onnx_name][0] for t in plan.tensors}
        precisions["int8"] = {"file": rel, **_precision(q_inits, plan, key, names,
                                                         tolerance={t.onnx_name: [0.0, 0.0] for t in plan.tensors})}
        if guard:
            from closedloop.runtime.onnx_reader import parse_onnx

            precisions["int8"]["guard"] = _guard(parse_onnx(data).initializers, set(names.values()), plan, key)
        report(f"int8 variant (exact zero-sum blocks): max abs {parity['max_abs']:.3g} vs fp32")
    m.extra[ROBUST_EXTRA] = {
        "version": LAYOUT_VERSION, "scheme": "block zero-sum (sum w = 0, sum j w = 0)",
        "k": plan.k, "window": plan.window, "keyed": plan.keyed, "key_fingerprint": plan.key_fingerprint,
        "tensors": {t.onnx_name: t.shape for t in plan.tensors},
        "precisions": precisions,
        "notes": {"torch_parameters": {t.onnx_name: t.param for t in plan.tensors},
                  "unprotected": plan.skipped if not guard else
                  {k: v + "; guarded (stored block sums)" for k, v in plan.skipped.items()}},
    }
    write_bundle(path, m, files, overwrite=True, zip=path.is_file())
    guarded = sorted(precisions["fp32"].get("guard", {}))
    report(f"protected {len(plan.tensors)} tensors (k={plan.k}, {'keyed' if plan.keyed else 'unkeyed'}), guarded "
           f"{len(guarded)} more (stored block sums: {', '.join(guarded[:4])}{' ...' if len(guarded) > 4 else ''}) in {path}")
    return path
