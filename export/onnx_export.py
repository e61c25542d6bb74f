"""Trace a torch module into one ONNX graph with a dynamic batch axis, and check the graph.

Two kinds of graph (``GraphSpec.kind``):

* ``"feedforward"``: ``module(x) -> y`` (or a tuple of outputs).
* ``"recurrent"``: a single-step graph with explicit state in and out, so streaming
  is one call per bin. The module exposes ``step(x, *states) -> (y, *new_states)``
  and ``init_state(batch) -> tuple[Tensor, ...]``; the exported graph's ``forward``
  is ``step``. State input ``h`` pairs with state output ``h_out``.

Export uses the TorchScript exporter (``torch.onnx.export(..., dynamo=False)``, through
``closedloop.export.prepare``, which also turns torch's attention fast path off while tracing
and turns exporter failures into one-line errors naming the op and the submodule): it
writes one ONNX ``GRU`` node per layer with PyTorch's semantics
(``linear_before_reset=1``), whereas the dynamo exporter was silently wrong for GRU
with onnxscript < 0.7.1 and fixes example-sized axes. Which axis of each tensor is
the batch is measured, not assumed: the module runs at batch 2 and 3 and the axis
that changes is marked dynamic and named ``"batch"`` (for ``nn.GRU`` state
``(layers, batch, hidden)`` that is axis 1). The graph is then checked against
those shapes and, for GRU nodes, against PyTorch's GRU semantics.
"""

from __future__ import annotations

import copy
import io
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import torch
from torch import nn

from closedloop.runtime.manifest import GraphSpec, TensorSpec
from closedloop.runtime.onnx_reader import OnnxModel, parse_onnx

from .assemble import DATA_DEPENDENT_SIZE, KINDS, fix_declared_dims
from .errors import ExportError, GraphCheckError
from .prepare import torch_onnx_export

BATCH = "batch"  # the one dynamic axis name we export (TensorSpec.concrete_shape relies on it)


