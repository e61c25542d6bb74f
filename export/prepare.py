"""Run ``torch.onnx.export`` on a user's module as it should run, and explain its failures in one line.

``onnx_export`` calls :func:`torch_onnx_export` instead of ``torch.onnx.export``. It does two
things a user should not have to know about:

* **Settings.** While the graph is traced, torch's attention fast path is off
  (``torch.backends.mha.set_fastpath_enabled(False)``): in eval mode without gradients
  ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` otherwise call the fused kernels
  ``aten::_native_multi_head_attention`` / ``aten::_transformer_encoder_layer_fwd``, which no ONNX
  opset has. The slow path computes the same function from ops ONNX has. torch's own ONNX log is
  kept quiet too (torch 2.x turns it on during every export and then prints the whole TorchScript
  IR to stdout when a pass fails). ``aten::rms_norm`` (``nn.RMSNorm``), which this exporter has no
  symbolic for, is written with ONNX ops (:func:`rms_norm_symbolic`) unless one is registered already.
  An ``nn.LSTM`` with projections (``proj_size``), which ONNX's LSTM lacks, is traced through an explicit
  forward (``closedloop.export.lstm_projection``).
  Everything is restored afterwards, also on error.
* **Failures.** Any error from the exporter becomes an :class:`UnsupportedOpError` (an
  ``ExportError``): "cannot export MODULE_PATH (TYPE): op OP is not supported by ONNX opset N;
  WHAT TO DO". The op is read from torch's message; the submodule that calls it is found by
  tracing the module once more with every submodule's full name as its trace scope. The message
  is one short line: torch's (which may carry an IR dump or a stack) stays in ``__cause__``.

Which exporter: torch >= 2.9 defaults to ``dynamo=True``, which needs ``onnxscript`` and
decomposes ``nn.GRU``; export_bundle keeps the TorchScript exporter (``dynamo=False``).
"""

from __future__ import annotations

import contextlib
import fnmatch
import io
import os
import re
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .errors import ExportError, UnsupportedOpError
from .lstm_projection import explicit_projected_lstms

ROOT = "model"  # how messages name the exported module itself (its submodules: model.encoder.layers.0)
MAX_TORCH_TEXT = 160  # characters of torch's own message quoted when the op cannot be named

#: What to do about an op, by pattern (fnmatch) on its qualified name; the first match wins. ``{op}`` and
#: ``{opset}`` are filled in.
_FUSED = ("is torch's fused {what} fast path, which export_bundle turns off while exporting where torch has the switch "
          "(torch.backends.mha.set_fastpath_enabled); this torch lacks it or forward calls the kernel itself: call {use}")
OP_ADVICE: tuple[tuple[str, str], ...] = (
    ("aten::_native_multi_head_attention",
     "it " + _FUSED.format(what="attention", use="nn.MultiheadAttention or F.scaled_dot_product_attention")),
    ("aten::_transformer_encoder_layer_fwd", "it " + _FUSED.format(what="encoder", use="nn.TransformerEncoderLayer")),
    ("aten::adaptive_*_pool*", "give the adaptive pool an output size that divides the input length "
     "(or use a plain pool with an explicit kernel_size and stride)"),
    ("aten::linalg_*", "compute it once from the trained weights and store the result as a buffer, "
     "or move it out of the model (into preprocess/postprocess)"),
    ("aten::fft_*", "for a power or magnitude spectrum use closedloop.export.PowerSpectrum(n, window=...), which "
     "computes |rfft|^2 as products with fixed DFT matrices; otherwise compute the transform outside the model "
     "(preprocess)"),
    ("aten::lift_fresh", "forward builds a tensor from Python or numpy data (torch.from_numpy, .numpy(), .tolist()); "
     "keep the computation in torch ops"),
    ("prim::PythonOp", "a torch.autograd.Function that leaves torch (numpy, Python math on values) cannot be traced; "
     "rewrite its forward with torch ops or give it a symbolic() staticmethod"),
    ("prim::DictConstruct", "a TorchScript forward that returns a dict has no ONNX form: return a tuple and name the "
     "outputs with export_bundle(..., output_name=[...]), or export the Python module (its dict's keys then name "
     "the outputs)"),
)
GENERIC_ADVICE = ("compute it with ops ONNX has, move it out of the model (into preprocess/postprocess), or register "
                  "a symbolic: torch.onnx.register_custom_op_symbolic('{op}', fn, {opset})")

