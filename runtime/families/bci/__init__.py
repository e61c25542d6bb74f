"""The ``bci_handwriting`` runtime family: spike-count bins in, typed text out.

- :mod:`.plugin`: the session plug-in (normalisation, model step, characters to the device).
- :mod:`.ctc`: streaming CTC decoding with end-of-trial completion (Numba kernels; imported
  only when a decoder is built, so importing the runtime stays light).

The rest of the family (training, calibration, the generator, the wire message) is mapped
in ``docs/families.md``.
"""

from .plugin import (
    DEFAULT_DISPLAY,
    BCIHandwritingFamily,
    calibration_state_shapes,
    meta_form_of,
    read_calibration_state,
)

__all__ = [
    "DEFAULT_DISPLAY",
    "BCIHandwritingFamily",
    "calibration_state_shapes",
    "meta_form_of",
    "read_calibration_state",
]
