"""Prove that an exported graph computes what the torch module computes.

Every export compares two runners (torch vs ONNX Runtime for the FP32 graph; the
FP32 graph vs a variant for FP16/INT8) on the same inputs:

* random inputs at several batch sizes (1 and 3 by default: batch 1 is the deployed
  case, 3 proves the dynamic batch axis), with random recurrent state;
* a recorded input sequence of shape ``(T, features...)`` (the caller's, or a
  random walk): a feed-forward graph takes it as one batch of ``T``; a recurrent
  graph is rolled out step by step from ``init_state(1)``, each runner carrying its
  own state, so errors that accumulate through the state are caught;
* for recurrent modules whose ``forward(seq, *states)`` runs a whole sequence
  (batch-first), the ONNX rollout is also compared with that one torch call.

Errors: ``max_abs = max|a - b|`` and ``max_rel = max|a - b| / (max|b| + 1e-12)`` per
output, ``b`` the reference. An output passes when ``max_abs <= tol.abs`` OR
``max_rel <= tol.rel`` (absolute for small outputs, relative for large ones); a check
passes when all its outputs do. ONNX Runtime runs on the CPU with one intra-op
thread and full graph optimisation, as the runtime runs it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from closedloop.runtime.manifest import GraphSpec, TensorSpec

from .errors import ExportError, ParityError

if TYPE_CHECKING:  # torch only where a torch module is compared: an imported ONNX file needs none
    from torch import nn

REL_EPS = 1e-12

Feeds = dict[str, np.ndarray]
Runner = Callable[[Feeds], Feeds]


@dataclass(frozen=True)
class Tolerance:
    """Largest accepted error: an output passes if ``max_abs <= abs`` or ``max_rel <= rel``."""

    abs: float = 1e-4
    rel: float = 1e-3

    def passes(self, max_abs: float, max_rel: float) -> bool:
        return bool(max_abs <= self.abs or max_rel <= self.rel)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


#: FP32 ONNX vs torch. Float32 reassociation gives ~1e-6; 1e-4 leaves room for long rollouts.
FP32_TOLERANCE = Tolerance(abs=1e-4, rel=1e-3)


def ort_runner(onnx_bytes: bytes, threads: int = 1) -> Runner:
    """Run a graph with ONNX Runtime on the CPU, as the runtime does (one thread, full optimisation)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # An int8w variant's DequantizeLinear -> MatMul becomes MatMulNBits, which by default (level 4) also
    # quantizes the activations to int8: 4e-3 off the graph's float32 arithmetic on a small transformer.
    # Level 1 computes in float32, as the graph says (and as the Numba backend does).
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
    so.log_severity_level = 3
    sess = ort.InferenceSession(onnx_bytes, sess_options=so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]

    def run(feeds: Feeds) -> Feeds:
        return dict(zip(names, sess.run(None, feeds), strict=True))

    return run


def torch_runner(fn: nn.Module, spec: GraphSpec) -> Runner:
    """Run the torch twin of a graph (inputs and outputs in the graph's order and names)."""
    import torch

    from .onnx_export import as_outputs, module_device, to_numpy

    in_names = [t.name for t in spec.inputs]
    out_names = [t.name for t in spec.outputs]
    device = module_device(fn)

    def run(feeds: Feeds) -> Feeds:
        args = [torch.from_numpy(np.ascontiguousarray(feeds[n])).to(device) for n in in_names]
        with torch.no_grad():
            outs = as_outputs(fn(*args), "the exported function")
        return {n: to_numpy(o) for n, o in zip(out_names, outs, strict=True)}

    return run


@dataclass
class ParityInputs:
    """The inputs every comparison of one export uses (so variants see the same data)."""

    random: dict[int, Feeds]  # batch size -> feeds
    sequence: np.ndarray  # (T, features...)
    sequence_source: str
    initial_state: Feeds  # state name -> array at batch 1 (recurrent only)
    seed: int
    #: the other data inputs (a goal, a mode) at batch 1, held fixed over the sequence
    held: Feeds = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: a graph whose batch is fixed at 1 (an imported file): a feed-forward sequence runs one row per call
    row_by_row: bool = False


def random_walk(steps: int, feature_shape: tuple[int, ...], seed: int) -> np.ndarray:
    """A random walk with unit spread at its end: steps ~ N(0, 1/steps), started at N(0, 1)."""
    rng = np.random.default_rng(seed + 1)
    start = rng.standard_normal(feature_shape)
    walk = start + np.cumsum(rng.standard_normal((steps, *feature_shape)) / np.sqrt(steps), axis=0)
    return walk.astype(np.float32)