def as_outputs(value: Any, what: str) -> tuple[torch.Tensor, ...]:
    """A tensor, a tuple/list of tensors or a dict of them (its values in order), as a tuple; anything else is
    refused by name."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, tuple | list) and value and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(value)
    raise ExportError(f"{what} returned {type(value).__name__}; expected a Tensor, a tuple of Tensors or a dict "
                      "of them")


class _FeedForward(nn.Module):
    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.output_keys: list[str] | None = None  # a forward that returns a dict: its keys, in order

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        value = self.module(*inputs)
        if isinstance(value, Mapping):
            self.output_keys = [str(k) for k in value]
        return as_outputs(value, f"{type(self.module).__name__}.forward")


def step_outputs(value: Any, what: str) -> tuple[tuple[torch.Tensor, ...], list[str] | None]:
    """A step's return value as one flat tuple of tensors, and the keys of a dict of outputs where it gave one.

    ``step`` may return ``(y, *new_states)`` or group either side one level deep: ``((y1, y2), h)``,
    ``({"velocity": v, "click": c}, h)``, ``(y, (h, c))``; the data outputs come first, the new states last (as
    many as ``init_state`` gives)."""
    if isinstance(value, torch.Tensor | Mapping):
        value = (value,)
    if not isinstance(value, tuple | list) or not value:
        raise ExportError(f"{what} returned {type(value).__name__}; expected (y, *new_states): tensors, where y may "
                          "be a tuple or dict of tensors and the states a tuple of them")
    flat: list[torch.Tensor] = []
    keys: list[str] | None = None
    for i, part in enumerate(value):
        if isinstance(part, torch.Tensor):
            flat.append(part)
            continue
        if isinstance(part, Mapping):
            if i == 0:
                keys = [str(k) for k in part]
            part = list(part.values())
        if isinstance(part, tuple | list) and part and all(isinstance(t, torch.Tensor) for t in part):
            flat.extend(part)
            continue
        inner = ", ".join(sorted({type(t).__name__ for t in part})) if isinstance(part, tuple | list) else ""
        raise ExportError(f"{what} returned a {type(value).__name__} whose item {i} is a {type(part).__name__}"
                          + (f" of {inner}" if inner else "") + "; expected (y, *new_states): tensors, where y "
                          "may be a tuple or dict of tensors and the states a tuple of them, one level deep")
    return tuple(flat), keys


class _Step(nn.Module):
    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.output_keys: list[str] | None = None  # a step whose outputs are a dict: its keys, in order

    def forward(self, *inputs_and_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        flat, keys = step_outputs(self.module.step(*inputs_and_states), f"{type(self.module).__name__}.step")
        if keys is not None:
            self.output_keys = keys
        return flat


def _run_batches(run: Callable[[int], Any], probe: Callable[[], None], module: nn.Module, kind: str,
                 as_given: Callable[[], Any] | None = None, shapes: Sequence[Sequence[int]] = ()) -> tuple[Any, Any]:
    """``run(2)`` and ``run(3)`` (which axis changes is the batch); a module that fails there is explained: one that
    works at batch 1 only is told how to take any batch, one that fails at batch 1 too is shown its error. A module
    whose buffers change when it runs (``probe``: random inputs) keeps state the graph cannot carry, and is refused;
    the buffers are put back either way."""
    what = f"{type(module).__name__}.{'step' if kind == 'recurrent' else 'forward'}"
    before = {n: b.detach().clone() for n, b in module.named_buffers()}
    try:
        out = run(2), run(3)
        # compared after those runs, so a cache a module fills on its first call (rotary tables) is not state
        settled = {n: b.detach().clone() for n, b in module.named_buffers()}
        try:
            probe()
        except Exception:  # noqa: BLE001 - random inputs outside what the module accepts: the examples decide
            pass
        changed = [n for n, b in module.named_buffers() if n in settled and not _same_tensor(b, settled[n])]
        if changed:
            raise ExportError(
                f"{what} changes its buffer(s) {changed[:4]} when it runs: state kept inside the module is frozen "
                "at trace time, so the bundle would not carry it. Make the state explicit: kind='recurrent' with "
                "init_state(batch) and step(x, *states) -> (y, *new_states), which the runtime carries from step "
                "to step (docs/workflow.md)"
            )
        return out
    except ExportError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        try:
            run(1)
        except Exception:
            try:  # the examples exactly as given: a module written for unbatched input runs on them
                if as_given is None:
                    raise
                as_given()
            except Exception:
                raise ExportError(f"{what} fails on the example input(s): {type(exc).__name__}: {first}") from exc
            given = ", ".join(str(tuple(s)) for s in shapes)
            raise ExportError(
                f"{what} runs on the example input(s) as given ({given}) but not on their first row, which is how "
                "the exporter reads them: axis 0 of every example is the batch. The module takes unbatched input; "
                f"give the example and forward a batch axis first: an example of shape (1, {_dims(shapes)}) and a "
                f"forward over (batch, {_dims(shapes)}) ({type(exc).__name__} at batch 2: {first})"
            ) from exc
        raise ExportError(
            f"{what} runs at batch 1 but fails at batch 2 ({type(exc).__name__}: {first}). The exporter runs it at "
            "batch sizes 2 and 3 to find which axis is the batch (the bundle's graph takes any batch; parity is "
            "checked at 1 and 3): make it batch-agnostic, e.g. x.reshape(x.shape[0], -1) instead of "
            "x.reshape(1, -1), and no buffer or constant shaped with a batch of 1" + _layout_hint(module)
        ) from exc
    finally:
        _restore_buffers(module, before)  # the runs above leave the caller's module as it was


#: The export warning for a Python ``if`` on a tensor's value, which tracing freezes.
BRANCH_FROZEN = (
    "the module branches on a tensor's value in Python (if x.abs().max() > t: ...): the trace kept the branch the "
    "example input took, and the bundle takes it for every input. Parity runs standard-normal inputs (and "
    "recorded_sequence=), so a branch taken only beyond them (an artefact threshold) is not tested. Write the "
    "branch with torch.where(cond, a, b), which every backend runs, or export a torch.jit.script-ed module (an If "
    "node: ONNX Runtime runs it, Numba refuses it)"
)


def stable_log_sigmoid(data: bytes) -> tuple[bytes, int]:
    """Rewrite every ``Log(Sigmoid(x))`` (how torch exports ``F.logsigmoid``) as ``Neg(Softplus(Neg(x)))``.

    Both backends compute the logistic function to an absolute error of about 2e-7, fine for a gate but not in its
    tail: ``log`` of it was -16.6 for x = -16 on ONNX Runtime and -17.3 for every x below -18 on Numba, and
    -inf on ONNX Runtime below about -17 (a finite torch output refused as non-finite), where
    ``-softplus(-x)`` is accurate everywhere. A Sigmoid that feeds nothing else is dropped. Returns the graph and
    how many were rewritten.
    """
    import onnx
    from onnx import helper

    model = onnx.load_from_string(data)
    graph = model.graph
    standard = ("", "ai.onnx")
    producer = {out: n for n in graph.node for out in n.output}
    nodes, rewritten = [], 0
    for node in graph.node:
        src = producer.get(node.input[0]) if node.op_type == "Log" and node.domain in standard else None
        if src is None or src.op_type != "Sigmoid" or src.domain not in standard:
            nodes.append(node)
            continue
        tag = f"closedloop_logsigmoid_{rewritten}"
        nodes += [helper.make_node("Neg", [src.input[0]], [f"{tag}_neg"], name=f"{tag}_neg"),
                  helper.make_node("Softplus", [f"{tag}_neg"], [f"{tag}_softplus"], name=f"{tag}_softplus"),
                  helper.make_node("Neg", [f"{tag}_softplus"], list(node.output), name=f"{tag}_out")]
        rewritten += 1
    if not rewritten:
        return data, 0
    used = {i for n in nodes for i in n.input} | {o.name for o in graph.output}
    nodes = [n for n in nodes if n.op_type != "Sigmoid" or any(o in used for o in n.output)]
    del graph.node[:]
    graph.node.extend(nodes)
    return model.SerializeToString(), rewritten


def _dims(shapes: Sequence[Sequence[int]]) -> str:
    return ", ".join(map(str, shapes[0])) if shapes else "..."


def _layout_hint(module: nn.Module) -> str:
    """A step adapter told the sequence is batch first around recurrent layers that are all time first (or the
    reverse): the likely cause of a failure at batch 2, said with the fix."""
    batch_first = getattr(module, "batch_first", None)
    inner = getattr(module, "module", None)
    if batch_first is None or not isinstance(inner, nn.Module):
        return ""
    rnns = [(name, m) for name, m in inner.named_modules() if isinstance(m, nn.RNNBase)]
    if not rnns or any(m.batch_first == batch_first for _, m in rnns):
        return ""
    name, rnn = rnns[0]
    layout = "batch first (batch_first=True)" if rnn.batch_first else "time first (batch_first=False)"
    return (f". The wrapped model's {type(rnn).__name__} {name!r} is {layout}, and the step adapter was given "
            f"batch_first={batch_first}: if forward takes its sequence that way, pass "
            f"SequenceStep(..., batch_first={rnn.batch_first})")


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


def _restore_buffers(module: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Put ``saved`` back: in place where the buffer kept its shape, else the tensor itself (Python modules; a
    TorchScript module's buffers can only change in place)."""
    owners = dict(module.named_modules())
    current = dict(module.named_buffers())
    for name, value in saved.items():
        now = current.get(name)
        if now is None or _same_tensor(now, value):
            continue
        with torch.no_grad():
            if now.shape == value.shape and now.dtype == value.dtype:
                now.copy_(value)
            elif not isinstance(module, torch.jit.ScriptModule):
                owner, _, leaf = name.rpartition(".")
                owners[owner]._buffers[leaf] = value


