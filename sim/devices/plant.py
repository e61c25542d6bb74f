"""Plant emulator: integrates a registered dynamical system and streams PLANT_MEASUREMENT.

``sim://plant?model=msd&rate=1000&noise=0.001&seed=1``.  The plant is integrated
with RK4 at ``internal_hz`` (default 5 kHz) in device time; each tick (default 1 kHz)
it sends ``y = h(x) + noise`` together with the input ``u`` being applied.  An
ACTUATOR_COMMAND takes effect when it arrives (zero-order hold: the plant is first
integrated up to that instant with the old input), clipped to the plant's limits
(reported by STATUS).  With no command for ``hold_s`` the plant applies zero input,
its own safety, until the next command. ``report_u=0`` sends ``y`` alone (an empty ``u``), as a device that
does not report what it applied: an observer then takes the last command it sent as applied.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from closedloop.firmware_bridge import ActuatorCommand, Hello, Message, PlantMeasurement, Severity

from ..params import Param
from ..plants import PLANTS, make_plant, plant_class, rk4_step
from .base import Device, StatusCode, register_device

__all__ = ["PlantDevice"]


@register_device("plant")
class PlantDevice(Device):
    """A plant on a serial line: measurements out, actuator commands in."""

    KIND = "plant"
    PARAMS = (
        Param("rate", float, 1000.0, "measurements per second", low=0.1, high=20_000.0),
        Param("model", str, "msd", "plant model (sim.plants registry)", choices=lambda: PLANTS),
        Param("internal_hz", float, 5000.0, "RK4 integration rate in Hz", low=1.0, high=1e6),
        Param("noise", float, 0.0, "measurement noise standard deviation (output units)", low=0.0),
        Param("hold_s", float, 0.1, "apply zero input after this long without a command", low=0.0),
        Param("report_u", int, 1, "1: each measurement carries the input being applied; 0: y alone, as a device "
              "that does not report it", low=0, high=1),
    )

    @classmethod
    def extra_params(cls, raw: Mapping[str, str]) -> tuple[Param, ...]:
        return plant_class(raw.get("model", "msd")).PARAMS

    def __init__(self, params: Mapping[str, Any], log: Callable[[str], None] | None = None) -> None:
        super().__init__(params, log)
        p = self.params
        self.plant = make_plant(p["model"], **{s.name: p[s.name] for s in plant_class(p["model"]).PARAMS})
        self.dt_s = 1.0 / p["internal_hz"]
        self.u_low = np.asarray(self.plant.u_low, dtype=float)
        self.u_high = np.asarray(self.plant.u_high, dtype=float)
        self._noise_rng = np.random.default_rng(np.random.SeedSequence([p["seed"], 0x9147]))
        self.x = np.asarray(self.plant.x0, dtype=float).copy()
        self.u = np.zeros(self.plant.n_inputs)
        self.t_start_s = 0.0
        self.steps = 0
        self.last_command_s: float | None = None
        self.commands = 0
        self.clipped = 0
        self.refused = 0

    def hello(self) -> Hello:
        return Hello(kind=self.KIND, name=self.params["model"], n_channels=self.plant.n_outputs,
                     rate_hz=self.rate_hz, command_low=self.u_low, command_high=self.u_high)

    def start(self, t_s: float) -> None:
        self.t_start_s = t_s
        self.steps = 0

    def _advance(self, t_s: float) -> None:
        """Integrate with the current input up to device time ``t_s``."""
        target = int((t_s - self.t_start_s) / self.dt_s + 1e-9)
        x, u, dt, plant = self.x, self.u, self.dt_s, self.plant
        for k in range(self.steps, target):
            x = rk4_step(plant, x, u, k * dt, dt)
        self.x = x
        self.steps = max(self.steps, target)

    def _check_hold(self, t_s: float) -> None:
        if self.safe_action_applied or self.last_command_s is None:
            return
        if t_s - self.last_command_s > self.params["hold_s"]:
            self.u = np.zeros_like(self.u)
            self.safe_action_applied = True
            self.notify(StatusCode.HOLD, Severity.WARNING,
                        f"no ACTUATOR_COMMAND for {self.params['hold_s']:g} s: applying u = 0", t_s,
                        min_interval_s=0.0)

    def tick(self, index: int, t_s: float) -> Sequence[Message]:
        self._advance(t_s)
        self._check_hold(t_s)
        y = np.asarray(self.plant.h(self.x), dtype=float)
        if self.params["noise"]:
            y = y + self._noise_rng.normal(0.0, self.params["noise"], y.shape)
        return [PlantMeasurement(y, self.u if self.params["report_u"] else np.zeros(0))]

    def on_message(self, message: Message, t_s: float) -> None:
        if not isinstance(message, ActuatorCommand):
            super().on_message(message, t_s)
            return
        u = np.asarray(message.u, dtype=float)
        if u.shape != self.u.shape or not np.all(np.isfinite(u)):
            self.refused += 1
            self.notify(StatusCode.BAD_COMMAND, Severity.ERROR,
                        f"refused ACTUATOR_COMMAND u={u.tolist()}: expected {self.u.size} finite value(s) "
                        f"for plant {self.params['model']!r}; input unchanged", t_s)
            return
        self._advance(t_s)
        applied = np.clip(u, self.u_low, self.u_high)
        if np.any(applied != u):
            self.clipped += 1
            self.notify(StatusCode.COMMAND_CLIPPED, Severity.WARNING,
                        f"ACTUATOR_COMMAND u={u.tolist()} clipped to {applied.tolist()} "
                        f"(limits {self.u_low.tolist()}..{self.u_high.tolist()})", t_s)
        self.u = applied
        self.commands += 1
        self.last_command_s = t_s
        self.safe_action_applied = False

    def report(self) -> dict[str, Any]:
        return {"model": self.params["model"], "x": self.x.tolist(), "u": self.u.tolist(),
                "commands": self.commands, "clipped": self.clipped, "refused": self.refused,
                "holding": self.safe_action_applied}
