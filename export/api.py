"""``export_bundle``: a trained torch module in, a verified bundle out.

The one public entry of the export stage. It traces the module to ONNX
(``closedloop.export.onnx_export``), proves parity with torch (``closedloop.export.parity``), makes the
optional FP16/INT8 variants and measures them (``closedloop.export.variants``), reports
TensorRT compatibility and builds an engine where TensorRT and a GPU are present
(``closedloop.export.tensorrt``), records provenance, and writes the bundle atomically
(``closedloop.export.writer``). Nothing is written unless every step succeeds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from closedloop.runtime.manifest import GraphSpec, Window

from .assemble import (
    GRAPH_NAME,
    ExportOptions,
    apply_roles_and_windows,
    check_args,
    finish_bundle,
    manifest_meta,
)
from .errors import ExportError
from .onnx_export import (
    cpu_copy,
    eval_mode,
    export_onnx,
    initial_states,
    module_device,
    to_numpy,
    training_behaviour,
)
from .parity import (
    FP32_TOLERANCE,
    NotASequenceForward,
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
from .variants import check_variant_names

__all__ = ["ExportOptions", "export_bundle"]


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
        Reduced-precision variants to add (default ``("fp16", "int8")``): ``fp16`` and ``int8`` (ONNX Runtime's
        float16 graph and dynamic quantization), ``fp16w`` and ``int8w`` (float32 graphs whose weights are stored
        in float16, or int8 with a scale per row, which the Numba backend keeps in that storage; docs/bundle.md).
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
    check_args(kind, family, rate_hz, provenance)
    variant_names = check_variant_names(list(variants))
    tolerance = tolerance or FP32_TOLERANCE
    meta = manifest_meta(preprocess, postprocess, extra, provenance)
    names, examples = _example_inputs(example_input, input_name)
    source_device = module_device(module)
    if source_device.type != "cpu":
        # The bundle runs in fp32 on the CPU (ONNX Runtime, Numba) and its parity reference must be fp32 math too:
        # on a GPU, cuDNN's GRU and convolutions use TF32 by default, whose error can exceed the fp32 tolerance.
        # Export a CPU copy; the caller's module stays on its device, untouched.
        report(f"module is on {source_device}: exporting a CPU copy (parity is checked against fp32 torch on the CPU)")
        module = cpu_copy(module)
    in_training = training_behaviour(module)
    restore_mode = eval_mode(module)
    try:
        exported = export_onnx(
            module, examples, kind=kind, input_name=names, output_name=output_name,
            state_names=options.state_names, opset=options.opset, file=f"{GRAPH_NAME}.onnx", report=report,
        )
        if in_training:
            note = (f"exported in eval mode; these layers were in training mode and compute differently there: "
                    f"{', '.join(in_training[:5])}{' ...' if len(in_training) > 5 else ''} (your module's modes "
                    "are put back as they were: call .eval() before comparing it with the bundle)")
            report(f"note: {note}")
            exported.warnings.append(note)
        spec = exported.spec
        apply_roles_and_windows(spec, input_roles, output_roles, windows)
        for i, o in spec.state_like_pairs() if kind == "feedforward" else []:
            report(f"note: input {i!r} has the shape of output {o!r}; if it is a recurrent state that {o!r} feeds "
                   "back, export with kind='recurrent' (init_state and step, docs/workflow.md), or a session will "
                   "ask for its value as a held input")
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
            try:
                checks = dict(parity["checks"])
                checks["sequence_vs_torch_full_forward"] = full_sequence_check(module, onnx_run, spec, inputs,
                                                                               tolerance)
                parity = summarize(checks, tolerance, inputs)
            except NotASequenceForward as exc:
                if full:  # asked for: an error
                    raise
                # only offered by forward's signature: forward is the step itself (or means something else)
                report(f"note: the whole-sequence check is skipped: {exc}")
                exported.warnings.append(f"whole-sequence check skipped: {exc}")
        parity["reference"] = "torch (" + str(module_device(module)) + ")"
        spec.parity = parity
        raise_if_outside(parity, f"graph {GRAPH_NAME!r} ({type(module).__name__})")
        report(f"parity fp32 vs torch: max abs {fmt_error(parity['max_abs'])}, max rel {fmt_error(parity['max_rel'])} "
               f"over {len(parity['checks'])} checks ({parity['sequence_steps']}-step sequence): OK")
    finally:
        restore_mode()

    settings = {
        "kind": kind, "input_name": input_name, "output_name": output_name, "variants": list(variant_names),
        "tolerance": tolerance.to_dict(), "tensorrt": tensorrt, "example_input_shape": {names[i]: list(examples[i].shape) for i in range(len(names))},
        "recorded_sequence": recorded_sequence is not None, "module_device": str(source_device),
        "options": options.record(),
        "graph_checks": exported.checks, "export_warnings": exported.warnings,
    }
    return finish_bundle(out, spec, exported.onnx_bytes, onnx_run, inputs, variant_names=variant_names,
                         options=options, tensorrt=tensorrt, family=family, name=name, rate_hz=rate_hz, meta=meta,
                         settings=settings, overwrite=overwrite, zip=zip, report=report)
