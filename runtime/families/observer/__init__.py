"""The ``observer`` runtime family: plant measurements in, state and disturbance estimates out.

- :mod:`.plugin`: the session plug-in (the network step as one Numba kernel).
- :mod:`.certificate`: the LMI stability certificate's math (numpy, float64), checked at load.
- :mod:`.certificate_bundle`: reading and checking the certificate a bundle carries.

The rest of the family (training, the LMI solve, the plants) is mapped in ``docs/families.md``.
"""

from .certificate import CertificateError, certify_bundle, check_bundle_certificate, check_certificate
from .plugin import ObserverArrays, ObserverFamily, pack_network

__all__ = [
    "CertificateError",
    "ObserverArrays",
    "ObserverFamily",
    "certify_bundle",
    "check_bundle_certificate",
    "check_certificate",
    "pack_network",
]