_OP_PATTERNS = (  # torch's phrasings of "this op cannot be exported", most specific first
    re.compile(r"Exporting the operator '(?P<op>[\w:.]+)' to ONNX opset version \d+ is not supported"),
    re.compile(r"Unsupported: ONNX export of (?P<op>[\w:.]+) in opset \d+\.\s*(?:(?P<why>[^\n]*?)\.\s*)?"
               r"Please try opset version (?P<opset>\d+)"),
    re.compile(r"Unsupported: ONNX export of operator (?P<op>[\w:.]+)(?:, (?P<why>[^\n]*?))?\. Please"),
    re.compile(r"Couldn't export operator (?P<op>[\w:.]+)"),
    re.compile(r"Could not export Python function call '(?P<pyname>\w+)'"),
    re.compile(r"^[^\n]*?(?P<op>\b(?:aten|prim|quantized)::\w+)"),  # any op named on the first line (not in an IR dump)
)


@contextlib.contextmanager
def export_settings() -> Iterator[None]:
    """Attention fast path off, torch's ONNX log quiet and :func:`rms_norm_symbolic` registered while exporting;
    all restored after, also on error."""
    mha = getattr(torch.backends, "mha", None)
    get_fast, set_fast = getattr(mha, "get_fastpath_enabled", None), getattr(mha, "set_fastpath_enabled", None)
    fast = get_fast() if get_fast and set_fast else None
    log_was = torch._C._jit_is_onnx_log_enabled()
    with contextlib.ExitStack() as stack:
        if fast is not None:
            set_fast(False)
            stack.callback(set_fast, fast)
        stack.callback(torch._C._jit_set_onnx_log_enabled, log_was)
        stack.enter_context(_quiet_onnx_log())
        stack.enter_context(_symbolics())
        yield


# ops the TorchScript exporter has no symbolic for, written with ops ONNX has (and the numba backend runs), and the
# lowest opset each is registered from; one the user (or torch) already registered is left alone
_FIRST_OPSET = 9


def rms_norm_symbolic(g: Any, x: Any, normalized_shape: Any, weight: Any, eps: Any) -> Any:
    """``aten::rms_norm`` (``nn.RMSNorm``, ``F.rms_norm``) as ONNX ops: ``x / sqrt(mean(x^2 over the normalised
    axes) + eps) * weight``, with torch's default ``eps`` (the float32 machine epsilon) where none is given."""
    from torch.onnx import symbolic_helper as sh

    dims = sh._get_const(normalized_shape, "is", "normalized_shape")
    axes = list(range(-len(dims), 0))
    eps_value = sh._maybe_get_const(eps, "f")
    if eps_value is None or sh._is_none(eps) or not isinstance(eps_value, float):
        eps_value = float(torch.finfo(torch.float32).eps)
    square = g.op("Mul", x, x)
    if g.opset >= 18:  # ReduceMean's axes became an input
        mean = g.op("ReduceMean", square, g.op("Constant", value_t=torch.tensor(axes, dtype=torch.int64)), keepdims_i=1)
    else:
        mean = g.op("ReduceMean", square, axes_i=axes, keepdims_i=1)
    rms = g.op("Sqrt", g.op("Add", mean, g.op("Constant", value_t=torch.tensor(eps_value, dtype=torch.float32))))
    y = g.op("Div", x, rms)
    return y if sh._is_none(weight) else g.op("Mul", y, weight)


_SYMBOLICS = {"aten::rms_norm": rms_norm_symbolic}


@contextlib.contextmanager
def _symbolics() -> Iterator[None]:
    try:
        from torch.onnx._internal.torchscript_exporter.registration import registry
    except ImportError:  # a torch that keeps its registry elsewhere: the exporter's own errors stand
        yield
        return
    added = []
    try:
        for name, fn in _SYMBOLICS.items():
            if not registry.is_registered_op(name, _FIRST_OPSET) and not registry.is_registered_op(name, 17):
                torch.onnx.register_custom_op_symbolic(name, fn, _FIRST_OPSET)
                added.append(name)
        yield
    finally:
        for name in added:
            torch.onnx.unregister_custom_op_symbolic(name, _FIRST_OPSET)