def eval_mode(module: nn.Module) -> Callable[[], None]:
    """Put ``module`` in inference mode and return what puts its mode back. A module from ``torch.export``
    (``ExportedProgram.module()``) refuses mode switches, and its shapes do not survive the TorchScript tracer
    (its batch is fixed at the traced size): it is refused with what to export instead."""
    modes = [(m, m.training) for m in module.modules()]  # each one's own: a wrapper in train mode (a new
    # SequenceStep) around a model in eval mode must not put that model in train mode on the way back
    try:
        module.eval()
    except NotImplementedError as exc:  # torch.export's GraphModule: "Calling eval() is not supported yet"
        raise ExportError(
            f"{type(module).__name__} cannot be put in eval mode ({exc}): it looks like a torch.export program's "
            "module (ExportedProgram.module()), which export_bundle cannot trace with a free batch axis. Export "
            "the nn.Module the program was made from (model.eval()), or a TorchScript module of it"
        ) from exc

    def restore() -> None:
        for m, was in modes:  # parents before children (modules() is pre-order): each ends as it was
            m.train(was)

    return restore


def training_behaviour(module: nn.Module) -> list[str]:
    """Submodules in training mode that compute differently in eval mode (dropout, batch-norm statistics, an RNN's
    dropout between layers): what exporting in eval mode changes for a module the caller left in train mode."""
    found = []
    for name, m in module.named_modules():
        if not m.training:
            continue
        if isinstance(m, (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._BatchNorm)) or (
                isinstance(m, nn.modules.instancenorm._InstanceNorm) and m.track_running_stats) or (
                isinstance(m, nn.RNNBase) and m.dropout > 0):
            found.append(f"{name or type(module).__name__} ({type(m).__name__})")
    return found


