"""Export a recurrent decoder to a bundle and stream it one bin at a time.

Workflow: train (here: a fresh model) -> export (ONNX single-step graph with
explicit state, parity checked) -> load the verified bundle in the torch-free
runtime -> stream bins, state carried between calls -> compare with torch on the
whole sequence.

    python examples/export_and_stream_decoder.py [OUT_DIR]
"""

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from closedloop.export import export_bundle
from closedloop.runtime import Model
from closedloop.sdk.models import GRUDecoder

if len(sys.argv) > 1 and sys.argv[1].startswith("-"):  # -h / --help: what it does; it takes one folder

    print(__doc__)

    sys.exit(0 if sys.argv[1] in ("-h", "--help") else 2)

out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()) / "decoder"
torch.manual_seed(0)
decoder = GRUDecoder(n_inputs=32, n_hidden=64, n_layers=2, n_outputs=8).eval()

bundle = export_bundle(decoder, out, kind="recurrent", example_input=torch.zeros(1, 32), rate_hz=50.0,
                       name="example-decoder", overwrite=True)
print(f"bundle written to {bundle}")

model = Model(bundle, backend="auto")  # times every available backend, keeps the fastest
print(f"backend chosen: {model.backend_name} (p99 us: {model.choice.p99_us})")

bins = np.random.default_rng(1).poisson(2.0, size=(100, 32)).astype(np.float32)
streamed = np.stack([model.step(b[None]).copy() for b in bins])[:, 0]

with torch.no_grad():
    offline, _ = decoder(torch.from_numpy(bins)[None])
err = np.abs(streamed - offline[0].numpy()).max()
print(f"streamed vs offline (torch, whole sequence): max abs error {err:.2e} over {len(bins)} bins")
assert err < 1e-3
