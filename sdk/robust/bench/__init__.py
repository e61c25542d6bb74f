"""The bit-flip benchmark: deployed weights under random and targeted flips, unprotected against protected.

For each family evaluator (the iBCI handwriting decoder's CER, the certified observer's state
RMSE, a behaviour-cloned Panda reach policy's success rate) the harness trains a small model,
fine-tunes a copy into the protected form (keyed, and unkeyed for the adaptive attack) and an
unconstrained copy for the same number of steps, exports bundles, and measures the family's
metric through the *runtime* (Numba backend for fp32, ONNX Runtime for int8) after injecting
flips into the memory the backend computes with:

* random flips (uniform over every bit of every weight tensor, biases included), 1 to 1000,
  several seeds, fp32 and int8;
* targeted flips (Bit-Flip-Attack-style progressive search on int8 weights, and the adaptive
  variant that keeps the block constraints of the unkeyed layout), 1 to 50;

for the unprotected model, the protected model without scrubbing, and with scrubbing (policy
fallback: a block that cannot be repaired is restored from the last-good copy); for families
with unprotected weights also with the flips drawn only over the protected tensors (what the
scheme can reach). The iBCI decoder's clean cost of the constraints is also read as a mean
over fine-tuning seeds, because one fine-tune differs from the next by as much as the
constraints cost. It also times a full scrub of the iBCI benchmark decoder (192 channels) and
of the 2x256 ``GRUDecoder`` on one core.

``run_bitflip_benchmark(BitflipBenchConfig())`` (``python bench/bench_bitflip.py``) writes
``bench/results/bitflip/bitflip.{json,md}`` and one PNG per family. Modules: ``config``
(settings), ``memory`` (the backend's weight memory), ``evaluate_bci`` / ``evaluate_observer``
/ ``evaluate_policy`` (the family evaluators), ``sweeps`` (the measurements), ``report``
(table, targets, plots), ``harness`` (the run).
"""

from .config import KEY, BitflipBenchConfig
from .harness import EVALUATORS, run_bitflip_benchmark
from .memory import WeightMemory

__all__ = ["EVALUATORS", "KEY", "BitflipBenchConfig", "WeightMemory", "run_bitflip_benchmark"]
