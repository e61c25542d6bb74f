"""Typed errors of the export stage.

Each subclasses ``ValueError`` (as ``closedloop.runtime.errors.BundleError`` does), so a caller
may catch either. Messages name the bad value, what was expected and what to do.
"""

from __future__ import annotations


class ExportError(ValueError):
    """The module, its example input or the export settings cannot make a bundle."""


class GraphCheckError(ExportError):
    """The exported ONNX graph is not the graph we meant to write (wrong semantics or shapes)."""


class ParityError(ExportError):
    """ONNX Runtime's outputs differ from torch's by more than the stated tolerance."""
