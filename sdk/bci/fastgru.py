"""A GRU with its own backward pass through time, for training on CPU, and for many weight sets at once.

PyTorch's ``nn.GRU`` on CPU records every time step's operations for autograd, so its
backward computes the recurrent weight gradient as one small product per step. Here
the backward pass runs the recurrence for the state gradient only and forms the
weight gradients with one matrix product over all steps (and, for a frozen GRU, none).
Speed on the benchmark's 1 x 128 GRU and one core: ``bench/bench_bci_gru.py``
(``bench/results/bci_gru/``).

The recurrence itself (forward over time, and the state gradient back over time) runs
as two Numba kernels, one compiled loop over every step each, for float32 and float64
on CPU: in torch each step is five to seven small operations, and on a CPU their
dispatch costs more than their arithmetic (155 us per step for a batch of 16, of which the
16 x 128 by 128 x 384 product is about 40 us). The step's product is a small blocked loop
of our own (:func:`_matmul_nt`), not a BLAS call: for 2 rows SciPy's OpenBLAS called from
Numba takes 48 us, the loop 8 us. The weight gradients stay one torch product over all steps.
``use_compiled = False`` runs the torch loop instead (other dtypes and devices always do, and so
do large step products when torch has more than one thread: :data:`COMPILED_MAX_STEP_MACS`).

The same code runs a *stack* of GRUs, each with its own weights (a leading task axis
on every weight and on the input), as one batch: that is how the fine-tuning
baseline fits its cross-validation folds at once (:func:`stacked_backbone`; about 4x
over nine ``nn.GRU`` fits one after another).

The equations are ``nn.GRU``'s (gate order r, z, n in the weight rows)::

    r = sigmoid(W_ir x + b_ir + W_hr h + b_hr)
    z = sigmoid(W_iz x + b_iz + W_hz h + b_hz)
    n = tanh(W_in x + b_in + r * (W_hn h + b_hn))
    h' = (1 - z) * n + z * h

``tests/sdk/test_bci_fastgru.py`` checks outputs, final states and every gradient
against ``nn.GRU`` (relative tolerance 1e-5). The backward pass is first order only
(differentiating it raises): :class:`~closedloop.sdk.bci.models.GRUBackbone` takes this path when a
first-order gradient flows through it on CPU (its weights or its input are trained) and
``nn.GRU`` inside :func:`twice_differentiable`, which second-order meta-learning opens.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator

import numba
import numpy as np
import torch
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

_LAYER_WEIGHTS = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")  # nn.GRU's names, suffixed _l{layer}
_TWICE = contextvars.ContextVar("closedloop_bci_twice_differentiable", default=False)


@contextlib.contextmanager
def twice_differentiable() -> Iterator[None]:
    """Inside this block :class:`~closedloop.sdk.bci.models.GRUBackbone` runs ``nn.GRU``, whose backward can be differentiated.

    Second-order meta-learning builds its inner-loop gradients in one; without it, differentiating
    them raises (this module's backward is first order only).
    """
    token = _TWICE.set(True)
    try:
        yield
    finally:
        _TWICE.reset(token)


def in_twice_differentiable() -> bool:
    return _TWICE.get()


def _addmm(input: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``input + a @ b`` for one weight set (``b`` 2-D) or a stack of them (3-D, batched), into ``out`` if given."""
    return torch.addmm(input, a, b, out=out) if b.dim() == 2 else torch.baddbmm(input, a, b, out=out)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``F.linear`` for one weight set, or per task for a stack: (n, B, T, C) with (n, out, C) and (n, out)."""
    if weight.dim() == 2:
        return F.linear(x, weight, bias)
    return (x.flatten(1, 2) @ weight.transpose(-1, -2) + bias.unsqueeze(-2)).view(*x.shape[:-1], -1)


def _layers(lookup, n_layers: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(W_ih, W_hh, b_ih, b_hh)`` per layer, ``lookup(name)`` giving the tensor of ``nn.GRU``'s ``name``."""
    return [tuple(lookup(f"{k}_l{i}") for k in _LAYER_WEIGHTS) for i in range(n_layers)]


#: Leave exp free to overflow to inf (no ``nnan``/``ninf``): 1 / (1 + inf) is the sigmoid's 0, as it should be.
#: ``reassoc`` lets the products' sums over k run in vector lanes.
_FASTMATH = {"contract", "arcp", "reassoc"}


@numba.njit(cache=True, fastmath=_FASTMATH)
def _matmul_nt(a, w, out, zero):  # pragma: no cover - compiled
    """``out = a @ w.T`` for ``a`` (B, K) and ``w`` (J, K), four rows of ``a`` by two of ``w`` at a time.

    The step products are small (B = 2 to 16 rows): a BLAS call costs more than the product
    itself there (SciPy's OpenBLAS from Numba: about 48 us for 2 x 128 by 128 x 384, this loop 8 us).
    """
    n_rows, n_k = a.shape
    n_cols = w.shape[0]
    i = 0
    while i + 4 <= n_rows:
        a0, a1, a2, a3 = a[i], a[i + 1], a[i + 2], a[i + 3]
        j = 0
        while j + 2 <= n_cols:
            w0, w1 = w[j], w[j + 1]
            s0 = s1 = s2 = s3 = t0 = t1 = t2 = t3 = zero
            for k in range(n_k):
                x, y = w0[k], w1[k]
                s0 += a0[k] * x
                s1 += a1[k] * x
                s2 += a2[k] * x
                s3 += a3[k] * x
                t0 += a0[k] * y
                t1 += a1[k] * y
                t2 += a2[k] * y
                t3 += a3[k] * y
            out[i, j], out[i + 1, j], out[i + 2, j], out[i + 3, j] = s0, s1, s2, s3
            out[i, j + 1], out[i + 1, j + 1], out[i + 2, j + 1], out[i + 3, j + 1] = t0, t1, t2, t3
            j += 2
        if j < n_cols:
            w0 = w[j]
            s0 = s1 = s2 = s3 = zero
            for k in range(n_k):
                x = w0[k]
                s0 += a0[k] * x
                s1 += a1[k] * x
                s2 += a2[k] * x
                s3 += a3[k] * x
            out[i, j], out[i + 1, j], out[i + 2, j], out[i + 3, j] = s0, s1, s2, s3
        i += 4
    for row in range(i, n_rows):
        ai = a[row]
        for j in range(n_cols):
            wj = w[j]
            acc = zero
            for k in range(n_k):
                acc += ai[k] * wj[k]
            out[row, j] = acc


@numba.njit(cache=True, fastmath=_FASTMATH)
def _forward_kernel(gi, whh, bhh, states, rz, new, hn, one):  # pragma: no cover - compiled
    """The recurrence over every step and weight set, in one compiled loop (see :class:`_GRURecurrence`).

    ``gi`` (S, B, T, 3H) the input gates, ``whh`` (S, 3H, H), ``bhh`` (S, 3H); writes ``states``
    (T + 1, S, B, H, row 0 given), ``rz`` (T, S, B, 2H), ``new`` (T, S, B, H) and ``hn`` (T, S, B, H:
    W_hn h + b_hn). ``one`` is 1 in the arrays' dtype, so that no step is computed in float64.
    """
    n_steps, n_sets, batch, n_hidden = new.shape
    zero, two = one - one, one + one
    gh = np.empty((batch, 3 * n_hidden), dtype=gi.dtype)
    for t in range(n_steps):
        for s in range(n_sets):
            _matmul_nt(states[t, s], whh[s], gh, zero)
            for b in range(batch):
                for j in range(n_hidden):
                    r = one / (one + math.exp(-(gi[s, b, t, j] + bhh[s, j] + gh[b, j])))
                    z = one / (one + math.exp(-(gi[s, b, t, n_hidden + j] + bhh[s, n_hidden + j]
                                                + gh[b, n_hidden + j])))
                    h_n = gh[b, 2 * n_hidden + j] + bhh[s, 2 * n_hidden + j]
                    x = gi[s, b, t, 2 * n_hidden + j] + r * h_n
                    n = two / (one + math.exp(-two * x)) - one  # tanh(x), in a form that vectorises
                    rz[t, s, b, j] = r
                    rz[t, s, b, n_hidden + j] = z
                    new[t, s, b, j] = n
                    hn[t, s, b, j] = h_n
                    states[t + 1, s, b, j] = n + z * (states[t, s, b, j] - n)


@numba.njit(cache=True, fastmath=_FASTMATH)
def _backward_kernel(d_out, whh_t, states, rz, new, hn, d_gi, d_gh, dh, one):  # pragma: no cover - compiled
    """The state gradient back through every step, in one compiled loop.

    ``d_out`` (S, B, T, H) the gradient on every output state, ``whh_t`` (S, H, 3H); ``dh`` (S, B, H)
    holds the gradient on the last state and ends with the one on ``h_0``. Writes the gradient of
    the input gates ``d_gi`` (S, B, T, 3H) and of each step's ``W_h h + b_h``, ``d_gh`` (T, S, B, 3H).
    """
    n_steps, n_sets, batch, n_hidden = new.shape
    zero = one - one
    carry = np.empty((batch, n_hidden), dtype=d_out.dtype)
    for t in range(n_steps - 1, -1, -1):
        for s in range(n_sets):
            g = d_gh[t, s]
            for b in range(batch):
                for j in range(n_hidden):
                    d = dh[s, b, j] + d_out[s, b, t, j]
                    r, z, n = rz[t, s, b, j], rz[t, s, b, n_hidden + j], new[t, s, b, j]
                    d_n = d * (one - z) * (one - n * n)
                    d_r = d_n * hn[t, s, b, j] * r * (one - r)
                    d_z = d * (states[t, s, b, j] - n) * z * (one - z)
                    d_gi[s, b, t, j] = d_r
                    d_gi[s, b, t, n_hidden + j] = d_z
                    d_gi[s, b, t, 2 * n_hidden + j] = d_n
                    g[b, j] = d_r
                    g[b, n_hidden + j] = d_z
                    g[b, 2 * n_hidden + j] = d_n * r
                    carry[b, j] = d * z
            dh_s = dh[s]
            _matmul_nt(g, whh_t[s], dh_s, zero)
            for b in range(batch):
                for j in range(n_hidden):
                    dh_s[b, j] += carry[b, j]


class _GRURecurrence(torch.autograd.Function):
    """The recurrence of one GRU layer over time, given the input gates ``W_i x + b_i``.

    Shapes (``...`` is empty, or the task axis of a stack): ``gi`` (..., B, T, 3H),
    ``whh`` (..., 3H, H), ``bhh`` (..., 3H), ``h0`` (..., B, H). Returns every step's
    state (..., B, T, H) and the last one (..., B, H). Inside, time is the leading axis
    of every buffer, so each step writes contiguous slices.
    """

    @staticmethod
    def forward(ctx, gi, whh, bhh, h0):
        ctx.compiled = use_compiled and _compilable(gi, whh, bhh, h0)
        if ctx.compiled:
            return _compiled_forward(ctx, gi, whh, bhh, h0)
        n_hidden, n_steps = whh.shape[-1], gi.shape[-2]
        whh_t = whh.transpose(-1, -2)
        bias = bhh if whh.dim() == 2 else bhh.unsqueeze(-2)
        # what each step's product is added to, time-major: (W_i x + b_i + b_h) for r and z, b_hn for n
        gi_t = gi.movedim(-2, 0)
        pre = gi.new_empty(n_steps, *h0.shape[:-1], 3 * n_hidden)
        torch.add(gi_t[..., : 2 * n_hidden], bias[..., : 2 * n_hidden], out=pre[..., : 2 * n_hidden])
        pre[..., 2 * n_hidden:] = bias[..., 2 * n_hidden:]
        gi_n = gi_t[..., 2 * n_hidden:]
        states = gi.new_empty(n_steps + 1, *h0.shape)  # h_0 .. h_T
        rz = gi.new_empty(n_steps, *h0.shape[:-1], 2 * n_hidden)  # the gates r and z
        new = gi.new_empty(n_steps, *h0.shape)  # the candidate state n
        gh = torch.empty_like(pre)  # each step's W_h h + b_h (the n block is kept for the backward pass)
        states[0] = h0
        # one unbind per buffer instead of an index per step: each step's slices are ready-made views
        h_t, rz_t, new_t, pre_t, gi_n_t, gh_t = (v.unbind(0) for v in (states, rz, new, pre, gi_n, gh))
        r_t, z_t = rz[..., :n_hidden].unbind(0), rz[..., n_hidden:].unbind(0)
        ghrz_t, hn_t = gh[..., : 2 * n_hidden].unbind(0), gh[..., 2 * n_hidden:].unbind(0)
        for t in range(n_steps):
            _addmm(pre_t[t], h_t[t], whh_t, out=gh_t[t])
            torch.sigmoid(ghrz_t[t], out=rz_t[t])
            torch.tanh(torch.addcmul(gi_n_t[t], r_t[t], hn_t[t]), out=new_t[t])
            torch.lerp(new_t[t], h_t[t], z_t[t], out=h_t[t + 1])
        ctx.save_for_backward(whh)
        ctx.steps = (states, rz, new, gh[..., 2 * n_hidden:])
        return states[1:].movedim(0, -2).contiguous(), states[-1].clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out, d_last):
        if ctx.compiled:
            return _compiled_backward(ctx, d_out, d_last)
        (whh,) = ctx.saved_tensors
        states, rz, n, hn = ctx.steps
        del ctx.steps
        n_hidden = whh.shape[-1]
        # With dh the gradient reaching h_t, the pre-activation gradients are d_n = dh * a,
        # d_z = dh * b and d_r = d_n * c; the hidden gates get (d_r, d_z, d_n * r) = dh * k.
        # a, b, c and k are computed for all steps at once.
        r, z, h_prev = rz[..., :n_hidden], rz[..., n_hidden:], states[:-1]
        # k is (T, ..., B, 3, H): the gates' blocks on their own axis, so dh broadcasts over them
        k = n.new_empty(*n.shape[:-1], 3, n_hidden)
        a = torch.mul(n, n).neg_().add_(1).mul_(1 - z)  # (1 - z)(1 - n^2)
        torch.mul(a, hn, out=k[..., 0, :]).mul_(r).mul_(1 - r)
        torch.sub(h_prev, n, out=k[..., 1, :]).mul_(z).mul_(1 - z)
        torch.mul(a, r, out=k[..., 2, :])
        d_outs = d_out.unbind(-2)
        dh_all = torch.empty_like(n)  # the gradient reaching each h_t
        dh_t, k_t, z_t = dh_all.unbind(0), k.unbind(0), z.unbind(0)
        dh = d_last  # autograd passes zeros for an output that was not used
        for t in range(n.shape[0] - 1, -1, -1):
            dh = torch.add(dh, d_outs[t], out=dh_t[t])
            d_gh = (dh.unsqueeze(-2) * k_t[t]).flatten(-2)
            dh = _addmm(dh * z_t[t], d_gh, whh)
        # the loop's d_gh again, for all steps at once (cheaper than keeping each step's)
        d_gh = k.mul_(dh_all.unsqueeze(-2)).flatten(-2)  # (T, ..., B, 3H)
        d_gi = torch.cat((d_gh[..., : 2 * n_hidden], dh_all.mul_(a)), -1).movedim(0, -2)  # input gates: (r, z, n)
        if not (ctx.needs_input_grad[1] or ctx.needs_input_grad[2]):  # a frozen GRU: the input's gradient only
            return d_gi, None, None, dh
        # weight gradients: one product over every step (and batch row) per weight set, read from the
        # time-major buffers as they are for one weight set; a stack's task axis must lead, which takes a copy
        if whh.dim() == 2:
            g, h_prev = d_gh.flatten(0, -2), h_prev.flatten(0, -2)  # (T * B, 3H), (T * B, H): views
        else:
            g = d_gh.movedim(0, -2).flatten(-3, -2)  # (n, B * T, 3H)
            h_prev = h_prev.movedim(0, -2).flatten(-3, -2)  # (n, B * T, H)
        return d_gi, g.transpose(-1, -2) @ h_prev, g.sum(-2), dh