def check_float32(module: nn.Module, examples: dict[str, torch.Tensor]) -> None:
    """Bundles compute in float32 (device frames are float32; fp16 is a variant made from the float32 graph):
    refuse float64, float16 or bfloat16 example inputs, parameters or buffers by name, with the conversion to
    make, rather than fail later."""
    def other(t: torch.Tensor) -> bool:
        return t.is_floating_point() and t.dtype != torch.float32

    found = [f"example input {n!r} ({ex.dtype})" for n, ex in examples.items() if other(ex)]
    found += [f"parameter {n!r} ({p.dtype})" for n, p in module.named_parameters() if other(p)][:3]
    found += [f"buffer {n!r} ({b.dtype})" for n, b in module.named_buffers() if other(b)][:3]
    if found:
        raise ExportError(
            f"{', '.join(found)} {'is' if len(found) == 1 else 'are'} not float32; a bundle computes in float32 (the "
            "device's frames are float32, and export adds fp16 and int8 variants made from the float32 graph, each "
            "checked against it): export module.float() with float32 example inputs (check the float32 model's "
            "accuracy first if it was trained in another precision)"
        )


def initial_states(module: nn.Module, batch: int) -> tuple[torch.Tensor, ...]:
    """``module.init_state(batch)`` as a tuple of tensors."""
    return as_outputs(module.init_state(batch), f"{type(module).__name__}.init_state({batch})")


def check_recurrent_protocol(module: nn.Module) -> None:
    missing = [m for m in ("step", "init_state") if not callable(getattr(module, m, None))]
    if missing:
        raise ExportError(
            f"{type(module).__name__} has no {' or '.join(missing)}(); a recurrent export needs "
            "step(x, *states) -> (y, *new_states) and init_state(batch) -> tuple of state tensors "
            "(see sdk.models.GRUDecoder). A module whose forward(x, h) is already one step needs only those two "
            "methods: init_state(batch) returning the starting h, and step(self, x, h) returning self(x, h). A "
            "sequence model with forward(seq, state) -> (out, new_state), batch first, streams through "
            "closedloop.export.SequenceStep(module, init_state=lambda b: torch.zeros(layers, b, hidden))"
        )


def example_batch(example: torch.Tensor, batch: int) -> torch.Tensor:
    """The example input's first row repeated to ``batch`` rows."""
    return example[:1].repeat(batch, *([1] * (example.dim() - 1)))


def _batch_axis(a: Sequence[int], b: Sequence[int], what: str) -> int | None:
    if len(a) != len(b):
        raise ExportError(f"{what} has rank {len(a)} at batch 2 but rank {len(b)} at batch 3; its rank must not depend on the batch")
    changed = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    if len(changed) > 1:
        raise ExportError(
            f"{what} has shape {tuple(a)} at batch 2 and {tuple(b)} at batch 3: axes {changed} follow the batch; "
            "exactly one axis (or none) may"
        )
    return changed[0] if changed else None


