"""The Numba backend's recurrent op handlers: ONNX GRU and LSTM, one kernel step per layer.

torch.onnx writes one GRU or LSTM node per layer of ``nn.GRU``/``nn.LSTM``; in a
single-step graph (``step(x, h[, c])``) each reads its initial state from a layer
slice of the state input (a window, no copy) and its final state goes straight
into its slice of the state output (the Concat of the layers places it there).
Sequences longer than one step (a recurrent layer over a window) run inside the
kernel. Forward and reverse directions are supported; bidirectional layers,
peepholes, clipping, non-default activations and ``sequence_lens`` are refused
by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ._numba_values import Act, Buffer, Mat, handles, unsupported

if TYPE_CHECKING:
    from ._numba_plan import Planner


def _check(node, checks: dict) -> None:
    for key, (got, want) in checks.items():
        if got != want:
            raise unsupported(node, f"{key}={got!r} (supported: {want!r})")


def _initial(p: Planner, node, i: int, batch: int, hidden: int, what: str) -> Act:
    v = p.value(node, i)
    if v is None:
        return Act(Buffer.of(np.zeros((batch, hidden), np.float32)), (1, batch, hidden))
    v = p.act(node, i, materialize=True)
    if v.shape != (1, batch, hidden):
        raise unsupported(node, f"{what} of shape {v.shape}, expected (1, {batch}, {hidden})")
    return v


def _recurrent(p: Planner, node, gates: int, activations: list[str]) -> tuple:
    """Check what GRU and LSTM share; returns (x, w, r, bias, hidden, steps, batch, reverse)."""
    a = node.attributes
    hidden = int(a.get("hidden_size", p.const(node, 2).shape[-1]))
    direction = a.get("direction", "forward")
    if direction not in ("forward", "reverse"):
        raise unsupported(node, f"direction={direction!r} (supported: 'forward' or 'reverse'; a bidirectional layer "
                                "runs on onnxruntime)")
    _check(node, {
        "activations": (a.get("activations", activations), activations),
        "clip": (a.get("clip"), None),
        "layout": (a.get("layout", 0), 0),
        "activation_alpha/beta": (a.get("activation_alpha", a.get("activation_beta")), None),
    })
    if p.value(node, 4) is not None:
        raise unsupported(node, "sequence_lens is given (every sequence must have the full length)")
    x, w, r = p.act(node), p.const(node, 1).astype(np.float32), p.const(node, 2).astype(np.float32)
    if len(x.shape) != 3:
        raise unsupported(node, f"input of shape {x.shape}: (steps, batch, features) is required")
    steps, batch, n_in = x.shape
    if w.shape != (1, gates * hidden, n_in) or r.shape != (1, gates * hidden, hidden):
        raise unsupported(node, f"weights {w.shape}/{r.shape} for hidden_size {hidden} and {n_in} inputs")
    b = p.const(node, 3, required=False)
    b = np.zeros((1, 2 * gates * hidden), np.float32) if b is None else b.astype(np.float32)
    if b.shape != (1, 2 * gates * hidden):
        raise unsupported(node, f"bias of shape {b.shape} for hidden_size {hidden} (need (1, {2 * gates * hidden}))")
    return x, w[0], r[0], b[0], hidden, steps, batch, direction == "reverse"


def _weights(p: Planner, node, w: np.ndarray, r: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """The input and recurrent weights as panel parameters in the storage the file gives them, and its code.

    One storage for both (the kernel takes one); weights stored differently run in float32.
    """
    (ws, w_scales), (rs, r_scales) = p.storage(node, 1, 1), p.storage(node, 2, 1)
    if ws != rs:
        ws = rs = p.k.W_F32
        w_scales = r_scales = None
    return p.panels(p.k.panel_layout(w), ws, w_scales), p.panels(p.k.panel_layout(r), rs, r_scales), ws


def _outputs(p: Planner, node, y: Act, steps: int, batch: int, hidden: int, reverse: bool) -> None:
    """Y (steps, 1, batch, hidden) and Y_h, the state after the last step run (a window of Y)."""
    p.define(node, y, 0)
    last = 0 if reverse else steps - 1
    p.define(node, Act(y.buf.window(last * batch * hidden, batch * hidden), (1, batch, hidden)), 1)


@handles("GRU")
def _gru(p: Planner, node) -> None:
    lbr = node.attributes.get("linear_before_reset", 0)
    if lbr != 1:
        raise unsupported(node, f"linear_before_reset={lbr} (supported: 1, what torch.nn.GRU exports)")
    x, w, r, b, hidden, steps, batch, reverse = _recurrent(p, node, 3, ["Sigmoid", "Tanh"])
    h0 = _initial(p, node, 5, batch, hidden, "initial_h")
    y = p.new_act((steps, 1, batch, hidden))
    gx, gh = Buffer(batch * 3 * hidden), Buffer(batch * 3 * hidden)
    wp, rp, storage = _weights(p, node, w, r)
    p.emit(p.k.OP_GRU, x.mat(), h0.mat(), wp, rp, p.param(b[: 3 * hidden]), p.param(b[3 * hidden :]),
           Mat(y.buf, steps * batch, hidden), Mat(gx, batch, 3 * hidden), Mat(gh, batch, 3 * hidden), int(reverse),
           storage, out=[y.buf, gx, gh])
    _outputs(p, node, y, steps, batch, hidden, reverse)


@handles("LSTM")
def _lstm(p: Planner, node) -> None:
    if node.attributes.get("input_forget", 0):
        raise unsupported(node, "input_forget=1 (coupled input and forget gates)")
    if p.value(node, 7) is not None:
        raise unsupported(node, "peephole weights (P) are given")
    x, w, r, b, hidden, steps, batch, reverse = _recurrent(p, node, 4, ["Sigmoid", "Tanh", "Tanh"])
    h0 = _initial(p, node, 5, batch, hidden, "initial_h")
    c0 = _initial(p, node, 6, batch, hidden, "initial_c")
    y = p.new_act((steps, 1, batch, hidden))
    c = p.new_act((1, batch, hidden))
    gx = Buffer(batch * 4 * hidden)
    wp, rp, storage = _weights(p, node, w, r)
    p.emit(p.k.OP_LSTM, x.mat(), h0.mat(), c0.mat(), wp, rp, p.param(b[: 4 * hidden] + b[4 * hidden :]),
           Mat(y.buf, steps * batch, hidden), c.mat(), Mat(gx, batch, 4 * hidden), int(reverse), storage,
           out=[y.buf, c.buf, gx])
    _outputs(p, node, y, steps, batch, hidden, reverse)
    p.define(node, c, 2)
