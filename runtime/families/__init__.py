"""Family plug-ins: pre/postprocessing, safe output and load-time checks per model family."""

from . import bci, generic, observer, policy  # noqa: F401  (register "bci_handwriting", "generic", "observer", "policy")
from .base import FamilyPlugin
from .registry import family_names, family_problems, get_family, register_family

__all__ = ["FamilyPlugin", "family_names", "family_problems", "get_family", "register_family"]
