"""Synthetic drift applied to normalised trials: what a new recording day does to the inputs.

One :class:`DriftAugmentation` describes random perturbations of a batch ``x``
(B, T, C) in normalised units:

.. math::  x' = \\big((F(P x) \\odot g) M + o + r_t\\big) \\odot m + \\epsilon

with :math:`P` a partial channel permutation (each channel, with probability
``swap_p``, records what another channel did: a unit lost and a differently tuned
one found, the commonest change on a Utah array), a fresh-unit replacement :math:`F` (each channel, with
probability ``fresh_p``, records a new unit whose tuning is new: a random mixture of all channels, standardised,
since a new unit's rate is another function of the same low-dimensional neural state), per-channel gains :math:`g = e^{\\sigma_g z}`, offsets :math:`o \\sim N(0, \\sigma_o^2)`,
a slowly wandering offset :math:`r_t` (a random walk with step :math:`\\sigma_r`), a channel
mixing :math:`M = I + \\sigma_m Z / \\sqrt{C}`, a dropout mask :math:`m` (each channel silenced
with probability :math:`p`) and white noise :math:`\\epsilon \\sim N(0, \\sigma_w^2)`.

``per="trial"`` draws a fresh drift for every trial (stage-1 augmentation: the backbone
must cope with any of them); ``per="batch"`` draws one drift for the whole batch
(stage-2 meta-learning tasks: one simulated day, shared by the calibration and the
query sentences).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass
class DriftAugmentation:
    noise_std: float = 0.0
    offset_std: float = 0.0
    gain_std: float = 0.0
    walk_std: float = 0.0
    mixing_std: float = 0.0
    dropout_p: float = 0.0
    swap_p: float = 0.0
    fresh_p: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def active(self) -> bool:
        return any(v > 0 for v in asdict(self).values())

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None, per: str = "trial") -> torch.Tensor:
        """Return a drifted copy of ``x`` (B, T, C)."""
        if not self.active:
            return x
        if per not in ("trial", "batch"):
            raise ValueError(f"per={per!r}; expected 'trial' or 'batch'")
        b, t, c = x.shape
        n = b if per == "trial" else 1
        dev, dt = x.device, x.dtype

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=generator, device="cpu", dtype=dt).to(dev)

        out = x
        if self.swap_p > 0:
            src = torch.arange(c).repeat(n, 1)
            hit = torch.rand(n, c, generator=generator) < self.swap_p
            src[hit] = torch.randint(0, c, (int(hit.sum()),), generator=generator)
            src = src.to(dev)
            out = torch.gather(out, 2, src[:, None, :].expand(b, t, c)) if n == b else out[..., src[0]]
        if self.fresh_p > 0:
            hit = torch.rand(n, 1, c, generator=generator) < self.fresh_p
            mix = randn(n, c, c) / c**0.5
            out = _fresh_units(out, hit[:, 0], mix.to(dev))
        if self.gain_std > 0:
            out = out * torch.exp(self.gain_std * randn(n, 1, c))
        if self.mixing_std > 0:
            mix = torch.eye(c, dtype=dt).to(dev) + self.mixing_std / c**0.5 * randn(n, c, c)
            out = torch.bmm(out, mix.expand(b, c, c)) if n == b else out @ mix[0]
        if self.offset_std > 0:
            out = out + self.offset_std * randn(n, 1, c)
        if self.walk_std > 0:
            out = out + self.walk_std * torch.cumsum(randn(n, t, c), dim=1) / t**0.5
        if self.dropout_p > 0:
            keep = (torch.rand(n, 1, c, generator=generator) >= self.dropout_p).to(dev, dt)
            out = out * keep
        if self.noise_std > 0:
            out = out + self.noise_std * randn(b, t, c)
        return out


def _fresh_units(x: torch.Tensor, hit: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """``x`` with the channels ``hit`` (n, C) replaced by their columns of ``x @ mix`` (n, C, C), standardised.

    ``n`` is the batch (one drift per trial) or 1 (one for all). Only the replaced columns are
    computed: with 10% of the channels, a tenth of the full product.
    """
    out = x.clone()
    per_trial = hit.shape[0] == x.shape[0]
    for i in range(hit.shape[0]):
        cols = hit[i].nonzero()[:, 0].to(x.device)
        if len(cols) == 0:
            continue
        rows, target = (x[i], out[i]) if per_trial else (x, out)  # (T, C) for one trial's drift, (B, T, C) for all
        fresh = rows @ mix[i][:, cols]
        dims = tuple(range(fresh.dim() - 1))
        target[..., cols] = (fresh - fresh.mean(dims, keepdim=True)) / fresh.std(dims, keepdim=True).clamp(min=1e-6)
    return out


def time_mask(x: torch.Tensor, max_bins: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Zero one random span of up to ``max_bins`` bins per trial (SpecAugment-style)."""
    if max_bins <= 0:
        return x
    b, t, _ = x.shape
    width = torch.randint(0, max_bins + 1, (b,), generator=generator)
    start = (torch.rand(b, generator=generator) * (t - width).clamp(min=1)).long()
    idx = torch.arange(t)
    mask = ((idx[None] >= start[:, None]) & (idx[None] < (start + width)[:, None])).to(x.device)
    return x.masked_fill(mask[..., None], 0.0)
