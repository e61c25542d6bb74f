"""The handwriting decoder's modules: GRU backbone, alignment layer, per-session input layers.

Every module here streams: ``init_state(batch)``, ``step(x, h) -> (logp, h)`` for
one 20 ms bin and ``forward(seq, h) -> (logp, h)`` for whole trials, with ``logp``
the log-softmax over the 32 CTC classes (:mod:`closedloop.sdk.bci.charset`). That is what
``closedloop.export.export_bundle(module, out, kind="recurrent", example_input=torch.zeros(1, C))``
turns into a single-step ONNX graph. Input normalisation is not part of any module:
it is computed per session (:mod:`closedloop.sdk.bci.data`) and applied by the bundle's
preprocess block.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from .charset import N_CLASSES
from .fastgru import gru_layers, gru_sequence, in_twice_differentiable


class GRUBackbone(nn.Module):
    """Stacked GRU over bins with a linear CTC read-out.

    Parameters
    ----------
    n_inputs
        Channels per bin (192 for FALCON H2).
    n_hidden, n_layers
        GRU width and depth.
    dropout
        Dropout between GRU layers and before the read-out (training only).
    """

    #: train through :mod:`closedloop.sdk.bci.fastgru` on CPU (False: always ``nn.GRU``, e.g. to compare the two)
    use_fastgru: bool = True

    def __init__(self, n_inputs: int, n_hidden: int = 256, n_layers: int = 2, dropout: float = 0.0):
        super().__init__()
        self.n_inputs, self.n_hidden, self.n_layers = n_inputs, n_hidden, n_layers
        self.gru = nn.GRU(n_inputs, n_hidden, n_layers, batch_first=True, dropout=dropout if n_layers > 1 else 0.0)
        self.drop = nn.Dropout(dropout)
        self.readout = nn.Linear(n_hidden, N_CLASSES)

    def init_state(self, batch: int = 1) -> torch.Tensor:
        p = self.readout.weight
        return torch.zeros(self.n_layers, batch, self.n_hidden, dtype=p.dtype, device=p.device)

    def forward(self, seq: torch.Tensor, h: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``seq`` (batch, time, inputs) -> log-probabilities (batch, time, 32) and the final state.

        When a gradient will flow through the GRU on CPU (its weights are trained, or its
        input is: calibration and meta-learning in front of a frozen backbone) and the input
        is batched, this runs :func:`closedloop.sdk.bci.fastgru.gru_sequence` (the same function, a faster
        backward pass); otherwise, and inside :func:`closedloop.sdk.bci.fastgru.twice_differentiable`,
        ``nn.GRU``.
        """
        if (self.use_fastgru and seq.dim() == 3 and seq.device.type == "cpu" and torch.is_grad_enabled()
                and (self.gru.weight_hh_l0.requires_grad or seq.requires_grad) and not in_twice_differentiable()):
            y, h = gru_sequence(seq, gru_layers(self.gru), h, self.gru.dropout, self.training)
        else:
            y, h = self.gru(seq, h)
        return torch.log_softmax(self.readout(self.drop(y)), dim=-1), h

    def step(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One bin: ``x`` (batch, inputs), ``h`` (layers, batch, hidden)."""
        y, h = self.gru(x.unsqueeze(1), h)
        return torch.log_softmax(self.readout(self.drop(y[:, 0])), dim=-1), h


class AffineAlignment(nn.Module):
    """The alignment layer :math:`x \\mapsto A x + b` on the input channels (identity at start).

    It sits in front of a frozen backbone and is the only thing calibrated for a
    new session. ``weight`` is :math:`A` (C x C), ``bias`` is :math:`b` (C).
    """

    def __init__(self, n_channels: int):
        super().__init__()
        self.n_channels = n_channels
        self.weight = nn.Parameter(torch.eye(n_channels))
        self.bias = nn.Parameter(torch.zeros(n_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return affine(x, self.weight, self.bias)

    def reset(self) -> None:
        """Back to the identity map."""
        with torch.no_grad():
            self.weight.copy_(torch.eye(self.n_channels, device=self.weight.device))
            self.bias.zero_()

    def load(self, weight: torch.Tensor, bias: torch.Tensor) -> AffineAlignment:
        """Set :math:`A` and :math:`b` (copied) and return self."""
        with torch.no_grad():
            self.weight.copy_(weight)
            self.bias.copy_(bias)
        return self


def affine(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """:math:`A x + b` on the last axis of ``x``.

    ``weight`` may carry a leading task axis (``(n, C, C)`` with ``bias`` ``(n, C)``)
    when ``x`` is ``(n, time, C)``: each sequence then gets its own map, which is how
    meta-learning adapts many tasks at once.
    """
    if weight.dim() == 3:
        return torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))
    return x @ weight.T + bias


#: How the alignment :math:`(A, b)` is parameterised while it is fitted (the result is always a plain
#: :class:`AffineAlignment`): ``"full"`` fits every entry of :math:`A`; ``"lowrank"`` fits
#: :math:`A = \operatorname{diag}(g) + U V` with ``rank`` r (per-channel gains plus a rank-r
#: cross-channel part), :math:`C(2 + 2r)` numbers instead of :math:`C(C + 1)`.
ALIGNMENT_FORMS = ("full", "lowrank")


def alignment_params(form: str, n_channels: int, rank: int = 0, seed: int = 0) -> dict[str, torch.Tensor]:
    """The starting parameters of ``form`` at the identity map.

    ``lowrank`` starts with :math:`U = 0` and :math:`V` drawn with orthonormal rows from
    ``seed`` (so :math:`UV = 0`; the first steps move :math:`U` along the directions :math:`V`).
    """
    c = n_channels
    if form == "full":
        return {"weight": torch.eye(c), "bias": torch.zeros(c)}
    if form != "lowrank":
        raise ValueError(f"alignment form {form!r} is not one of {ALIGNMENT_FORMS}")
    if not 1 <= rank <= c:
        raise ValueError(f"alignment form 'lowrank' needs 1 <= rank <= {c} channels, got rank {rank}")
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(c, rank, generator=g))
    return {"gain": torch.ones(c), "bias": torch.zeros(c), "u": torch.zeros(c, rank), "v": q.T.contiguous()}


def compose_alignment(params: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """:math:`(A, b)` from the parameters of a form (a leading task axis is kept)."""
    if "weight" in params:
        return params["weight"], params["bias"]
    return torch.diag_embed(params["gain"]) + params["u"] @ params["v"], params["bias"]


class AlignedDecoder(nn.Module):
    """``alignment`` followed by ``backbone``: the deployable decoder of one session.

    It has the backbone's streaming interface, so the alignment layer exports inside
    the same single-step graph and a calibrated bundle is self-contained.
    """

    def __init__(self, alignment: AffineAlignment, backbone: GRUBackbone):
        super().__init__()
        self.alignment = alignment
        self.backbone = backbone

    @property
    def n_inputs(self) -> int:
        return self.alignment.n_channels

    def init_state(self, batch: int = 1) -> torch.Tensor:
        return self.backbone.init_state(batch)

    def forward(self, seq: torch.Tensor, h: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.backbone(self.alignment(seq), h)

    def step(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.backbone.step(self.alignment(x), h)

    def freeze_backbone(self) -> AlignedDecoder:
        """Stop gradients into the backbone (it stays bit-identical through calibration)."""
        for p in self.backbone.parameters():
            p.requires_grad_(False)
        return self


class SessionInputDecoder(nn.Module):
    """The usual multi-session decoder: one affine input layer per session, one shared backbone.

    The layers are :class:`AffineAlignment` (identity at start) so a trained layer can
    be placed in an :class:`AlignedDecoder` as it is.
    """

    def __init__(self, sessions: Sequence[str], backbone: GRUBackbone):
        super().__init__()
        self.session_names = list(sessions)
        self.layers = nn.ModuleList(AffineAlignment(backbone.n_inputs) for _ in self.session_names)
        self.backbone = backbone

    def forward(self, seq: torch.Tensor, session_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``seq`` (batch, time, C); ``session_index`` (batch,) picks each row's input layer."""
        w = torch.stack([layer.weight for layer in self.layers])[session_index]
        b = torch.stack([layer.bias for layer in self.layers])[session_index]
        return self.backbone(affine(seq, w, b))

    def decoder_for(self, session: str | int) -> AlignedDecoder:
        """A standalone :class:`AlignedDecoder` (deep copies) with ``session``'s input layer."""
        i = self.session_names.index(session) if isinstance(session, str) else int(session)
        return AlignedDecoder(copy.deepcopy(self.layers[i]), copy.deepcopy(self.backbone))