@contextlib.contextmanager
def _quiet_onnx_log() -> Iterator[None]:
    # torch's setup_onnx_logging(verbose) tests the function object _C._jit_is_onnx_log_enabled (always truthy)
    # instead of calling it, so every export logs, and a failing pass prints the whole IR graph to stdout. Swap in
    # the intended behaviour (log only when verbose) for the duration of the export; a torch without that helper
    # has nothing to fix.
    try:
        from torch.onnx._internal.torchscript_exporter import utils as ts_utils
    except ImportError:
        yield
        return
    original = getattr(ts_utils, "setup_onnx_logging", None)
    if original is None:
        yield
        return

    @contextlib.contextmanager
    def setup_onnx_logging(verbose: bool) -> Iterator[None]:
        was = torch._C._jit_is_onnx_log_enabled()
        torch._C._jit_set_onnx_log_enabled(bool(verbose))
        try:
            yield
        finally:
            torch._C._jit_set_onnx_log_enabled(was)

    ts_utils.setup_onnx_logging = setup_onnx_logging
    try:
        yield
    finally:
        ts_utils.setup_onnx_logging = original


def torch_onnx_export(fn: nn.Module, args: tuple[torch.Tensor, ...], f: io.BytesIO, *, root: nn.Module | None = None,
                      opset: int, **kwargs: Any) -> None:
    """``torch.onnx.export(fn, args, f, dynamo=False, opset_version=opset, **kwargs)`` under :func:`export_settings`.

    ``root`` is the user's module inside the wrapper ``fn`` (``fn`` itself when None): error messages
    name submodules by their path from it. Any failure other than our own ``ExportError`` is raised as
    :class:`UnsupportedOpError` with torch's exception as ``__cause__``.
    """
    with export_settings(), explicit_projected_lstms(fn):
        try:
            torch.onnx.export(fn, args, f, dynamo=False, opset_version=opset, **kwargs)
        except ExportError:
            raise
        except Exception as exc:
            raise explain_export_failure(exc, fn, args, opset, root=root) from exc


def explain_export_failure(exc: BaseException, fn: nn.Module, args: Sequence[torch.Tensor], opset: int, *,
                           root: nn.Module | None = None) -> UnsupportedOpError:
    """One short, actionable error for a failed ``torch.onnx.export`` of ``fn(*args)`` (see the module docstring)."""
    root = fn if root is None else root
    text = str(exc)
    op, why, from_opset, pyname = _parse(text)
    path, mtype, where = ROOT, type(root).__name__, ""
    if op or pyname:
        found = find_op(fn, args, op or "prim::PythonOp", root=root, pyname=pyname)
        if found is not None:
            path, mtype, where, op = found
    if not op:
        first = _one_line(text) or type(exc).__name__
        message = (f"cannot export {path} ({mtype}) to ONNX opset {opset}: torch.onnx.export failed: {first}; "
                   "simplify the module until it exports; torch's full error is this exception's __cause__")
        return UnsupportedOpError(message, op=None, module_path=path, module_type=mtype, opset=opset)
    label = f"{op} ({pyname})" if pyname and op == "prim::PythonOp" else op
    reason = f" ({_one_line(why, 100)})" if why else ""
    later = from_opset or _supported_from(op, opset)
    advice = (f"it is supported from opset {later}: export with options=ExportOptions(opset={later})" if later
              else _advice(op, opset))
    message = f"cannot export {path} ({mtype}): op {label} is not supported by ONNX opset {opset}{reason}{where}; {advice}"
    return UnsupportedOpError(message, op=op, module_path=path, module_type=mtype, opset=opset)


def _parse(text: str) -> tuple[str | None, str | None, int | None, str | None]:
    """(op, reason, opset that has it, autograd Function name) from torch's message; None where it does not say."""
    for pattern in _OP_PATTERNS:
        m = pattern.search(text)
        if m:
            groups = m.groupdict()
            opset = groups.get("opset")
            return groups.get("op"), groups.get("why"), int(opset) if opset else None, groups.get("pyname")
    return None, None, None, None