#: run the recurrence through the compiled kernels where they apply (False: the torch loop, to compare)
use_compiled = True


#: Above this many multiply-adds per step (sets x batch x 3H x H) and with more than one torch thread, the
#: torch loop runs: its per-step product is MKL's, which uses the threads, and the kernels use one.
#: On 2 threads (``bench_bci_gru``'s shapes, T = 500): 16 x 128 (0.8M) compiled 1.52x faster;
#: 16 x 256 (3.1M) 1.01x; 64 x 128 (3.1M) 0.92x; 16 x 512 (12.6M) 0.83x. On one thread it is faster at all.
COMPILED_MAX_STEP_MACS = 1 << 20


def _compilable(gi: torch.Tensor, whh: torch.Tensor, bhh: torch.Tensor, h0: torch.Tensor) -> bool:
    dtype = gi.dtype
    if dtype not in (torch.float32, torch.float64) or any(t.device.type != "cpu" or t.dtype != dtype
                                                           for t in (gi, whh, bhh, h0)):
        return False
    return torch.get_num_threads() == 1 or h0.numel() * whh.shape[-2] <= COMPILED_MAX_STEP_MACS


def _compiled_forward(ctx, gi, whh, bhh, h0):
    """:class:`_GRURecurrence`'s forward through :func:`_forward_kernel`, on (sets, ...) views of the inputs."""
    n_hidden = whh.shape[-1]
    gi_s = gi.detach().reshape(-1, *gi.shape[-3:]).contiguous()  # (S, B, T, 3H)
    n_sets, batch, n_steps, _ = gi_s.shape
    whh_s = whh.detach().reshape(n_sets, 3 * n_hidden, n_hidden).contiguous()
    bhh_s = bhh.detach().reshape(n_sets, 3 * n_hidden).contiguous()
    states = gi.new_empty(n_steps + 1, n_sets, batch, n_hidden)  # h_0 .. h_T
    states[0] = h0.detach().reshape(n_sets, batch, n_hidden)
    rz = gi.new_empty(n_steps, n_sets, batch, 2 * n_hidden)
    new, hn = gi.new_empty(n_steps, n_sets, batch, n_hidden), gi.new_empty(n_steps, n_sets, batch, n_hidden)
    arrays = [v.numpy() for v in (gi_s, whh_s, bhh_s, states, rz, new, hn)]
    _forward_kernel(*arrays, arrays[0].dtype.type(1))
    ctx.save_for_backward(whh)
    ctx.steps, ctx.gi_shape, ctx.h0_shape, ctx.bhh_shape = (states, rz, new, hn), gi.shape, h0.shape, bhh.shape
    out = states[1:].permute(1, 2, 0, 3).contiguous()  # (S, B, T, H)
    return out.view(*gi.shape[:-1], n_hidden), states[-1].reshape(h0.shape).clone()


