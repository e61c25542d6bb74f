"""Band power that exports: PowerSpectrum against torch.fft.rfft, through export_bundle, on both backends."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from closedloop import Model, export_bundle
from closedloop.export import PowerSpectrum, UnsupportedOpError

C, T = 8, 64


@pytest.mark.parametrize(("window", "magnitude", "norm", "n"), [
    (None, False, "backward", T), ("hann", False, "ortho", T), ("hann", True, "forward", T), (None, False, "backward", 80)])
def test_power_spectrum_is_rffts_power_or_magnitude(window, magnitude, norm, n):
    w = torch.hann_window(n) if window else None
    x = torch.randn(3, C, T, dtype=torch.float32)
    padded = torch.nn.functional.pad(x, (0, n - T))  # rfft(x, n) zero-pads a shorter input
    spec = torch.fft.rfft(padded * (w if w is not None else 1.0), n=n, norm=norm).abs()
    want = spec if magnitude else spec ** 2
    got = PowerSpectrum(n, window=w, magnitude=magnitude, norm=norm)(x)
    assert got.shape == (3, C, n // 2 + 1)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_power_spectrum_over_a_middle_axis():
    x = torch.randn(2, T, C)  # time-major: time is axis 1
    np.testing.assert_allclose(PowerSpectrum(T, dim=1)(x).numpy(), (torch.fft.rfft(x, dim=1).abs() ** 2).numpy(),
                               rtol=1e-4, atol=1e-2)


class BandPower(nn.Module):
    """An EEG decoder's usual front end: log band power of each channel over the window, then a linear readout."""

    def __init__(self, spectrum: nn.Module | None = None) -> None:
        super().__init__()
        self.spectrum = spectrum
        self.readout = nn.Linear(C * (T // 2 + 1), 3)

    def forward(self, x):
        p = self.spectrum(x) if self.spectrum is not None else torch.fft.rfft(x * torch.hann_window(T)).abs() ** 2
        return self.readout(torch.log(p + 1e-6).flatten(1))


def test_a_band_power_decoder_exports_and_runs_on_both_backends(tmp_path):
    torch.manual_seed(0)
    model = BandPower(PowerSpectrum(T, window=torch.hann_window(T))).eval()
    bundle = export_bundle(model, tmp_path / "bp", kind="feedforward", example_input=torch.zeros(1, C, T),
                           rate_hz=250.0, windows={"x": {"length": T, "hop": 16, "layout": "channel_major"}},
                           variants=(), tensorrt=False, report=lambda s: None)
    x = np.random.default_rng(1).standard_normal((1, C, T)).astype(np.float32)
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
        reference = BandPower().eval()
        reference.readout.load_state_dict(model.readout.state_dict())
        np.testing.assert_allclose(want, reference(torch.from_numpy(x)).numpy(), rtol=1e-4, atol=1e-4)  # = rfft's
    for backend in ("onnxruntime", "numba"):
        np.testing.assert_allclose(Model(bundle, backend=backend).step(x), want, rtol=1e-4, atol=1e-4)


def test_rfft_itself_is_refused_pointing_at_power_spectrum(tmp_path):
    with pytest.raises(UnsupportedOpError, match=r"aten::fft_rfft.*closedloop\.export\.PowerSpectrum"):
        export_bundle(BandPower().eval(), tmp_path / "refused", kind="feedforward", example_input=torch.zeros(1, C, T),
                      rate_hz=250.0, variants=(), tensorrt=False, report=lambda s: None)
