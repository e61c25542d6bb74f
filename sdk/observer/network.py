"""The observer's neural correction ``N(r)``: a bias-free MLP of the output error, and its LFT.

``ObserverNet`` maps the output error ``r = y - Cd z_hat`` (``ny`` values) to a correction
of the extended state (``nz`` values). It has no biases, so ``N(0) = 0`` and the error
equilibrium ``e = 0`` is kept; this is what makes a *global* certificate possible (a bias
would be a constant forcing of the error dynamics). Its weights are read as an LFT by
``closedloop.runtime.families.observer.certificate.lft_from_weights`` in numpy, and by ``torch_lft`` here in torch (the
same construction, through ``TORCH_OPS``) for the differentiable LMI of fine-tuning.

Notes
-----
For hidden layers ``h_k = phi(W_k h_{k-1})``, ``h_0 = r``, output ``W_{K+1} h_K``:

    v = [W_1 r; W_2 h_1; ...; W_K h_{K-1}] = Dvr r + Dvw w,   w = [h_1; ...; h_K] = phi(v),
    N(r) = Dor r + Dow w,   Dvr = [W_1; 0],  Dvw = blocks W_k at (k, k-1),  Dor = 0,  Dow = [0, W_{K+1}].
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from closedloop.runtime.families.observer.certificate import ArrayOps, NetworkLFT, lft_from_weights


def _torch_block(rows: list[list]) -> torch.Tensor:
    conv = [[torch.as_tensor(a, dtype=torch.float64) for a in row] for row in rows]
    return torch.cat([torch.cat(row, dim=1) for row in conv], dim=0)


TORCH_OPS = ArrayOps(
    block=_torch_block,
    zeros=lambda r, c: torch.zeros(r, c, dtype=torch.float64),
    eye=lambda n: torch.eye(n, dtype=torch.float64),
    diag=torch.diag,
    asarray=lambda a: torch.as_tensor(np.asarray(a, dtype=float), dtype=torch.float64),
)

_ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU}


class ObserverNet(nn.Module):
    """Bias-free MLP ``N: R^ny -> R^nz`` of the output error.

    Parameters
    ----------
    n_outputs_error
        ``ny``, the size of the output error ``r`` (the network's input).
    n_state
        ``nz``, the size of the extended state the correction is added to.
    hidden
        Hidden widths, e.g. ``(16, 16)``; ``()`` gives a linear network.
    activation
        ``"tanh"`` or ``"relu"`` (both in the sector [0, 1]).
    init_gain
        Scale of the initial output layer; small (the default) starts close to the
        Luenberger observer, which the certificate covers.
    in_scale, out_scale
        Fixed diagonal scalings folded into the first and last weights: the network
        computes ``diag(out_scale) W_K+1 phi(... W_1 diag(in_scale) r)``. They put outputs
        and states of very different units (ft/s and rad) on one scale for training;
        ``effective_weights`` (what is certified and exported) include them.

    Examples
    --------
    >>> net = ObserverNet(1, 5, hidden=(8,))
    >>> net(torch.zeros(3, 1)).shape
    torch.Size([3, 5])
    >>> float(net(torch.zeros(1, 1)).detach().abs().max())   # N(0) = 0: no biases
    0.0
    """

    def __init__(self, n_outputs_error: int, n_state: int, hidden: Sequence[int] = (16, 16),
                 activation: str = "tanh", init_gain: float = 0.1, in_scale: Sequence[float] | None = None,
                 out_scale: Sequence[float] | None = None):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not one of {sorted(_ACTIVATIONS)}")
        self.n_in, self.n_out = int(n_outputs_error), int(n_state)
        self.hidden = tuple(int(h) for h in hidden)
        self.activation = activation
        dims = (self.n_in, *self.hidden, self.n_out)
        self.raw = nn.ParameterList()
        for i in range(len(dims) - 1):
            w = torch.empty(dims[i + 1], dims[i])
            nn.init.xavier_uniform_(w, gain=init_gain if i == len(dims) - 2 else 1.0)
            self.raw.append(nn.Parameter(w))
        ones_in, ones_out = torch.ones(self.n_in), torch.ones(self.n_out)
        self.register_buffer("in_scale", ones_in if in_scale is None else torch.as_tensor(in_scale, dtype=torch.float32))
        self.register_buffer("out_scale", ones_out if out_scale is None else torch.as_tensor(out_scale, dtype=torch.float32))
        self._act = _ACTIVATIONS[activation]()

    def effective_weights(self, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        """The weights ``(out, in)`` with the fixed scalings folded in (differentiable)."""
        ws = [w.to(dtype) for w in self.raw]
        ws[0] = ws[0] * self.in_scale.to(dtype)[None, :]
        ws[-1] = self.out_scale.to(dtype)[:, None] * ws[-1]
        return ws

    def forward(self, r: torch.Tensor) -> torch.Tensor:
        ws = self.effective_weights(r.dtype)
        h = r
        for k, w in enumerate(ws):
            h = h @ w.T
            if k < len(ws) - 1:
                h = self._act(h)
        return h

    @property
    def activations(self) -> tuple[str, ...]:
        return (self.activation,) * len(self.hidden)

    def weights(self) -> list[np.ndarray]:
        """The effective weights ``(out, in)`` as float32 numpy arrays (exactly what ONNX stores)."""
        return [w.detach().cpu().numpy().astype(np.float32).copy() for w in self.effective_weights()]

    def lft(self) -> NetworkLFT:
        """The LFT of the float32 effective weights, in float64 numpy (what the certificate uses)."""
        return lft_from_weights([w.astype(float) for w in self.weights()], self.activations)

    def torch_lft(self) -> NetworkLFT:
        """The same LFT in torch float64, differentiable in the weights."""
        return lft_from_weights(self.effective_weights(torch.float64), self.activations, TORCH_OPS)

    def plain(self) -> nn.Sequential:
        """A plain ``Linear(bias=False)`` / activation stack with the effective weights (for ONNX export)."""
        layers: list[nn.Module] = []
        ws = self.weights()
        for k, w in enumerate(ws):
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
            with torch.no_grad():
                lin.weight.copy_(torch.from_numpy(w))
            layers.append(lin)
            if k < len(ws) - 1:
                layers.append(_ACTIVATIONS[self.activation]())
        return nn.Sequential(*layers).eval()

    def scale_(self, factor: float) -> ObserverNet:
        """Multiply every weight by ``factor`` in place (for tests and gain studies)."""
        with torch.no_grad():
            for w in self.raw:
                w.mul_(factor)
        return self


def numpy_forward(weights: Sequence[np.ndarray], activations: Sequence[str], r: np.ndarray) -> np.ndarray:
    """``N(r)`` in numpy for a batch ``r`` of shape ``(..., ny)`` (float64 arithmetic)."""
    h = np.asarray(r, dtype=float)
    for k, w in enumerate(weights):
        h = h @ np.asarray(w, dtype=float).T
        if k < len(weights) - 1:
            h = np.tanh(h) if activations[k] == "tanh" else np.maximum(h, 0.0)
    return h
