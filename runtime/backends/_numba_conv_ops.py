"""The Numba backend's convolution and pooling op handlers (1-D and 2-D).

Conv (any padding, stride, dilation and groups; explicit pads or ``auto_pad``)
becomes one convolution step (weights in panels per kernel row, see
``closedloop.runtime.kernels_conv``; a direct loop for grouped convolutions), into
which a following element-wise activation (Relu, Tanh, Sigmoid, GELU) is fused; MaxPool and AveragePool (padding, strides,
dilation for max, ``ceil_mode``, ``count_include_pad``) become one pooling step.
A 1-D op runs as 2-D with height 1. BatchNormalization after a convolution is
folded into it by torch's eval-mode export; where it is not, it is an affine step
(``_numba_ops``). ConvTranspose (1-D and 2-D, any stride, dilation, groups, pads and
``output_padding``) becomes the convolution it equals over its input spread out by the stride.
3-D convolution and pooling and LpPool are refused by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ._numba_values import Buffer, Mat, contiguous_strides, handles, unsupported

if TYPE_CHECKING:
    from ._numba_plan import Planner


def _window(p: Planner, node, x_shape: tuple, kernel: list[int]) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """Strides, dilations, start pads, end pads and output sizes of a sliding window op."""
    a = node.attributes
    spatial = len(x_shape) - 2
    strides = list(a.get("strides") or [1] * spatial)
    dil = list(a.get("dilations") or [1] * spatial)
    pads = list(a.get("pads") or [0] * (2 * spatial))
    begin, end = pads[:spatial], pads[spatial:]
    auto = a.get("auto_pad", "NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    size = list(x_shape[2:])
    if auto == "VALID":
        begin, end = [0] * spatial, [0] * spatial
    elif auto in ("SAME_UPPER", "SAME_LOWER"):
        for i in range(spatial):
            out = -(-size[i] // strides[i])
            total = max(0, (out - 1) * strides[i] + (kernel[i] - 1) * dil[i] + 1 - size[i])
            small = total // 2
            begin[i], end[i] = (small, total - small) if auto == "SAME_UPPER" else (total - small, small)
    elif auto != "NOTSET":
        raise unsupported(node, f"auto_pad={auto!r}")
    outs = []
    for i in range(spatial):
        span = size[i] + begin[i] + end[i] - ((kernel[i] - 1) * dil[i] + 1)
        if a.get("ceil_mode", 0):
            n = -(-span // strides[i]) + 1
            if (n - 1) * strides[i] >= size[i] + begin[i]:  # the last window must start inside the input
                n -= 1
        else:
            n = span // strides[i] + 1
        if n < 1:
            raise unsupported(node, f"a window of {kernel} does not fit an input of {tuple(size)}")
        outs.append(n)
    return strides, dil, begin, end, outs


def _as_2d(values: list[int], fill: int) -> list[int]:
    return [fill] + values if len(values) == 1 else values


def _geometry_2d(x_shape, outs, kernel, strides, dil, begin, end) -> tuple[int, ...]:
    """A 1-D or 2-D window's sizes as 2-D ones (a 1-D axis is height 1): input h, w; output h, w; kernel,
    strides, dilations, and the padding at the start and end of each axis."""
    return (*_as_2d(list(x_shape[2:]), 1), *_as_2d(outs, 1), *_as_2d(kernel, 1), *_as_2d(strides, 1),
            *_as_2d(dil, 1), *_as_2d(begin, 0), *_as_2d(end, 0))



@handles("Conv")
def _conv(p: Planner, node) -> None:
    x, w = p.act(node), p.const(node, 1).astype(np.float32)
    if len(x.shape) not in (3, 4):
        raise unsupported(node, f"input of shape {x.shape}: 1-D (batch, channels, length) and 2-D convolutions only")
    groups = int(node.attributes.get("group", 1))
    cout, cin = w.shape[0], x.shape[1]
    if w.ndim != len(x.shape) or w.shape[1] * groups != cin or cout % groups:
        raise unsupported(node, f"weight {w.shape} with group={groups} does not fit input {x.shape}")
    strides, dil, begin, end, outs = _window(p, node, x.shape, list(w.shape[2:]))
    p.define(node, _emit_conv(p, node, x, w, _bias(p, node, cout), strides, dil, begin, end, outs, groups,
                              p.storage(node, 1, 0)))


def _bias(p: Planner, node, cout: int) -> np.ndarray:
    b = p.const(node, 2, required=False)
    return np.zeros((1, cout), np.float32) if b is None else b.astype(np.float32).reshape(1, cout)


def _emit_conv(p: Planner, node, x, w: np.ndarray, bias: np.ndarray, strides, dil, begin, end, outs, groups: int,
               storage: tuple[int, np.ndarray | None]):
    """One convolution step of weights ``w`` (cout, cin / groups, kernel...) over ``x``; returns its output."""
    cout, cin, kernel = w.shape[0], x.shape[1], list(w.shape[2:])
    y = p.new_act((x.shape[0], cout, *outs))
    h, wd, ho, wo, kh, kw, sh, sw, dh, dw, ph, pw, ph_end, pw_end = _geometry_2d(x.shape, outs, kernel, strides, dil,
                                                                                 begin, end)
    geometry = (x.shape[0], cin, h, wd, cout, ho, wo, kh, kw, sh, sw, dh, dw, ph, pw, ph_end, pw_end, groups,
                p.k.ACT_NONE)
    if groups == 1:
        w4 = w.reshape(cout, cin, kh, kw)
        if dw == 1:  # a kernel row of all channels is one contiguous run of the channels-last input
            segments = [w4[:, :, i, :].transpose(0, 2, 1).reshape(cout, kw * cin) for i in range(kh)]
        else:
            segments = [w4[:, :, i, j] for i in range(kh) for j in range(kw)]
        panels = np.concatenate([p.k.panel_layout(s) for s in segments], axis=0)
        padded = Buffer((h + ph + ph_end) * (wd + pw + pw_end) * cin)
        code, scales = storage
        p.emit(p.k.OP_CONV, x.flat(), p.panels(panels, code, scales), p.param(bias), y.flat(),
               Mat(padded, 1, padded.size), code, *geometry, out=[y.buf, padded])
    else:
        p.emit(p.k.OP_CONV_GROUPED, x.flat(), p.param(w.reshape(cout, -1)), p.param(bias), y.flat(), *geometry,
               out=y.buf)
    return y


@handles("ConvTranspose")
def _conv_transpose(p: Planner, node) -> None:
    """A transposed convolution as a convolution: the input spread out by the stride (zeros between its samples),
    padded by dilation x (kernel - 1) less the op's pads (and ``output_padding`` more at the end), and convolved at
    stride 1 with the kernel flipped and, per group, its input and output channels swapped."""
    x, w = p.act(node), p.const(node, 1).astype(np.float32)
    if len(x.shape) not in (3, 4):
        raise unsupported(node, f"input of shape {x.shape}: 1-D and 2-D transposed convolutions only")
    a = node.attributes
    groups, cin, spatial = int(a.get("group", 1)), x.shape[1], len(x.shape) - 2
    if w.ndim != len(x.shape) or w.shape[0] != cin or cin % groups:
        raise unsupported(node, f"weight {w.shape} with group={groups} does not fit input {x.shape}")
    if a.get("output_shape") is not None:
        raise unsupported(node, "the output_shape attribute (give pads and output_padding)")
    auto = a.get("auto_pad", "NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if auto not in ("NOTSET", "VALID"):
        raise unsupported(node, f"auto_pad={auto!r}")
    kernel = list(w.shape[2:])
    strides = list(a.get("strides") or [1] * spatial)
    dil = list(a.get("dilations") or [1] * spatial)
    pads = [0] * (2 * spatial) if auto == "VALID" else list(a.get("pads") or [0] * (2 * spatial))
    extra = list(a.get("output_padding") or [0] * spatial)
    reach = [dil[i] * (kernel[i] - 1) for i in range(spatial)]
    begin = [reach[i] - pads[i] for i in range(spatial)]
    end = [reach[i] - pads[spatial + i] + extra[i] for i in range(spatial)]
    if min(begin + end) < 0:
        raise unsupported(node, f"pads {pads} beyond dilation x (kernel - 1) = {reach} (a crop)")
    spread = [(x.shape[2 + i] - 1) * strides[i] + 1 for i in range(spatial)]
    if any(st != 1 for st in strides):
        shape = (*x.shape[:2], *spread)
        wide = p.new_act(shape)
        dst = contiguous_strides(shape)
        p.copy(node, p.materialize(np.zeros(shape, np.float32)), 0, shape, dst, wide.buf, 0, dst)  # each run
        p.copy(node, x, 0, x.shape, contiguous_strides(x.shape), wide.buf, 0,
               [dst[0], dst[1], *(dst[2 + i] * strides[i] for i in range(spatial))])
        x = wide
    cin_g, cout_g = cin // groups, w.shape[1]
    conv_w = np.swapaxes(w.reshape(groups, cin_g, cout_g, *kernel), 1, 2).reshape(groups * cout_g, cin_g, *kernel)
    conv_w = np.ascontiguousarray(np.flip(conv_w, axis=tuple(range(2, 2 + spatial))))
    outs = [spread[i] + begin[i] + end[i] - reach[i] for i in range(spatial)]
    # the weights are re-laid out here, so they run in float32 whatever the file stores them in
    p.define(node, _emit_conv(p, node, x, conv_w, _bias(p, node, groups * cout_g), [1] * spatial, dil, begin, end,
                              outs, groups, (p.k.W_F32, None)))


@handles("MaxPool", "AveragePool")
def _pool(p: Planner, node) -> None:
    if len(node.outputs) > 1 and p.uses.get(node.outputs[1]):
        raise unsupported(node, "the indices output is used")
    x = p.act(node)
    if len(x.shape) not in (3, 4):
        raise unsupported(node, f"input of shape {x.shape}: 1-D and 2-D pooling only")
    kernel = list(node.attributes["kernel_shape"])
    strides, dil, begin, end, outs = _window(p, node, x.shape, kernel)
    is_max = node.op_type == "MaxPool"
    if not is_max and any(d != 1 for d in dil):
        raise unsupported(node, f"dilations={dil} in average pooling")
    y = p.new_act(x.shape[:2] + tuple(outs))
    h, wd, ho, wo, kh, kw, sh, sw, dh, dw, ph, pw, ph_end, pw_end = _geometry_2d(x.shape, outs, kernel, strides, dil,
                                                                                 begin, end)
    mode = p.k.POOL_MAX if is_max else p.k.POOL_AVG
    p.emit(p.k.OP_POOL, x.flat(), y.flat(), x.shape[0] * x.shape[1], h, wd, ho, wo, kh, kw, sh, sw, ph, pw,
           ph_end, pw_end, dh, dw, mode, int(node.attributes.get("count_include_pad", 0)), out=y.buf)
    p.define(node, y)
