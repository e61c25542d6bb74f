"""The Numba backend's recurrent op handlers: ONNX GRU, LSTM and RNN, one kernel step per layer.

torch.onnx writes one GRU, LSTM or RNN node per layer of ``nn.GRU``/``nn.LSTM``/``nn.RNN``; in a
single-step graph (``step(x, h[, c])``) each reads its initial state from a layer
slice of the state input (a window, no copy) and its final state goes straight
into its slice of the state output (the Concat of the layers places it there).
Sequences longer than one step (a recurrent layer over a window) run inside the
kernel. Forward and reverse directions run in place; a bidirectional layer runs
both (one kernel step each, weights in float32) and copies their outputs into
``Y`` (steps, 2, batch, hidden) and the final states into ``Y_h`` (and ``Y_c``).
An RNN's activation is Tanh or Relu (``nn.RNN``'s ``nonlinearity``). Peepholes, clipping,
other activations and ``sequence_lens`` are refused by name.
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


def _initial(p: Planner, node, i: int, batch: int, hidden: int, what: str, dirs: int = 1) -> list[Act]:
    """The initial state of each direction, (1, batch, hidden): zeros, or a window of input ``i``."""
    v = p.value(node, i)
    if v is None:
        return [Act(Buffer.of(np.zeros((batch, hidden), np.float32)), (1, batch, hidden)) for _ in range(dirs)]
    v = p.act(node, i, materialize=True)
    if v.shape != (dirs, batch, hidden):
        raise unsupported(node, f"{what} of shape {v.shape}, expected ({dirs}, {batch}, {hidden})")
    if dirs == 1:
        return [v]
    size = batch * hidden
    return [Act(v.buf.window(d * size, size), (1, batch, hidden)) for d in range(dirs)]


def _recurrent(p: Planner, node, gates: int, activations: list[str]) -> tuple:
    """Check what GRU and LSTM share; returns (x, w, r, bias, hidden, steps, batch, directions), the weights with
    one row per direction and ``directions`` a list of reverse flags (one, or forward and reverse)."""
    a = node.attributes
    hidden = int(a.get("hidden_size", p.const(node, 2).shape[-1]))
    direction = a.get("direction", "forward")
    if direction not in ("forward", "reverse", "bidirectional"):
        raise unsupported(node, f"direction={direction!r} (supported: 'forward', 'reverse', 'bidirectional')")
    directions = [False, True] if direction == "bidirectional" else [direction == "reverse"]
    dirs = len(directions)
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
    if w.shape != (dirs, gates * hidden, n_in) or r.shape != (dirs, gates * hidden, hidden):
        raise unsupported(node, f"weights {w.shape}/{r.shape} for hidden_size {hidden}, {n_in} inputs and {dirs} "
                                "direction(s)")
    b = p.const(node, 3, required=False)
    b = np.zeros((dirs, 2 * gates * hidden), np.float32) if b is None else b.astype(np.float32)
    if b.shape != (dirs, 2 * gates * hidden):
        raise unsupported(node, f"bias of shape {b.shape} for hidden_size {hidden} (need ({dirs}, "
                                f"{2 * gates * hidden}))")
    return x, w, r, b, hidden, steps, batch, directions


def _weights(p: Planner, node, w: np.ndarray, r: np.ndarray, d: int, dirs: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Direction ``d``'s input and recurrent weights as panel parameters in the storage the file gives them, and
    its code. One storage for both (the kernel takes one); weights stored differently, and the two directions of
    a bidirectional layer, run in float32."""
    (ws, w_scales), (rs, r_scales) = p.storage(node, 1, 1), p.storage(node, 2, 1)
    if ws != rs or dirs > 1:
        ws = rs = p.k.W_F32
        w_scales = r_scales = None
    return p.panels(p.k.panel_layout(w[d]), ws, w_scales), p.panels(p.k.panel_layout(r[d]), rs, r_scales), ws


def _outputs(p: Planner, node, ys: list[Act], steps: int, batch: int, hidden: int, directions: list[bool]) -> None:
    """Y (steps, directions, batch, hidden) and Y_h, each direction's state after the last step it ran: windows of
    the one direction's Y, or copies of both into their places."""
    size = batch * hidden
    if len(ys) == 1:
        y, reverse = ys[0], directions[0]
        p.define(node, y, 0)
        last = 0 if reverse else steps - 1
        p.define(node, Act(y.buf.window(last * size, size), (1, batch, hidden)), 1)
        return
    dirs = len(ys)
    y_all, h_all = p.new_act((steps, dirs, batch, hidden)), p.new_act((dirs, batch, hidden))
    for d, (y, reverse) in enumerate(zip(ys, directions, strict=True)):
        p.copy(node, y, 0, (steps, size), [size, 1], y_all.buf, d * size, [dirs * size, 1])
        last = 0 if reverse else steps - 1
        p.copy(node, y, last * size, (size,), [1], h_all.buf, d * size, [1])
    p.define(node, y_all, 0)
    p.define(node, h_all, 1)


