"""``import_onnx``: an ONNX file made elsewhere in, a verified bundle out.

For a model that does not start as a torch module in this process: another framework's
export (TensorFlow through tf2onnx, JAX, scikit-learn), a colleague's file, or torch's own
``torch.onnx.export`` run by the user. The file is the reference: there is no torch to
compare it with, so what :func:`~closedloop.export.export_bundle` proves against torch is
proved here against ONNX Runtime running the file itself:

* the file is read whole (no external data files), passes ``onnx.checker`` and loads in
  ONNX Runtime; its inputs and outputs are float32, each with at most one free axis;
* a free first axis is the batch: ONNX Runtime's batched call must equal the same rows run
  one at a time (a graph that mixes rows, say a reshape to ``(1, -1)``, is refused); a graph
  whose batch is fixed runs batch 1, one row per call;
* recurrent state is named by the caller (``state={"h": "h_out"}``: the input a step reads
  and the output that feeds it back), and a 64-step rollout carries it;
* the Numba backend, where it can run the graph, must give ONNX Runtime's outputs within the
  fp32 tolerance on the same random inputs and rollout, or nothing is written;
* the variants, TensorRT's report and the manifest are made as ``export_bundle`` makes them.

The file's bytes are the bundle's ``main.onnx`` unchanged, unless ``outputs`` keeps some of its
outputs (the graph cut down to them) or an output's size is missing from the graph (ONNX's shape
inference lost it; ONNX Runtime's answer at batch 1 and 2 is written in); ``provenance.export``
records the file's name, SHA-256, producer, opset, the outputs kept and the sizes stated.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from closedloop.common.atomic import refuse_existing
from closedloop.runtime.manifest import GraphSpec, TensorSpec, Window
from closedloop.runtime.onnx_reader import ValueInfo, parse_onnx

from .assemble import (
    DATA_DEPENDENT_SIZE,
    GRAPH_NAME,
    ExportOptions,
    apply_roles_and_windows,
    check_args,
    finish_bundle,
    fix_declared_dims,
    manifest_meta,
)
from .errors import ExportError, GraphCheckError, ParityError
from .parity import (
    FP32_TOLERANCE,
    Feeds,
    Runner,
    Tolerance,
    compare,
    fmt_error,
    make_parity_inputs,
    ort_runner,
    row_by_row,
    summarize,
)
from .variants import check_variant_names

__all__ = ["import_onnx"]


def _read(path: Path) -> tuple[bytes, onnx.ModelProto]:
    if not path.is_file():
        raise ExportError(f"{path}: no such file (give the path of an .onnx model)")
    data = path.read_bytes()
    try:
        proto = onnx.load_from_string(data)
    except Exception as exc:  # noqa: BLE001  (protobuf's DecodeError and friends)
        raise ExportError(f"{path} is not an ONNX model ({type(exc).__name__}: {exc})") from None
    if not proto.graph.output:
        raise ExportError(f"{path} is not an ONNX model with a graph (no outputs)")
    external = [t.name for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    if external:
        raise ExportError(f"{path} keeps {len(external)} weight tensors in external data files (first {external[0]!r}); "
                          "a bundle holds one self-contained graph: save it whole with "
                          "onnx.save_model(onnx.load(PATH), OUT, save_as_external_data=False)")
    try:
        onnx.checker.check_model(proto, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise GraphCheckError(f"{path} fails onnx.checker: {str(exc).strip()}") from None
    return data, proto


def _keep_outputs(proto: onnx.ModelProto, keep: Sequence[str], state: Mapping[str, str], path: Path) -> bytes:
    """The graph cut down to the outputs ``keep`` (in that order) and the state outputs, the nodes no kept output
    needs removed (``onnx.utils.Extractor``): a label output of another type dropped, the command put first."""
    names = [o.name for o in proto.graph.output]
    missing = [k for k in keep if k not in names]
    if missing:
        raise ExportError(f"outputs names {missing}, which the graph does not have; its outputs are {names}")
    if len(set(keep)) != len(keep):
        raise ExportError(f"outputs {list(keep)} names an output twice")
    kept = [*keep, *(o for o in state.values() if o not in keep)]
    initializers = {t.name for t in proto.graph.initializer}
    inputs = [i.name for i in proto.graph.input if i.name not in initializers]
    try:
        cut = onnx.utils.Extractor(proto).extract_model(inputs, kept)
    except Exception as exc:  # noqa: BLE001  (onnx's own errors)
        raise ExportError(f"{path}: cannot keep only the outputs {kept}: {exc}") from None
    for field in ("ir_version", "producer_name", "producer_version", "domain", "model_version", "doc_string"):
        setattr(cut, field, getattr(proto, field))
    del cut.opset_import[:]
    cut.opset_import.extend(proto.opset_import)
    return cut.SerializeToString()


def _free(d: object) -> bool:
    return not (isinstance(d, int) and d > 0)


def _settle_output_sizes(data: bytes, state: Mapping[str, str], path: Path) -> tuple[bytes, list[str]]:
    """Data outputs whose declared shape has a free axis after the first, where ONNX's shape inference lost a size
    (a file from ``torch.onnx.export`` of a model with ``F.pad`` before a flatten says ``['batch', 'batch']``): ONNX
    Runtime runs the graph at batch 1 and 2 on random inputs, and an axis after the first whose size is the same in
    both runs is written into the graph as that fixed size. A graph whose sizes depend on the input values (NonZero,
    Unique, Compress) is refused; anything else is left for :func:`_tensor` to judge. Returns the graph and the
    outputs whose sizes were written in."""
    model = parse_onnx(data)
    loose = [v for v in model.outputs if v.name not in state.values() and any(_free(d) for d in v.shape[1:])]
    if not loose:
        return data, []
    sized = sorted({n.op_type for n in model.nodes} & DATA_DEPENDENT_SIZE)
    if sized:
        raise ExportError(f"{path}: outputs {[v.name for v in loose]} have sizes the graph does not state, and its "
                          f"{', '.join(sized)} node(s) make sizes depend on the input values; a bundle streams fixed "
                          "sizes at a fixed rate")
    inputs = model.graph_inputs()
    if any(sum(_free(d) for d in v.shape) > 1 for v in inputs) or any(v.dtype != "float32" for v in inputs):
        return data, []  # not runnable from the declared inputs alone: _tensor says what is wrong with them
    try:
        run = ort_runner(data)
    except Exception:  # noqa: BLE001  (import_onnx reports ONNX Runtime's own error when it loads the file)
        return data, []
    rng = np.random.default_rng(0)
    shapes = []
    for b in (1, 2):
        feeds = {v.name: rng.standard_normal([b if _free(d) else int(d) for d in v.shape]).astype(np.float32)
                 for v in inputs}
        try:
            shapes.append({k: v.shape for k, v in run(feeds).items()})
        except Exception:  # noqa: BLE001
            return data, []
    settled = {}
    for v in loose:
        one, two = shapes[0][v.name], shapes[1][v.name]
        if len(one) == len(v.shape) and one[1:] == two[1:]:
            settled[v.name] = [v.shape[0] if _free(v.shape[0]) else int(one[0]), *(int(d) for d in one[1:])]
    return (fix_declared_dims(data, settled), sorted(settled)) if settled else (data, [])


def _tensor(v: ValueInfo, where: str, state: bool, pair: str | None) -> TensorSpec:
    """The manifest's view of one graph input or output: float32, at most one free axis (named ``batch``)."""
    if v.dtype != "float32":
        fix = ("keep only the float32 outputs: outputs=[...] (--output NAME, repeatable)"
               if where == "output" and v.dtype not in ("float16", "float64", "bfloat16") else
               "convert the model to float32 before importing it")
        raise ExportError(f"{where} {v.name!r} is {v.dtype or 'of no stated type'}: a bundle computes in float32 "
                          f"(its fp16 and int8 variants are made from the float32 graph); {fix}")
    free = [i for i, d in enumerate(v.shape) if _free(d)]
    if len(free) > 1:
        names = [v.shape[i] if isinstance(v.shape[i], str) else "?" for i in free]
        raise ExportError(f"{where} {v.name!r} has shape {v.shape}, {len(free)} free axes ({names}); a bundle allows one, "
                          "the batch: fix the others, e.g. python -m onnxruntime.tools.make_dynamic_shape_fixed "
                          "--dim_param NAME --dim_value N in.onnx out.onnx")
    if not state and free and free[0] != 0:
        raise ExportError(f"{where} {v.name!r} has shape {v.shape} with its free axis at {free[0]}; a data tensor is "
                          "(batch, features...): its free axis, if any, is the first")
    if not state and not free and v.shape and v.shape[0] != 1:
        raise ExportError(f"{where} {v.name!r} has the fixed shape {v.shape}: closedloop runs one sample per step, so "
                          "its first axis is a batch of 1 or free; export the model with a batch of 1 or a dynamic "
                          "batch axis")
    if not v.shape and not state:
        raise ExportError(f"{where} {v.name!r} is a scalar: a data tensor is (batch, features...)")
    shape = ["batch" if i in free else int(d) for i, d in enumerate(v.shape)]  # type: ignore[arg-type]
    return TensorSpec(name=v.name, dtype="float32", shape=shape, state=state, state_pair=pair)


