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


class UnsupportedOpError(ExportError):
    """``torch.onnx.export`` met an op it cannot write at the requested opset.

    ``op`` is the torch op (``aten::linalg_inv``), ``module_path`` where the module calls it
    (``model.encoder.layers.0.self_attn``; ``model`` is the exported module itself), ``module_type``
    that submodule's class name, ``opset`` the opset asked for. ``op`` is None where torch's error
    names none; ``module_path`` is ``model`` where a re-trace could not place the op deeper.
    """

    def __init__(self, message: str, *, op: str | None, module_path: str, module_type: str, opset: int):
        super().__init__(message)
        self.op, self.module_path, self.module_type, self.opset = op, module_path, module_type, opset
