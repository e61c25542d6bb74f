"""Put an existing torch model into the protected (block-wise zero-sum) form.

The block layout is defined on the weights *as the exported ONNX graph stores them*,
because that is what the runtime checks. ``probe_onnx_layout`` finds, for every
parameter, which ONNX initializer holds it and in what element order: it exports a copy
whose parameters hold coded values (``c`` and, in a second export, ``2c + 7``), so an
initializer element that is a plain copy of parameter element ``c`` shows both codes;
anything the exporter computed (sums, scalings) does not. A parameter is protectable
when one initializer is an exact re-arrangement of it (GRU gate reordering and
transposed MatMul weights are; the GRU's concatenated bias pair is not).

``protect`` then registers a :class:`~closedloop.sdk.robust.projection.BlockZeroSum`
parametrization on each protected parameter with the blocks mapped back into its own
layout; fine-tune as usual; ``finalize`` bakes the projected values in (float64
projection, then float32) before export.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.utils import parametrize

from closedloop.runtime.onnx_reader import parse_onnx
from closedloop.runtime.protect.scrubber import block_positions, key_fingerprint

from .projection import BlockZeroSum, project_numpy


@dataclass
class ProtectedTensor:
    param: str  # qualified parameter name in the torch module
    onnx_name: str  # fp32 initializer name
    shape: list[int]  # ONNX shape
    to_param: np.ndarray  # ONNX flat index -> parameter flat index


@dataclass
class ProtectionPlan:
    """What ``protect`` did: block size, keying and the protected tensors (the key itself is not kept here)."""

    k: int
    window: int
    keyed: bool
    key_fingerprint: str | None
    tensors: list[ProtectedTensor]
    skipped: dict[str, str] = field(default_factory=dict)  # parameter -> why it is not protected
    kind: str = "recurrent"

    def summary(self, model: nn.Module) -> dict[str, Any]:
        n_all = sum(p.numel() for p in model.parameters())
        n_prot = sum(int(np.prod(t.shape)) for t in self.tensors)
        return {"k": self.k, "keyed": self.keyed, "protected_tensors": [t.onnx_name for t in self.tensors],
                "protected_weights": n_prot, "all_weights": n_all, "protected_fraction": n_prot / max(1, n_all),
                "skipped": dict(self.skipped)}


def _export_bytes(module: nn.Module, example_input: torch.Tensor, kind: str) -> bytes:
    from closedloop.export.onnx_export import export_onnx

    return export_onnx(module, example_input, kind=kind, report=lambda s: None).onnx_bytes


def probe_onnx_layout(module: nn.Module, example_input: torch.Tensor, kind: str,
                      include_bias: bool = False, min_numel: int = 64) -> tuple[list[ProtectedTensor], dict[str, str]]:
    """Which ONNX initializer stores each parameter, element by element (see the module docstring)."""
    params = dict(module.named_parameters())
    skipped: dict[str, str] = {}
    cand = {}
    start = 1
    for name, p in params.items():
        if p.dim() < 2 and not include_bias:
            skipped[name] = "bias/vector (not protected by default)"
        elif p.numel() < min_numel:
            skipped[name] = f"fewer than {min_numel} elements"
        else:
            cand[name] = (start, p.numel())
            start += p.numel()
    if 2 * start + 7 >= 1 << 24:
        raise ValueError(f"{start - 1} weights are too many for float32 probe codes")

    def probe(fn) -> dict[str, np.ndarray]:
        m = copy.deepcopy(module).eval()
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name in cand:
                    s, n = cand[name]
                    p.copy_(torch.as_tensor(fn(np.arange(s, s + n, dtype=np.float64)), dtype=p.dtype).reshape(p.shape))
        return parse_onnx(_export_bytes(m, example_input, kind)).initializers

    first, second = probe(lambda c: c), probe(lambda c: 2 * c + 7)
    owners = sorted(cand.items(), key=lambda kv: kv[1][0])
    starts = np.array([s for _, (s, _) in owners])
    found: dict[str, list[tuple[str, np.ndarray, list[int]]]] = {}
    for oname, a in first.items():
        if a.dtype != np.float32 or oname not in second:
            continue
        a64, b64 = a.reshape(-1).astype(np.float64), second[oname].reshape(-1).astype(np.float64)
        ok = (a64 >= 1) & (a64 < start) & (a64 == np.round(a64)) & (b64 == 2 * a64 + 7)
        if not ok.all():
            continue
        codes = a64.astype(np.int64)
        owner = np.searchsorted(starts, codes, side="right") - 1
        if np.any(owner != owner[0]):
            continue  # mixes several parameters (e.g. the GRU's bias pair)
        pname, (s, n) = owners[int(owner[0])]
        local = codes - s
        if local.size != n or np.unique(local).size != n:
            continue
        found.setdefault(pname, []).append((oname, local, list(a.shape)))
    tensors = []
    for name in cand:
        hits = found.get(name, [])
        if len(hits) != 1:
            skipped[name] = "not stored as one re-arranged initializer" if not hits else "stored twice in the graph"
            continue
        oname, local, shape = hits[0]
        tensors.append(ProtectedTensor(name, oname, shape, local))
    return tensors, skipped


def _param_blocks(t: ProtectedTensor, k: int, key: bytes | None, window: int) -> np.ndarray:
    pos = block_positions(int(np.prod(t.shape)), k, key, t.onnx_name, window)
    return np.where(pos >= 0, t.to_param[np.maximum(pos, 0)], -1)


def _owner(model: nn.Module, qualified: str) -> tuple[nn.Module, str]:
    mod_name, _, attr = qualified.rpartition(".")
    return (model.get_submodule(mod_name) if mod_name else model), attr


def protect(model: nn.Module, example_input: torch.Tensor, *, kind: str = "recurrent", k: int = 16,
            key: bytes | None = None, window: int = 4096, include_bias: bool = False,
            min_numel: int = 64) -> ProtectionPlan:
    """Register the block-wise zero-sum parametrization on ``model``'s weights (in place); return the plan.

    Parameters
    ----------
    example_input
        One input batch as for ``closedloop.export.export_bundle`` (a single step for recurrent models).
    k
        Block size: two constraints per block, so ``2/k`` of the weights' freedom is given up.
    key
        Secret bytes for keyed block membership (``None``: contiguous blocks). Keep it out of the
        bundle; the runtime needs it to scrub (``--weights-key-file``).
    include_bias
        Also try to protect 1-D parameters (only those stored as their own initializer can be).
    """
    if k < 4:
        raise ValueError(f"block size k={k} must be at least 4")
    tensors, skipped = probe_onnx_layout(model, example_input, kind, include_bias, min_numel)
    for t in tensors:
        owner, attr = _owner(model, t.param)
        parametrize.register_parametrization(owner, attr, BlockZeroSum(_param_blocks(t, k, key, window)))
    return ProtectionPlan(k, window, key is not None, key_fingerprint(key) if key is not None else None,
                          tensors, skipped, kind)


def finalize(model: nn.Module, plan: ProtectionPlan, key: bytes | None = None) -> nn.Module:
    """Remove the parametrizations and store the projected weights (projected in float64, rounded once)."""
    if plan.keyed and (key is None or key_fingerprint(key) != plan.key_fingerprint):
        raise ValueError("finalize needs the key the plan was made with")
    for t in plan.tensors:
        owner, attr = _owner(model, t.param)
        if parametrize.is_parametrized(owner, attr):
            parametrize.remove_parametrizations(owner, attr, leave_parametrized=True)
        p = getattr(owner, attr)
        with torch.no_grad():
            w = project_numpy(p.detach().cpu().numpy(), _param_blocks(t, plan.k, key, plan.window))
            p.copy_(torch.as_tensor(w, dtype=p.dtype))
    return model
