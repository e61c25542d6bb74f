"""Models as people write them, exported as they are and streamed by the torch-free runtime.

Four shapes closedloop's own models do not have:

1. a recurrent decoder written for whole sequences, ``forward(seq, h) -> (out, h)``, with a learned initial
   state ``h0`` (as LFADS-style models have): ``SequenceStep`` streams it one bin at a time from ``h0``, the
   bundle carries ``h0``, and the stream equals one call over the sequence;
2. a two-head cursor decoder (velocity and click) over a window of bins, whose ``forward`` returns a dict:
   the bundle's outputs are named by the keys; and the same model shared as TorchScript (a ``.pt`` read back
   with ``torch.jit.load``, returning a tuple), exported as it is;
3. a stable-baselines3 policy (SAC on Pendulum-v1, untrained: the mapping is what matters):
   ``SB3Policy`` gives the bundle ``model.predict(obs, deterministic=True)``'s actions;
4. a model that is already an ONNX file (the cursor decoder as ``torch.onnx.export`` writes it, standing for
   another framework's export): ``import_onnx`` makes the bundle without the module, checked on both backends.

    python examples/bring_your_own_model.py [OUT_DIR]
"""

import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from closedloop import Model, SequenceStep, export_bundle, import_onnx

if len(sys.argv) > 1 and sys.argv[1].startswith("-"):  # -h / --help: what it does; it takes one folder

    print(__doc__)

    sys.exit(0 if sys.argv[1] in ("-h", "--help") else 2)

out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
torch.manual_seed(0)
quiet = {"variants": (), "tensorrt": False, "overwrite": True, "report": lambda line: None}


# 1. a sequence model -----------------------------------------------------------------------------
class SequenceDecoder(nn.Module):
    def __init__(self, channels: int = 32, hidden: int = 64, outputs: int = 8):
        super().__init__()
        self.gru = nn.GRU(channels, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, outputs)
        self.h0 = nn.Parameter(0.5 * torch.randn(2, 1, hidden))  # learned with the rest

    def forward(self, seq, h):
        y, h = self.gru(seq, h)
        return self.head(y).log_softmax(-1), h


decoder = SequenceDecoder().eval()
step = SequenceStep(decoder, init_state=lambda batch: decoder.h0.expand(2, batch, 64))
bundle = export_bundle(step, out / "sequence-decoder", kind="recurrent", example_input=torch.zeros(1, 32),
                       rate_hz=50.0, **quiet)
model = Model(bundle, backend="auto")
bins = np.random.default_rng(1).poisson(2.0, size=(100, 32)).astype(np.float32)
streamed = np.stack([model.step(b[None]).copy()[0] for b in bins])
with torch.no_grad():
    whole, _ = decoder(torch.from_numpy(bins)[None], decoder.h0)
err = float(np.abs(streamed - whole[0].numpy()).max())
print(f"1. sequence decoder on {model.backend_name}: streamed from its learned h0 vs one call over {len(bins)} bins, "
      f"max abs error {err:.1e}")
assert err < 1e-3
model.reset()  # a new trial starts from h0 again
assert np.array_equal(model.step(bins[0][None]), streamed[:1])


# 2. two heads, as a dict and as TorchScript -------------------------------------------------------
class CursorDecoder(nn.Module):
    def __init__(self, channels: int = 32):
        super().__init__()
        self.body = nn.Sequential(nn.Conv1d(channels, 16, 5), nn.GELU(), nn.AdaptiveAvgPool1d(1), nn.Flatten())
        self.velocity, self.click = nn.Linear(16, 2), nn.Linear(16, 1)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.velocity(h), torch.sigmoid(self.click(h))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        velocity, click = self.heads(x)
        return {"velocity": velocity, "click": click}


class CursorHeads(CursorDecoder):  # what gets scripted and shared: TorchScript's ONNX form takes a tuple
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return self.heads(x)


cursor = CursorDecoder().eval()
window_spec = {"x": {"length": 20, "hop": 2, "layout": "channel_major"}}
window = np.random.default_rng(2).poisson(2.0, size=(1, 32, 20)).astype(np.float32)
with torch.no_grad():
    want = cursor(torch.from_numpy(window))
scripted = CursorHeads().eval()
scripted.load_state_dict(cursor.state_dict())
torch.jit.save(torch.jit.script(scripted), str(out / "cursor.pt"))
for label, module, names in (("dict outputs", cursor, "y"),
                             ("TorchScript .pt", torch.jit.load(str(out / "cursor.pt")), ["velocity", "click"])):
    bundle = export_bundle(module, out / ("cursor-ts" if isinstance(names, list) else "cursor"), kind="feedforward",
                           example_input=torch.zeros(1, 32, 20), rate_hz=50.0, windows=window_spec,
                           output_name=names, **quiet)
    model = Model(bundle, backend="auto")
    model.step(window)
    errs = {k: float(np.abs(model.outputs[k] - want[k].numpy()).max()) for k in ("velocity", "click")}
    print(f"2. cursor decoder, {label}, on {model.backend_name}: outputs {list(model.outputs)}, max abs error "
          f"{max(errs.values()):.1e}")
    assert max(errs.values()) < 1e-3


# 3. a stable-baselines3 policy -------------------------------------------------------------------
try:
    import gymnasium as gym
    from stable_baselines3 import SAC

    from closedloop.sdk.rl import SB3Policy
except ImportError as exc:  # the [rl] extra
    print(f"3. skipped: {exc} (pip install 'closedloop[rl]')")
    sys.exit(0)

env = gym.make("Pendulum-v1")
sac = SAC("MlpPolicy", env, seed=0, device="cpu")
policy = SB3Policy(sac)
bundle = export_bundle(policy, out / "pendulum-policy", kind="feedforward", rate_hz=50.0,
                       example_input=torch.zeros(1, 3), postprocess={"low": policy.low.tolist(),
                                                                     "high": policy.high.tolist()}, **quiet)
model = Model(bundle, backend="auto")
env.observation_space.seed(0)
obs = np.stack([env.observation_space.sample() for _ in range(50)]).astype(np.float32)
got = np.stack([model.step(o[None]).copy()[0] for o in obs])
want, _ = sac.predict(obs, deterministic=True)
err = float(np.abs(got - want).max())
print(f"3. SB3 SAC policy on {model.backend_name}: runtime vs predict over {len(obs)} observations, max abs error {err:.1e}")
assert err < 1e-3


# 4. an ONNX file made elsewhere ------------------------------------------------------------------
onnx_file = out / "cursor.onnx"
with warnings.catch_warnings():  # torch 2.13 calls its TorchScript-based exporter deprecated; it writes this file
    warnings.simplefilter("ignore")
    torch.onnx.export(scripted, (torch.zeros(1, 32, 20),), str(onnx_file), input_names=["spikes"],
                      output_names=["velocity", "click"],
                      dynamic_axes={n: {0: "N"} for n in ("spikes", "velocity", "click")}, dynamo=False)
bundle = import_onnx(onnx_file, out / "cursor-imported", rate_hz=50.0,
                     windows={"spikes": window_spec["x"]}, **quiet)
with torch.no_grad():
    want = cursor(torch.from_numpy(window))
for backend in ("onnxruntime", "numba"):
    model = Model(bundle, backend=backend)
    model.step(window)
    err = max(float(np.abs(model.outputs[k] - want[k].numpy()).max()) for k in ("velocity", "click"))
    print(f"4. imported ONNX file on {backend}: outputs {list(model.outputs)}, max abs error {err:.1e}")
    assert err < 1e-3