def _one_line(text: str | None, limit: int = MAX_TORCH_TEXT) -> str:
    line = next((s.strip() for s in (text or "").splitlines() if s.strip()), "")
    return line if len(line) <= limit else line[: limit - 3].rstrip() + "..."


def _advice(op: str, opset: int) -> str:
    advice = next((text for pattern, text in OP_ADVICE if fnmatch.fnmatchcase(op, pattern)), GENERIC_ADVICE)
    return advice.format(op=op, opset=opset)


def _supported_from(op: str, opset: int) -> int | None:
    """The lowest opset above ``opset`` for which torch has a symbolic of ``op`` (None: none has, or unknown)."""
    try:
        from torch.onnx._constants import ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET as top
        from torch.onnx._internal.torchscript_exporter.registration import registry
    except ImportError:
        return None
    if registry.is_registered_op(op, opset):
        return None  # the op has a symbolic here; it refused these arguments, a newer opset will not help
    return next((v for v in range(opset + 1, top + 1) if registry.is_registered_op(op, v)), None)


def find_op(fn: nn.Module, args: Sequence[torch.Tensor], op: str, *, root: nn.Module,
            pyname: str | None = None) -> tuple[str, str, str, str] | None:
    """Where ``fn(*args)`` first calls ``op``: (module path, its type name, a note, the op as traced).

    The note is "" or `` (called at FILE:LINE, first of N calls)`` (either part where known).

    Traces ``fn`` with each submodule's full path as its scope (the exporter names scopes by their last
    attribute only), so the innermost module around the op names it. ``op`` may be unqualified
    (``adaptive_avg_pool1d``, ``Sort``) as some torch messages write it. None when tracing fails or the
    op is not in the trace.
    """
    by_module = {m: name for name, m in root.named_modules()}
    by_name = {name: m for m, name in by_module.items()}
    kinds = {op} if "::" in op else {f"aten::{op}", f"aten::{op.lower()}"}
    # the wrapper around root (and root itself) get the empty name: their ops are root's
    scope_map = {m: torch._C._jit_onnx_create_full_scope_name(torch.typename(type(m)), by_module.get(m, ""))
                 for m in fn.modules()}
    trace_state = torch.jit._trace
    saved = getattr(trace_state, "_trace_module_map", None)
    try:
        trace_state._trace_module_map = scope_map
        with warnings.catch_warnings(), torch.no_grad(), export_settings():
            warnings.simplefilter("ignore")
            graph, _ = torch.jit._get_trace_graph(fn, tuple(args), strict=False)
    except Exception:  # a module that cannot be traced twice still gets a message, without the path
        return None
    finally:
        trace_state._trace_module_map = saved
    hits = [n for n in _walk(graph)
            if n.kind() in kinds and (pyname is None or n.kind() != "prim::PythonOp" or n.pyname() == pyname)]
    if not hits:
        return None
    node = hits[0]
    scope = node.scopeName().rsplit("/", 1)[-1]
    name = scope.split("::", 1)[1] if "::" in scope else ""
    module = by_name.get(name, root)
    path = f"{ROOT}.{name}" if module is not root else ROOT
    where = _source(node)
    more = f"first of {len(hits)} calls" if len(hits) > 1 else ""
    note = f" ({', '.join(p for p in (where, more) if p)})" if where or more else ""
    return path, type(module).__name__, note, node.kind()


def _walk(graph: Any) -> Iterator[Any]:
    for node in graph.nodes():
        yield node
        for block in node.blocks():
            yield from _walk(block)
        if "Subgraph" in node.attributeNames():  # an autograd Function's body
            yield from _walk(node.g("Subgraph"))


def _source(node: Any) -> str:
    # A traced node's source range is a stack, innermost first ("path/file.py(LINE): function"); the first frame
    # outside torch and this package is the user's call site.
    skip = (os.path.dirname(torch.__file__), os.path.dirname(__file__))
    for m in re.finditer(r"^(.+?\.py)\((\d+)\)", str(node.sourceRange()), re.MULTILINE):
        if not m.group(1).startswith(skip):
            return f"called at {os.path.basename(m.group(1))}:{m.group(2)}"
    return ""