@dataclass
class ExportedGraph:
    """An exported ONNX graph and what is needed to run its torch twin."""

    onnx_bytes: bytes
    spec: GraphSpec
    torch_fn: nn.Module  # forward(x, *states) -> tuple of outputs, in the graph's I/O order
    model: OnnxModel
    checks: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def _names(given: str | Sequence[str] | None, count: int, default: str, what: str) -> list[str]:
    given = default if given is None else given
    if isinstance(given, str):
        return [given] if count == 1 else [f"{given}{i}" for i in range(count)]
    names = list(given)
    if len(names) != count:
        raise ExportError(f"{len(names)} {what} names given ({names}) but the module has {count} {what}s")
    return names


def _check_dims(t: TensorSpec, graph_shape: list, torch_shape: Sequence[int], axis: int | None, role: str) -> list:
    """The manifest shape: the graph's, checked against torch's (batch axis named, the rest fixed)."""
    if len(graph_shape) != len(torch_shape):
        raise GraphCheckError(
            f"{role} {t.name!r}: the ONNX graph has rank {len(graph_shape)} ({graph_shape}), torch gives shape "
            f"{tuple(torch_shape)}; the exporter changed the tensor's rank"
        )
    out: list = []
    for i, (g, d) in enumerate(zip(graph_shape, torch_shape, strict=True)):
        if i == axis:
            if g != BATCH:
                raise GraphCheckError(f"{role} {t.name!r} axis {i} is the batch axis but the graph has {g!r} there, not {BATCH!r}")
            out.append(BATCH)
        elif isinstance(g, int) and g != d:
            raise GraphCheckError(f"{role} {t.name!r} axis {i} is {g} in the graph but torch gives {d}")
        else:
            # a name (or nothing) where torch gives the same size at batch 2 and 3: ONNX's shape inference lost track
            # (F.pad's computed pads, a Concat after it, ...), the size is fixed; the graph is told so (fix_declared_dims)
            out.append(int(d))
    return out


def check_gru_nodes(model: OnnxModel, module: nn.Module) -> dict[str, Any]:
    """Each GRU node must follow PyTorch's semantics, one node per ``nn.GRU`` layer."""
    grus = [n for n in model.nodes if n.op_type == "GRU"]
    for n in grus:
        lbr = n.attributes.get("linear_before_reset", 0)
        if lbr != 1:
            raise GraphCheckError(
                f"GRU node {n.name!r} has linear_before_reset={lbr}; PyTorch's GRU applies the reset gate after the "
                "recurrent linear layer (linear_before_reset=1), so this graph computes something else. Export with "
                "torch.onnx.export(..., dynamo=False) (what export_bundle does) or fix the exporter"
            )
        if n.attributes.get("layout", 0) != 0:
            raise GraphCheckError(f"GRU node {n.name!r} has layout={n.attributes['layout']}; expected 0 (time-major)")
    layers = sum(m.num_layers for m in module.modules() if isinstance(m, nn.GRU))
    if layers and len(grus) != layers:
        raise GraphCheckError(
            f"the module has {layers} nn.GRU layer(s) but the graph has {len(grus)} GRU node(s); the exporter "
            "decomposed the GRU (the dynamo exporter does), which backends run slower and differently"
        )
    return {"gru_nodes": len(grus), "gru_linear_before_reset": [n.attributes.get("linear_before_reset", 0) for n in grus]}


def check_batchnorm_nodes(model: OnnxModel, module: nn.Module) -> dict[str, Any]:
    """BatchNorm in the graph uses the running statistics; how many layers were folded into a Conv is recorded.

    The exporter folds an eval-mode BatchNorm that follows a Conv into the Conv's weights; any other
    BatchNorm stays one ``BatchNormalization`` node, which must be in inference mode (``training_mode=0``):
    batch statistics would make one row's output depend on the other rows of its batch.
    """
    nodes = [n for n in model.nodes if n.op_type == "BatchNormalization"]
    for n in nodes:
        if n.attributes.get("training_mode", 0):
            raise GraphCheckError(
                f"BatchNormalization node {n.name!r} has training_mode=1 (batch statistics); call module.eval() "
                "before exporting (export_bundle does) and make sure forward does not switch a BatchNorm back to training"
            )
    layers = sum(1 for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))
    return {"batchnorm_layers": layers, "batchnorm_nodes": len(nodes), "batchnorm_folded": max(layers - len(nodes), 0)}