@handles("GRU")
def _gru(p: Planner, node) -> None:
    lbr = node.attributes.get("linear_before_reset", 0)
    if lbr != 1:
        raise unsupported(node, f"linear_before_reset={lbr} (supported: 1, what torch.nn.GRU exports)")
    x, w, r, b, hidden, steps, batch, directions = _recurrent(p, node, 3, ["Sigmoid", "Tanh"])
    h0s = _initial(p, node, 5, batch, hidden, "initial_h", len(directions))
    ys = []
    for d, (reverse, h0) in enumerate(zip(directions, h0s, strict=True)):
        y = p.new_act((steps, 1, batch, hidden))
        gx, gh = Buffer(batch * 3 * hidden), Buffer(batch * 3 * hidden)
        wp, rp, storage = _weights(p, node, w, r, d, len(directions))
        p.emit(p.k.OP_GRU, x.mat(), h0.mat(), wp, rp, p.param(b[d, : 3 * hidden]), p.param(b[d, 3 * hidden :]),
               Mat(y.buf, steps * batch, hidden), Mat(gx, batch, 3 * hidden), Mat(gh, batch, 3 * hidden),
               int(reverse), storage, out=[y.buf, gx, gh])
        ys.append(y)
    _outputs(p, node, ys, steps, batch, hidden, directions)


@handles("LSTM")
def _lstm(p: Planner, node) -> None:
    if node.attributes.get("input_forget", 0):
        raise unsupported(node, "input_forget=1 (coupled input and forget gates)")
    if p.value(node, 7) is not None:
        raise unsupported(node, "peephole weights (P) are given")
    x, w, r, b, hidden, steps, batch, directions = _recurrent(p, node, 4, ["Sigmoid", "Tanh", "Tanh"])
    dirs = len(directions)
    h0s = _initial(p, node, 5, batch, hidden, "initial_h", dirs)
    c0s = _initial(p, node, 6, batch, hidden, "initial_c", dirs)
    ys, cs = [], []
    for d, (reverse, h0, c0) in enumerate(zip(directions, h0s, c0s, strict=True)):
        y = p.new_act((steps, 1, batch, hidden))
        c = p.new_act((1, batch, hidden))
        gx = Buffer(batch * 4 * hidden)
        wp, rp, storage = _weights(p, node, w, r, d, dirs)
        p.emit(p.k.OP_LSTM, x.mat(), h0.mat(), c0.mat(), wp, rp, p.param(b[d, : 4 * hidden] + b[d, 4 * hidden :]),
               Mat(y.buf, steps * batch, hidden), c.mat(), Mat(gx, batch, 4 * hidden), int(reverse), storage,
               out=[y.buf, c.buf, gx])
        ys.append(y)
        cs.append(c)
    _outputs(p, node, ys, steps, batch, hidden, directions)
    if dirs == 1:
        p.define(node, cs[0], 2)
        return
    size = batch * hidden
    c_all = p.new_act((dirs, batch, hidden))
    for d, c in enumerate(cs):
        p.copy(node, c, 0, (size,), [1], c_all.buf, d * size, [1])
    p.define(node, c_all, 2)


@handles("RNN")
def _rnn(p: Planner, node) -> None:
    given = node.attributes.get("activations", ["Tanh"])
    given = [a.decode() if isinstance(a, bytes) else a for a in given]
    activations = given if all(a in ("Tanh", "Relu") for a in given) and len(set(given)) == 1 else ["Tanh"]
    x, w, r, b, hidden, steps, batch, directions = _recurrent(p, node, 1, activations)
    dirs = len(directions)
    if len(activations) not in (1, dirs):
        raise unsupported(node, f"activations={given!r} for {dirs} direction(s)")
    h0s = _initial(p, node, 5, batch, hidden, "initial_h", dirs)
    ys = []
    for d, (reverse, h0) in enumerate(zip(directions, h0s, strict=True)):
        y = p.new_act((steps, 1, batch, hidden))
        wp, rp, storage = _weights(p, node, w, r, d, dirs)
        p.emit(p.k.OP_RNN, x.mat(), h0.mat(), wp, rp, p.param(b[d, :hidden] + b[d, hidden:]),
               Mat(y.buf, steps * batch, hidden), int(activations[0] == "Relu"), int(reverse), storage, out=[y.buf])
        ys.append(y)
    _outputs(p, node, ys, steps, batch, hidden, directions)
