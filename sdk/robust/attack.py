"""Targeted bit flips: a progressive bit search in the style of the Bit-Flip Attack.

Rakin, He, Fan, "Bit-Flip Attack: Crushing Neural Network with Progressive Bit Search"
(ICCV 2019): per iteration, rank every single-bit flip of the stored weights by the
first-order loss increase ``grad . delta``, evaluate the best few exactly, commit the
one that raises the loss most, repeat. The loss here is the deployed model's
disagreement with its own clean outputs (NLL of the clean arg-max for log-probability
outputs, squared error otherwise) on the given inputs, so any bundle can be attacked
without labels. Gradients come from running the bundle's ONNX graph in torch
(``_OnnxTorch``, a small interpreter for the ops our exporters emit).

``adaptive=True`` is the attacker who knows the scheme (block size ``k``, the two
constraints) but not the key: it only commits sets of three int8 flips
``(+d, -2d, +d)`` at members ``a, a+s, a+2s`` of one *unkeyed* block, which keep both
block sums exactly zero, so an unkeyed protected model cannot see them. Under a keyed
layout the same sets land in different blocks and are caught.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from closedloop.runtime.onnx_reader import OnnxModel

from .faults import BitFlip, weight_tensors

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _gru(x, w, r, b, h0, attrs):
    hidden = int(attrs["hidden_size"])
    if b is None:
        b = torch.zeros(1, 6 * hidden, dtype=x.dtype)
    h = h0[0]
    ys = []
    wz, wr, wh = w[0].split(hidden)
    rz, rr, rh = r[0].split(hidden)
    bwz, bwr, bwh, brz, brr, brh = b[0].split(hidden)
    for t in range(x.shape[0]):
        z = torch.sigmoid(x[t] @ wz.T + bwz + h @ rz.T + brz)
        rg = torch.sigmoid(x[t] @ wr.T + bwr + h @ rr.T + brr)
        n = torch.tanh(x[t] @ wh.T + bwh + rg * (h @ rh.T + brh))
        h = (1 - z) * n + z * h
        ys.append(h)
    return torch.stack(ys).unsqueeze(1), h.unsqueeze(0)


def _axes(node, ins, i=1):
    if len(ins) > i and ins[i] is not None:
        return [int(a) for a in ins[i].reshape(-1).tolist()]
    return node.attributes.get("axes")


def _unsqueeze(node, ins):
    x = ins[0]
    for a in sorted(_axes(node, ins)):
        x = x.unsqueeze(a if a >= 0 else a + x.dim() + 1)
    return x


def _squeeze(node, ins):
    axes = _axes(node, ins)
    x = ins[0]
    if axes is None:
        return x.squeeze()
    for a in sorted((a if a >= 0 else a + x.dim() for a in axes), reverse=True):
        x = x.squeeze(a)
    return x


def _gemm(node, ins):
    a, b = ins[0], ins[1]
    at = node.attributes
    a = a.T if at.get("transA", 0) else a
    b = b.T if at.get("transB", 0) else b
    y = at.get("alpha", 1.0) * (a @ b)
    return y + at.get("beta", 1.0) * ins[2] if len(ins) > 2 and ins[2] is not None else y


def _slice(node, ins):
    x = ins[0]
    starts, ends = ins[1].tolist(), ins[2].tolist()
    axes = ins[3].tolist() if len(ins) > 3 and ins[3] is not None else list(range(len(starts)))
    steps = ins[4].tolist() if len(ins) > 4 and ins[4] is not None else [1] * len(starts)
    idx = [slice(None)] * x.dim()
    for s, e, a, st in zip(starts, ends, axes, steps, strict=True):
        n = x.shape[a]
        idx[a] = slice(max(min(int(s), n), -n), max(min(int(e), n), -n - 1), int(st))
    return x[tuple(idx)]


_OPS = {
    "Identity": lambda n, i: i[0], "Dropout": lambda n, i: i[0],
    "Cast": lambda n, i: i[0] if i[0].is_floating_point() else i[0].to(torch.float32),
    "Unsqueeze": _unsqueeze, "Squeeze": _squeeze,
    "Transpose": lambda n, i: i[0].permute(*n.attributes.get("perm", list(range(i[0].dim()))[::-1])),
    "Reshape": lambda n, i: i[0].reshape([int(d) if d != 0 else i[0].shape[k] for k, d in enumerate(i[1].tolist())]),
    "Gather": lambda n, i: torch.index_select(i[0], n.attributes.get("axis", 0), i[1].reshape(-1).long()).reshape(
        i[0].shape[: n.attributes.get("axis", 0)] + i[1].shape + i[0].shape[n.attributes.get("axis", 0) + 1:]),
    "Gemm": _gemm, "MatMul": lambda n, i: i[0] @ i[1], "Add": lambda n, i: i[0] + i[1],
    "Sub": lambda n, i: i[0] - i[1], "Mul": lambda n, i: i[0] * i[1], "Div": lambda n, i: i[0] / i[1],
    "Neg": lambda n, i: -i[0], "Relu": lambda n, i: torch.relu(i[0]), "Tanh": lambda n, i: torch.tanh(i[0]),
    "Sigmoid": lambda n, i: torch.sigmoid(i[0]),
    "LogSoftmax": lambda n, i: torch.log_softmax(i[0], n.attributes.get("axis", -1)),
    "Softmax": lambda n, i: torch.softmax(i[0], n.attributes.get("axis", -1)),
    "Concat": lambda n, i: torch.cat(i, n.attributes["axis"]), "Slice": _slice,
    "DequantizeLinear": lambda n, i: (i[0] - (i[2] if len(i) > 2 else 0)) * i[1],
}


class _OnnxTorch:
    """Runs an ONNX graph in torch with some initializers as differentiable leaves."""

    def __init__(self, model: OnnxModel):
        self.model = model
        self.consts = {k: torch.as_tensor(np.asarray(v, dtype=np.float32 if v.dtype.kind in "fi" and v.dtype != np.int64
                                                     else v.dtype)) for k, v in model.initializers.items()}

    def run(self, feeds: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        env = dict(self.consts) | params | feeds
        for node in self.model.nodes:
            if node.op_type == "Constant":
                env[node.outputs[0]] = self.consts[node.outputs[0]]
                continue
            ins = [env[i] if i else None for i in node.inputs]
            if node.op_type == "GRU":
                outs = _gru(ins[0], ins[1], ins[2], ins[3] if len(ins) > 3 else None, ins[5], node.attributes)
                for name, v in zip(node.outputs, outs, strict=False):
                    if name:
                        env[name] = v
                continue
            if node.op_type not in _OPS:
                raise ValueError(f"the attack's ONNX interpreter has no op {node.op_type!r}")
            env[node.outputs[0]] = _OPS[node.op_type](node, ins)
        return env


@dataclass
class AttackConfig:
    flips: int = 10
    seed: int = 0
    candidates: int = 8  # exact loss evaluations per iteration
    adaptive: bool = False
    k: int | None = None  # block size the adaptive attacker assumes (default: the bundle's)
    batch: int = 4
    steps: int = 48


@dataclass
class AttackResult:
    flips: list[BitFlip]
    losses: list[float] = field(default_factory=list)


def _flip_values(v: np.ndarray) -> np.ndarray:
    """``(n, bits)`` values of each element with each single bit flipped."""
    width = v.itemsize * 8
    u = v.reshape(-1).view(_UINT[v.itemsize])
    masks = (np.ones(1, u.dtype) << np.arange(width, dtype=u.dtype))
    return (u[:, None] ^ masks[None, :]).view(v.dtype).astype(np.float64)


class _Attack:
    def __init__(self, bundle, variant, cfg: AttackConfig, data):
        self.spec = bundle.graph("main")
        self.net = _OnnxTorch(bundle.onnx("main", variant))
        values = {k: np.array(v, copy=True) for k, v in weight_tensors(bundle.onnx("main", variant).initializers).items()
                  if v.size > 1}
        # An int8 graph is attacked in its int8 weights, as the Bit-Flip Attack does.
        ints = {k: v for k, v in values.items() if v.dtype == np.int8}
        self.values = ints or values
        rng = np.random.default_rng(cfg.seed)
        x = self.spec.data_inputs[0]
        feat = [int(d) for d in x.shape[1:]]
        if data is None:
            shape = (cfg.batch, cfg.steps, *feat) if self.spec.kind == "recurrent" else (cfg.batch * cfg.steps, *feat)
            data = np.cumsum(rng.standard_normal(shape) * 0.3, axis=1 if self.spec.kind == "recurrent" else 0)
        self.data = torch.as_tensor(np.asarray(data, dtype=np.float32))
        with torch.no_grad():
            self.ref = self._forward({})
        self.logprob = bool(torch.all(self.ref <= 1e-4)) and bool(torch.allclose(self.ref.exp().sum(-1),
                                                                             torch.ones(1), atol=1e-3))
        self.target = self.ref.argmax(-1)
        self.scale = self.ref.var().clamp(min=1e-12)

    def _forward(self, params) -> torch.Tensor:
        xname = self.spec.data_inputs[0].name
        yname = self.spec.data_outputs[0].name
        if self.spec.kind != "recurrent":
            return self.net.run({xname: self.data}, params)[yname]
        b = self.data.shape[0]
        state = {t.name: torch.zeros([b if isinstance(d, str) else d for d in t.shape]) for t in self.spec.state_inputs}
        ys = []
        for t in range(self.data.shape[1]):
            env = self.net.run({xname: self.data[:, t], **state}, params)
            ys.append(env[yname])
            state = {s.name: env[s.state_pair] for s in self.spec.state_inputs}
        return torch.stack(ys, 1)

    def loss(self, params) -> torch.Tensor:
        y = self._forward(params)
        if self.logprob:
            return torch.nn.functional.nll_loss(y.reshape(-1, y.shape[-1]), self.target.reshape(-1))
        return ((y - self.ref) ** 2).mean() / self.scale

    def exact(self, changes: dict[str, np.ndarray]) -> float:
        params = {k: torch.as_tensor(v.astype(np.float32)) for k, v in changes.items()}
        with torch.no_grad():
            v = float(self.loss(params))
        return v if np.isfinite(v) else 1e30

    def gradients(self) -> dict[str, np.ndarray]:
        params = {k: torch.tensor(v.astype(np.float32), requires_grad=True) for k, v in self.values.items()}
        self.loss(params).backward()
        return {k: (p.grad.numpy().astype(np.float64) if p.grad is not None else np.zeros(p.shape)) for k, p in
                params.items()}


def _single_candidates(att: _Attack, grads, n: int) -> list[list[BitFlip]]:
    scored = []
    for name, v in att.values.items():
        with np.errstate(all="ignore"):
            delta = _flip_values(v) - v.reshape(-1, 1).astype(np.float64)
            gain = grads[name].reshape(-1, 1) * delta
        gain[~np.isfinite(gain)] = -np.inf
        flat = np.argsort(gain, axis=None)[-n:]
        for f in flat:
            i, b = divmod(int(f), gain.shape[1])
            scored.append((gain[i, b], [BitFlip(name, i, b)]))
    scored.sort(key=lambda s: -s[0])
    return [s[1] for s in scored[:n]]


def _triple_candidates(att: _Attack, grads, n: int, k: int) -> list[list[BitFlip]]:
    """Sets (+d, -2d, +d) at members a, a+s, a+2s of contiguous blocks of int8 tensors (both sums kept)."""
    scored = []
    for name, v in att.values.items():
        if v.dtype != np.int8 or v.size < k:
            continue
        nb = v.size // k
        q = v.reshape(-1)[: nb * k].astype(np.int64).reshape(nb, k) & 0xFF
        g = grads[name].reshape(-1)[: nb * k].reshape(nb, k)
        for s in range(1, (k - 1) // 2 + 1):
            for a in range(k - 2 * s):
                m, c = a + s, a + 2 * s
                for b in range(6):
                    for sign in (1, -1):
                        # sign=+1: bit b clear at a and c (flip adds 2^b), bit b+1 set at m (flip subtracts 2^(b+1))
                        want = 0 if sign > 0 else 1
                        ok = (((q[:, a] >> b) & 1) == want) & (((q[:, m] >> (b + 1)) & 1) == 1 - want) & \
                             (((q[:, c] >> b) & 1) == want)
                        gain = np.where(ok, sign * (1 << b) * (g[:, a] - 2 * g[:, m] + g[:, c]), -np.inf)
                        blk = int(np.argmax(gain))
                        if np.isfinite(gain[blk]):
                            base = blk * k
                            scored.append((gain[blk], [BitFlip(name, base + a, b), BitFlip(name, base + m, b + 1),
                                                       BitFlip(name, base + c, b)]))
    scored.sort(key=lambda s: -s[0])
    return [s[1] for s in scored[:n]]


def bit_flip_attack(bundle, variant: str | None, cfg: AttackConfig, data: np.ndarray | None = None,
                    report=print, checkpoints: list[int] | None = None, on_checkpoint=None) -> AttackResult:
    """Progressive bit search on the bundle's stored weights of ``variant``; returns the flips in order."""
    torch.manual_seed(cfg.seed)
    att = _Attack(bundle, variant, cfg, data)
    robust = bundle.manifest.extra.get("robust", {})
    k = cfg.k or int(robust.get("k", 16))
    result = AttackResult([], [float(att.exact({}))])
    while len(result.flips) < cfg.flips:
        grads = att.gradients()
        if cfg.adaptive:
            cands = _triple_candidates(att, grads, cfg.candidates, k)
            cands = [c for c in cands if len(result.flips) + len(c) <= cfg.flips]
        else:
            cands = _single_candidates(att, grads, cfg.candidates)
        if not cands:
            break
        best, best_loss = None, -np.inf
        for cand in cands:
            changes = {}
            for f in cand:
                arr = changes.setdefault(f.tensor, att.values[f.tensor].copy()).reshape(-1)
                words = arr.view(_UINT[arr.itemsize])
                words[f.index] ^= words.dtype.type(1) << words.dtype.type(f.bit)
            loss = att.exact(changes)
            if loss > best_loss:
                best, best_loss, best_changes = cand, loss, changes
        att.values.update(best_changes)
        result.flips += best
        result.losses.append(best_loss)
        report(f"flip {len(result.flips)}: loss {best_loss:.4g} ({', '.join(f'{f.tensor}[{f.index}] bit {f.bit}' for f in best)})")
        if on_checkpoint is not None and checkpoints and len(result.flips) in checkpoints:
            on_checkpoint(list(result.flips))
    return result
