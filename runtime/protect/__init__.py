"""Bit-flip protection of deployed weights: check and repair a protected bundle's weights in memory.

- :mod:`.layout`: the keyed block layout a protected bundle records.
- :mod:`.kernels`: the Numba scans (fp32, fp16 and int8 storage).
- :mod:`.scrubber`: the scrubber a session runs between steps.

The training side (constraining weights at fine-tuning) is :mod:`closedloop.sdk.robust`.
"""

from .scrubber import (
    ProtectionLayout,
    Scrubber,
    ScrubError,
    ScrubEvent,
    WeightsCorruptedError,
    attach_scrubber,
    session_scrubber,
)

__all__ = [
    "ProtectionLayout",
    "ScrubError",
    "ScrubEvent",
    "Scrubber",
    "WeightsCorruptedError",
    "attach_scrubber",
    "session_scrubber",
]