def _compiled_backward(ctx, d_out, d_last):
    (whh,) = ctx.saved_tensors
    states, rz, new, hn = ctx.steps
    del ctx.steps
    n_steps, (n_sets, batch, n_hidden) = new.shape[0], states.shape[1:]
    d_out_s = d_out.reshape(n_sets, batch, n_steps, n_hidden).contiguous()
    dh = d_last.reshape(n_sets, batch, n_hidden).clone(memory_format=torch.contiguous_format)
    whh_t = whh.detach().reshape(n_sets, 3 * n_hidden, n_hidden).transpose(1, 2).contiguous()
    d_gi = d_out.new_empty(n_sets, batch, n_steps, 3 * n_hidden)
    d_gh = d_out.new_empty(n_steps, n_sets, batch, 3 * n_hidden)
    arrays = [v.numpy() for v in (d_out_s, whh_t, states, rz, new, hn, d_gi, d_gh, dh)]
    _backward_kernel(*arrays, arrays[0].dtype.type(1))
    d_gi, d_h0 = d_gi.view(ctx.gi_shape), dh.view(ctx.h0_shape)
    if not (ctx.needs_input_grad[1] or ctx.needs_input_grad[2]):
        return d_gi, None, None, d_h0
    # weight gradients: one product over every step and batch row per weight set (torch's BLAS)
    g = d_gh.permute(1, 0, 2, 3).reshape(n_sets, n_steps * batch, 3 * n_hidden)
    h_prev = states[:-1].permute(1, 0, 2, 3).reshape(n_sets, n_steps * batch, n_hidden)
    d_whh, d_bhh = g.transpose(1, 2) @ h_prev, g.sum(1)
    return d_gi, d_whh.view(whh.shape), d_bhh.view(ctx.bhh_shape), d_h0


