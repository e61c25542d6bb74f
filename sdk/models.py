"""Small reference models used by the spine's demo, benchmark and tests.

``GRUDecoder`` is the shape of the iBCI decoder (spike counts per bin in, character
log-probabilities out) with the streaming interface the exporter needs:
``init_state(batch)`` and ``step(x, h) -> (y, h)``, plus ``forward(seq, h)`` for
training on whole sequences. ``MLPPolicy`` is a plain feed-forward policy.
"""

from __future__ import annotations

import torch
from torch import nn


class GRUDecoder(nn.Module):
    """GRU over bins, then a linear read-out with log-softmax.

    Parameters
    ----------
    n_inputs, n_hidden, n_layers, n_outputs
        Channels per bin, GRU width, GRU depth, output classes (characters + CTC blank).
    """

    def __init__(self, n_inputs: int = 192, n_hidden: int = 256, n_layers: int = 2, n_outputs: int = 32):
        super().__init__()
        self.n_inputs, self.n_hidden, self.n_layers, self.n_outputs = n_inputs, n_hidden, n_layers, n_outputs
        self.gru = nn.GRU(n_inputs, n_hidden, n_layers, batch_first=True)
        self.readout = nn.Linear(n_hidden, n_outputs)

    def init_state(self, batch: int = 1) -> tuple[torch.Tensor]:
        return (torch.zeros(self.n_layers, batch, self.n_hidden),)

    def forward(self, seq: torch.Tensor, h: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``seq`` (batch, time, inputs) -> log-probs (batch, time, outputs), final state."""
        y, h = self.gru(seq, h)
        return torch.log_softmax(self.readout(y), dim=-1), h

    def step(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One bin: ``x`` (batch, inputs), ``h`` (layers, batch, hidden)."""
        y, h = self.gru(x.unsqueeze(1), h)
        return torch.log_softmax(self.readout(y[:, 0]), dim=-1), h


class MLPPolicy(nn.Module):
    """Observation -> action in [-1, 1] (tanh), hidden layers with ReLU."""

    def __init__(self, n_obs: int = 40, n_actions: int = 8, hidden: tuple[int, ...] = (256, 256)):
        super().__init__()
        layers: list[nn.Module] = []
        width = n_obs
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers += [nn.Linear(width, n_actions), nn.Tanh()]
        self.net = nn.Sequential(*layers)
        self.n_obs, self.n_actions = n_obs, n_actions

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs)
