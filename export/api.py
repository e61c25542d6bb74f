"""``export_bundle``: a trained torch module in, a verified bundle out.

The one public entry of the export stage. It traces the module to ONNX
(``closedloop.export.onnx_export``), proves parity with torch (``closedloop.export.parity``), makes the
optional FP16/INT8 variants and measures them (``closedloop.export.variants``), reports
TensorRT compatibility and builds an engine where TensorRT and a GPU are present
(``closedloop.export.tensorrt``), records provenance, and writes the bundle atomically
(``closedloop.export.writer``). Nothing is written unless every step succeeds.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from closedloop.runtime.manifest import GraphSpec, Manifest, Window

from .errors import ExportError
from .onnx_export import KINDS, eval_mode, export_onnx, initial_states, module_device, to_numpy
from .parity import (
    FP32_TOLERANCE,
    Tolerance,
    compare,
    fmt_error,
    full_sequence_check,
    make_parity_inputs,
    offers_full_sequence,
    ort_runner,
    raise_if_outside,
    summarize,
    torch_runner,
)
from .provenance import export_provenance, jsonable
from .tensorrt import build_tensorrt_engines, tensorrt_compatibility
from .variants import VARIANT_TOLERANCES, build_variant, check_variant_names
from .writer import write_bundle

GRAPH_NAME = "main"


@dataclass
class ExportOptions:
    """Less common export settings (recorded in ``provenance.export.settings``)."""

    state_names: tuple[str, ...] | None = None  # default "h" (one state) or "h0", "h1", ...
    opset: int = 17
    parity_batch_sizes: tuple[int, ...] = (1, 3)
    sequence_steps: int = 64  # length of the generated random walk when no recorded_sequence is given
    seed: int = 0
    full_sequence_check: bool | None = None  # None: when module.forward takes (seq, *states)
    variant_tolerances: dict[str, Tolerance] = field(default_factory=lambda: dict(VARIANT_TOLERANCES))
    tensorrt_max_batch: int = 8

    def __post_init__(self) -> None:
        if not self.parity_batch_sizes or any(int(b) < 1 for b in self.parity_batch_sizes):
            raise ExportError(f"parity_batch_sizes {self.parity_batch_sizes} must be positive integers")
        if self.sequence_steps < 2:
            raise ExportError(f"sequence_steps {self.sequence_steps} must be at least 2")
        if self.tensorrt_max_batch < 1:
            raise ExportError(f"tensorrt_max_batch {self.tensorrt_max_batch} must be at least 1")


def _check_args(kind: str, family: str, rate_hz: float, provenance: dict | None) -> None:
    if kind not in KINDS:
        raise ExportError(f"kind {kind!r} is not one of {KINDS}")
    if not family or not isinstance(family, str):
        raise ExportError(f"family {family!r} must be a non-empty string naming a runtime family plug-in (e.g. 'generic')")
    if not isinstance(rate_hz, int | float) or not math.isfinite(rate_hz) or rate_hz <= 0:
        raise ExportError(f"rate_hz {rate_hz!r} must be a positive number of loop steps per second (e.g. 50 for 20 ms bins)")
    if provenance and "export" in provenance:
        raise ExportError("provenance key 'export' is reserved for what export_bundle records; rename your key")


def _example_inputs(example: Any, input_name: str | Sequence[str]) -> tuple[list[str], list[torch.Tensor]]:
    """``(names, tensors)`` of the example input(s): a tensor or array, a tuple/list of them, or a dict."""
    if isinstance(example, Mapping):
        if not example:
            raise ExportError("example_input is an empty dict; give one example tensor per model input")
        names, values = [str(k) for k in example], list(example.values())
        if input_name not in ("x", names):
            raise ExportError(f"example_input is a dict, so its keys {names} name the inputs; drop input_name={input_name!r}")
    elif isinstance(example, tuple | list):
        if not example:
            raise ExportError("example_input is empty; give one example tensor per model input")
        values = list(example)
        given = [input_name] if isinstance(input_name, str) else list(input_name)
        if len(given) == len(values):
            names = given
        elif isinstance(input_name, str):
            names = [f"{input_name}{i}" for i in range(len(values))]
        else:
            raise ExportError(f"{len(given)} input names {given} for {len(values)} example inputs; give one name each")
    else:
        values = [example]
        names = [input_name] if isinstance(input_name, str) else list(input_name)
        if len(names) != 1:
            raise ExportError(f"{len(names)} input names {names} for one example input")
    tensors = []
    for name, v in zip(names, values, strict=True):
        if not isinstance(v, torch.Tensor | np.ndarray):
            raise ExportError(f"example input {name!r} is a {type(v).__name__}; give a torch tensor or a numpy array "
                              "shaped (batch, features...)")
        # an example only fixes shapes: numpy's default float64 is taken as the float32 the bundle computes in
        tensors.append(torch.as_tensor(v, dtype=torch.float32) if isinstance(v, np.ndarray) and v.dtype == np.float64
                       else torch.as_tensor(v))
    if len(set(names)) != len(names):
        raise ExportError(f"input names must be distinct, got {names}")
    return names, tensors


def _apply_roles_and_windows(spec: GraphSpec, input_roles: Mapping[str, str] | None,
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


def _initial_state_feeds(module: nn.Module, spec: GraphSpec) -> dict[str, np.ndarray]:
    states = initial_states(module, 1)
    return {s.name: to_numpy(t) for s, t in zip(spec.state_inputs, states, strict=True)}


def export_bundle(
    module: nn.Module,
    out: str | Path,
    *,
    kind: str,
    example_input: torch.Tensor | np.ndarray | Sequence[torch.Tensor | np.ndarray] | Mapping[str, torch.Tensor | np.ndarray],
    rate_hz: float,
    family: str = "generic",
    name: str = "",
    preprocess: dict[str, Any] | None = None,
    postprocess: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    provenance: dict[str, Any] | None = None,
    recorded_sequence: np.ndarray | torch.Tensor | None = None,
    variants: Sequence[str] = ("fp16", "int8"),
    tolerance: Tolerance | None = None,
    tensorrt: bool = True,
    overwrite: bool = False,
    zip: bool = False,
    input_name: str | Sequence[str] = "x",
    output_name: str | Sequence[str] = "y",
    input_roles: Mapping[str, str] | None = None,
    output_roles: Mapping[str, str] | None = None,
    windows: Mapping[str, Window | Mapping[str, Any]] | None = None,
    options: ExportOptions | None = None,
    report: Callable[[str], None] = print,
) -> Path:
    """Export ``module`` to a bundle at ``out`` and return its path.

    Parameters
    ----------
    module
        The trained module. ``kind="feedforward"``: ``module(x)`` returns the output(s).
        ``kind="recurrent"``: it has ``step(x, *states) -> (y, *new_states)`` and
        ``init_state(batch)``; see ``closedloop.sdk.models.GRUDecoder``.
    example_input
        One input batch ``(batch, features...)`` (a single step for recurrent modules). A module
        with several inputs takes a tuple (in the order ``forward``/``step`` takes them, named by
        ``input_name``) or a dict ``{name: tensor}`` (its keys name the inputs). Examples fix shapes
        only: a bundle computes in float32, so a float64 numpy array is taken as float32, and a tensor or
        module in another precision (float64, float16, bfloat16) is refused (export ``module.float()``). A
        TorchScript module
        (``torch.jit.script``, ``trace`` or ``load``) exports with ``kind="feedforward"``.
    rate_hz
        The loop rate the model was trained for (e.g. 50 for 20 ms bins).
    family, name, preprocess, postprocess, extra
        Written to the manifest as given (numpy arrays become lists); the runtime's
        ``family`` plug-in interprets ``preprocess``/``postprocess``/``extra``.
    provenance
        The caller's record (training config, data, seeds), stored beside the
        automatic ``provenance["export"]``.
    recorded_sequence
        Inputs ``(T, features...)`` from real use for the sequence parity check; a
        random walk when None.
    variants
        Reduced-precision variants to add, from ``("fp16", "int8")``.
    tolerance
        FP32 parity tolerance (default ``Tolerance(abs=1e-4, rel=1e-3)``); a larger
        error raises ``ParityError`` and nothing is written.
    tensorrt
        Build a TensorRT FP16 engine when TensorRT and a CUDA GPU are present.
    overwrite, zip
        Replace an existing bundle; write one zip file instead of a folder.
    input_name, output_name
        Graph tensor names (state tensors are named by ``options.state_names``); a string names
        several inputs ``x0``, ``x1``, ... . A ``forward`` that returns a dict of tensors names its
        outputs by the keys, in order, unless ``output_name`` lists names.
    input_roles, output_roles
        ``{name: role}``: what each tensor is to a session (inputs: ``measurement`` from the device's
        stream, ``goal``/``mode``/``context`` held by the session; outputs: ``command``, ``estimate``,
        ``output``). Unstated: the first data input is the measurement and the first output the command.
    windows
        ``{input name: Window(length, hop, layout)}`` (or the same as a dict): the input is a window over
        a stream of frames, ``(batch, length, features)`` time-major or ``(batch, features, length)``
        channel-major; a session fills it from single frames and runs the model every ``hop`` frames.
    report
        Called with one line per stage (``print`` by default; pass ``logging.info``
        or ``lambda s: None``).
    """
    options = options or ExportOptions()
    _check_args(kind, family, rate_hz, provenance)
    variant_names = check_variant_names(list(variants))
    tolerance = tolerance or FP32_TOLERANCE
    meta = {
        "preprocess": jsonable(dict(preprocess or {}), "preprocess"),
        "postprocess": jsonable(dict(postprocess or {}), "postprocess"),
        "extra": jsonable(dict(extra or {}), "extra"),
        "provenance": jsonable(dict(provenance or {}), "provenance"),
    }
    names, examples = _example_inputs(example_input, input_name)
    source_device = module_device(module)
    if source_device.type != "cpu":
        # The bundle runs in fp32 on the CPU (ONNX Runtime, Numba) and its parity reference must be fp32 math too:
        # on a GPU, cuDNN's GRU and convolutions use TF32 by default, whose error can exceed the fp32 tolerance.
        # Export a CPU copy; the caller's module stays on its device, untouched.
        report(f"module is on {source_device}: exporting a CPU copy (parity is checked against fp32 torch on the CPU)")
        module = copy.deepcopy(module).cpu()
    restore_mode = eval_mode(module)
    try:
        exported = export_onnx(
            module, examples, kind=kind, input_name=names, output_name=output_name,
            state_names=options.state_names, opset=options.opset, file=f"{GRAPH_NAME}.onnx", report=report,
        )
        spec = exported.spec
        _apply_roles_and_windows(spec, input_roles, output_roles, windows)
        report(f"exported {spec.file}: {exported.checks['nodes']} nodes, opset {exported.checks['opset']}, "
               f"{exported.checks['gru_nodes']} GRU node(s)")
        init = _initial_state_feeds(module, spec) if kind == "recurrent" else {}
        inputs = make_parity_inputs(
            spec, batch_sizes=tuple(options.parity_batch_sizes), sequence=recorded_sequence,
            sequence_steps=options.sequence_steps, seed=options.seed, initial_state=init,
        )
        onnx_run = ort_runner(exported.onnx_bytes)
        parity = compare(torch_runner(exported.torch_fn, spec), onnx_run, spec, inputs, tolerance)
        full = options.full_sequence_check
        # a windowed input's step sees windows, which forward(seq) over frames need not match: no such check
        if kind == "recurrent" and (full or (full is None and len(spec.data_inputs) == 1
                                             and spec.data_inputs[0].window is None
                                             and offers_full_sequence(module, len(spec.state_inputs)))):
            checks = dict(parity["checks"])
            checks["sequence_vs_torch_full_forward"] = full_sequence_check(module, onnx_run, spec, inputs, tolerance)
            parity = summarize(checks, tolerance, inputs)
        parity["reference"] = "torch (" + str(module_device(module)) + ")"
        spec.parity = parity
        raise_if_outside(parity, f"graph {GRAPH_NAME!r} ({type(module).__name__})")
        report(f"parity fp32 vs torch: max abs {fmt_error(parity['max_abs'])}, max rel {fmt_error(parity['max_rel'])} "
               f"over {len(parity['checks'])} checks ({parity['sequence_steps']}-step sequence): OK")
    finally:
        restore_mode()

    files: dict[str, bytes] = {spec.file: exported.onnx_bytes}
    for vname in variant_names:
        data, record = build_variant(
            vname, exported.onnx_bytes, spec, onnx_run, inputs, options.variant_tolerances.get(vname)
        )
        rel = f"{GRAPH_NAME}.{vname}.onnx"
        record = {"file": rel, **record, "tensorrt_compatibility": tensorrt_compatibility(data)}
        spec.variants[vname] = record
        files[rel] = data
        p = record["parity_vs_fp32"]
        flag = "OK" if record["within_tolerance"] else f"OUTSIDE its tolerance {record['tolerance']} (written, flagged)"
        report(f"variant {vname}: max abs {fmt_error(p['max_abs'])}, max rel {fmt_error(p['max_rel'])} vs fp32: {flag}")

    spec.tensorrt_compatibility = tensorrt_compatibility(exported.model)
    trt = spec.tensorrt_compatibility
    report(f"TensorRT compatibility (no TensorRT needed): {'compatible' if trt['compatible'] else 'NOT compatible'}"
           + (f", unsupported {trt['unsupported_ops']}" if trt["unsupported_ops"] else ""))
    if tensorrt:
        fp16 = files.get(spec.variants.get("fp16", {}).get("file", ""))
        files.update(build_tensorrt_engines(
            GRAPH_NAME, spec, exported.onnx_bytes, fp16, max_batch=options.tensorrt_max_batch, report=report
        ))

    settings = {
        "kind": kind, "input_name": input_name, "output_name": output_name, "variants": list(variant_names),
        "tolerance": tolerance.to_dict(), "tensorrt": tensorrt, "example_input_shape": {names[i]: list(examples[i].shape) for i in range(len(names))},
        "recorded_sequence": recorded_sequence is not None, "module_device": str(source_device),
        "options": {**asdict(options), "variant_tolerances": {k: v.to_dict() for k, v in options.variant_tolerances.items()}},
        "graph_checks": exported.checks, "export_warnings": exported.warnings,
    }
    manifest = Manifest(
        family=family,
        name=name,
        rate_hz=float(rate_hz),
        graphs={GRAPH_NAME: spec},
        files={},
        preprocess=meta["preprocess"],
        postprocess=meta["postprocess"],
        provenance={**meta["provenance"], "export": jsonable(export_provenance(settings), "provenance.export")},
        extra=meta["extra"],
    )
    path = write_bundle(out, manifest, files, overwrite=overwrite, zip=zip)
    report(f"wrote bundle {path} ({len(files)} files + manifest)")
    return path
