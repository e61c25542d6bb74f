"""The zoo's seven models: the everyday shapes a user brings, each with a ``tiny()`` and a ``full()`` size.

Three stream recurrent state (``LSTMDecoder``, ``GRUDecoder``: ``init_state(batch)``, ``step(x, *states)``),
three see a window over the stream (``TCNDecoder`` and ``CNNDecoder`` channel-major ``(batch, channels, time)``,
``TransformerDecoder`` time-major ``(batch, time, channels)``), and two are policies (``GoalPolicy`` with two
inputs ``forward(obs, goal)``, ``MLPPolicy``). The neural ones read spike-count frames and give class
log-probabilities; the policies read plant measurements and give an action in ``[-1, 1]``. ``tiny()`` sizes
test in seconds; ``full()`` sizes are what a deployed model looks like (the spine's GRU 192-2x256-32).
``closedloop.sdk.zoo.catalog`` says how each exports and streams.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import models as _spine


class LSTMDecoder(nn.Module):
    """Stacked LSTM over bins, then a linear read-out with log-softmax; ``step(x, h, c)`` streams one bin.

    ``forward(seq, h, c)`` runs a whole ``(batch, time, inputs)`` sequence (for training, and for the
    exporter's whole-sequence parity check); ``step`` is the one-bin graph that ships.
    """

    def __init__(self, n_inputs: int = 192, n_hidden: int = 256, n_layers: int = 2, n_outputs: int = 32):
        super().__init__()
        self.n_inputs, self.n_hidden, self.n_layers, self.n_outputs = n_inputs, n_hidden, n_layers, n_outputs
        self.lstm = nn.LSTM(n_inputs, n_hidden, n_layers, batch_first=True)
        self.readout = nn.Linear(n_hidden, n_outputs)

    @classmethod
    def tiny(cls) -> LSTMDecoder:
        return cls(n_inputs=8, n_hidden=16, n_layers=2, n_outputs=5)

    @classmethod
    def full(cls) -> LSTMDecoder:
        return cls(n_inputs=192, n_hidden=256, n_layers=2, n_outputs=32)

    def init_state(self, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.n_layers, batch, self.n_hidden)
        return torch.zeros(shape), torch.zeros(shape)

    def forward(self, seq: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y, (h, c) = self.lstm(seq, (h, c))
        return torch.log_softmax(self.readout(y), dim=-1), h, c

    def step(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One bin: ``x`` (batch, inputs); ``h``, ``c`` (layers, batch, hidden)."""
        y, (h, c) = self.lstm(x[:, None], (h, c))
        return torch.log_softmax(self.readout(y[:, 0]), dim=-1), h, c


class GRUDecoder(_spine.GRUDecoder):
    """The spine's GRU decoder (``closedloop.sdk.models.GRUDecoder``, ``step(x, h)``) in the zoo's two sizes."""

    @classmethod
    def tiny(cls) -> GRUDecoder:
        return cls(n_inputs=8, n_hidden=16, n_layers=2, n_outputs=5)

    @classmethod
    def full(cls) -> GRUDecoder:
        return cls(n_inputs=192, n_hidden=256, n_layers=2, n_outputs=32)


class _CausalBlock(nn.Module):
    """Two dilated causal convolutions with a residual: the output at time t sees inputs t - (k-1)d ... t only.

    Causal by padding both ends and dropping the right-hand ``(k-1)d`` outputs (the usual TCN "chomp").
    """

    def __init__(self, n_in: int, n_out: int, kernel: int, dilation: int):
        super().__init__()
        self.chomp = (kernel - 1) * dilation
        self.conv1 = nn.Conv1d(n_in, n_out, kernel, padding=self.chomp, dilation=dilation)
        self.conv2 = nn.Conv1d(n_out, n_out, kernel, padding=self.chomp, dilation=dilation)
        self.skip = nn.Conv1d(n_in, n_out, 1) if n_in != n_out else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv1(x)[..., : -self.chomp])
        y = torch.relu(self.conv2(y)[..., : -self.chomp])
        return torch.relu(y + self.skip(x))


