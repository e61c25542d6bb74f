"""``nn.LSTM`` with projections (``proj_size > 0``, LSTMP) written with ops ONNX has, for the export's trace.

ONNX's LSTM operator has no projection, and torch's TorchScript exporter refuses ``aten::lstm`` with one.
While a graph is traced, :func:`explicit_projected_lstms` gives each such LSTM a forward that computes the
same function from matrix products and element-wise ops (the torch documentation's equations, gates in
torch's order ``i, f, g, o``)::

    gates = x W_ih^T + b_ih + h W_hh^T + b_hh        (4 * hidden_size values per direction)
    c' = sigmoid(f) * c + sigmoid(i) * tanh(g)
    h' = (sigmoid(o) * tanh(c')) W_hr^T              (proj_size values)

for every layer and direction (the reverse direction reads the sequence from its end; a layer above the
first reads both directions' outputs, concatenated). The forward is unrolled over the traced sequence (one
step for a streaming graph). Only the trace sees it: the parity checks compare the exported graph with
torch's own LSTM, so any difference between the two would fail the export rather than hide in it.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
from torch import nn

from .errors import ExportError


def _cell(x: torch.Tensor, h: torch.Tensor, c: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor,
          b: torch.Tensor | None, w_hr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gates = x @ w_ih.t() + h @ w_hh.t()
    if b is not None:
        gates = gates + b
    i, f, g, o = gates.chunk(4, dim=-1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    h = (torch.sigmoid(o) * torch.tanh(c)) @ w_hr.t()
    return h, c


def _projected_forward(self: nn.LSTM, input: torch.Tensor,
                       hx: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    if input.dim() != 3:
        raise ExportError(f"an LSTM with proj_size={self.proj_size} exports for batched input (3-D) only, got "
                          f"{input.dim()}-D: give the sequence a batch axis")
    seq = input.transpose(0, 1) if self.batch_first else input  # (time, batch, features)
    directions = 2 if self.bidirectional else 1
    batch = seq.shape[1]
    if hx is None:
        h0 = seq.new_zeros(self.num_layers * directions, batch, self.proj_size)
        c0 = seq.new_zeros(self.num_layers * directions, batch, self.hidden_size)
    else:
        h0, c0 = hx
    h_n, c_n = [], []
    layer_in = seq
    for layer in range(self.num_layers):
        outs = []
        for d in range(directions):
            sfx = f"_l{layer}" + ("_reverse" if d else "")
            w_ih, w_hh, w_hr = (getattr(self, f"weight_{k}{sfx}") for k in ("ih", "hh", "hr"))
            b = getattr(self, f"bias_ih{sfx}") + getattr(self, f"bias_hh{sfx}") if self.bias else None
            h, c = h0[layer * directions + d], c0[layer * directions + d]
            steps = range(layer_in.shape[0] - 1, -1, -1) if d else range(layer_in.shape[0])
            ys: list[torch.Tensor] = []
            for t in steps:
                h, c = _cell(layer_in[t], h, c, w_ih, w_hh, b, w_hr)
                ys.append(h)
            if d:
                ys.reverse()
            outs.append(torch.stack(ys))
            h_n.append(h)
            c_n.append(c)
        layer_in = torch.cat(outs, dim=-1) if directions == 2 else outs[0]
    out = layer_in.transpose(0, 1) if self.batch_first else layer_in
    return out, (torch.stack(h_n), torch.stack(c_n))


@contextlib.contextmanager
def explicit_projected_lstms(module: nn.Module) -> Iterator[int]:
    """While in the context, every ``nn.LSTM`` with ``proj_size > 0`` inside ``module`` runs the explicit forward
    (yields how many); each gets torch's own forward back on exit, also on error."""
    swapped = [m for m in module.modules() if isinstance(m, nn.LSTM) and m.proj_size > 0]
    try:
        for m in swapped:
            m.forward = types.MethodType(_projected_forward, m)  # type: ignore[method-assign]
        yield len(swapped)
    finally:
        for m in swapped:
            m.__dict__.pop("forward", None)