def check_sequence(seq: Any, feature_shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    arr = np.asarray(seq.detach().cpu().numpy() if hasattr(seq, "detach") else seq)  # a torch tensor or an array
    if arr.ndim != 1 + len(feature_shape) or tuple(arr.shape[1:]) != feature_shape or arr.shape[0] < 2:
        raise ExportError(
            f"recorded_sequence has shape {arr.shape}; expected (T, {', '.join(map(str, feature_shape))}) "
            "with T >= 2 (one row per step, the features of one example_input row)"
        )
    bad = np.argwhere(~np.isfinite(arr))
    if bad.size:
        raise ExportError(f"recorded_sequence has a non-finite value at index {tuple(int(i) for i in bad[0])}; clean the recording")
    return arr.astype(dtype, copy=False)


def make_parity_inputs(
    spec: GraphSpec,
    *,
    batch_sizes: tuple[int, ...],
    sequence: Any = None,
    sequence_steps: int = 64,
    seed: int = 0,
    initial_state: Feeds | None = None,
) -> ParityInputs:
    rng = np.random.default_rng(seed)
    x = sequence_input(spec)
    feature_shape = tuple(x.concrete_shape(1)[1:])
    dtype = np.dtype(x.dtype)
    random: dict[int, Feeds] = {}
    for b in batch_sizes:
        feeds = {t.name: rng.standard_normal(t.concrete_shape(b)).astype(np.dtype(t.dtype)) for t in spec.data_inputs}
        for s in spec.state_inputs:  # a recurrent state anywhere a tanh-bounded unit can be
            feeds[s.name] = rng.uniform(-1.0, 1.0, s.concrete_shape(b)).astype(np.dtype(s.dtype))
        random[b] = feeds
    held = {t.name: rng.standard_normal(t.concrete_shape(1)).astype(np.dtype(t.dtype))
            for t in spec.data_inputs if t is not x}
    if sequence is None:
        seq, source = random_walk(sequence_steps, feature_shape, seed), f"random_walk(seed={seed})"
    else:
        seq, source = check_sequence(sequence, feature_shape, dtype), "recorded"
    return ParityInputs(random=random, sequence=seq, sequence_source=source, initial_state=dict(initial_state or {}),
                        seed=seed, held=held)


def sequence_input(spec: GraphSpec) -> TensorSpec:
    """The data input a sequence runs through (the measurement); the others are held fixed."""
    for t in spec.data_inputs:
        if spec.role_of(t) == "measurement":
            return t
    return spec.data_inputs[0]


def _errors(got: Feeds, want: Feeds, tol: Tolerance) -> dict[str, Any]:
    worst_abs, worst_rel, worst_name, ok = 0.0, 0.0, "", True
    for name, b in want.items():
        a = np.asarray(got[name], dtype=np.float64)
        b = np.asarray(b, dtype=np.float64)
        if a.shape != b.shape:
            raise ParityError(f"output {name!r} has shape {a.shape} from the candidate but {b.shape} from the reference")
        if not np.all(np.isfinite(b)):  # the reference itself: the model is not defined on these inputs
            return {"max_abs": None, "max_rel": None, "worst_output": name, "non_finite": True,
                    "reference_non_finite": True, "within_tolerance": False}
        if not np.all(np.isfinite(a)):
            # JSON has no infinity: a non-finite output is recorded as null errors and fails.
            return {"max_abs": None, "max_rel": None, "worst_output": name, "non_finite": True, "within_tolerance": False}
        err = float(np.max(np.abs(a - b))) if a.size else 0.0
        rel = err / (float(np.max(np.abs(b))) + REL_EPS) if a.size else 0.0
        ok = ok and tol.passes(err, rel)
        if err >= worst_abs:
            worst_abs, worst_name = err, name
        worst_rel = max(worst_rel, rel)
    return {"max_abs": worst_abs, "max_rel": worst_rel, "worst_output": worst_name, "within_tolerance": ok}


def rollout(run: Runner, spec: GraphSpec, seq: np.ndarray, initial_state: Feeds,
            held: Feeds | None = None) -> tuple[Feeds, Feeds]:
    """Run a single-step graph over ``seq`` one row at a time, carrying state through its outputs.

    Returns (per-output arrays stacked over steps with the batch axis of 1 dropped, and the
    final state keyed by its input name). ``held`` gives the other data inputs, fixed.
    """
    held = held or {}
    x = sequence_input(spec).name
    state = {k: v.copy() for k, v in initial_state.items()}
    steps: list[Feeds] = []
    for t in range(seq.shape[0]):
        out = run({x: seq[t : t + 1], **held, **state})
        steps.append(out)
        state = {s.name: out[s.state_pair] for s in spec.state_inputs if s.state_pair}
    stacked = {t.name: np.concatenate([o[t.name] for o in steps], axis=0) for t in spec.data_outputs}
    return stacked, state


def row_by_row(run: Runner, spec: GraphSpec) -> Runner:
    """``run`` called once per batch row (a batch of one each), the outputs joined again along each tensor's batch
    axis (its ``"batch"`` axis, else axis 0): what one batched call gives when rows are independent, and the way to
    give a batch to a graph whose batch is fixed at 1 or to a backend that runs batch 1."""
    # a state tensor of a graph fixed at batch 1 has no batch axis to split along (its axis 0 is an RNN's layers)
    axis: dict[str, int | None] = {t.name: t.shape.index("batch") if "batch" in t.shape else (None if t.state else 0)
                                   for t in [*spec.inputs, *spec.outputs]}

    def run_rows(feeds: Feeds) -> Feeds:
        split = [k for k in feeds if axis.get(k, 0) is not None]
        n = max((feeds[k].shape[axis.get(k, 0) or 0] for k in split), default=1)
        if n == 1:
            return run(feeds)
        whole = [k for k in feeds if axis.get(k, 0) is None]
        if whole:
            raise ExportError(f"cannot run a batch of {n} row by row through a graph whose state {whole[0]!r} has no "
                              "batch axis; give the rows one at a time")
        outs = [run({k: np.take(v, [i], axis=axis.get(k, 0) or 0) for k, v in feeds.items()}) for i in range(n)]
        return {k: np.concatenate([o[k] for o in outs], axis=axis.get(k, 0) or 0) for k in outs[0]}

    return run_rows


def _final(spec: GraphSpec, state: Feeds) -> Feeds:
    """A rollout's final state keyed by the state *output* names (``h_out``)."""
    return {s.state_pair: state[s.name] for s in spec.state_inputs if s.state_pair}


def compare(reference: Runner, candidate: Runner, spec: GraphSpec, inputs: ParityInputs, tol: Tolerance) -> dict[str, Any]:
    """Compare ``candidate`` with ``reference`` on ``inputs``; return the parity record (never raises on error size)."""
    checks: dict[str, dict[str, Any]] = {}
    for b, feeds in inputs.random.items():
        checks[f"random_batch_{b}"] = {"batch": b, **_errors(candidate(feeds), reference(feeds), tol)}
    seq = inputs.sequence
    if spec.kind == "recurrent":
        got, got_state = rollout(candidate, spec, seq, inputs.initial_state, inputs.held)
        want, want_state = rollout(reference, spec, seq, inputs.initial_state, inputs.held)
        rec = _errors({**got, **_final(spec, got_state)}, {**want, **_final(spec, want_state)}, tol)
        checks["sequence_step_by_step"] = {"steps": int(seq.shape[0]), **rec}
    else:
        feeds = {sequence_input(spec).name: seq,
                 **{k: np.repeat(v, seq.shape[0], axis=0) for k, v in inputs.held.items()}}
        if inputs.row_by_row:
            candidate, reference = row_by_row(candidate, spec), row_by_row(reference, spec)
        checks["sequence_as_batch"] = {"steps": int(seq.shape[0]), **_errors(candidate(feeds), reference(feeds), tol)}
    return summarize(checks, tol, inputs)


def _worst(values: Iterable[float | None]) -> float | None:
    vals = list(values)
    return None if any(v is None for v in vals) else max(vals)


def fmt_error(v: float | None) -> str:
    return "non-finite" if v is None else f"{v:.2e}"


def summarize(checks: dict[str, dict[str, Any]], tol: Tolerance, inputs: ParityInputs) -> dict[str, Any]:
    return {
        "within_tolerance": all(c["within_tolerance"] for c in checks.values()),
        "max_abs": _worst(c["max_abs"] for c in checks.values()),
        "max_rel": _worst(c["max_rel"] for c in checks.values()),
        "tolerance": tol.to_dict(),
        "rule": "an output passes when max_abs <= tolerance.abs or max_rel <= tolerance.rel; "
        "max_rel = max|a-b| / (max|b| + 1e-12), b the reference",
        "batch_sizes": sorted(inputs.random),
        "sequence_steps": int(inputs.sequence.shape[0]),
        "sequence_source": inputs.sequence_source,
        "seed": inputs.seed,
        "ort_threads": 1,
        "checks": checks,
    }


def offers_full_sequence(module: nn.Module, n_states: int) -> bool:
    """Whether ``module.forward`` takes a sequence and the states (``forward(seq, *states)``). A module that
    defines no ``forward`` (torch's placeholder takes ``*input`` and raises) offers none."""
    from torch import nn

    if getattr(type(module), "forward", None) is nn.Module.forward:
        return False
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return True
    positional = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 1 + n_states


class NotASequenceForward(ExportError):
    """``module.forward(seq, *states)`` does not give the step outputs over a sequence: a forward that is the step
    itself (``forward(x, h)`` of a GRUCell model) or that means something else."""


def full_sequence_check(
    module: nn.Module, onnx_run: Runner, spec: GraphSpec, inputs: ParityInputs, tol: Tolerance
) -> dict[str, Any]:
    """The ONNX step-by-step rollout vs one torch call ``module(seq[None], *init_state)``. Raises
    ``NotASequenceForward`` where forward does not take or give a sequence (the caller decides whether that is an
    error: it is when the check was asked for, a note when it was only offered by forward's signature)."""
    import torch

    from .onnx_export import module_device, step_outputs, to_numpy

    device = module_device(module)
    seq = torch.from_numpy(inputs.sequence[None]).to(device)
    states = [torch.from_numpy(inputs.initial_state[s.name]).to(device) for s in spec.state_inputs]
    call = f"{type(module).__name__}.forward(seq, *states)"
    try:
        with torch.no_grad():
            raw = module(seq, *states)
    except Exception as exc:  # noqa: BLE001  (torch raises anything for a step-style forward given a sequence)
        raise NotASequenceForward(
            f"{call} with a batch-first sequence of shape {tuple(seq.shape)} raised {type(exc).__name__}: "
            f"{str(exc).strip()[:200]}. A forward that is the step itself cannot be checked over a whole sequence; "
            "pass ExportOptions(full_sequence_check=False) to say so") from None
    try:
        outs = step_outputs(raw, call)[0]  # (out, h) or (out, (h, c)), as nn.GRU and nn.LSTM return
    except ExportError as exc:
        raise NotASequenceForward(str(exc)) from None
    data_out, state_out = spec.data_outputs, [t for t in spec.outputs if t.state]
    if len(outs) != len(data_out) + len(state_out):
        raise NotASequenceForward(
            f"{type(module).__name__}.forward(seq, *states) returned {len(outs)} tensors; expected "
            f"{len(data_out) + len(state_out)} (the step outputs over the sequence, then the final states). "
            "Pass ExportOptions(full_sequence_check=False) if forward has another meaning"
        )
    steps = inputs.sequence.shape[0]
    want: Feeds = {}
    for t, o in zip(data_out + state_out, outs, strict=True):
        arr = to_numpy(o)
        if not t.state:
            if arr.shape[:2] != (1, steps):
                raise NotASequenceForward(
                    f"{type(module).__name__}.forward(seq, *states) output {t.name!r} has shape {arr.shape}; expected "
                    f"batch-first (1, {steps}, ...). Pass ExportOptions(full_sequence_check=False) to skip this check"
                )
            arr = arr[0]
        want[t.name] = arr
    got, got_state = rollout(onnx_run, spec, inputs.sequence, inputs.initial_state, inputs.held)
    got_all = {**got, **_final(spec, got_state)}
    return {"steps": int(steps), **_errors(got_all, want, tol)}


def raise_if_outside(record: dict[str, Any], what: str) -> None:
    if record["within_tolerance"]:
        return
    tol = record["tolerance"]
    undefined = [name for name, c in record["checks"].items() if c.get("reference_non_finite")]
    if undefined:
        c = record["checks"][undefined[0]]
        raise ParityError(
            f"{what}: the torch model itself gives a non-finite output ({c['worst_output']!r}) on the parity inputs of "
            f"{', '.join(undefined)}, so nothing can be compared. Parity feeds standard-normal values (negative ones "
            "included) at each batch size and a random walk, or recorded_sequence= for the sequence: a model with "
            "log, sqrt or a division that is undefined for some real inputs gives NaN or inf there. Make it finite "
            "for any input (clamp or shift before log/sqrt, e.g. torch.log1p(x.clamp_min(0))); what the device "
            "sends can be outside your training range too (docs/bundle.md, 'Parity record')."
        )
    bad = [
        f"{name}: max abs {fmt_error(c['max_abs'])}, max rel {fmt_error(c['max_rel'])} (worst output {c['worst_output']!r})"
        for name, c in record["checks"].items()
        if not c["within_tolerance"]
    ]
    raise ParityError(
        f"{what}: ONNX Runtime differs from torch beyond the tolerance (abs {tol['abs']:g} or rel {tol['rel']:g}):\n  - "
        + "\n  - ".join(bad)
        + "\nLook for ops that the TorchScript exporter maps differently (in-place ops, data-dependent Python control "
        "flow frozen at trace time, train-mode layers), or pass a looser `tolerance=Tolerance(...)` if the "
        "difference is acceptable for this model."
    )