class TCNDecoder(nn.Module):
    """A temporal convolutional network over a channel-major window ``(batch, channels, window)``.

    Causal blocks with dilations 1, 2, 4, ...; the last time step's features are read out (log-softmax).
    Its receptive field is ``1 + 2 (kernel - 1) (2**levels - 1)`` frames; the window should cover it.
    """

    def __init__(self, n_channels: int = 96, n_hidden: int = 64, n_levels: int = 4, kernel: int = 3,
                 window: int = 64, n_outputs: int = 32):
        super().__init__()
        self.n_channels, self.window, self.n_outputs = n_channels, window, n_outputs
        blocks = [_CausalBlock(n_channels if i == 0 else n_hidden, n_hidden, kernel, 2**i) for i in range(n_levels)]
        self.blocks = nn.Sequential(*blocks)
        self.readout = nn.Linear(n_hidden, n_outputs)
        self.receptive_field = 1 + 2 * (kernel - 1) * (2**n_levels - 1)

    @classmethod
    def tiny(cls) -> TCNDecoder:
        return cls(n_channels=8, n_hidden=8, n_levels=2, kernel=2, window=8, n_outputs=5)

    @classmethod
    def full(cls) -> TCNDecoder:
        return cls(n_channels=96, n_hidden=64, n_levels=4, kernel=3, window=64, n_outputs=32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.blocks(x)
        return torch.log_softmax(self.readout(z[:, :, -1]), dim=-1)


class CNNDecoder(nn.Module):
    """Conv1d + BatchNorm + max pooling, a second Conv1d, global average pooling, a linear read-out.

    Over a channel-major window ``(batch, channels, window)``; BatchNorm folds into the convolution at export.
    """

    def __init__(self, n_channels: int = 96, n_hidden: int = 64, kernel: int = 5, window: int = 64,
                 n_outputs: int = 32):
        super().__init__()
        self.n_channels, self.window, self.n_outputs = n_channels, window, n_outputs
        self.features = nn.Sequential(
            nn.Conv1d(n_channels, n_hidden, kernel, padding=kernel // 2), nn.BatchNorm1d(n_hidden), nn.ReLU(),
            nn.MaxPool1d(2),
            nn.Conv1d(n_hidden, n_hidden, kernel, padding=kernel // 2), nn.ReLU(),
            nn.AdaptiveAvgPool1d(1),
        )
        self.readout = nn.Linear(n_hidden, n_outputs)

    @classmethod
    def tiny(cls) -> CNNDecoder:
        return cls(n_channels=8, n_hidden=8, kernel=3, window=8, n_outputs=5)

    @classmethod
    def full(cls) -> CNNDecoder:
        return cls(n_channels=96, n_hidden=64, kernel=5, window=64, n_outputs=32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.readout(self.features(x).flatten(1)), dim=-1)


class TransformerDecoder(nn.Module):
    """``nn.TransformerEncoderLayer`` stack over a time-major window ``(batch, window, channels)``.

    A linear embedding plus a learned position per frame, ``n_layers`` encoder layers (post-norm, ReLU,
    torch's defaults), and the newest frame's token read out (log-softmax).
    """

    def __init__(self, n_channels: int = 96, d_model: int = 64, n_heads: int = 4, d_ff: int = 128,
                 n_layers: int = 2, window: int = 32, n_outputs: int = 32):
        super().__init__()
        self.n_channels, self.window, self.n_outputs = n_channels, window, n_outputs
        self.embed = nn.Linear(n_channels, d_model)
        self.position = nn.Parameter(0.02 * torch.randn(1, window, d_model))
        layer = nn.TransformerEncoderLayer(d_model, n_heads, d_ff, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.readout = nn.Linear(d_model, n_outputs)

    @classmethod
    def tiny(cls) -> TransformerDecoder:
        return cls(n_channels=8, d_model=8, n_heads=2, d_ff=16, n_layers=1, window=8, n_outputs=5)

    @classmethod
    def full(cls) -> TransformerDecoder:
        return cls(n_channels=96, d_model=64, n_heads=4, d_ff=128, n_layers=2, window=32, n_outputs=32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.encoder(self.embed(x) + self.position)
        return torch.log_softmax(self.readout(z[:, -1]), dim=-1)


class GoalPolicy(nn.Module):
    """A goal-conditioned policy with two inputs: ``forward(obs, goal)`` -> action in [-1, 1].

    The observation streams from the plant; the goal is held by the session (its config, or a
    second message type) and changes rarely. The two meet in the first layer (a concatenation).
    """

    def __init__(self, n_obs: int = 3, n_goal: int = 3, n_actions: int = 3, hidden: tuple[int, ...] = (256, 256)):
        super().__init__()
        self.n_obs, self.n_goal, self.n_actions = n_obs, n_goal, n_actions
        layers: list[nn.Module] = []
        width = n_obs + n_goal
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers += [nn.Linear(width, n_actions), nn.Tanh()]
        self.net = nn.Sequential(*layers)

    @classmethod
    def tiny(cls) -> GoalPolicy:
        return cls(n_obs=1, n_goal=1, n_actions=1, hidden=(16,))

    @classmethod
    def full(cls) -> GoalPolicy:
        return cls(n_obs=3, n_goal=3, n_actions=3, hidden=(256, 256))

    def forward(self, obs: torch.Tensor, goal: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([obs, goal], dim=-1))


class MLPPolicy(_spine.MLPPolicy):
    """The spine's MLP policy (``closedloop.sdk.models.MLPPolicy``) in the zoo's two sizes."""

    @classmethod
    def tiny(cls) -> MLPPolicy:
        return cls(n_obs=1, n_actions=1, hidden=(16,))

    @classmethod
    def full(cls) -> MLPPolicy:
        return cls(n_obs=3, n_actions=3, hidden=(256, 256))
