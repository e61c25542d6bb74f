"""Spectral features that export: the real DFT as two products with fixed matrices.

``torch.fft.rfft`` has no ONNX form in the exporter ``export_bundle`` uses (``aten::fft_rfft`` is not supported,
and ONNX's own DFT op works on a trailing real/imaginary axis that torch's complex tensors do not have). EEG and
ECoG decoders often start from band power over a window, so :class:`PowerSpectrum` computes what

``torch.fft.rfft(x * window, n=n, dim=dim).abs() ** 2``  (or ``.abs()`` with ``magnitude=True``)

computes, with real arithmetic only: ``X_k = sum_t x_t (cos(2 pi k t / n) - i sin(2 pi k t / n))`` for
``k = 0 .. n // 2``, as two matrix products whose matrices are buffers. It exports to two ``MatMul`` nodes (plus a
multiply and a sum of squares), which every backend runs; the cost is ``n x (n // 2 + 1)`` per row, nothing for
the windows a decoder sees (tens to a few hundred samples).
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["PowerSpectrum"]


class PowerSpectrum(nn.Module):
    """``|rfft(x * window, n, dim)|**2`` (or ``|...|`` with ``magnitude=True``) in ops that export.

    Parameters
    ----------
    n
        The transform length: the length of ``x`` along ``dim`` (a shorter input is zero-padded to ``n``, as
        ``torch.fft.rfft(x, n=n)`` does; a longer one is refused).
    dim
        The axis of time (default the last).
    window
        A tensor of ``n`` weights multiplied in first (``torch.hann_window(n)``, say); None for none.
    magnitude
        Return ``|X_k|`` instead of ``|X_k|**2``.
    norm
        ``"backward"`` (default: no scaling), ``"ortho"`` (``1 / sqrt(n)``) or ``"forward"`` (``1 / n``), as
        ``torch.fft.rfft``'s ``norm``.

    The output has ``n // 2 + 1`` values along ``dim`` (frequencies ``k * rate / n``).

    Example
    -------
    >>> import torch
    >>> spectrum = PowerSpectrum(64, window=torch.hann_window(64))
    >>> x = torch.randn(2, 8, 64)
    >>> want = torch.fft.rfft(x * torch.hann_window(64), n=64).abs() ** 2
    >>> bool(torch.allclose(spectrum(x), want, rtol=1e-4, atol=1e-3))
    True
    """

    def __init__(self, n: int, dim: int = -1, window: torch.Tensor | None = None, magnitude: bool = False,
                 norm: str = "backward"):
        super().__init__()
        if n < 1:
            raise ValueError(f"n={n}: the transform length is a positive number of samples")
        if norm not in ("backward", "ortho", "forward"):
            raise ValueError(f"norm={norm!r}: 'backward', 'ortho' or 'forward', as torch.fft.rfft")
        if window is not None and tuple(window.shape) != (n,):
            raise ValueError(f"window of shape {tuple(window.shape)}: give n={n} weights")
        self.n, self.dim, self.magnitude = n, dim, magnitude
        t = torch.arange(n, dtype=torch.float64)
        k = torch.arange(n // 2 + 1, dtype=torch.float64)
        angle = 2.0 * math.pi * torch.outer(t, k) / n  # (n, n // 2 + 1)
        scale = {"backward": 1.0, "ortho": 1.0 / math.sqrt(n), "forward": 1.0 / n}[norm]
        w = torch.ones(n, dtype=torch.float64) if window is None else window.detach().to(torch.float64).cpu()
        # the window folded into the matrices: one product each for the real and the imaginary part
        self.register_buffer("cos", (w[:, None] * torch.cos(angle) * scale).to(torch.float32))
        self.register_buffer("sin", (w[:, None] * -torch.sin(angle) * scale).to(torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.movedim(self.dim, -1)
        length = x.shape[-1]
        if length > self.n:
            raise ValueError(f"input of {length} samples along dim {self.dim}, longer than n={self.n}")
        cos, sin = self.cos[:length], self.sin[:length]  # zero-padding to n adds nothing to the sums
        power = (x @ cos) ** 2 + (x @ sin) ** 2
        out = torch.sqrt(power) if self.magnitude else power
        return out.movedim(-1, self.dim)
