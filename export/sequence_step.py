"""Stream a sequence model one step at a time: the adapter from ``forward(seq, state)`` to the recurrent protocol.

Recurrent models are usually written for whole sequences, batch first:
``forward(seq (B, T, ...), state) -> (out (B, T, ...), new_state)``, the state a tensor (``nn.GRU``'s ``h``) or a
tuple of tensors (``nn.LSTM``'s ``(h, c)``). ``export_bundle(kind="recurrent")`` needs ``step(x, *states)`` and
``init_state(batch)``; :class:`SequenceStep` gives both by calling ``forward`` on a sequence of length 1, and keeps
``forward(seq, *states)`` so the export also compares the streamed rollout with one call over the whole sequence.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .errors import ExportError

__all__ = ["SequenceStep"]

StateLike = torch.Tensor | tuple[torch.Tensor, ...]


class SequenceStep(nn.Module):
    """``module`` (``forward(seq, state) -> (out, new_state)``, batch first) as a one-step recurrent module.

    Parameters
    ----------
    module
        The sequence model. Its ``forward`` takes a batch-first sequence and a state and returns the outputs over
        the sequence and the final state, as ``nn.GRU`` and ``nn.LSTM`` with ``batch_first=True`` do.
    init_state
        ``init_state(batch)``: the zero state for a batch, a tensor or a tuple of tensors shaped as ``forward``
        takes it (``lambda b: torch.zeros(layers, b, hidden)`` for a GRU, a pair of those for an LSTM).
    batch_first
        Whether ``forward`` takes and returns sequences as (B, T, ...) (default) or time first, (T, B, ...), as
        ``nn.GRU`` and ``nn.LSTM`` do without ``batch_first=True``.

    Example
    -------
    >>> import torch
    >>> from torch import nn
    >>> class Decoder(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.gru, self.head = nn.GRU(4, 8, batch_first=True), nn.Linear(8, 2)
    ...     def forward(self, seq, h):
    ...         y, h = self.gru(seq, h)
    ...         return self.head(y), h
    >>> step = SequenceStep(Decoder(), lambda b: torch.zeros(1, b, 8))
    >>> y, h = step.step(torch.zeros(3, 4), *step.init_state(3))
    >>> tuple(y.shape), tuple(h.shape)
    ((3, 2), (1, 3, 8))
    """

    def __init__(self, module: nn.Module, init_state: Callable[[int], StateLike], batch_first: bool = True):
        super().__init__()
        if isinstance(module, torch.jit.ScriptModule):
            raise ExportError(f"{type(module).__name__} is a TorchScript module: the tracer cannot enter it from the "
                              "step adapter; wrap the Python module it was made from")
        both_ways = [name or "model" for name, m in module.named_modules() if isinstance(m, nn.RNNBase) and m.bidirectional]
        if both_ways:
            raise ExportError(f"{both_ways[0]} is bidirectional: its reverse direction reads the sequence from its end, "
                              "so it cannot stream one step at a time. Stream a unidirectional model, or export this one "
                              "over windows of frames (kind='feedforward' with windows={...}, docs/bundle.md)")
        self.module = module
        self._init_state = init_state
        self.batch_first = bool(batch_first)
        self.time_axis = 1 if self.batch_first else 0
        first = init_state(1)
        self.nested = isinstance(first, tuple | list)
        states = tuple(first) if self.nested else (first,)
        self.n_states = len(states)
        if not states or not all(isinstance(s, torch.Tensor) for s in states):
            raise ExportError(f"init_state(1) returned {type(first).__name__}; give a tensor or a tuple of tensors "
                              "shaped as the module's forward takes its state")

    def _state(self, states: tuple[torch.Tensor, ...]) -> StateLike:
        return tuple(states) if self.nested else states[0]

    def _flat(self, state: StateLike, what: str) -> tuple[torch.Tensor, ...]:
        flat = tuple(state) if self.nested else (state,)
        if not all(isinstance(s, torch.Tensor) for s in flat):
            raise ExportError(f"{type(self.module).__name__}.forward returned a state of {type(state).__name__} "
                              f"{what}; expected what init_state gives (a tensor or a tuple of tensors)")
        return flat

    @property
    def state_names(self) -> tuple[str, ...] | None:
        """The bundle's names for the states when the export is not given any: ``h`` and ``c`` for an ``nn.LSTM``'s
        ``(h, c)`` pair (its only recurrent layers), else the exporter's defaults (``h``, or ``h0``, ``h1``, ...)."""
        rnns = [m for m in self.module.modules() if isinstance(m, nn.RNNBase)]
        return ("h", "c") if self.n_states == 2 and rnns and all(isinstance(m, nn.LSTM) for m in rnns) else None

    def init_state(self, batch: int) -> tuple[torch.Tensor, ...]:
        first = self._init_state(batch)
        return tuple(first) if self.nested else (first,)

    def _call(self, seq: torch.Tensor, states: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, StateLike]:
        result = self.module(seq, self._state(states))
        if not (isinstance(result, tuple | list) and len(result) == 2 and isinstance(result[0], torch.Tensor)):
            raise ExportError(f"{type(self.module).__name__}.forward(seq, state) returned "
                              f"{type(result).__name__}; SequenceStep expects (outputs over the sequence, new state)")
        return result[0], result[1]

    def step(self, x: torch.Tensor, *states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One step: ``x`` (B, ...) is a sequence of length 1 to ``forward``; returns ``(y, *new_states)``."""
        y, new = self._call(x.unsqueeze(self.time_axis), states)
        return (y.squeeze(self.time_axis), *self._flat(new, "after one step"))

    def forward(self, seq: torch.Tensor, *states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The whole sequence at once, batch first whatever the module's layout: ``(outputs over it, *final
        states)``."""
        if self.batch_first:
            y, new = self._call(seq, states)
        else:
            y, new = self._call(seq.transpose(0, 1), states)
            y = y.transpose(0, 1)
        return (y, *self._flat(new, "after the sequence"))
