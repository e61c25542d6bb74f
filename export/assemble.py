"""The torch-free half of making a bundle: the settings, the checks of the caller's arguments, roles and windows
on a graph's tensors, and the steps after a checked fp32 graph (variants, TensorRT's report, manifest, atomic write).

:func:`~closedloop.export.export_bundle` (from a torch module) and :func:`~closedloop.export.import_onnx` (from an
ONNX file, where torch need not be installed) both end here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import onnx

from closedloop.runtime.manifest import GraphSpec, Manifest, Window

from .errors import ExportError
from .parity import fmt_error
from .provenance import export_provenance, jsonable
from .tensorrt import build_tensorrt_engines, tensorrt_compatibility
from .variants import VARIANT_TOLERANCES, Tolerance, build_variant
from .writer import write_bundle

KINDS = ("feedforward", "recurrent")

GRAPH_NAME = "main"


@dataclass
class ExportOptions:
    """Less common export settings (recorded in ``provenance.export.settings``)."""

    state_names: tuple[str, ...] | None = None  # default: the module's `state_names` if it has them, else "h" (one
    # state) or "h0", "h1", ...
    opset: int = 17
    parity_batch_sizes: tuple[int, ...] = (1, 3)
    sequence_steps: int = 64  # length of the generated random walk when no recorded_sequence is given
    seed: int = 0
    full_sequence_check: bool | None = None  # None: when module.forward takes (seq, *states)
    variant_tolerances: dict[str, Tolerance] = field(default_factory=lambda: dict(VARIANT_TOLERANCES))
    tensorrt_max_batch: int = 8

    def record(self) -> dict[str, Any]:
        """These settings as ``provenance.export.settings.options`` records them."""
        return {**asdict(self), "variant_tolerances": {k: v.to_dict() for k, v in self.variant_tolerances.items()}}

    def __post_init__(self) -> None:
        if not self.parity_batch_sizes or any(int(b) < 1 for b in self.parity_batch_sizes):
            raise ExportError(f"parity_batch_sizes {self.parity_batch_sizes} must be positive integers")
        if self.sequence_steps < 2:
            raise ExportError(f"sequence_steps {self.sequence_steps} must be at least 2")
        if self.tensorrt_max_batch < 1:
            raise ExportError(f"tensorrt_max_batch {self.tensorrt_max_batch} must be at least 1")


def manifest_meta(preprocess: dict[str, Any] | None, postprocess: dict[str, Any] | None,
                  extra: dict[str, Any] | None, provenance: dict[str, Any] | None) -> dict[str, Any]:
    """The caller's manifest sections as JSON values (numpy arrays become lists; anything else is refused)."""
    return {
        "preprocess": jsonable(dict(preprocess or {}), "preprocess"),
        "postprocess": jsonable(dict(postprocess or {}), "postprocess"),
        "extra": jsonable(dict(extra or {}), "extra"),
        "provenance": jsonable(dict(provenance or {}), "provenance"),
    }


def check_args(kind: str, family: str, rate_hz: float, provenance: dict | None) -> None:
    if kind not in KINDS:
        raise ExportError(f"kind {kind!r} is not one of {KINDS}")
    if not family or not isinstance(family, str):
        raise ExportError(f"family {family!r} must be a non-empty string naming a runtime family plug-in (e.g. 'generic')")
    if not isinstance(rate_hz, int | float) or not math.isfinite(rate_hz) or rate_hz <= 0:
        raise ExportError(f"rate_hz {rate_hz!r} must be a positive number of loop steps per second (e.g. 50 for 20 ms bins)")
    if provenance and "export" in provenance:
        raise ExportError("provenance key 'export' is reserved for what closedloop records about the export; "
                          "rename your key")


def apply_roles_and_windows(spec: GraphSpec, input_roles: Mapping[str, str] | None,
                             output_roles: Mapping[str, str] | None,
                             windows: Mapping[str, Window | Mapping[str, Any]] | None) -> None:
    """Write the caller's roles and windows onto the exported graph's tensors, refusing what does not fit."""
    by_name = {t.name: t for t in spec.inputs}
    out_by_name = {t.name: t for t in spec.outputs}
    for what, given, tensors in (("input_roles", input_roles, by_name), ("output_roles", output_roles, out_by_name)):
        for name, role in (given or {}).items():
            if name not in tensors:
                raise ExportError(f"{what} names {name!r}, which is not a graph {what[:-6]}; they are {list(tensors)}")
            tensors[name].role = role
    for name, w in (windows or {}).items():
        if name not in by_name:
            raise ExportError(f"windows names {name!r}, which is not a graph input; inputs: {list(by_name)}")
        try:
            by_name[name].window = w if isinstance(w, Window) else Window.from_dict(dict(w))
        except (ValueError, KeyError, TypeError) as exc:
            raise ExportError(f"window of input {name!r}: {exc}") from None
    problems = spec.problems("export")
    if problems:
        raise ExportError("; ".join(problems))