def _graph_spec(data: bytes, state: Mapping[str, str], path: Path) -> GraphSpec:
    model = parse_onnx(data)
    g_in, g_out = model.graph_inputs(), model.outputs
    in_names, out_names = [v.name for v in g_in], [v.name for v in g_out]
    for s_in, s_out in state.items():
        if s_in not in in_names:
            raise ExportError(f"state names input {s_in!r}, which the graph does not have; its inputs are {in_names}")
        if s_out not in out_names:
            raise ExportError(f"state pairs {s_in!r} with output {s_out!r}, which the graph does not have; its outputs "
                              f"are {out_names}")
    if len(set(state.values())) != len(state):
        raise ExportError(f"state {dict(state)} feeds one output back into two inputs; pair each state input with its "
                          "own output")
    back = {o: i for i, o in state.items()}
    inputs = [_tensor(v, "input", v.name in state, state.get(v.name)) for v in g_in]
    outputs = [_tensor(v, "output", v.name in back, back.get(v.name)) for v in g_out]
    by_name = {t.name: t for t in inputs + outputs}
    for s_in, s_out in state.items():
        a, b = by_name[s_in].shape, by_name[s_out].shape
        if a != b:
            raise ExportError(f"state input {s_in!r} has shape {a} but output {s_out!r}, which feeds it back, has {b}")
    if not any(not t.state for t in inputs):
        raise ExportError(f"{path} has no data input besides its state ({in_names}): a session feeds the device's "
                          "stream into one")
    if not any(not t.state for t in outputs):
        raise ExportError(f"{path} has no data output besides its state ({out_names}): a session needs one to act on")
    return GraphSpec(file=f"{GRAPH_NAME}.onnx", kind="recurrent" if state else "feedforward", inputs=inputs,
                     outputs=outputs)


