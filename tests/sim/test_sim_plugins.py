"""A plant defined outside sim/ is loaded by the emulator process through ``plugins=``."""

from __future__ import annotations

import numpy as np

from closedloop.firmware_bridge import ActuatorCommand, PlantMeasurement
from closedloop.sim.plants import PLANTS

PLUGIN = '''
import numpy as np
from closedloop.sim.params import Param
from closedloop.sim.plants import Plant, register_plant

@register_plant("test-first-order")
class FirstOrder(Plant):
    PARAMS = (Param("tau", float, 0.05, "time constant in s", low=1e-6),)

    def __init__(self, tau):
        self.tau = tau
        self.n_states = self.n_inputs = self.n_outputs = 1
        self.x0, self.u_low, self.u_high = np.zeros(1), -np.ones(1), np.ones(1)

    def f(self, x, u, t):
        return (u - x) / self.tau

    def h(self, x):
        return x.copy()
'''


def test_plugin_plant_runs_in_the_emulator_process(host, tmp_path, monkeypatch):
    (tmp_path / "my_lab_plants.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    try:
        h = host("sim://plant?plugins=my_lab_plants&model=test-first-order&tau=0.02&rate=200")
        hello = h.handshake()
        assert hello.name == "test-first-order" and hello.n_channels == 1
        for _ in range(40):
            h.send(ActuatorCommand([0.8]))
            h.collect(0.01)
        y = h.wait_for(lambda f: isinstance(f.message, PlantMeasurement), 1.0).message.y[0]
        np.testing.assert_allclose(y, 0.8, atol=0.02)
    finally:
        PLANTS.pop("test-first-order", None)