def finish_bundle(out: str | Path, spec: GraphSpec, onnx_bytes: bytes, onnx_run: Any, inputs: Any, *,
                  variant_names: Sequence[str], options: ExportOptions, tensorrt: bool, family: str, name: str,
                  rate_hz: float, meta: dict[str, Any], settings: dict[str, Any], overwrite: bool, zip: bool,
                  report: Callable[[str], None], exporter: str = "torch.onnx.export(dynamo=False)") -> Path:
    """The steps after a checked fp32 graph, shared by :func:`export_bundle` and ``import_onnx``: the variants
    measured against it on the same parity inputs, TensorRT's compatibility report (and engines where TensorRT and a
    GPU are present), the manifest with provenance, and the atomic write."""
    files: dict[str, bytes] = {spec.file: onnx_bytes}
    for vname in variant_names:
        data, record = build_variant(
            vname, onnx_bytes, spec, onnx_run, inputs, options.variant_tolerances.get(vname)
        )
        rel = f"{GRAPH_NAME}.{vname}.onnx"
        record = {"file": rel, **record, "tensorrt_compatibility": tensorrt_compatibility(data)}
        spec.variants[vname] = record
        files[rel] = data
        p = record["parity_vs_fp32"]
        flag = "OK" if record["within_tolerance"] else f"OUTSIDE its tolerance {record['tolerance']} (written, flagged)"
        report(f"variant {vname}: max abs {fmt_error(p['max_abs'])}, max rel {fmt_error(p['max_rel'])} vs fp32: {flag}")

    spec.tensorrt_compatibility = tensorrt_compatibility(onnx_bytes)
    trt = spec.tensorrt_compatibility
    report(f"TensorRT compatibility (no TensorRT needed): {'compatible' if trt['compatible'] else 'NOT compatible'}"
           + (f", unsupported {trt['unsupported_ops']}" if trt["unsupported_ops"] else ""))
    if tensorrt:
        fp16 = files.get(spec.variants.get("fp16", {}).get("file", ""))
        files.update(build_tensorrt_engines(
            GRAPH_NAME, spec, onnx_bytes, fp16, max_batch=options.tensorrt_max_batch, report=report
        ))

    manifest = Manifest(
        family=family,
        name=name,
        rate_hz=float(rate_hz),
        schema_version=Manifest.version_for({GRAPH_NAME: spec}),
        graphs={GRAPH_NAME: spec},
        files={},
        preprocess=meta["preprocess"],
        postprocess=meta["postprocess"],
        provenance={**meta["provenance"], "export": jsonable(export_provenance(settings, exporter), "provenance.export")},
        extra=meta["extra"],
    )
    path = write_bundle(out, manifest, files, overwrite=overwrite, zip=zip)
    report(f"wrote bundle {path} ({len(files)} files + manifest)")
    return path


#: ops whose output size depends on the input's values: a size seen on one input is not fixed where they are
DATA_DEPENDENT_SIZE = frozenset({"NonZero", "Unique", "Compress", "NonMaxSuppression"})


def fix_declared_dims(data: bytes, shapes: dict[str, list]) -> bytes:
    """The graph with each named input's and output's declared dims set as ``shapes`` says (an int, or ``"batch"``);
    unchanged bytes when they already agree."""
    proto = onnx.load_from_string(data)
    changed = False
    for v in [*proto.graph.input, *proto.graph.output]:
        want = shapes.get(v.name)
        if want is None:
            continue
        for dim, d in zip(v.type.tensor_type.shape.dim, want, strict=True):
            if isinstance(d, int) and not (dim.HasField("dim_value") and dim.dim_value == d):
                dim.Clear()
                dim.dim_value = d
                changed = True
    return proto.SerializeToString() if changed else data
