"""A model zoo: seven everyday PyTorch models that export, stream from an emulated device and run on every backend.

LSTM and GRU decoders (recurrent, one bin per step), a TCN, a CNN and a transformer encoder over a
window of frames, a goal-conditioned two-input policy and an MLP policy, each in a ``tiny()`` size
(tests, seconds) and a ``full()`` size (the benchmark). ``make_bundle(name, size, out)`` exports one
with the kind, window, roles and session block it needs; ``run_zoo_session`` streams it from
``sim://headstage`` or ``sim://plant``. ``closedloop.sdk.zoo.benchmark`` times the full sizes on
torch eager, ONNX Runtime and Numba (``bench/bench_zoo.py``). See docs/zoo.md.
"""

from .catalog import SIZES, ZOO, ZooEntry, make_bundle, run_zoo_session, session_config, zoo_entry
from .models import CNNDecoder, GoalPolicy, GRUDecoder, LSTMDecoder, MLPPolicy, TCNDecoder, TransformerDecoder

__all__ = [
    "SIZES",
    "ZOO",
    "CNNDecoder",
    "GRUDecoder",
    "GoalPolicy",
    "LSTMDecoder",
    "MLPPolicy",
    "TCNDecoder",
    "TransformerDecoder",
    "ZooEntry",
    "make_bundle",
    "run_zoo_session",
    "session_config",
    "zoo_entry",
]