def _numba_runner(data: bytes, spec: GraphSpec) -> tuple[Runner | None, str]:
    """The Numba backend on this graph at batch 1, or None and why it cannot run it here."""
    from closedloop.runtime.backends import create_backend
    from closedloop.runtime.errors import BackendUnavailableError

    with tempfile.TemporaryDirectory(prefix="closedloop-import-") as tmp:
        path = Path(tmp) / spec.file
        path.write_bytes(data)
        try:
            backend, _ = create_backend("numba", path, spec)
        except BackendUnavailableError as exc:
            return None, str(exc)

    def run(feeds: Feeds) -> Feeds:
        for name, value in feeds.items():
            np.copyto(backend.inputs[name], value)
        backend.run()
        return {name: value.copy() for name, value in backend.outputs.items()}

    return run, "numba"


def _prefixed(record: dict[str, Any], prefix: str) -> dict[str, dict[str, Any]]:
    return {f"{prefix}/{name}": check for name, check in record["checks"].items()}


def _worst_output(record: dict[str, Any]) -> str:
    bad = [(name, c) for name, c in record["checks"].items() if not c["within_tolerance"]]
    name, c = bad[0] if bad else next(iter(record["checks"].items()))
    return (f"output {c.get('worst_output')!r} in check {name!r}: max abs {fmt_error(c.get('max_abs'))}, "
            f"max rel {fmt_error(c.get('max_rel'))}")


def _set_initial(spec: GraphSpec, initial: dict[str, np.ndarray], path: Path) -> None:
    """Each given initial state onto its state input, checked against the state's shape."""
    states = {t.name: t for t in spec.state_inputs}
    for name, values in initial.items():
        t = states.get(name)
        if t is None:
            raise ExportError(f"{path}: initial value for {name!r}, which is not a state input (state inputs: "
                              f"{sorted(states) or 'none; give --state IN=OUT first'})")
        arr = np.asarray(values, dtype=np.float64).reshape(-1)
        size = int(np.prod(t.concrete_shape(1)))
        if arr.size != size or not np.isfinite(arr).all():
            raise ExportError(f"{path}: initial value for {name!r} has {arr.size} values"
                              + ("" if np.isfinite(arr).all() else " (not all finite)")
                              + f"; its shape {t.shape} at batch 1 holds {size} finite values")
        t.initial = arr.astype(np.float32).astype(np.float64).tolist() if np.any(arr != 0) else None


