"""The plant integrates its dynamics, echoes the applied input, clips commands and holds zero on silence."""

from __future__ import annotations

import numpy as np
import pytest

from closedloop.firmware_bridge import ActuatorCommand, PlantMeasurement
from closedloop.sim import StatusCode


def _drive(h, u, seconds):
    """Send ``u`` every 10 ms for ``seconds``; return the measurements seen."""
    import time

    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        h.send(ActuatorCommand(u))
        out += [f.message for _, f in h.collect(0.01, PlantMeasurement)]
    return out


def test_constant_force_moves_the_mass_and_u_is_echoed(host):
    h = host("sim://plant?model=msd&rate=1000&noise=0.001&seed=1&damping=4")
    h.handshake()
    rest = [m.y[0] for _, f in h.collect(0.2, PlantMeasurement) for m in [f.message]]
    assert abs(np.mean(rest)) < 0.01
    meas = _drive(h, [2.0], 1.5)
    assert meas[-1].u[0] == pytest.approx(2.0)
    # m=1, c=4, k=4 (critically damped): heads for u/k = 0.5 m, ~80% there after 1.5 s, no overshoot
    y = [m.y[0] for m in meas]
    assert 0.3 < np.mean(y[-20:]) < 0.52
    assert np.mean(y[len(y) // 3 : len(y) // 3 + 20]) < np.mean(y[-20:])
    assert all(m.y.shape == (1,) and m.u.shape == (1,) for m in meas)
    report = h.report()
    assert report["commands"] > 50 and report["clipped"] == 0


def test_negative_force_moves_it_the_other_way(host):
    h = host("sim://plant?model=msd")
    h.handshake()
    meas = _drive(h, [-3.0], 0.6)
    assert meas[-1].y[0] < -0.1


def test_measurement_rate(host):
    h = host("sim://plant?model=msd&rate=1000")
    h.handshake()
    frames = [f for _, f in h.collect(1.0, PlantMeasurement)]
    assert 850 <= len(frames) <= 1100
    assert np.allclose(np.diff([f.timestamp_us for f in frames[:100]]), 1000, atol=2)


def test_command_beyond_the_limit_is_clipped_and_reported(host):
    h = host("sim://plant?model=msd")
    h.handshake()
    meas = _drive(h, [100.0], 0.2)
    assert meas[-1].u[0] == pytest.approx(10.0)
    status = h.wait_status(StatusCode.COMMAND_CLIPPED)
    assert "100.0" in status.text and "10.0" in status.text


def test_no_command_for_hold_s_applies_zero(host):
    h = host("sim://plant?model=msd&hold_s=0.1")
    h.handshake()
    assert _drive(h, [5.0], 0.2)[-1].u[0] == pytest.approx(5.0)
    later = [f.message for _, f in h.collect(0.4, PlantMeasurement)]
    assert later[-1].u[0] == 0.0
    assert "0.1 s" in h.wait_status(StatusCode.HOLD).text
    assert h.report()["holding"] is True


def test_wrong_size_or_nan_command_is_refused(host):
    h = host("sim://plant?model=msd")
    h.handshake()
    h.send(ActuatorCommand([1.0, 2.0]))
    assert "expected 1 finite" in h.wait_status(StatusCode.BAD_COMMAND).text
    h.send(ActuatorCommand([float("nan")]))
    h.collect(0.1)
    assert h.report()["refused"] == 2


def test_dc_motor_spins_up_under_voltage(host):
    h = host("sim://plant?model=dc-motor&rate=500")
    h.handshake()
    meas = _drive(h, [12.0], 1.0)
    angle, speed = meas[-1].y
    assert speed > 0.3 and angle > 0.1  # CTMS motor: ~1.1 rad/s at 12 V in steady state
