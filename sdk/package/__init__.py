"""``closedloop package``: bundles and their runtime for a board, installed offline (docs/jetson.md)."""

from .build import PackageOptions, PackageResult, package
from .targets import TARGETS, PackageError, Target, get_target, target_names

__all__ = ["TARGETS", "PackageError", "PackageOptions", "PackageResult", "Target", "get_target", "package",
           "target_names"]
