"""closedloop: train neural models in PyTorch, run them in real-time closed loops with hardware.

One namespace, five layers (see ``docs/families.md`` for where each family's files sit):

- :mod:`closedloop.firmware_bridge`: the framed serial wire protocol, transports, the C library.
- :mod:`closedloop.runtime`: load a verified bundle and run it at a fixed rate (no torch).
- :mod:`closedloop.sim`: synthetic recordings, plants, PyBullet tasks and device emulators.
- :mod:`closedloop.export`: a trained torch module -> a bundle, with parity proved.
- :mod:`closedloop.sdk`: the model families, training, calibration, evaluation and the CLI.

The names a user starts from are importable from here. They load on first use, so
``import closedloop`` stays cheap and never pulls in torch: ``export_bundle`` needs the
``train`` extra, everything else runs on the deployed footprint.

>>> import closedloop
>>> sorted(closedloop.__all__)[:3]
['Bundle', 'BundleError', 'ExportOptions']
"""

from __future__ import annotations

import os

__version__ = "0.1.0"

# In a source checkout the five layers sit beside this folder rather than inside it
# (an installed wheel maps them inside). Extending the package path lets a checkout on
# PYTHONPATH import ``closedloop.runtime`` with no install at all.
_HERE = os.path.dirname(os.path.abspath(__file__))
if not os.path.isdir(os.path.join(_HERE, "runtime")):
    __path__.append(os.path.dirname(_HERE))

from .common.lazy import lazy_exports  # noqa: E402  (after __path__ is complete)

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "Bundle": "closedloop.runtime",
    "LoopConfig": "closedloop.runtime",
    "Model": "closedloop.runtime",
    "RealTimeLoop": "closedloop.runtime",
    "RecordingReader": "closedloop.runtime",
    "Session": "closedloop.runtime",
    "SessionConfig": "closedloop.runtime",
    "SessionSummary": "closedloop.runtime",
    "BundleError": "closedloop.runtime",
    "backend_report": "closedloop.runtime",
    "load_bundle": "closedloop.runtime",
    "replay_recording": "closedloop.runtime",
    "run_session": "closedloop.runtime",
    "Window": "closedloop.runtime",
    "open_transport": "closedloop.firmware_bridge",
    "export_bundle": "closedloop.export",
    "import_onnx": "closedloop.export",
    "ExportOptions": "closedloop.export",
    "SequenceStep": "closedloop.export",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