def _check_example_input(name: str, ex: object) -> None:
    """A data input streams float values shaped (batch, features...): say what else was given and what to do."""
    got = f"{getattr(ex, 'dtype', type(ex).__name__)} {tuple(getattr(ex, 'shape', ()))}"
    if not isinstance(ex, torch.Tensor):
        raise ExportError(f"example input {name!r} must be a torch tensor shaped (batch, features...), got {got}")
    if not ex.is_floating_point():
        raise ExportError(
            f"example input {name!r} is {got}: a data input streams float values shaped (batch, features...). "
            "An integer input that stays the same through a session (a session or day index, a subject id) is "
            "fixed at export: wrap the model so that it passes the value itself (for a recurrent model, "
            "step(self, x, h) returning inner.step(x, torch.tensor([DAY]), h)) and export one bundle per value. "
            "One that changes from step to step arrives from the device as a float: take a float tensor and "
            "convert inside the model (x.round().long())"
        )
    if ex.dim() < 2:
        raise ExportError(
            f"example input {name!r} is {got}: a data input is shaped (batch, features...) with the batch first; "
            f"give it a feature axis (a scalar per step: shape (1, 1), x.unsqueeze(-1))"
        )


def export_onnx(
    module: nn.Module,
    example_input: torch.Tensor | Sequence[torch.Tensor],
    *,
    kind: str,
    input_name: str | Sequence[str] = "x",
    output_name: str | Sequence[str] = "y",
    state_names: Sequence[str] | None = None,
    opset: int = 17,
    file: str = "main.onnx",
    report: Callable[[str], None] = print,
) -> ExportedGraph:
    """Export ``module`` (in eval mode) to ONNX bytes and a checked ``GraphSpec``.

    ``example_input`` is one tensor or a sequence of tensors (a module with several inputs,
    ``module(obs, goal)`` or ``step(obs, goal, *states)``), named by ``input_name`` in order.
    """
    if kind not in KINDS:
        raise ExportError(f"kind {kind!r} is not one of {KINDS}")
    examples = [example_input] if isinstance(example_input, torch.Tensor) else list(example_input)
    names_given = [input_name] if isinstance(input_name, str) else list(input_name)
    data_names = names_given if len(names_given) == len(examples) else _names(input_name, len(examples), "x", "input")
    for name, ex in zip(data_names, examples, strict=True):
        _check_example_input(name, ex)
    check_float32(module, dict(zip(data_names, examples, strict=True)))
    device = module_device(module)
    examples = [ex.to(device) for ex in examples]
    n_data = len(examples)
    scripted = isinstance(module, torch.jit.ScriptModule)
    if kind == "recurrent":
        if scripted:
            raise ExportError(
                f"{type(module).__name__} is a TorchScript module (torch.jit.script, trace or load): its step() "
                "cannot be traced into a one-step graph. Export the Python module it was made from, or script a "
                "module whose forward(x, *states) is the step and export that with kind='recurrent' from Python"
            )
        check_recurrent_protocol(module)
        fn: nn.Module = _Step(module)
    else:
        fn = _FeedForward(module)
    eval_mode(module)  # the caller's mode is the caller's to restore (export_bundle does)
    fn.training = False
    # torch's tracer cannot enter a TorchScript module from inside a Python wrapper: export it directly (its
    # forward is the graph); the wrapper still runs it for the shapes and the parity checks
    traced: nn.Module = module if scripted else fn

    def run(batch: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        xs = tuple(example_batch(ex, batch) for ex in examples)
        states = tuple(s.to(device) for s in initial_states(module, batch)) if kind == "recurrent" else ()
        with torch.no_grad():
            return (*xs, *states), fn(*xs, *states)

    def probe() -> None:  # random inputs: a buffer that follows the data changes even where the examples are zeros
        g = torch.Generator().manual_seed(0)
        xs = tuple(torch.randn(tuple(example_batch(ex, 2).shape), generator=g).to(ex) for ex in examples)
        states = tuple(s.to(device) for s in initial_states(module, 2)) if kind == "recurrent" else ()
        with torch.no_grad():
            fn(*xs, *states)

    def as_given() -> None:
        states = tuple(s.to(device) for s in initial_states(module, 1)) if kind == "recurrent" else ()
        with torch.no_grad():
            fn(*examples, *states)

    (ins2, outs2), (ins3, outs3) = _run_batches(run, probe, module, kind, as_given,
                                                [tuple(ex.shape) for ex in examples])
    n_states = len(ins2) - n_data
    n_data_out = len(outs2) - n_states
    if n_data_out < 1:
        raise ExportError(f"step() returned {len(outs2)} tensors for {n_states} states; it must return (y, *new_states)")
    for s_in, s_out, i in zip(ins2[n_data:], outs2[n_data_out:], range(n_states), strict=True):
        if s_in.shape != s_out.shape:
            raise ExportError(
                f"state {i}: init_state gives shape {tuple(s_in.shape)} but step returns its next value with shape "
                f"{tuple(s_out.shape)}; step must return (y, *new_states) with each new state shaped like its input"
            )
    # A learned initial state (an LFADS-style h0) is kept: the manifest's ``initial`` (schema version 3), where the
    # runtime starts and resets the state; a zero one is left implicit, so such a bundle stays version 2.
    learned: list[list[float] | None] = []
    for i, s in enumerate(initial_states(module, 1) if kind == "recurrent" else ()):
        value = s.detach().to("cpu", torch.float32)
        if not bool(torch.isfinite(value).all()):
            raise ExportError(f"init_state(1)[{i}] is not finite (NaN or inf); a state must start at finite values")
        learned.append(value.reshape(-1).tolist() if bool(torch.any(value != 0)) else None)
    if state_names is None:  # a module may name its own states (SequenceStep over an nn.LSTM: h and c)
        state_names = getattr(module, "state_names", None)
    s_names = _names(state_names, n_states, "h", "state") if n_states else []
    in_names = [*data_names, *s_names]
    keys = getattr(fn, "output_keys", None)
    if keys and output_name in (None, "y"):  # a dict's keys name the outputs unless names were given
        output_name = keys
    out_names = [*_names(output_name, n_data_out, "y", "output"), *[f"{s}_out" for s in s_names]]
    if len(set(in_names + out_names)) != len(in_names) + len(out_names):
        raise ExportError(f"input/output names must be distinct, got inputs {in_names} and outputs {out_names}")

    in_axes = [0] * n_data + [_batch_axis(a.shape, b.shape, f"state {n!r}")
                              for a, b, n in zip(ins2[n_data:], ins3[n_data:], s_names, strict=True)]
    out_axes = [_batch_axis(a.shape, b.shape, f"output {n!r}") for a, b, n in zip(outs2, outs3, out_names, strict=True)]
    dynamic_axes = {n: {ax: BATCH} for n, ax in zip(in_names + out_names, in_axes + out_axes, strict=True) if ax is not None}

    buf = io.BytesIO()
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch_onnx_export(
            traced,
            ins2,
            buf,
            root=module,
            opset=opset,
            input_names=in_names,
            output_names=out_names,
            dynamic_axes=dynamic_axes,
            do_constant_folding=True,
        )
    # The legacy-exporter deprecation notice is expected (we chose that exporter on purpose), and
    # torch's own tracer notes about nn.GRU internals are noise; the user's code's warnings are kept.
    torch_dir = os.path.dirname(torch.__file__)
    noted = [
        f"{w.category.__name__}: {w.message}"
        for w in caught
        if not issubclass(w.category, DeprecationWarning) and not str(w.filename).startswith(torch_dir)
    ]
    branches = [w for w in noted if w.startswith("TracerWarning") and "Python boolean" in w]
    if branches:  # an if on a tensor's value: the trace keeps the branch the example took, whatever the input
        noted.insert(0, BRANCH_FROZEN + f" (torch: {branches[0][:160]})")
        report("WARNING: " + noted[0])
    elif noted:
        report(f"torch.onnx.export: {len(noted)} warning(s), first: {noted[0][:160]} (parity checks below test the result)")
    data, log_sigmoids = stable_log_sigmoid(buf.getvalue())
    try:
        onnx.checker.check_model(onnx.load_from_string(data), full_check=True)
    except onnx.checker.ValidationError as exc:
        raise GraphCheckError(f"the exported graph fails onnx.checker: {exc}") from exc
    model = parse_onnx(data)
    g_in, g_out = model.graph_inputs(), model.outputs
    if [v.name for v in g_in] != in_names or [v.name for v in g_out] != out_names:
        raise GraphCheckError(
            f"the exported graph has inputs {[v.name for v in g_in]} and outputs {[v.name for v in g_out]}, expected "
            f"{in_names} and {out_names}. The exporter drops an input no output depends on: the module ignores it, or "
            "forward leaves torch (numpy, .item(), .tolist(), Python floats) so the trace recorded its values as constants"
        )

    pair = {**dict(zip(s_names, out_names[n_data_out:], strict=True)), **dict(zip(out_names[n_data_out:], s_names, strict=True))}
    inputs, outputs = [], []
    for v, t, ax in zip(g_in, ins2, in_axes, strict=True):
        spec = TensorSpec(name=v.name, dtype=v.dtype or "", shape=[], state=v.name in pair, state_pair=pair.get(v.name))
        spec.shape = _check_dims(spec, v.shape, t.shape, ax, "input")
        if v.name in s_names:
            spec.initial = learned[s_names.index(v.name)]
        inputs.append(spec)
    for v, t, ax in zip(g_out, outs2, out_axes, strict=True):
        spec = TensorSpec(name=v.name, dtype=v.dtype or "", shape=[], state=v.name in pair, state_pair=pair.get(v.name))
        spec.shape = _check_dims(spec, v.shape, t.shape, ax, "output")
        outputs.append(spec)
    for t in inputs + outputs:
        if t.dtype not in ("float32", "float16", "float64"):
            what = "output" if t in outputs else "input"
            raise GraphCheckError(
                f"{what} {t.name!r} has dtype {t.dtype!r}; a bundle's inputs and outputs are floating-point. "
                + ("Return it as a float (label.float(): an argmax label is exact in float32 and runs on every "
                   "backend), or return the scores it came from (logits or probabilities)"
                   if what == "output" else "Take a float input and convert it inside the model")
            )
    declared = {v.name: v.shape for v in [*g_in, *g_out]}
    if any(declared[t.name] != t.shape for t in inputs + outputs):
        sized = sorted({n.op_type for n in model.nodes} & DATA_DEPENDENT_SIZE)
        if sized:
            raise GraphCheckError(f"the graph's {', '.join(sized)} node(s) give outputs whose size depends on the input "
                                  "values; a bundle streams fixed sizes at a fixed rate: keep the computation's sizes "
                                  "fixed (a mask and a multiply instead of indexing by a condition, say)")
        data = fix_declared_dims(data, {t.name: t.shape for t in inputs + outputs})
        model = parse_onnx(data)

    checks = check_gru_nodes(model, module)
    checks.update(check_batchnorm_nodes(model, module))
    checks["opset"] = model.opset.get("ai.onnx", opset)
    checks["nodes"] = len(model.nodes)
    if log_sigmoids:
        checks["log_sigmoid_rewritten"] = log_sigmoids  # Log(Sigmoid(x)) -> -Softplus(-x): exact in the tail
    spec = GraphSpec(file=file, kind=kind, inputs=inputs, outputs=outputs)
    return ExportedGraph(onnx_bytes=data, spec=spec, torch_fn=fn, model=model, checks=checks, warnings=noted)


def module_device(module: nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def cpu_copy(module: nn.Module) -> nn.Module:
    """A CPU copy of ``module``; the module itself stays as it is.

    A tensor a forward pass with gradients kept as an attribute (``self.h = h`` in a streaming model) is not a
    graph leaf, and ``copy.deepcopy`` refuses it: such attributes are copied detached. Anything else deepcopy
    refuses is an ExportError that says what to do."""
    memo: dict[int, Any] = {}
    for m in module.modules():
        for value in vars(m).values():
            if isinstance(value, torch.Tensor) and not value.is_leaf:
                memo[id(value)] = value.detach().clone()
    try:
        return copy.deepcopy(module, memo).cpu()
    except (RuntimeError, TypeError) as exc:
        raise ExportError(f"cannot copy the module to the CPU for export ({exc}); move it there yourself "
                          "(module.cpu()) and export again") from exc


def to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()