def gru_sequence(x: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
                 h0: torch.Tensor | None = None, dropout: float = 0.0, training: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A stacked GRU over ``x`` (..., B, T, C) with ``layers`` of ``(W_ih, W_hh, b_ih, b_hh)``.

    ``h0`` is (layers, ..., B, H) (zeros by default). Dropout ``dropout`` between layers in
    training, as ``nn.GRU``. Returns the last layer's states (..., B, T, H) and the final
    states (layers, ..., B, H).
    """
    n_hidden = layers[0][1].shape[-1]
    if h0 is None:
        h0 = x.new_zeros(len(layers), *x.shape[:-2], n_hidden)
    y, finals = x, []
    for i, (w_ih, w_hh, b_ih, b_hh) in enumerate(layers):
        if i > 0 and dropout > 0.0 and training:
            y = F.dropout(y, dropout, training=True)
        y, h = _GRURecurrence.apply(_linear(y, w_ih, b_ih), w_hh, b_hh, h0[i])
        finals.append(h)
    return y, torch.stack(finals)


def gru_layers(gru: torch.nn.GRU) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``nn.GRU``'s weights as :func:`gru_sequence` takes them."""
    return _layers(lambda name: getattr(gru, name), gru.num_layers)


def stacked_backbone(params: dict[str, torch.Tensor], x: torch.Tensor, n_layers: int) -> torch.Tensor:
    """Log-probabilities (n, B, T, 32) of ``n`` :class:`~closedloop.sdk.bci.models.GRUBackbone` weight sets.

    ``params`` maps the backbone's parameter names to tensors with a leading axis of
    ``n`` (one weight set per task); ``x`` is (n, B, T, C). Evaluation mode (no dropout).
    """
    y, _ = gru_sequence(x, _layers(lambda name: params[f"gru.{name}"], n_layers))
    return torch.log_softmax(_linear(y, params["readout.weight"], params["readout.bias"]), dim=-1)
