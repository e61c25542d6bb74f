"""Flip bits in the weights a runtime ``Model`` computes with, and put them back."""

from __future__ import annotations

import numpy as np


class WeightMemory:
    """Flip bits in the weights a runtime ``Model`` computes with, and put them back.

    Numba: the kernels' arena, located with ``NumbaBackend.weight_locations``. ONNX Runtime: host
    copies of every weight initializer (for a protected bundle, the scrubber's own buffer) pushed
    with ``set_initializers``.
    """

    def __init__(self, model, scrubber=None):
        from closedloop.sdk.robust.faults import weight_tensors

        self.model = model
        inits = model.bundle.onnx(model.graph_name, model.variant).initializers
        self.inits = {k: v for k, v in weight_tensors(inits).items() if v.size > 1}
        self.numba = hasattr(model.backend, "weight_locations")
        if self.numba:
            self.arena, self.where = model.backend.weight_locations(sorted(self.inits))
            self.clean = self.arena.copy()
        else:
            views = dict(getattr(model.backend, "_overrides", {})) if scrubber is not None else {}
            self.host = {k: views.get(k, np.array(v, copy=True)) for k, v in self.inits.items()}
            self.clean = {k: np.array(v, copy=True) for k, v in self.host.items()}

    def apply(self, flips) -> int:
        if self.numba:
            words = self.arena.view(np.uint32)
            n = 0
            for f in flips:
                p = int(self.where[f.tensor].reshape(-1)[f.index])
                if p >= 0:
                    words[p] ^= np.uint32(1 << f.bit)
                    n += 1
            return n
        touched = set()
        for f in flips:
            a = self.host[f.tensor].reshape(-1)
            w = a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.itemsize])
            w[f.index] ^= w.dtype.type(1 << f.bit)
            touched.add(f.tensor)
        self.model.backend.set_initializers({k: self.host[k] for k in touched})
        return len(flips)

    def current(self) -> dict[str, np.ndarray]:
        """The weight initializers as the backend holds them now (ONNX shapes)."""
        if self.numba:
            return {k: self.arena[self.where[k]].reshape(v.shape) for k, v in self.inits.items()
                    if np.all(self.where[k] >= 0)}
        return dict(self.host)

    def restore(self) -> None:
        if self.numba:
            self.arena[:] = self.clean
            return
        for k, v in self.clean.items():
            self.host[k][...] = v
        self.model.backend.set_initializers(self.host)