def import_onnx(
    path: str | Path,
    out: str | Path,
    *,
    rate_hz: float,
    state: Mapping[str, str] | None = None,
    initial: Mapping[str, np.ndarray] | None = None,
    outputs: Sequence[str] | None = None,
    family: str = "generic",
    name: str = "",
    preprocess: dict[str, Any] | None = None,
    postprocess: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    provenance: dict[str, Any] | None = None,
    input_roles: Mapping[str, str] | None = None,
    output_roles: Mapping[str, str] | None = None,
    windows: Mapping[str, Window | Mapping[str, Any]] | None = None,
    recorded_sequence: np.ndarray | None = None,
    variants: Sequence[str] = ("fp16", "int8"),
    tolerance: Tolerance | None = None,
    tensorrt: bool = True,
    overwrite: bool = False,
    zip: bool = False,
    options: ExportOptions | None = None,
    report: Callable[[str], None] = print,
) -> Path:
    """Make a bundle at ``out`` from the ONNX file at ``path`` and return the bundle's path.

    Parameters
    ----------
    path
        An ``.onnx`` file with its weights inside (no external data), float32 inputs and outputs, each with at most
        one free axis: the batch (the first axis of a data tensor), or none (a graph exported at batch 1).
    rate_hz
        The loop rate the model was trained for.
    state
        ``{state input: state output}`` for a recurrent graph: each step's output feeds the next step's input,
        starting from zeros (the runtime's reset). Absent: a feed-forward graph.
    initial
        ``{state input: values}``: a learned initial state (the value the runtime starts and resets that state at,
        instead of zeros), shaped as the state at batch 1 (or flat with as many values); the bundle then carries it
        (schema version 3, docs/bundle.md).
    outputs
        The data outputs to keep, in this order (a session acts on the first): the graph is cut down to them and
        the state outputs, so an output the runtime cannot hold (an int64 label beside the probabilities) can be
        left out, and the command put first. Absent: every output, in the file's order, and the file's bytes
        unchanged.
    family, name, preprocess, postprocess, extra, provenance, input_roles, output_roles, windows, variants,
    tolerance, tensorrt, overwrite, zip, report
        As :func:`~closedloop.export.export_bundle`. ``recorded_sequence`` ``(T, features...)`` replaces the random
        walk of the rollout check.

    Raises
    ------
    ExportError
        The file cannot be a bundle: what is wrong, and what to do.
    ParityError
        The Numba backend computes the graph differently from ONNX Runtime beyond ``tolerance``: nothing is written.
    """
    options = options or ExportOptions()
    path = Path(path)
    refuse_existing(out, overwrite)  # before the checks, which run the model many times
    check_args("recurrent" if state else "feedforward", family, rate_hz, provenance)
    variant_names = check_variant_names(list(variants))
    tolerance = tolerance or FP32_TOLERANCE
    state = dict(state or {})
    data, proto = _read(path)
    source_sha256 = hashlib.sha256(data).hexdigest()
    all_outputs = [o.name for o in proto.graph.output]
    if outputs is not None:
        data = _keep_outputs(proto, list(outputs), state, path)
    data, settled = _settle_output_sizes(data, state, path)
    spec = _graph_spec(data, state, path)
    for i, o in [] if state else spec.state_like_pairs():
        report(f"note: input {i!r} has the shape of output {o!r}; if it is a recurrent state that {o!r} feeds back, "
               f"pass --state {i}={o} (state={{{i!r}: {o!r}}}), or a session will ask for its value as a held input")
    apply_roles_and_windows(spec, input_roles, output_roles, windows)
    _set_initial(spec, dict(initial or {}), path)
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    report(f"read {path.name}: {len(proto.graph.node)} nodes, opset {opset}, from "
           f"{proto.producer_name or 'an unnamed producer'} {proto.producer_version}".rstrip())
    try:
        onnx_run = ort_runner(data)
    except Exception as exc:  # noqa: BLE001  (onnxruntime's own exception types)
        raise ExportError(f"ONNX Runtime cannot load {path}: {str(exc).strip()}") from None

    tensors = [*spec.inputs, *spec.outputs]
    dynamic = all("batch" in t.shape for t in tensors)
    init = {s.name: s.initial_value(1) for s in spec.state_inputs}  # zeros, or the initial values given
    inputs = make_parity_inputs(spec, batch_sizes=tuple(options.parity_batch_sizes) if dynamic else (1,),
                                sequence=recorded_sequence, sequence_steps=options.sequence_steps, seed=options.seed,
                                initial_state=init)
    inputs.row_by_row = not dynamic
    for b, feeds in inputs.random.items():
        try:
            onnx_run(feeds)
        except Exception as exc:  # noqa: BLE001
            raise ExportError(f"ONNX Runtime cannot run {path} at batch {b} on inputs of the shapes its graph states "
                              f"({ {k: list(v.shape) for k, v in feeds.items()} }): {str(exc).strip()}") from None

    checks: dict[str, dict[str, Any]] = {}
    if dynamic:  # the free first axis is a batch: rows run together equal rows run alone
        rows = compare(onnx_run, row_by_row(onnx_run, spec), spec, inputs, tolerance)
        if not rows["within_tolerance"]:
            raise ExportError(f"{path}: the free first axis is not a batch axis: the rows of a batch change each "
                              f"other's outputs ({_worst_output(rows)}); export the model so each row is computed "
                              "alone, or with a fixed batch of 1")
        checks |= _prefixed(rows, "onnxruntime_row_by_row")
    numba_run, why = _numba_runner(data, spec)
    if numba_run is not None:
        numba = compare(onnx_run, row_by_row(numba_run, spec), spec, inputs, tolerance)
        if not numba["within_tolerance"]:
            raise ParityError(f"{path}: the Numba backend computes this graph differently from ONNX Runtime "
                              f"({_worst_output(numba)}; tolerance abs {tolerance.abs:g} or rel {tolerance.rel:g}): "
                              "nothing written. Please report the graph; meanwhile export_bundle from the torch module, "
                              "if there is one, checks each op the same way")
        checks |= _prefixed(numba, "numba")
    parity = summarize(checks, tolerance, inputs) if checks else {
        "within_tolerance": True, "max_abs": None, "max_rel": None, "tolerance": tolerance.to_dict(), "checks": {}}
    parity["reference"] = "onnxruntime (the imported file)"
    parity["candidates"] = {"onnxruntime row by row": "checked" if dynamic else "the batch is fixed at 1",
                            "numba": "checked" if numba_run is not None else why}
    spec.parity = parity
    report("parity vs ONNX Runtime on the file: "
           + (f"max abs {fmt_error(parity['max_abs'])}, max rel {fmt_error(parity['max_rel'])} over "
              f"{len(checks)} checks (rows {'one by one' if dynamic else 'fixed at batch 1'}; numba "
              f"{'checked' if numba_run is not None else 'cannot run it: ' + why}): OK" if checks else
              f"nothing to compare (batch fixed at 1, and numba cannot run it: {why}); ONNX Runtime runs the file "
              "as it is"))

    meta = manifest_meta(preprocess, postprocess, extra, provenance)
    settings = {
        "source": "import_onnx", "file": path.name, "sha256": source_sha256,
        "outputs_kept": None if outputs is None else [t.name for t in spec.outputs], "file_outputs": all_outputs,
        "output_sizes_stated": settled,
        "producer": f"{proto.producer_name} {proto.producer_version}".strip(), "opset": opset,
        "kind": spec.kind, "state": state, "batch": "free" if dynamic else "fixed at 1",
        "variants": list(variant_names), "tolerance": tolerance.to_dict(), "tensorrt": tensorrt,
        "recorded_sequence": recorded_sequence is not None,
        "options": options.record(),
    }
    return finish_bundle(out, spec, data, onnx_run, inputs, variant_names=variant_names, options=options,
                         tensorrt=tensorrt, family=family, name=name or path.stem, rate_hz=rate_hz, meta=meta,
                         settings=settings, overwrite=overwrite, zip=zip, report=report,
                         exporter="none: the ONNX file as given" + (", cut to the outputs kept" if outputs else "")
                         + (", with the output sizes ONNX Runtime gives stated in the graph" if settled else ""))
