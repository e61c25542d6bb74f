"""Export an MLP policy with action limits and run it in the fixed-rate loop.

Workflow: export a feed-forward policy (with observation normalisation and command
limits in the manifest) -> pick a backend -> run the family's preprocess / model /
postprocess at 1 kHz for one second -> read the loop summary.

    python examples/run_policy_in_loop.py [OUT_DIR]
"""

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from closedloop.export import export_bundle
from closedloop.runtime import LoopConfig, Model, RealTimeLoop, backend_report, get_family, load_bundle
from closedloop.sdk.models import MLPPolicy

if len(sys.argv) > 1 and sys.argv[1].startswith("-"):  # -h / --help: what it does; it takes one folder

    print(__doc__)

    sys.exit(0 if sys.argv[1] in ("-h", "--help") else 2)

out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()) / "policy"
policy = MLPPolicy(n_obs=10, n_actions=4, hidden=(64, 64)).eval()
bundle_path = export_bundle(
    policy, out, kind="feedforward", example_input=torch.zeros(1, 10), rate_hz=1000.0, name="example-policy",
    preprocess={"mean": [0.0] * 10, "std": [2.0] * 10},
    postprocess={"scale": [0.5] * 4, "low": [-0.2] * 4, "high": [0.2] * 4},
    variants=(), overwrite=True,
)

for name, availability in backend_report().items():
    print(f"{name:<22} {'yes' if availability else 'no ':<4} {availability.reason}")

bundle = load_bundle(bundle_path)
model = Model(bundle, backend="onnxruntime")  # or "numba", or "auto"
family = get_family(bundle.manifest.family)(bundle, model)  # normalise, run, scale, clip
obs = np.random.default_rng(0).standard_normal((1000, 1, 10)).astype(np.float32)
sent = []


def step(k: int) -> None:
    family.preprocess(obs[k % 1000])
    model.run()
    sent.append(family.postprocess().copy())


summary = RealTimeLoop(LoopConfig(rate_hz=bundle.manifest.rate_hz, duration_s=1.0)).run(step)
print(summary.format())
assert np.abs(np.array(sent)).max() <= 0.2 + 1e-6, "commands must respect the bundle's limits"
