"""The zoo's catalogue: how each model exports, which device streams to it, and one call to a live session.

Every entry says what ``export_bundle`` needs beyond the module (the kind, the input names and roles,
the window over the stream, the loop rate, the session block) and which emulated device drives it:
``sim://headstage`` for the neural decoders (spike-count frames in, decoder outputs back), ``sim://plant``
for the policies (measurements in, actuator commands back). ``make_bundle(name, size, out)`` exports one,
``session_config`` builds the ``SessionConfig`` that streams to it, ``run_zoo_session`` does both and runs.

>>> sorted(ZOO)
['cnn', 'goal_policy', 'gru', 'lstm', 'mlp', 'tcn', 'transformer']
>>> ZOO["tcn"].describe("tiny")
'tcn: channel_major window of 8 frames of 8, hop 1 -> 5 outputs; device sim://headstage?channels=8&rate=50&seed=0'
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from closedloop.export import ExportOptions, export_bundle
from closedloop.runtime import SessionConfig, SessionSummary, Window, run_session

from .models import CNNDecoder, GoalPolicy, GRUDecoder, LSTMDecoder, MLPPolicy, TCNDecoder, TransformerDecoder

SIZES = ("tiny", "full")
NEURAL_SESSION = {"input": "neural_frame", "command": "decoder_output"}
PLANT_SESSION = {"input": "plant_measurement", "command": "actuator_command"}
#: the plant each policy size drives: its measurements are the observation, its inputs the action
PLANTS = {"tiny": "msd", "full": "x29-nd-pa-lon"}


@dataclass(frozen=True)
class ZooEntry:
    """One zoo model: its class, how it is exported and which device streams to it.

    ``layout`` is None for a model that takes one frame per step (recurrent, policies), else the
    window's layout; the window's length is the model's ``window`` attribute.
    """

    name: str
    model: type[nn.Module]
    summary: str
    kind: str  # export kind: "recurrent" or "feedforward"
    stream: str  # "neural" (sim://headstage) or "plant" (sim://plant)
    rate_hz: float
    layout: str | None = None
    hop: int = 1
    input_names: tuple[str, ...] = ("x",)
    state_names: tuple[str, ...] | None = None
    input_roles: dict[str, str] = field(default_factory=dict)

    def build(self, size: str = "tiny", seed: int = 0) -> nn.Module:
        """The ``tiny`` or ``full`` model, weights drawn from ``seed``, in eval mode."""
        if size not in SIZES:
            raise ValueError(f"size {size!r} is not one of {SIZES}")
        torch.manual_seed(seed)
        module = getattr(self.model, size)().eval()
        if self.model is CNNDecoder:  # fresh BatchNorm is the identity: give it statistics, as training would
            bn = module.features[1]
            bn.running_mean.normal_(0.0, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
        return module

    def window(self, module: nn.Module) -> Window | None:
        return None if self.layout is None else Window(length=int(module.window), hop=self.hop, layout=self.layout)

    def example_inputs(self, module: nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
        """One example batch per data input, by name (the shapes the bundle's graph takes at batch 1)."""
        g = torch.Generator().manual_seed(seed)
        if self.layout == "channel_major":
            return {"x": torch.randn(1, module.n_channels, module.window, generator=g)}
        if self.layout == "time_major":
            return {"x": torch.randn(1, module.window, module.n_channels, generator=g)}
        if self.model is GoalPolicy:
            return {"obs": torch.randn(1, module.n_obs, generator=g), "goal": torch.randn(1, module.n_goal, generator=g)}
        if self.model is MLPPolicy:
            return {"obs": torch.randn(1, module.n_obs, generator=g)}
        return {"x": torch.randn(1, module.n_inputs, generator=g)}

    def frame_size(self, module: nn.Module) -> int:
        """Values per device frame: channels per bin, or measurements per plant sample."""
        return int(getattr(module, "n_channels", None) or getattr(module, "n_inputs", None) or module.n_obs)

    def n_outputs(self, module: nn.Module) -> int:
        return int(getattr(module, "n_outputs", None) or module.n_actions)

    def device_url(self, size: str = "tiny", seed: int = 0) -> str:
        """The emulator that streams this model's input: a headstage of its channels, or its plant."""
        if self.stream == "neural":
            channels = self.frame_size(self.model.tiny() if size == "tiny" else self.model.full())
            return f"sim://headstage?channels={channels}&rate={self.rate_hz:g}&seed={seed}"
        return f"sim://plant?model={PLANTS[size]}&rate={self.rate_hz:g}&seed={seed}"

    def held_inputs(self, module: nn.Module) -> dict[str, list[float]]:
        """Values for the inputs the device does not stream (the goal), for ``SessionConfig.inputs``."""
        if self.model is GoalPolicy:
            return {"goal": [0.5] * module.n_goal}
        return {}

    def describe(self, size: str = "tiny") -> str:
        m = self.build(size)
        n = self.frame_size(m)
        w = self.window(m)
        takes = f"{w.layout} window of {w.length} frames of {n}, hop {w.hop}" if w else f"frames of {n}"
        if self.kind == "recurrent":
            takes += f", state {', '.join(self.state_names or ('h',))}"
        return f"{self.name}: {takes} -> {self.n_outputs(m)} outputs; device {self.device_url(size)}"


ZOO: dict[str, ZooEntry] = {e.name: e for e in (
    ZooEntry("lstm", LSTMDecoder, "stacked LSTM decoder, step(x, h, c)", "recurrent", "neural", 50.0,
             state_names=("h", "c")),
    ZooEntry("gru", GRUDecoder, "stacked GRU decoder, step(x, h)", "recurrent", "neural", 50.0, state_names=("h",)),
    ZooEntry("tcn", TCNDecoder, "dilated causal Conv1d stack (TCN) over a window", "feedforward", "neural", 50.0,
             layout="channel_major", hop=1),
    ZooEntry("cnn", CNNDecoder, "Conv1d + pooling over a window", "feedforward", "neural", 50.0,
             layout="channel_major", hop=4),
    ZooEntry("transformer", TransformerDecoder, "nn.TransformerEncoderLayer stack over a window", "feedforward",
             "neural", 50.0, layout="time_major", hop=1),
    ZooEntry("goal_policy", GoalPolicy, "goal-conditioned policy, forward(obs, goal)", "feedforward", "plant", 200.0,
             input_names=("obs", "goal"), input_roles={"goal": "goal"}),
    ZooEntry("mlp", MLPPolicy, "MLP policy, forward(obs)", "feedforward", "plant", 200.0, input_names=("obs",)),
)}


def zoo_entry(name: str) -> ZooEntry:
    """The entry called ``name``; an unknown name lists the zoo."""
    try:
        return ZOO[name]
    except KeyError:
        raise ValueError(f"no zoo model {name!r}; the zoo has {sorted(ZOO)}") from None


def _postprocess(entry: ZooEntry, size: str) -> dict[str, Any]:
    if entry.stream != "plant":
        return {}
    from closedloop.sim.plants import make_plant

    plant = make_plant(PLANTS[size])
    high = np.asarray(plant.u_high, dtype=float)
    # tanh actions in [-1, 1] scaled to the plant's input range and clipped to its limits
    return {"scale": high.tolist(), "low": np.asarray(plant.u_low, dtype=float).tolist(), "high": high.tolist()}


def make_bundle(name: str, size: str, out: str | Path, *, module: nn.Module | None = None, seed: int = 0,
                variants: tuple[str, ...] = (), overwrite: bool = True,
                report: Callable[[str], None] = lambda s: None) -> Path:
    """Export zoo model ``name`` at ``size`` (``"tiny"``/``"full"``) to a bundle at ``out`` and return its path.

    ``module`` exports that instance (e.g. one you trained) instead of a fresh one drawn from ``seed``;
    it must be the entry's class. Parity with torch is checked by ``export_bundle``, which raises if it fails.
    """
    entry = zoo_entry(name)
    module = module if module is not None else entry.build(size, seed)
    if not isinstance(module, entry.model):
        raise TypeError(f"zoo model {name!r} exports a {entry.model.__name__}, got a {type(module).__name__}")
    examples = entry.example_inputs(module, seed)
    window = entry.window(module)
    return export_bundle(
        module, out, kind=entry.kind, example_input=examples, rate_hz=entry.rate_hz, name=f"zoo-{name}-{size}",
        input_roles=entry.input_roles or None, windows={"x": window} if window else None,
        postprocess=_postprocess(entry, size),
        extra={"session": NEURAL_SESSION if entry.stream == "neural" else PLANT_SESSION},
        provenance={"zoo": {"model": name, "size": size, "seed": seed}},
        variants=variants, tensorrt=False, overwrite=overwrite,
        options=ExportOptions(state_names=entry.state_names), report=report,
    )


def session_config(name: str, size: str, seconds: float, *, backend: str = "auto", seed: int = 0,
                   **more: Any) -> SessionConfig:
    """A ``SessionConfig`` that streams zoo model ``name`` from its emulator for ``seconds``."""
    entry = zoo_entry(name)
    held = entry.held_inputs(entry.build(size, seed))
    return SessionConfig(device=entry.device_url(size, seed), duration_s=seconds, backend=backend,
                         inputs=held, **more)


def run_zoo_session(name: str, size: str, bundle: str | Path, seconds: float = 3.0, *, backend: str = "auto",
                    seed: int = 0, **more: Any) -> SessionSummary:
    """Run a live session of ``bundle`` (made by ``make_bundle(name, size, ...)``) against its emulator."""
    return run_session(bundle, session_config(name, size, seconds, backend=backend, seed=seed, **more))
